"""The transfer engine: every byte that moves between the cache and the store goes through here.

Owns: part sizing, parallelism (one pool of parts in flight shared by every file, up and down), the
memory budget (bytes of part data held in memory at once, whatever the number or size of files),
priorities (a reader waiting on a range first, read-ahead next, background uploads after, commit markers
last), retries with backoff of each part, checksums (CRC32 per part, combined into the whole-file
checksum), staged uploads with resume from a journaled UploadState, spills (the start of a file still
being written, staged at a hidden key), ranged downloads, and the clean-up of interrupted uploads.

Stores (backends/) implement only primitives: one attempt each, in a worker thread. This module never
knows inodes or paths of the mount and never touches the journal: callers persist the UploadState it
reports through `progress` (called in the trio thread after the upload is opened and after every part).
Everything here runs in the trio thread except the blocking store calls and local reads.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import heapq
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, TypeVar

import trio

from ckptfs.backends.base import (
    TEMP_PREFIX,
    ObjectMeta,
    ObjectStore,
    UploadPart,
    UploadRef,
    UploadState,
    backoff_delays,
    crc32,
    crc32_combine,
    crc_of,
    crc_text,
    pread_exact,
    pread_into,
)
from ckptfs.errors import (
    BackendError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    TooLargeToCopyError,
    TransientBackendError,
    UploadGoneError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20
IO_CHUNK = 1 * MiB  # local reads of the checksum scan, per thread
DEFAULT_MEMORY_BUDGET = 256 * MiB
DEFAULT_PART_SIZE = 64 * MiB
DEFAULT_DOWNLOAD_PART_SIZE = 16 * MiB
DEFAULT_PARTS_IN_FLIGHT = 16
DEFAULT_MULTIPART_THRESHOLD = 8 * MiB
DEFAULT_ATTEMPTS = 5  # per part or request; the drain retries whole jobs forever on top
# Store calls that carry no part data (open, complete, abort, head, list) run on their own threads, so
# that they never queue behind big parts.
CONTROL_THREADS = 8
# Parts of one file in parallel that the part size aims for (boto3's default concurrency is 10).
UPLOAD_SPREAD = 8
COPY_PART_SIZE = 512 * MiB  # server-side part copies of an object larger than the store copies at once
RATE_WINDOW = 5.0  # seconds over which status reports bytes per second


class Priority(IntEnum):
    """Who waits for a transfer; lower goes first."""

    READ = 0  # a process is blocked in read() on these bytes
    READAHEAD = 1  # a sequential reader will want them soon
    UPLOAD = 2  # the background drain
    MARKER = 3  # commit markers: after everything else


class SourceChangedError(TransientBackendError):
    """The local file changed while it was being uploaded: retrying the part cannot help, the caller
    starts the upload again once the file is quiet."""


@dataclass(frozen=True)
class SmallFile:
    """A small closed file for put_files: read whole, PUT in one request. `changed` (called in the worker
    thread, after the read) says whether the file may have changed since the caller chose it."""

    key: str
    src_path: str
    meta: ObjectMeta
    changed: Callable[[], bool]


@dataclass(frozen=True)
class PutFile:
    """What put_files put at a key: the bytes the file held, their checksum."""

    size: int
    checksum: str


@dataclass(frozen=True)
class StagedUpload:
    """An upload whose bytes are in the store (or, below the multipart threshold, checked locally) but not
    yet visible at `key`. `state` is the staged multipart upload, None for a one-request upload at commit."""

    key: str
    size: int
    checksum: str
    meta: ObjectMeta
    src_path: str
    state: UploadState | None


@dataclass(frozen=True)
class FetchedRange:
    """What one ranged download wrote into a local file."""

    offset: int
    length: int  # bytes written (fewer than asked at the object's end)
    crc: int  # CRC32 of those bytes
    size: int  # the whole object's size
    etag: str | None  # the object's version: pass it as if_match to read more of the same
    checksum: str | None  # the whole object's checksum from its metadata, if any


@dataclass
class TransferStats:
    parts_up: int = 0  # part uploads in flight now
    parts_down: int = 0  # ranged downloads in flight now
    bytes_up: int = 0  # since start
    bytes_down: int = 0
    up_bytes_per_second: float = 0.0  # over the last RATE_WINDOW seconds
    down_bytes_per_second: float = 0.0
    retries: int = 0
    memory_in_use: int = 0
    memory_budget: int = 0
    memory_peak: int = 0
    memory_waiters: int = 0


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
    """Bytes of part data in memory, granted in priority order (first come, first served within one
    priority). A request larger than the whole budget is granted the whole budget, so it runs alone.

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

    async def acquire(self, nbytes: int, priority: Priority) -> int:
        """Wait until `nbytes` fit; return what was granted (pass it to release)."""
        granted, _ = await self._acquire(nbytes, priority, wants_buffer=False)
        return granted

    async def acquire_buffer(self, nbytes: int, priority: Priority) -> tuple[int, bytearray]:
        """acquire(), with a buffer of `nbytes` to fill (a spare one if there is); once no thread uses it any
        more, hand it back with keep() before releasing the grant."""
        granted, buffer = await self._acquire(nbytes, priority, wants_buffer=True)
        assert buffer is not None
        return granted, buffer

    async def _acquire(self, nbytes: int, priority: Priority, *, wants_buffer: bool) -> tuple[int, bytearray | None]:
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


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


@contextlib.asynccontextmanager
async def _parallel() -> AsyncIterator[trio.Nursery]:
    """A nursery for the parts of one transfer that fails with the first real error of its tasks, as one
    call would: callers handle a BackendError, not a group of them (a cancellation passes unchanged)."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        first = next((exc for exc in _leaves(group) if not isinstance(exc, trio.Cancelled)), None)
        if first is None:
            raise
        raise first from None


def plan_part_size(size: int, part_size: int, spread: int, *, min_part: int, max_parts: int) -> int:
    """The part size for a file of `size` bytes: the configured size, smaller for mid-size files so that
    `spread` parts can go in parallel (never below the store's minimum), and larger when the file would
    need more parts than the store allows. Whole MiB."""
    ps = max(min_part, part_size)
    if spread > 1:
        share = -(-size // spread)
        ps = min(ps, max(min_part, -(-share // MiB) * MiB))
    needed = -(-size // max_parts)
    return max(ps, -(-needed // MiB) * MiB)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class _RangeWriter:
    """A RangeSink that writes the pieces of a ranged GET into fd at the range's offset (no fd: -1, only
    the checksum) and keeps the CRC32 of what it got."""

    __slots__ = ("crc", "fd", "offset", "written")

    def __init__(self, fd: int, offset: int) -> None:
        self.fd = fd
        self.offset = offset
        self.written = 0
        self.crc = 0

    def __call__(self, piece: bytes) -> None:
        if self.fd >= 0:
            _pwrite_all(self.fd, piece, self.offset + self.written)
        self.crc = crc32(piece, self.crc)
        self.written += len(piece)


def _read_small_files(files: Sequence[SmallFile]) -> list[bytes | BaseException]:
    read: list[bytes | BaseException] = []
    for small in files:
        try:
            fd = os.open(small.src_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            read.append(_source_error(exc, small.key))
            continue
        try:
            size = os.fstat(fd).st_size
            data = pread_exact(fd, size + 1, 0)
            os.fsync(fd)
        except OSError as exc:
            read.append(_source_error(exc, small.key))
            continue
        finally:
            os.close(fd)
        # After the read: a change that began before this check may have torn the bytes read; one that
        # begins after it writes after the read (and is caught before the PUT).
        if len(data) != size or small.changed():
            read.append(SourceChangedError(f"{small.key}: the file changed while it was being read"))
        else:
            read.append(data)
    return read


def _whole_crc(crcs: Sequence[int], part_size: int, size: int) -> int:
    """The CRC32 of a file of `size` bytes from the CRC32s of its parts of `part_size`, in order."""
    whole = crcs[0]
    for index in range(1, len(crcs)):
        whole = crc32_combine(whole, crcs[index], min(part_size, size - index * part_size))
    return whole


def _fdatasync_path(path: str, key: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _source_error(exc, key) from exc


def _source_error(exc: OSError, key: str) -> BackendError:
    if exc.errno == errno.ENOENT:
        return NotFoundBackendError(f"{key}: source file vanished")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermanentBackendError(f"{key}: {exc.strerror}")
    return TransientBackendError(f"{key}: {exc.strerror}")


class Transfers:
    def __init__(
        self,
        store: ObjectStore,
        *,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        part_size: int = DEFAULT_PART_SIZE,
        download_part_size: int = DEFAULT_DOWNLOAD_PART_SIZE,
        parts_in_flight: int = DEFAULT_PARTS_IN_FLIGHT,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        attempts: int = DEFAULT_ATTEMPTS,
        sleep: Callable[[float], Any] = trio.sleep,
    ) -> None:
        self.store = store
        self.memory = MemoryBudget(memory_budget)
        limits = store.limits
        self.part_size = min(max(part_size, limits.min_part_size), limits.max_part_size)
        self.download_part_size = max(MiB, download_part_size)
        self.parts_in_flight = max(1, parts_in_flight)
        self.multipart_threshold = max(1, multipart_threshold)
        self.attempts = max(1, attempts)
        self._sleep = sleep
        self._part_threads = trio.CapacityLimiter(self.parts_in_flight)
        self._control_threads = trio.CapacityLimiter(CONTROL_THREADS)
        self._stats = TransferStats()
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()  # (time, up, down)
        # Sweeps of this owner's leftovers in the store (see sweep_leftovers): the staged uploads this process
        # still works on, which a sweep spares; store calls running, which a sweep's listing waits out.
        self._live_uploads: set[str] = set()
        self._calls_running = 0
        self._calls_idle: trio.Event | None = None
        self._sweep_listing: trio.Event | None = None  # set while a sweep lists; fired when it has listed
        self._sweep_lock = trio.Lock()
        # Something may be left in the store (a failed abort, a sweep that failed): the drain sweeps again.
        self._failed_cleanup = False

    def statistics(self) -> TransferStats:
        now = trio.current_time()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        return replace(
            self._stats, memory_in_use=self.memory.in_use + self.memory.spare_bytes, memory_budget=self.memory.limit,
            memory_peak=self.memory.peak, memory_waiters=self.memory.waiting,
            up_bytes_per_second=sum(up for _, up, _ in self._recent) / RATE_WINDOW,
            down_bytes_per_second=sum(down for _, _, down in self._recent) / RATE_WINDOW,
        )

    def _moved(self, up: int, down: int) -> None:
        self._stats.bytes_up += up
        self._stats.bytes_down += down
        self._recent.append((trio.current_time(), up, down))

    # -- plumbing ---------------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """One store call that carries no part data, in a worker thread, retried on transient errors."""
        return await self._retry(fn, *args, limiter=self._control_threads)

    async def _retry(
        self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter, abandon: bool = True,
        gated: bool = True,
    ) -> T:
        delays = backoff_delays()
        for attempt in range(self.attempts):
            try:
                if gated:  # a call that may leave something in the store (not a download)
                    return await self._gated(fn, args, limiter, abandon)
                return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon)
            except (SourceChangedError, ObjectChangedError):
                raise
            except TransientBackendError as exc:
                if attempt == self.attempts - 1:
                    raise
                self._stats.retries += 1
                log.debug("retrying %s after: %s", getattr(fn, "__name__", fn), exc)
                await self._sleep(next(delays))
        raise AssertionError("unreachable")

    async def _gated(self, fn: Callable[..., T], args: tuple[Any, ...], limiter: trio.CapacityLimiter,
                     abandon: bool) -> T:
        """One attempt of a store call, never while a sweep lists the leftovers: what a call has half made
        (a temp file, a multipart upload of a copy, an upload whose id it has not returned yet) looks like
        a leftover in a listing."""
        while self._sweep_listing is not None:
            await self._sweep_listing.wait()
        self._calls_running += 1
        try:
            # Abandoned on cancel (unless it writes into a file descriptor its caller owns) so that shutdown
            # never waits for a transfer; what the thread leaves half done is invisible (a staged part) or
            # harmless (an object the journal redoes, a leftover the next sweep removes).
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon)
        finally:
            self._calls_running -= 1
            if not self._calls_running and self._calls_idle is not None:
                self._calls_idle.set()

    def upload_part_size(self, size: int) -> int:
        """Parts small enough that UPLOAD_SPREAD of them fit the memory budget at once (one stream per part
        is what fills a link), and no larger than part_size."""
        limits = self.store.limits
        part_size = min(self.part_size, max(limits.min_part_size, self.memory.limit // UPLOAD_SPREAD))
        spread = max(1, min(self.parts_in_flight, self.memory.limit // part_size))
        return plan_part_size(size, part_size, spread, min_part=limits.min_part_size, max_parts=limits.max_parts)

    async def _put_part(
        self, ref: UploadRef, number: int, offset: int, length: int, src_path: str, expected_crc: int | None,
        priority: Priority,
    ) -> tuple[UploadPart, int]:
        """Read one part of the local file and stage it, under the memory budget; (part, its CRC32)."""
        buffer: bytearray | None = None
        if self.store.limits.reusable_buffers:
            granted, buffer = await self.memory.acquire_buffer(length, priority)
        else:
            granted = await self.memory.acquire(length, priority)
        self._stats.parts_up += 1
        try:
            result = await self._retry(self._read_and_put, ref, number, offset, length, buffer, src_path,
                                       expected_crc, limiter=self._part_threads)
            if buffer is not None:  # only now: a thread abandoned by a cancellation may still send from it
                self.memory.keep(buffer, granted)
        finally:
            self._stats.parts_up -= 1
            self.memory.release(granted)
        self._moved(length, 0)
        return result

    def _read_and_put(
        self, ref: UploadRef, number: int, offset: int, length: int, buffer: bytearray | None, src_path: str,
        expected_crc: int | None,
    ) -> tuple[UploadPart, int]:
        # Each part opens the file itself: a thread abandoned at shutdown never reads a descriptor that was
        # closed and reused meanwhile.
        data: bytes | bytearray
        try:
            fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if buffer is None:
                    data = pread_exact(fd, length, offset)
                    got = len(data)
                else:
                    data = buffer
                    got = pread_into(fd, buffer, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _source_error(exc, ref.key) from exc
        crc = crc32(data)
        if got != length or (expected_crc is not None and crc != expected_crc):
            raise SourceChangedError(f"{ref.key}: the file changed while it was being uploaded")
        part = self.store.put_part(ref, number, offset, data, crc)
        return part, crc

    # -- uploads of closed files --------------------------------------------------------------------------

    async def stage_upload(
        self, key: str, src_path: str, meta: ObjectMeta, *, resume: UploadState | None = None,
        progress: Callable[[UploadState], None] | None = None, priority: Priority = Priority.UPLOAD,
        sync_source: bool = False,
    ) -> StagedUpload:
        """Copy src_path's bytes into the store, invisible until commit_upload. Above the multipart threshold
        the parts go in parallel; `progress` (in the trio thread) gets the UploadState after the upload is
        opened and after each part, and when given, a failure leaves the staged upload for the caller to
        resume (`resume=`) or abort; else it is aborted here. A `resume` state continues when it is for the
        same key and the file is unchanged, else it is thrown away. `sync_source` fsyncs src_path before
        returning, for a caller about to call it a clean copy: a small file in the thread hop that reads
        it, a large one while its parts upload (writing back a freshly written GiB takes seconds, as long as
        a part upload or more, and the bytes uploaded are checked against the scan anyway)."""
        try:
            fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _source_error(exc, key) from exc
        try:
            size = os.fstat(fd).st_size
            if size < self.multipart_threshold:
                if resume is not None:
                    await self._discard(resume, "the file is now below the multipart threshold")
                crcs = await self._scan(fd, size, max(size, 1), key, sync_source=sync_source)
                return StagedUpload(key, size, crc_text(crcs[0]), meta, src_path, None)
            async with _parallel() as nursery:
                if sync_source:
                    nursery.start_soon(self._sync_source, fd, key)
                staged = await self._stage_parts(key, src_path, fd, size, meta, resume, progress, priority)
            return staged
        finally:
            os.close(fd)

    @staticmethod
    async def _sync_source(fd: int, key: str) -> None:
        try:
            # Not abandoned: it syncs the caller's descriptor.
            await trio.to_thread.run_sync(os.fsync, fd)
        except OSError as exc:
            raise _source_error(exc, key) from exc

    async def _scan(self, fd: int, size: int, part_size: int, key: str, *, sync_source: bool = False) -> list[int]:
        """CRC32 of every part of the file, read IO_CHUNK at a time, parts in parallel. `sync_source`
        (a file of one part only) fsyncs it in the same thread."""
        assert not sync_source or size <= part_size
        count = max(1, -(-size // part_size))
        crcs = [0] * count

        def scan(index: int) -> None:
            offset = index * part_size
            end = min(size, offset + part_size)
            crc = 0
            # One buffer per part, reused: the scan holds IO_CHUNK per thread. Sized to the part, so that a
            # small file does not pay for zeroing (and faulting in) a whole chunk it never fills.
            view = memoryview(bytearray(min(IO_CHUNK, end - offset)))
            try:
                while offset < end:
                    n = os.preadv(fd, [view[: min(IO_CHUNK, end - offset)]], offset)
                    if not n:
                        raise SourceChangedError(f"{key}: the file shrank while it was being read")
                    crc = crc32(view[:n], crc)
                    offset += n
                if sync_source:
                    os.fsync(fd)
            except OSError as exc:
                raise _source_error(exc, key) from exc
            crcs[index] = crc

        async def worker(indexes: list[int]) -> None:
            while indexes:
                # Not abandoned: it reads the caller's descriptor (and a local read is quick).
                await trio.to_thread.run_sync(scan, indexes.pop(0), limiter=self._part_threads)

        todo = list(range(count))
        async with _parallel() as nursery:
            for _ in range(min(self.parts_in_flight, count)):
                nursery.start_soon(worker, todo)
        return crcs

    async def _stage_parts(
        self, key: str, src_path: str, fd: int, size: int, meta: ObjectMeta, resume: UploadState | None,
        progress: Callable[[UploadState], None] | None, priority: Priority,
    ) -> StagedUpload:
        reusable = resume is not None and resume.key == key and resume.size == size and not resume.spilled
        part_size = resume.part_size if reusable and resume is not None else self.upload_part_size(size)
        crcs = await self._scan(fd, size, part_size, key)
        checksum = crc_text(_whole_crc(crcs, part_size, size))

        state: UploadState | None = None
        if resume is not None:
            state = await self._resumable(resume, key, size, checksum, meta, crcs)
        if state is None:
            ref = await self._open_upload(key, meta, checksum)
            state = UploadState(key=key, upload_id=ref.upload_id, marker=ref.marker, size=size, checksum=checksum,
                                mtime_ns=meta.mtime_ns, mode=meta.mode, part_size=part_size)
        else:
            log.info("resuming the upload of %s: %d of %d parts already in the store", key, len(state.parts),
                     len(crcs))
        if progress is not None:
            progress(state)
        done = {part.number for part in state.parts}
        todo = [n for n in range(1, len(crcs) + 1) if n not in done]
        current = [state]

        async def worker() -> None:
            while todo:
                number = todo.pop(0)
                offset = (number - 1) * part_size
                part, _ = await self._put_part(current[0].ref, number, offset, min(part_size, size - offset),
                                               src_path, crcs[number - 1], priority)
                parts = tuple(sorted((*current[0].parts, part), key=lambda p: p.number))
                current[0] = replace(current[0], parts=parts)
                if progress is not None:
                    progress(current[0])

        try:
            async with _parallel() as nursery:
                for _ in range(min(self.parts_in_flight, len(todo))):
                    nursery.start_soon(worker)
        except BaseException:
            if progress is None:  # nobody can resume it: do not leave it behind
                with trio.move_on_after(30, shield=True):
                    await self._abort_quietly(current[0].ref)
            raise
        return StagedUpload(key, size, checksum, meta, src_path, current[0])

    async def _resumable(
        self, resume: UploadState, key: str, size: int, checksum: str, meta: ObjectMeta, crcs: list[int]
    ) -> UploadState | None:
        """`resume` with the parts the store still holds, or None (the old upload thrown away) if it cannot
        continue: another key, changed content or metadata, or the upload is gone."""
        if resume.spilled or (resume.key, resume.size, resume.checksum, resume.mtime_ns, resume.mode) != (
            key, size, checksum, meta.mtime_ns, meta.mode
        ):
            await self._discard(resume, "the file changed since")
            return None
        held = await self.call(self.store.list_parts, resume.ref)
        if held is None:
            log.info("upload of %s: the interrupted upload is gone from the store; starting afresh", key)
            await self._abort_quietly(resume.ref)
            return None
        kept = []
        for part in resume.parts:
            offset = (part.number - 1) * resume.part_size
            length = min(resume.part_size, size - offset)
            have = held.get(part.number)
            if (
                have is not None and have[0].strip('"') == part.etag.strip('"') and have[1] == length
                and 0 < part.number <= len(crcs) and part.checksum == crc_text(crcs[part.number - 1])
            ):
                kept.append(part)
        return replace(resume, parts=tuple(kept))

    async def _discard(self, state: UploadState, why: str) -> None:
        log.info("upload of %s: %s; aborting the interrupted upload and starting afresh", state.key, why)
        await self._abort_quietly(state.ref)

    async def _open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        ref = await self.call(self.store.open_upload, key, meta, checksum)
        # No checkpoint since the call returned: a sweep cannot list it before it is live.
        self._live_uploads.add(ref.upload_id)
        return ref

    def _finished(self, ref: UploadRef) -> None:
        """This process is done with a staged upload: completed, or aborted."""
        self._live_uploads.discard(ref.upload_id)

    async def _abort_quietly(self, ref: UploadRef) -> None:
        try:
            await self.call(self.store.abort_upload, ref)
        except BackendError as exc:
            log.warning("could not abort the upload of %s: %s; it is removed later", ref.key, exc)
            self._failed_cleanup = True
        self._finished(ref)

    async def commit_upload(self, staged: StagedUpload, *, priority: Priority = Priority.UPLOAD) -> None:
        """Make a staged upload the object at its key, atomically."""
        if staged.state is None:
            await self._put_small(staged, priority)
            return
        state = staged.state
        await self._complete(state.ref, state.parts, state.size, state.checksum)
        self._finished(state.ref)

    async def _put_small(self, staged: StagedUpload, priority: Priority) -> None:
        granted = await self.memory.acquire(staged.size, priority)
        self._stats.parts_up += 1
        try:
            await self._retry(self._read_and_put_object, staged, limiter=self._part_threads)
        finally:
            self._stats.parts_up -= 1
            self.memory.release(granted)
        self._moved(staged.size, 0)

    def _read_and_put_object(self, staged: StagedUpload) -> None:
        try:
            fd = os.open(staged.src_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _source_error(exc, staged.key) from exc
        try:
            data = pread_exact(fd, staged.size + 1, 0)
        finally:
            os.close(fd)
        if len(data) != staged.size or crc_text(crc32(data)) != staged.checksum:
            raise SourceChangedError(f"{staged.key}: the file changed while it was being uploaded")
        self.store.put_object(staged.key, data, staged.meta, staged.checksum)

    async def put_files(
        self, files: Sequence[SmallFile], *, size: int, commit: Callable[[list[int]], list[int]],
        priority: Priority = Priority.UPLOAD,
    ) -> list[PutFile | BaseException | None]:
        """Upload small closed files together, in two worker-thread hops for all of them (`size`: their
        bytes in all, held in memory between the hops). The first reads each file once and fsyncs it (the
        caller will call the local copy clean); then `commit`, in the trio thread, gets
        the indexes of the files read and returns those to put (it re-checks them, and journals what must
        be before an object appears); the second PUTs those one after the other, each only if it has not
        changed since it was chosen. Each file's outcome in order: what was put, None (not to be put), or
        the exception it failed with (SourceChangedError: it changed; nothing was put). A transient store
        error is retried for that file alone, like a part; after a permanent one the rest are not tried."""
        granted = await self.memory.acquire(size, priority)
        self._stats.parts_up += 1
        try:
            read = await self._read_files(files)
            outcomes: list[PutFile | BaseException | None] = [
                item if isinstance(item, BaseException) else None for item in read
            ]
            wanted = commit([i for i, item in enumerate(read) if not isinstance(item, BaseException)])
            staged = [(files[i], read[i]) for i in wanted]
            put = await self._gated(self._put_read, (staged,), self._part_threads, True) if staged else []
            for index, outcome in zip(wanted, put, strict=True):
                outcomes[index] = outcome
                if isinstance(outcome, TransientBackendError) and not isinstance(outcome, SourceChangedError):
                    self._stats.retries += 1
                    try:
                        outcomes[index] = await self._retry(self._put_one, files[index], read[index],
                                                            limiter=self._part_threads)
                    except Exception as exc:
                        outcomes[index] = exc
        finally:
            self._stats.parts_up -= 1
            self.memory.release(granted)
        self._moved(sum(o.size for o in outcomes if isinstance(o, PutFile)), 0)
        return outcomes

    async def _read_files(self, files: Sequence[SmallFile]) -> list[bytes | BaseException]:
        """put_files' first hop: each file's bytes, or why it cannot be put."""
        return await trio.to_thread.run_sync(_read_small_files, files, limiter=self._part_threads)

    def _put_read(self, staged: list[tuple[SmallFile, bytes | BaseException]]) -> list[PutFile | BaseException]:
        outcomes: list[PutFile | BaseException] = []
        refused: BaseException | None = None
        for small, data in staged:
            if refused is not None:
                outcomes.append(refused)
                continue
            try:
                outcomes.append(self._put_one(small, data))
            except PermanentBackendError as exc:
                refused = exc
                outcomes.append(exc)
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _put_one(self, small: SmallFile, data: bytes | BaseException) -> PutFile:
        assert isinstance(data, bytes)
        if small.changed():
            raise SourceChangedError(f"{small.key}: the file changed while it was being uploaded")
        checksum = crc_text(crc32(data))
        self.store.put_object(small.key, data, small.meta, checksum)
        return PutFile(len(data), checksum)

    async def abort_upload(self, staged: StagedUpload) -> None:
        if staged.state is not None:
            await self.call(self.store.abort_upload, staged.state.ref)
            self._finished(staged.state.ref)

    async def abort_state(self, state: UploadState) -> None:
        """Throw away a staged upload or spill that a journal row remembers (best effort)."""
        await self._abort_quietly(state.ref)
        if state.spilled:
            try:
                await self.call(self.store.delete, state.key)
            except BackendError as exc:
                log.warning("could not remove the spilled start of %s: %s; it is removed later", state.key, exc)
                self._failed_cleanup = True

    async def abort_stale_uploads(self, keep: Iterable[str] = ()) -> int:
        """At start-up: the staged uploads the journal resumes (`keep`, upload ids) are this process's
        from now on; every other leftover of this owner in the store goes (sweep_leftovers)."""
        self._live_uploads.update(keep)
        return await self.sweep_leftovers() or 0  # never None: no patience limit

    @property
    def sweep_due(self) -> bool:
        """Did a cleanup fail (this engine's abort, a sweep, or one the store does on its own), so that a sweep
        would find something?"""
        return self._failed_cleanup or self.store.left_behind

    async def sweep_leftovers(self, *, patience: float = math.inf) -> int | None:
        """Remove this owner's staged uploads and spills that nobody will finish: those of a killed run, and
        those whose cleanup failed in this one. Spares the uploads this process works on. Returns how many
        went, or None if store calls still ran after `patience` seconds (nothing done, sweep_due stays
        true); raises BackendError (sweep_due stays true) if the store refuses."""
        async with self._sweep_lock:
            self._failed_cleanup = True  # until this sweep succeeds
            self.store.left_behind = False  # what fails from now on, the next sweep sees
            listed = trio.Event()
            self._sweep_listing = listed
            try:
                with trio.move_on_after(patience):
                    while self._calls_running:
                        self._calls_idle = trio.Event()
                        await self._calls_idle.wait()
                self._calls_idle = None
                if self._calls_running:
                    return None
                refs = await self._retry(self.store.list_leftovers, limiter=self._control_threads, gated=False)
                live = set(self._live_uploads)
            finally:
                self._sweep_listing = None
                listed.set()
            removed = 0
            for ref in refs:
                if ref.upload_id and ref.upload_id in live:
                    continue
                await self.call(self.store.abort_upload, ref)
                if ref.key.rsplit("/", 1)[-1].startswith(f"{TEMP_PREFIX}spill."):
                    await self.call(self.store.delete, ref.key)
                removed += 1
                log.info("removed an interrupted upload of %s", ref.key or "(unknown key)")
            self._failed_cleanup = False
            return removed

    # -- spills: the start of a file still being written, staged at a hidden key ------------------------

    async def spill_begin(self, part_size: int, *, early: bool = False) -> UploadState:
        key = f"{TEMP_PREFIX}spill.{self.store.owner}.{secrets.token_hex(8)}"
        ref = await self._open_upload(key, None, None)
        part_size = min(max(part_size, self.store.limits.min_part_size), self.store.limits.max_part_size)
        return UploadState(key=key, upload_id=ref.upload_id, marker=ref.marker, size=0, checksum="", mtime_ns=0,
                           mode=0, part_size=part_size, spilled=True, early=early)

    async def spill_matches(self, state: UploadState, src_path: str) -> bool:
        """Are the first state.size bytes of src_path still the ones the spill staged? (An early spill's
        parts stay in the cache, and a writer may have changed them since.) Also syncs src_path to disk, as
        stage_upload's `sync_source` does: the caller is about to call it a clean copy."""
        try:
            fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _source_error(exc, state.key) from exc
        try:
            async with _parallel() as nursery:
                nursery.start_soon(self._sync_source, fd, state.key)
                if not state.size:
                    return True
                try:
                    crcs = await self._scan(fd, state.size, state.part_size, state.key)
                except SourceChangedError:  # shorter than what was staged
                    return False
        finally:
            os.close(fd)
        return crc_text(_whole_crc(crcs, state.part_size, state.size)) == state.checksum

    async def spill_parts(
        self, state: UploadState, src_path: str, end: int, *, priority: Priority = Priority.UPLOAD,
        sync_source: bool = False,
    ) -> UploadState:
        """Stage src_path's bytes from state.size up to `end`, in parts of state.part_size in parallel as for
        any upload; return the new state. Nothing is journaled in between: after a crash they are all staged
        again, under the same part numbers. `sync_source` then fdatasyncs src_path: a file being written goes
        to disk a batch at a time, not all at once before it is called clean (spill_matches)."""
        part_size = state.part_size
        offsets = list(range(state.size, end, part_size))
        first = len(state.parts) + 1
        if first + len(offsets) - 1 > self.store.limits.max_parts:
            raise PermanentBackendError(f"a spilled file needs more than {self.store.limits.max_parts} parts;"
                                        " raise part_size")
        done: list[tuple[UploadPart, int]] = []
        todo = list(enumerate(offsets))

        async def worker() -> None:
            while todo:
                index, offset = todo.pop(0)
                part, crc = await self._put_part(state.ref, first + index, offset, min(part_size, end - offset),
                                                 src_path, None, priority)
                done.append((part, crc))

        async with _parallel() as nursery:
            for _ in range(min(self.parts_in_flight, len(todo))):
                nursery.start_soon(worker)
        if sync_source:
            await trio.to_thread.run_sync(_fdatasync_path, src_path, state.key, limiter=self._part_threads)
        done.sort(key=lambda item: item[0].number)
        whole, offset = (crc_of(state.checksum) if state.size else None), state.size
        for _, crc in done:
            length = min(part_size, end - offset)
            whole = crc if whole is None else crc32_combine(whole, crc, length)
            offset += length
        return replace(state, size=end, parts=(*state.parts, *(part for part, _ in done)),
                       checksum=crc_text(whole if whole is not None else 0))

    async def spill_commit(self, state: UploadState, key: str, meta: ObjectMeta) -> None:
        """Make the staged bytes the object at `key`, atomically, with `meta` and the whole checksum: where
        the store can, by completing the upload there; else by completing it at its hidden key, copying it to
        `key` and deleting the hidden object."""
        if self.store.limits.completes_anywhere:
            await self._complete(state.ref, state.parts, state.size, state.checksum, key=key, meta=meta)
            self._finished(state.ref)
            return
        try:
            await self._complete(state.ref, state.parts, state.size, None)
        except BackendError:
            if await self._holds(key, state.size, state.checksum):  # a retried commit: the first one got through
                await self.call(self.store.delete, state.key)  # if its delete of the spill did not
                self._finished(state.ref)
                return
            raise
        try:
            await self.copy(state.key, key, meta, state.checksum)
        except NotFoundBackendError:
            if await self._holds(key, state.size, state.checksum):  # a retried commit: the first one copied it
                self._finished(state.ref)
                return
            raise NotFoundBackendError(f"{key}: the spilled upload is gone") from None
        await self.call(self.store.delete, state.key)
        self._finished(state.ref)

    async def _complete(
        self, ref: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *, key: str | None = None,
        meta: ObjectMeta | None = None,
    ) -> None:
        """complete_upload, retried. An upload the store no longer has (UploadGoneError) was completed all the
        same if the object is at its key (a complete whose answer was lost, retried): then what the first
        complete left of the upload's bookkeeping goes too."""
        complete = self.store.complete_upload
        if key is not None:
            complete = functools.partial(complete, key=key, meta=meta)
        try:
            await self.call(complete, ref, parts, size, checksum)
        except UploadGoneError:
            if not await self._holds(key or ref.key, size, checksum):
                raise
            await self._abort_quietly(ref)

    async def _holds(self, key: str, size: int, checksum: str | None) -> bool:
        """Is the object at `key` the one of `size` bytes and `checksum` (None: any) that a commit made?"""
        info = await self.call(self.store.head, key)
        if info is None or info.size != size:
            return False
        if checksum is None:
            return True
        if info.checksum is not None:
            return info.checksum == checksum
        # A store without checksums in its metadata (file://): read it. Rare: only a retried commit.
        return await self.call(self._checksum_of, key, info.size) == checksum

    def _checksum_of(self, key: str, size: int) -> str:
        counted = _RangeWriter(-1, 0)  # the ranges arrive in order: one running CRC over all of them
        while counted.written < size:
            offset = counted.written
            self.store.get_range(key, offset, min(self.download_part_size, size - offset), sink=counted)
            if counted.written == offset:
                break
        return crc_text(counted.crc)

    async def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None,
                   checksum: str | None = None) -> None:
        """Server-side copy (ObjectStore.copy): dst_key appears atomically, with `meta` and `checksum` as its
        metadata if given, else the source's. An object larger than the store copies in one request goes part
        by part: open_upload, copy_part in parallel (pinned to the source's version), complete. Raises
        NotFoundBackendError only if the source is missing."""
        try:
            await self.call(self.store.copy, src_key, dst_key, meta, checksum)
            return
        except TooLargeToCopyError:
            pass
        source = await self.call(self.store.head, src_key)
        if source is None:
            raise NotFoundBackendError(f"copy {src_key}: no such object")
        # What is not given stays the source's, as in a copy in one request.
        meta = meta if meta is not None else ObjectMeta(source.mtime_ns, source.mode)
        checksum = checksum if checksum is not None else source.checksum
        limits = self.store.limits
        part_size = plan_part_size(source.size, COPY_PART_SIZE, UPLOAD_SPREAD, min_part=limits.min_part_size,
                                   max_parts=limits.max_parts)
        todo = [(index + 1, offset) for index, offset in enumerate(range(0, source.size, part_size))]
        copy_part = functools.partial(self.store.copy_part, if_match=source.etag)
        ref = await self._open_upload(dst_key, meta, checksum)
        parts: list[UploadPart] = []

        async def worker() -> None:
            while todo:
                number, offset = todo.pop(0)
                length = min(part_size, source.size - offset)
                parts.append(await self._retry(copy_part, ref, number, src_key, offset, length,
                                               limiter=self._part_threads))

        try:
            async with _parallel() as nursery:
                for _ in range(min(UPLOAD_SPREAD, len(todo))):
                    nursery.start_soon(worker)
            await self._complete(ref, sorted(parts, key=lambda p: p.number), source.size, checksum)
        except BaseException as exc:
            with trio.move_on_after(30, shield=True):
                await self._abort_quietly(ref)
            if isinstance(exc, UploadGoneError):  # the staged copy went, not the source (a NotFound to callers)
                raise TransientBackendError(f"copy {src_key} to {dst_key}: {exc}") from exc
            raise
        self._finished(ref)

    async def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """ObjectStore.set_meta; where the store rewrites metadata by copying an object onto itself and the
        object is larger than it copies in one request, a copy onto itself part by part (Transfers.copy)."""
        try:
            await self.call(self.store.set_meta, key, meta)
        except TooLargeToCopyError:
            await self.copy(key, key, meta)

    # -- downloads --------------------------------------------------------------------------------------

    async def fetch_range(
        self, key: str, fd: int, offset: int, length: int, *, if_match: str | None = None,
        priority: Priority = Priority.READ,
    ) -> FetchedRange:
        """One ranged GET of the object, written to fd at the same offset, under the memory budget."""
        granted = await self.memory.acquire(length, priority)
        self._stats.parts_down += 1
        try:
            # Not abandoned: it writes into the caller's descriptor, which must outlive the thread.
            fetched = await self._retry(self._get_and_write, key, fd, offset, length, if_match,
                                        limiter=self._part_threads, abandon=False, gated=False)
        finally:
            self._stats.parts_down -= 1
            self.memory.release(granted)
        self._moved(0, fetched.length)
        return fetched

    def _get_and_write(self, key: str, fd: int, offset: int, length: int, if_match: str | None) -> FetchedRange:
        # Streamed: each piece is checksummed and written while it is still in the CPU's cache, and the
        # range is never one fresh buffer of its own (see RANGE_PIECE).
        writer = _RangeWriter(fd, offset)
        answer = self.store.get_range(key, offset, length, if_match=if_match, sink=writer)
        expected = min(length, max(0, answer.size - offset))
        if writer.written != expected:
            raise TransientBackendError(f"download {key}: got {writer.written} of {expected} bytes")
        return FetchedRange(offset, writer.written, writer.crc, answer.size, answer.etag, answer.checksum)

    async def download(self, key: str, dst_path: str, *, priority: Priority = Priority.READ) -> str:
        """The whole object into dst_path (created or truncated), ranges in parallel, pinned to one version
        of the object and checked against the checksum in its metadata; returns its checksum."""
        fd = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            step = self.download_part_size
            first = await self.fetch_range(key, fd, 0, step, priority=priority)
            crcs = {0: (first.crc, first.length)}
            todo = list(range(first.length, first.size, step))

            async def worker() -> None:
                while todo:
                    offset = todo.pop(0)
                    got = await self.fetch_range(key, fd, offset, min(step, first.size - offset),
                                                 if_match=first.etag, priority=priority)
                    crcs[offset] = (got.crc, got.length)

            async with _parallel() as nursery:
                for _ in range(min(self.parts_in_flight, len(todo))):
                    nursery.start_soon(worker)
        finally:
            os.close(fd)
        whole = 0
        for offset in sorted(crcs):
            crc, length = crcs[offset]
            whole = crc if offset == 0 else crc32_combine(whole, crc, length)
        checksum = crc_text(whole)
        if first.checksum and first.checksum.startswith("crc32:") and first.checksum != checksum:
            raise TransientBackendError(f"download {key}: checksum mismatch (got {checksum}, the object says"
                                        f" {first.checksum})")
        return checksum
