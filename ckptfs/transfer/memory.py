"""The memory budget: the bytes of part data the transfer engine holds in memory at once, whatever the
number or size of the files moving, granted in priority order; and the spare part buffers kept inside it."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import trio


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    nbytes: int = field(compare=False)
    wants_buffer: bool = field(compare=False)
    event: trio.Event = field(compare=False, default_factory=trio.Event)
    status: str = field(compare=False, default="waiting")  # then "granted" or "cancelled"
    buffer: bytearray | None = field(compare=False, default=None)


class MemoryBudget:
    """Bytes of part data in memory, granted in priority order (lower first: the engine's Priority; first
    come, first served within one priority). A request larger than the whole budget is granted the whole
    budget, so it runs alone.

    It also keeps the buffers of finished upload parts for the next parts of the same size, inside the
    budget: a fresh part-sized buffer is its own mmap (glibc maps allocations above 32 MiB on their own, and
    smaller ones often), so every part would fault in and zero new pages (~15 % of the daemon's CPU while
    draining). A spare buffer goes with the next grant of its size; spares give way to any other request
    that needs their room, and all go when nothing is in flight, so an idle daemon holds none."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.in_use = 0
        self.peak = 0
        self.spare_bytes = 0
        self._spare: list[bytearray] = []
        self._waiters: list[_Waiter] = []  # a heap
        self._seq = 0

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if w.status == "waiting")

    async def acquire(self, nbytes: int, priority: int) -> int:
        """Wait until `nbytes` fit; return what was granted (pass it to release)."""
        granted, _ = await self._acquire(nbytes, priority, wants_buffer=False)
        return granted

    async def acquire_buffer(self, nbytes: int, priority: int) -> tuple[int, bytearray]:
        """acquire(), with a buffer of `nbytes` to fill (a spare one if there is); once no thread uses it any
        more, hand it back with keep() before releasing the grant."""
        granted, buffer = await self._acquire(nbytes, priority, wants_buffer=True)
        assert buffer is not None
        return granted, buffer

    async def _acquire(self, nbytes: int, priority: int, *, wants_buffer: bool) -> tuple[int, bytearray | None]:
        full = nbytes
        nbytes = min(nbytes, self.limit)
        self._seq += 1
        waiter = _Waiter(int(priority), self._seq, nbytes, wants_buffer)
        if not self.waiting and self._admit(waiter):
            return nbytes, self._buffer_of(waiter, full)
        heapq.heappush(self._waiters, waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.status == "granted":
                self.release(nbytes)
            else:
                waiter.status = "cancelled"
                self._grant()
            raise
        return nbytes, self._buffer_of(waiter, full)

    @staticmethod
    def _buffer_of(waiter: _Waiter, nbytes: int) -> bytearray | None:
        if not waiter.wants_buffer:
            return None
        return waiter.buffer if waiter.buffer is not None else bytearray(nbytes)

    def keep(self, buffer: bytearray, granted: int) -> None:
        """Keep the buffer of a finished part for the next part of its size."""
        if len(buffer) == granted:  # else the grant was cut to the whole budget: the buffer is outside it
            self._spare.append(buffer)
            self.spare_bytes += granted

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._grant()
        if not self.in_use:
            self._drop_spare(self.spare_bytes)

    def _admit(self, waiter: _Waiter) -> bool:
        """Grant the waiter if it fits now, with a spare buffer of its size, dropping other spares for room."""
        if waiter.wants_buffer:
            for i, spare in enumerate(self._spare):
                if len(spare) == waiter.nbytes:
                    waiter.buffer = self._spare.pop(i)
                    self.spare_bytes -= waiter.nbytes
                    break
        excess = self.in_use + self.spare_bytes + waiter.nbytes - self.limit
        if excess > 0:
            self._drop_spare(excess)
        if self.in_use + waiter.nbytes > self.limit:
            if waiter.buffer is not None:
                self.keep(waiter.buffer, waiter.nbytes)
                waiter.buffer = None
            return False
        self.in_use += waiter.nbytes
        self.peak = max(self.peak, self.in_use + self.spare_bytes)
        return True

    def _drop_spare(self, nbytes: int) -> None:
        while self._spare and nbytes > 0:
            dropped = len(self._spare.pop())
            self.spare_bytes -= dropped
            nbytes -= dropped

    def _grant(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.status == "cancelled":
                heapq.heappop(self._waiters)
                continue
            if not self._admit(waiter):
                return
            heapq.heappop(self._waiters)
            waiter.status = "granted"
            waiter.event.set()
