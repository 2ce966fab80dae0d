"""Bandwidth caps (issue 44): one token bucket per direction, up and down, that every transfer moving bytes
between this node and the store goes through, so that the drain leaves the NIC to NCCL and the data loader.

Where the tokens are taken, and why there (the engine calls these; writes through the mount never do):

- Uploads (the parts of staged uploads and of spills, small files in one PUT) take a part's bytes in the
  trio thread before the part asks for memory or a worker thread: a part waiting for its turn holds nothing
  that another transfer needs (one holding its memory grant or a part thread would starve the reads). The
  stores' SDKs send a part as one request from bytes in memory (boto3, google-cloud-storage and
  azure-storage-blob all take the part as bytes), which nothing outside them can pace, so a part goes at
  the link's speed once its bytes are earned: the rate over seconds is the cap, a burst is one part.
- Downloads (the fetcher's chunks, streams, restores) take tokens as the bytes arrive, one piece (1 MiB,
  64 KiB in a whole-file fetch) at a time, in the worker thread: the sink that writes a piece into the cache
  file waits for its tokens first, so the next piece is not read from the socket before its turn and TCP slows
  the sender down; a 16 MiB range does not burst. (gs:// and az:// SDKs gather a whole range before handing
  it over: there a range arrives at once and the pacing holds back the next.) So that slowed ranges do not
  hold every part thread and the memory budget, a download under a cap first waits for a slot of a window
  of about WINDOW_SECONDS of the cap's bytes in ranges, granted in priority order (a blocked read first).
- Server-side copies (renames on S3, spills committed on stores that cannot complete an upload at another
  key) move no bytes through this node: they take no tokens, nor do requests without part data (listings,
  heads, notes, directory markers).

Tokens are earned at the rate and paid before the bytes go: the transfer at the head of a FIFO queue
collects what is earned until it has all its bytes, then goes, and only an idle bucket saves tokens, at
most BURST_SECONDS of the rate. So over any stretch of t seconds at most (t + BURST_SECONDS) x rate bytes
go, however large the parts.

The cap in effect comes from the configured timetable (one entry: a plain rate), a runtime change
(`ckptfs limit`: until the timetable's next entry, or the daemon's restart) or a lift (`lift_limits`, for a
preemption notice: no cap until the daemon restarts or a runtime change sets one). Waiters look at it again
at least every WAKE_SECONDS, and a runtime change or a lift wakes them at once.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import heapq
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger(__name__)

# (minute of the day, bytes per second or None: no cap), sorted; what config.parse_bandwidth returns.
Timetable = tuple[tuple[int, int | None], ...]
NO_LIMIT: Timetable = ((0, None),)

# An idle bucket saves at most this many seconds of the rate: small, so that a link idle for a while does
# not let a burst through that NCCL would feel, and large enough that pieces arriving back to back at the
# cap do not each wait for a scheduler tick.
BURST_SECONDS = 0.2
# A waiter looks at the cap again at least this often: a timetable's next entry reaches transfers already
# waiting within it (a runtime change or a lift wakes them at once).
WAKE_SECONDS = 0.25
# Under a download cap, ranges in flight at once: about this many seconds of the cap's bytes (at least one).
WINDOW_SECONDS = 1.0


def _minute_of_day(wall: float) -> int:
    local = time.localtime(wall)
    return local.tm_hour * 60 + local.tm_min


def entry_index(timetable: Timetable, wall: float) -> int:
    """The index of the entry that applies at wall-clock time `wall` (local time of day): the last one at or
    before it, else the last one of the day before (the timetable wraps round midnight)."""
    minute = _minute_of_day(wall)
    index = len(timetable) - 1
    for i, (at, _) in enumerate(timetable):
        if at <= minute:
            index = i
    return index


def next_change(timetable: Timetable, wall: float) -> float | None:
    """The wall-clock time of the timetable's next entry after `wall` (None: one entry, nothing changes)."""
    if len(timetable) < 2:
        return None
    now = datetime.datetime.fromtimestamp(wall)
    minute = now.hour * 60 + now.minute
    day = now.date()
    upcoming = [at for at, _ in timetable if at > minute]
    if upcoming:
        at = upcoming[0]
    else:
        at, day = timetable[0][0], day + datetime.timedelta(days=1)
    return datetime.datetime.combine(day, datetime.time(at // 60, at % 60)).timestamp()


def clock_text(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def rate_text(rate: int | None) -> str:
    """A cap for people: '200 MiB/s', 'off'."""
    if rate is None:
        return "off"
    value = float(rate)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}/s" if value == int(value) else f"{value:.1f} {unit}/s"
        value /= 1024
    raise AssertionError


def timetable_text(timetable: Timetable) -> str:
    """A timetable as the configuration writes it: '08:00,50M 19:00,off', or one rate: '50M', 'off'."""
    def rate(value: int | None) -> str:
        if value is None:
            return "off"
        for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
            if value % unit == 0:
                return f"{value // unit}{suffix}"
        return str(value)

    if len(timetable) == 1 and timetable[0][0] == 0:
        return rate(timetable[0][1])
    return " ".join(f"{clock_text(at)},{rate(value)}" for at, value in timetable)


class _Turn:
    """One transfer's place in a bucket's queue."""

    __slots__ = ("need", "paid", "ready")

    def __init__(self, need: int) -> None:
        self.need = need
        self.paid = 0.0
        self.ready = False


class TokenBucket:
    """The bookkeeping of one direction's cap, in bytes per second (None: no cap): a FIFO queue of turns,
    each paid for before it goes (see the module's docstring). Thread-safe: uploads wait in the trio
    thread, downloads in worker threads. It never sleeps itself: `delay` says how long a turn has to wait,
    and `changed` (a Condition on its lock) is notified when the rate changes or a turn leaves."""

    def __init__(self, rate: int | None = None, *, clock: Callable[[], float] = time.monotonic,
                 burst_seconds: float = BURST_SECONDS) -> None:
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._clock = clock
        self._burst_seconds = burst_seconds
        self._rate = rate
        self._stamp = clock()
        self._tokens = self._capacity(rate)  # saved tokens, only while nobody waits
        self._queue: collections.deque[_Turn] = collections.deque()
        self.granted = 0  # bytes let through since start

    @property
    def rate(self) -> int | None:
        return self._rate

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _capacity(self, rate: int | None) -> float:
        return 0.0 if rate is None else rate * self._burst_seconds

    def set_rate(self, rate: int | None) -> None:
        """From now on, `rate`: what was earned until now at the old rate is kept, at most a burst of the new
        one is saved (a cap switched on starts with a full burst), and under no cap every waiter goes."""
        with self._lock:
            old = self._rate
            self._advance(self._clock())
            self._rate = rate
            self._tokens = self._capacity(rate) if old is None else min(self._tokens, self._capacity(rate))
            self._advance(self._clock())
            self.changed.notify_all()

    def enter(self, nbytes: int) -> _Turn:
        """Queue a transfer of `nbytes`; paid at once from saved tokens where it can be (turn.ready)."""
        turn = _Turn(max(0, nbytes))
        with self._lock:
            now = self._clock()
            self._advance(now)  # first: what an empty queue earned is saved up to a burst only
            self._queue.append(turn)
            self._advance(now)
        return turn

    def delay(self, turn: _Turn) -> float:
        """Seconds until `turn` is paid for at the current rate (0: it may go now)."""
        with self._lock:
            self._advance(self._clock())
            if turn.ready:
                return 0.0
            assert self._rate is not None  # under no cap every turn is ready
            owed = 0.0
            for queued in self._queue:
                owed += queued.need - queued.paid
                if queued is turn:
                    break
            return owed / self._rate

    def leave(self, turn: _Turn) -> None:
        """A turn given up before it went (its transfer was cancelled): what it had collected goes on to the
        next one, and the turns behind it move up."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            if turn.ready:
                return
            with contextlib.suppress(ValueError):
                self._queue.remove(turn)
            self._tokens += turn.paid
            self._advance(now)
            self.changed.notify_all()

    def _advance(self, now: float) -> None:
        """Pay what was earned since the last call to the turns in order (the lock is held)."""
        elapsed = max(0.0, now - self._stamp)
        self._stamp = now
        if self._rate is None:
            while self._queue:
                self._grant(self._queue.popleft())
            self._tokens = 0.0
            return
        available = self._tokens + elapsed * self._rate
        while self._queue:
            head = self._queue[0]
            owed = head.need - head.paid
            if available + 0.5 < owed:  # half a byte short is paid: float sums of rate x time are not exact
                head.paid += available
                available = 0.0
                break
            available = max(0.0, available - owed)
            self._grant(self._queue.popleft())
        self._tokens = min(available, self._capacity(self._rate))

    def _grant(self, turn: _Turn) -> None:
        turn.paid = turn.need
        turn.ready = True
        self.granted += turn.need


@dataclass(frozen=True)
class LimitNow:
    """One direction's cap at one moment, for status and metrics."""

    rate: int | None  # bytes per second; None: no cap
    source: str  # "config" (the configured rate), "timetable", "runtime" (`ckptfs limit`), "lifted"
    entry: str | None  # the timetable entry in effect ("08:00"), for source "timetable"
    until: float | None  # wall-clock time of the next change the timetable makes (None: none)
    timetable: Timetable  # as configured
    waiting: int  # transfers waiting for their bytes now


@dataclass(order=True)
class _SlotWaiter:
    priority: int
    seq: int
    event: trio.Event = field(compare=False, default_factory=trio.Event)
    status: str = field(compare=False, default="waiting")  # then "granted" or "cancelled"


class _Slots:
    """A number of slots granted in priority order (lower first, then first come), in the trio thread."""

    def __init__(self) -> None:
        self.limit = math.inf
        self.busy = 0
        self._waiters: list[_SlotWaiter] = []
        self._seq = 0

    def waiting(self) -> int:
        """Callers waiting for a slot now."""
        return sum(1 for w in self._waiters if w.status == "waiting")

    async def acquire(self, priority: int) -> None:
        if self.busy < self.limit and not self._waiters:
            self.busy += 1
            return
        self._seq += 1
        waiter = _SlotWaiter(priority, self._seq)
        heapq.heappush(self._waiters, waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.status == "granted":
                self.release()
            else:
                waiter.status = "cancelled"
            raise

    def release(self) -> None:
        self.busy -= 1
        self._grant()

    def set_limit(self, limit: float) -> None:
        self.limit = limit
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.busy < self.limit:
            waiter = heapq.heappop(self._waiters)
            if waiter.status == "cancelled":
                continue
            waiter.status = "granted"
            self.busy += 1
            waiter.event.set()


class Direction:
    """The cap of one direction ("upload" or "download"): the cap in effect now and the bucket that applies
    it. `take` (trio) and `take_blocking` (worker threads) wait for a transfer's bytes; `set_runtime` and
    `lift` run in the trio thread."""

    def __init__(self, name: str, timetable: Timetable = NO_LIMIT, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.timetable = timetable or NO_LIMIT
        self.bucket = TokenBucket(None, clock=clock)
        self._wall = wall
        self._override: tuple[int | None, float | None] | None = None  # `ckptfs limit`: (rate, until)
        self._lifted = False
        self._changed = trio.Event()  # set (and replaced) when a runtime change or a lift wakes the waiters
        self._slots = _Slots()
        self._range_size = 16 << 20  # the ranges downloads ask for (window() says)
        self._fixed = len(self.timetable) == 1  # a plain rate: the cap changes only at runtime
        self.sync()

    def now(self) -> LimitNow:
        rate, source, entry, until = self._resolve(self._wall())
        return LimitNow(rate, source, entry, until, self.timetable, self.bucket.waiting + self._slots_waiting())

    def _slots_waiting(self) -> int:
        return self._slots.waiting()

    def _resolve(self, wall: float) -> tuple[int | None, str, str | None, float | None]:
        """(rate, source, timetable entry, until) in effect at `wall`."""
        if self._lifted:
            return None, "lifted", None, None
        override = self._override  # read once: set_runtime may replace it meanwhile (worker threads call this)
        if override is not None:
            rate, until = override
            if until is None or wall < until:  # else the timetable's next entry came: it applies again
                return rate, "runtime", None, until
        if self._fixed:
            return self.timetable[0][1], "config", None, None
        at, rate = self.timetable[entry_index(self.timetable, wall)]
        return rate, "timetable", clock_text(at), next_change(self.timetable, wall)

    def sync(self) -> int | None:
        """Bring the bucket to the cap in effect now; the rate. Cheap: called before every wait."""
        if self._fixed and self._override is None and not self._lifted:
            rate = self.timetable[0][1]  # the common case: no clock to read
            source = "config"
        else:
            rate, source, entry, _ = self._resolve(self._wall())
            if entry is not None:
                source = f"timetable entry {entry}"
        if rate != self.bucket.rate:
            self.bucket.set_rate(rate)
            log.info("%s limit now %s (%s)", self.name, rate_text(rate), source)
        return rate

    async def take(self, nbytes: int) -> None:
        """Wait until `nbytes` may go (in the trio thread)."""
        self.sync()
        turn = self.bucket.enter(nbytes)
        try:
            while not turn.ready:
                self.sync()
                delay = self.bucket.delay(turn)
                if delay <= 0:
                    return
                with trio.move_on_after(min(delay, WAKE_SECONDS)):
                    await self._changed.wait()
        except BaseException:
            self.bucket.leave(turn)
            raise

    def take_blocking(self, nbytes: int, check: Callable[[], None] | None = None) -> None:
        """Wait until `nbytes` may go, in a worker thread. `check` is called while it waits and may raise to
        give up (trio.from_thread.check_cancelled: the transfer was cancelled)."""
        self.sync()
        turn = self.bucket.enter(nbytes)
        try:
            while not turn.ready:
                if check is not None:
                    check()
                self.sync()
                delay = self.bucket.delay(turn)
                if delay <= 0:
                    return
                with self.bucket.changed:
                    self.bucket.changed.wait(min(delay, WAKE_SECONDS))
        except BaseException:
            self.bucket.leave(turn)
            raise

    @contextlib.asynccontextmanager
    async def window(self, priority: int, range_size: int) -> AsyncIterator[None]:
        """A slot for one download under the cap (none needed without one): about WINDOW_SECONDS of the
        cap's bytes in ranges of `range_size` at once, at least one, granted in priority order."""
        self._range_size = range_size
        rate = self._set_window()
        if rate is None and not self._slots.waiting():
            yield
            return
        await self._slots.acquire(priority)
        try:
            yield
        finally:
            self._set_window()  # a timetable's entry may have changed the rate meanwhile
            self._slots.release()

    def _set_window(self) -> int | None:
        rate = self.sync()
        self._slots.set_limit(math.inf if rate is None else max(1, round(rate * WINDOW_SECONDS / self._range_size)))
        return rate

    def set_runtime(self, rate: int | None) -> None:
        """`ckptfs limit`: `rate` from now until the timetable's next entry (with one entry: until the daemon
        restarts); clears a lift. In the trio thread."""
        self._lifted = False
        self._override = (rate, next_change(self.timetable, self._wall()))
        self._wake()

    def lift(self) -> None:
        """No cap until the daemon restarts or a runtime change sets one. In the trio thread."""
        self._lifted = True
        self._wake()

    def _wake(self) -> None:
        self._set_window()  # the new rate, which wakes the waiting threads (TokenBucket.set_rate notifies)
        changed, self._changed = self._changed, trio.Event()
        changed.set()


class Bandwidth:
    """The engine's two caps (Transfers.bandwidth)."""

    def __init__(self, upload: Timetable = NO_LIMIT, download: Timetable = NO_LIMIT, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.up = Direction("upload", upload, clock=clock, wall=wall)
        self.down = Direction("download", download, clock=clock, wall=wall)

    def direction(self, name: str) -> Direction:
        """"upload" or "download"."""
        return {"upload": self.up, "download": self.down}[name]

    def lift(self) -> None:
        self.up.lift()
        self.down.lift()

    def now(self) -> tuple[LimitNow, LimitNow]:
        return self.up.now(), self.down.now()
