"""The small lane: starts the batches of small uploads that the scheduler claimed, each once an upload slot is
free and the writer lets it.

Owns: the queue of claimed batches, waiting for a lull in the FUSE layer's requests before a batch starts
(bounded by YIELD_LIMIT, and never while something presses), and the size of a batch that gave up waiting.
What a batch does is uploads.py's (Uploads.upload_small); claiming and settling its jobs the scheduler's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from ckptfs.drain.ordering import Job

# The FUSE requests of a writer arrive back to back while the last one ended less than FOREGROUND_LULL ago:
# a batch of small uploads waits for a lull that long (and that long after the previous batch started)
# before it starts, at most YIELD_LIMIT; one that gave up waiting takes at most YIELDED_BATCH files.
FOREGROUND_LULL = 0.05
YIELD_LIMIT = 1.0
YIELDED_BATCH = 8


class SmallLane:
    def __init__(
        self, slots: trio.Semaphore, run_batch: Callable[[list[Job], trio.Semaphore], Awaitable[None]],
        *, pressed: Callable[[], bool],
    ) -> None:
        self.slots = slots
        self.run_batch = run_batch
        self.pressed = pressed  # a flush waits or the cache needs room: nothing waits for a lull then
        # time.perf_counter() at the end of the FUSE layer's last request (the daemon wires it to the
        # request counters' timestamp, metrics.OpStats.last_at).
        self.foreground_at: Callable[[], float] = lambda: -math.inf
        self.waiting = 0  # jobs queued, not started
        self._queue: deque[list[Job]] = deque()
        self._queued = trio.Event()
        self._woken = trio.Event()
        self._started_at = -math.inf  # time.perf_counter() when the last batch started

    def queue(self, batch: list[Job]) -> None:
        """A batch of claimed small uploads, to start in turn."""
        self._queue.append(batch)
        self.waiting += len(batch)
        self._queued.set()

    def wake(self) -> None:
        """Something may press now (Drain.notify): a wait for a lull looks again."""
        self._woken.set()

    async def run(self, nursery: trio.Nursery) -> None:
        """Start the queued batches in order, each in `nursery` with an upload slot it then owns. Other
        jobs do not wait for this: the scheduler's dispatch goes on with them."""
        while True:
            while not self._queue:
                self._queued = trio.Event()
                await self._queued.wait()
            await self.slots.acquire()
            lull = await self._lull()
            batch = self._queue.popleft()
            if not lull and len(batch) > YIELDED_BATCH:
                self._queue.appendleft(batch[YIELDED_BATCH:])
                batch = batch[:YIELDED_BATCH]
            self.waiting -= len(batch)
            nursery.start_soon(self.run_batch, batch, self.slots)

    async def _lull(self) -> bool:
        """While the FUSE layer's requests arrive back to back (a writer waiting on each), wait for a lull
        of FOREGROUND_LULL after both the last request and the last batch's start, at most YIELD_LIMIT: a
        batch's journal transactions, reads, copies and fsyncs then run in the writer's pauses rather than
        between its requests. False if it gave up waiting. Something pressing ends the wait at once."""
        give_up_at = time.perf_counter() + YIELD_LIMIT
        lull = True
        while not self.pressed():
            now = time.perf_counter()
            lull_at = max(self.foreground_at(), self._started_at) + FOREGROUND_LULL
            if lull_at <= now:
                break
            if give_up_at <= now:
                lull = False
                break
            self._woken = trio.Event()
            with trio.move_on_after(min(lull_at, give_up_at) - now):
                await self._woken.wait()
        self._started_at = time.perf_counter()
        return lull
