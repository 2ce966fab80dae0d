"""The store calls every upload is made of, shared by the engine (engine.py), its spills (spills.py) and
its copies (copies.py): one store call in a worker thread, retried with backoff on transient errors and kept
out of a sweep's listing (`call`, `retry`); a part read from the local file and staged, under the upload cap
and the memory budget (`put_part`); a staged upload opened, completed (also one whose answer was lost), and
aborted (`open_upload`, `complete`, `abort`), with the leftovers it may leave tracked (`leftovers`); the
CRC32 scan of a local file (`scan`); and the download cap's pacing of a range as it arrives (`paced`)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from ckptfs.backends.base import ObjectMeta, ObjectStore, RangeSink, UploadPart, UploadRef, backoff_delays
from ckptfs.checksums import crc32, crc_text
from ckptfs.errors import BackendError, ObjectChangedError, TransientBackendError, UploadGoneError
from ckptfs.transfer.bandwidth import Bandwidth
from ckptfs.transfer.contracts import Priority, TransferStats
from ckptfs.transfer.leftovers import Leftovers
from ckptfs.transfer.local_io import RangeWriter, SourceChangedError, read_part, scan_crc, source_error
from ckptfs.transfer.memory import MemoryBudget
from ckptfs.transfer.pool import for_each

log = logging.getLogger(__name__)

T = TypeVar("T")

# Store calls that carry no part data (open, complete, abort, head, list) run on their own threads, so
# that they never queue behind big parts.
CONTROL_THREADS = 8


class StagedUploads:
    def __init__(
        self, store: ObjectStore, memory: MemoryBudget, bandwidth: Bandwidth, stats: TransferStats, *,
        parts_in_flight: int, download_part_size: int, attempts: int, sleep: Callable[[float], Any],
        moved: Callable[[int, int], None],
    ) -> None:
        self.store = store
        self.memory = memory
        self.bandwidth = bandwidth
        self.parts_in_flight = parts_in_flight
        self.download_part_size = download_part_size
        self.attempts = attempts
        self._stats = stats
        self._sleep = sleep
        self._moved = moved
        # Threads for part data, up and down; store calls without part data have their own.
        self.part_threads = trio.CapacityLimiter(parts_in_flight)
        self._control_threads = trio.CapacityLimiter(CONTROL_THREADS)
        # What interrupted uploads leave in the store: the uploads this process works on, the sweeps.
        self.leftovers = Leftovers(store, self.call)

    async def call(self, fn: Callable[..., T], *args: Any, gated: bool = True) -> T:
        """One store call that carries no part data, in a worker thread, retried on transient errors.
        `gated=False`: it leaves nothing in the store, and may run while a sweep lists (Leftovers)."""
        return await self.retry(fn, *args, limiter=self._control_threads, gated=gated)

    async def retry(
        self, fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter, abandon: bool = True,
        gated: bool = True, sends: int = 0,
    ) -> T:
        """`sends`: the bytes each attempt uploads, for the upload cap. The caller took them for the first
        attempt (before it asked for memory); a retry sends them again, so it takes them again."""
        delays = backoff_delays()
        for attempt in range(self.attempts):
            if attempt and sends:
                await self.bandwidth.up.take(sends)
            try:
                if gated:  # a call that may leave something in the store (not a download)
                    return await self.gated_once(fn, args, limiter, abandon)
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

    async def gated_once(self, fn: Callable[..., T], args: tuple[Any, ...], limiter: trio.CapacityLimiter,
                     abandon: bool) -> T:
        """One attempt of a store call, never while a sweep lists the leftovers (Leftovers.store_call)."""
        async with self.leftovers.store_call():
            # Abandoned on cancel (unless it writes into a file descriptor its caller owns) so that shutdown
            # never waits for a transfer; what the thread leaves half done is invisible (a staged part) or
            # harmless (an object the journal redoes, a leftover the next sweep removes).
            return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=abandon)


    async def put_part(
        self, ref: UploadRef, number: int, offset: int, length: int, src_path: str, expected_crc: int | None,
        priority: Priority,
    ) -> tuple[UploadPart, int]:
        """Read one part of the local file and stage it, under the upload cap and the memory budget; (part,
        its CRC32)."""
        # Its turn under the cap first, holding nothing meanwhile (bandwidth.py: why not after the memory).
        await self.bandwidth.up.take(length)
        buffer: bytearray | None = None
        if self.store.limits.reusable_buffers:
            granted, buffer = await self.memory.acquire_buffer(length, priority)
        else:
            granted = await self.memory.acquire(length, priority)
        self._stats.parts_up += 1
        try:
            result = await self.retry(self._read_and_put, ref, number, offset, length, buffer, src_path,
                                       expected_crc, limiter=self.part_threads, sends=length)
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
        data = read_part(src_path, ref.key, offset, length, buffer)
        crc = crc32(data)
        if expected_crc is not None and crc != expected_crc:
            raise SourceChangedError(f"{ref.key}: the file changed while it was being uploaded")
        part = self.store.put_part(ref, number, offset, data, crc)
        return part, crc


    @staticmethod
    async def sync_source(fd: int, key: str) -> None:
        try:
            # Not abandoned: it syncs the caller's descriptor.
            await trio.to_thread.run_sync(os.fsync, fd)
        except OSError as exc:
            raise source_error(exc, key) from exc

    async def scan(self, fd: int, size: int, part_size: int, key: str, *, sync_source: bool = False) -> list[int]:
        """CRC32 of every part of the file, read IO_CHUNK at a time, parts in parallel. `sync_source`
        (a file of one part only) fsyncs it in the same thread."""
        assert not sync_source or size <= part_size
        count = max(1, -(-size // part_size))
        crcs = [0] * count

        def scan_one(index: int) -> None:
            offset = index * part_size
            crcs[index] = scan_crc(fd, offset, min(size, offset + part_size), key, sync=sync_source)

        async def scan_part(index: int) -> None:
            # Not abandoned: it reads the caller's descriptor (and a local read is quick).
            await trio.to_thread.run_sync(scan_one, index, limiter=self.part_threads)

        await for_each(range(count), scan_part, self.parts_in_flight)
        return crcs


    async def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        ref = await self.call(self.store.open_upload, key, meta, checksum)
        # No checkpoint since the call returned: a sweep cannot list it before it is live.
        self.leftovers.opened(ref)
        return ref


    async def abort(self, ref: UploadRef) -> None:
        """Abort a staged upload, best effort: what fails is left for a sweep."""
        try:
            await self.call(self.store.abort_upload, ref)
        except BackendError as exc:
            log.warning("could not abort the upload of %s: %s; it is removed later", ref.key, exc)
            self.leftovers.cleanup_failed()
        self.leftovers.finished(ref)


    async def complete(
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
            if not await self.holds(key or ref.key, size, checksum):
                raise
            await self.abort(ref)

    async def holds(self, key: str, size: int, checksum: str | None) -> bool:
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
        counted = RangeWriter(-1, 0)  # the ranges arrive in order: one running CRC over all of them
        paced = self.paced(counted)
        while counted.written < size:
            offset = counted.written
            self.store.get_range(key, offset, min(self.download_part_size, size - offset), sink=paced)
            if counted.written == offset:
                break
        return crc_text(counted.crc)


    def paced(self, sink: RangeSink) -> RangeSink:
        """`sink` taking each piece's tokens of the download cap first, in the worker thread that reads the
        range: the next piece is not read from the socket before its turn. A cancelled transfer stops
        waiting (trio.from_thread.check_cancelled raises trio.Cancelled through the store call)."""
        down = self.bandwidth.down

        def paced(piece: bytes | memoryview) -> None:
            down.take_blocking(len(piece), _check_cancelled)
            sink(piece)

        return paced


def _check_cancelled() -> None:
    """trio.from_thread.check_cancelled, in a thread trio started; elsewhere (a direct call, as in a test)
    there is nothing to cancel the wait."""
    try:
        trio.from_thread.check_cancelled()
    except RuntimeError:
        pass
