"""The transfer engine (see the package docstring): `Transfers`, one scheduler for every part transfer:
uploads of closed files (staged, committed, resumed, abandoned), small files in one PUT each, and ranged
downloads, on the store calls of staging.py (`call`: a worker thread, the limiters, retries with backoff),
which its spills and copies share."""
from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import trio

from ckptfs.backends.base import (
    RANGE_PIECE,
    ObjectMeta,
    ObjectStore,
    UploadState,
)
from ckptfs.checksums import crc32, crc_text, whole_crc
from ckptfs.errors import (
    BackendError,
    PermanentBackendError,
    TransientBackendError,
)
from ckptfs.transfer.bandwidth import NO_LIMIT, Bandwidth, Timetable
from ckptfs.transfer.contracts import (
    UPLOAD_SPREAD,
    FetchedRange,
    MiB,
    Priority,
    PutFile,
    SmallFile,
    StagedUpload,
    TransferStats,
    plan_part_size,
)
from ckptfs.transfer.copies import Copies
from ckptfs.transfer.local_io import (
    RangeWriter,
    SourceChangedError,
    read_whole,
    source_error,
)
from ckptfs.transfer.memory import MemoryBudget
from ckptfs.transfer.pool import for_each, parallel
from ckptfs.transfer.spills import Spills
from ckptfs.transfer.staging import StagedUploads

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MEMORY_BUDGET = 256 * MiB
DEFAULT_PART_SIZE = 64 * MiB
DEFAULT_DOWNLOAD_PART_SIZE = 16 * MiB
DEFAULT_PARTS_IN_FLIGHT = 16
DEFAULT_MULTIPART_THRESHOLD = 8 * MiB
DEFAULT_ATTEMPTS = 5  # per part or request; the drain retries whole jobs forever on top
RATE_WINDOW = 5.0  # seconds over which status reports bytes per second


def _unchanged() -> bool:
    return False


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
        upload_limit: Timetable = NO_LIMIT,
        download_limit: Timetable = NO_LIMIT,
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
        self._stats = TransferStats()
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()  # (time, up, down)
        # The caps, one token bucket per direction shared by every transfer (transfer/bandwidth.py says
        # where each kind of transfer takes its tokens, and why there).
        self.bandwidth = Bandwidth(upload_limit, download_limit)
        # The store calls uploads are made of (retried, under the caps and the memory budget), which the
        # spills and the copies share with the uploads of closed files here.
        self.staging = StagedUploads(
            store, self.memory, self.bandwidth, self._stats, parts_in_flight=self.parts_in_flight,
            download_part_size=self.download_part_size, attempts=self.attempts, sleep=sleep, moved=self._moved,
        )
        self.leftovers = self.staging.leftovers
        self.copies = Copies(self.staging)  # server-side copies, part by part where the store copies less at once
        self.spills = Spills(self.staging, self.copies)  # the start of a file still being written, at a hidden key

    def statistics(self) -> TransferStats:
        now = trio.current_time()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent.popleft()
        return replace(
            self._stats, memory_in_use=self.memory.in_use + self.memory.spare_bytes, memory_budget=self.memory.limit,
            memory_peak=self.memory.peak, memory_waiters=self.memory.waiting,
            up_bytes_per_second=sum(up for _, up, _ in self._recent) / RATE_WINDOW,
            down_bytes_per_second=sum(down for _, _, down in self._recent) / RATE_WINDOW,
            upload_limit=self.bandwidth.up.now(), download_limit=self.bandwidth.down.now(),
        )

    def lift_limits(self) -> None:
        """No bandwidth cap, up or down, from now until the daemon restarts or `ckptfs limit` sets one (a
        preemption notice: what is left must go as fast as it can). Transfers waiting for tokens go now."""
        self.bandwidth.lift()

    def _moved(self, up: int, down: int) -> None:
        self._stats.bytes_up += up
        self._stats.bytes_down += down
        self._recent.append((trio.current_time(), up, down))

    # -- plumbing ---------------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any, gated: bool = True) -> T:
        """One store call that carries no part data, in a worker thread, retried on transient errors.
        `gated=False`: it leaves nothing in the store, and may run while a sweep lists (Leftovers)."""
        return await self.staging.call(fn, *args, gated=gated)

    async def note_call(self, fn: Callable[..., T], *args: Any) -> T:
        """call() of a store note (put_note, get_note, list_notes, delete_note). A note is written whole
        in one request (a file:// note's temp file carries this process's incarnation, which no sweep takes
        for a leftover), so it runs while a sweep lists: a node's pending record must not wait for the
        start-up sweep of the last run's leftovers, which a throttling store can make long."""
        return await self.call(fn, *args, gated=False)

    def upload_part_size(self, size: int) -> int:
        """Parts small enough that UPLOAD_SPREAD of them fit the memory budget at once (one stream per part
        is what fills a link), and no larger than part_size."""
        limits = self.store.limits
        part_size = min(self.part_size, max(limits.min_part_size, self.memory.limit // UPLOAD_SPREAD))
        spread = max(1, min(self.parts_in_flight, self.memory.limit // part_size))
        return plan_part_size(size, part_size, spread, min_part=limits.min_part_size, max_parts=limits.max_parts)

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
            raise source_error(exc, key) from exc
        try:
            size = os.fstat(fd).st_size
            if size < self.multipart_threshold:
                if resume is not None:
                    await self.abandon(resume, "the file is now below the multipart threshold")
                crcs = await self.staging.scan(fd, size, max(size, 1), key, sync_source=sync_source)
                return StagedUpload(key, size, crc_text(crcs[0]), meta, src_path, None)
            async with parallel() as nursery:
                if sync_source:
                    nursery.start_soon(self.staging.sync_source, fd, key)
                staged = await self._stage_parts(key, src_path, fd, size, meta, resume, progress, priority)
            return staged
        finally:
            os.close(fd)

    async def _stage_parts(
        self, key: str, src_path: str, fd: int, size: int, meta: ObjectMeta, resume: UploadState | None,
        progress: Callable[[UploadState], None] | None, priority: Priority,
    ) -> StagedUpload:
        reusable = resume is not None and resume.key == key and resume.size == size and not resume.spilled
        part_size = resume.part_size if reusable and resume is not None else self.upload_part_size(size)
        crcs = await self.staging.scan(fd, size, part_size, key)
        checksum = crc_text(whole_crc(crcs, part_size, size))

        state: UploadState | None = None
        if resume is not None:
            state = await self._resumable(resume, key, size, checksum, meta, crcs)
        if state is None:
            ref = await self.staging.open_upload(key, meta, checksum)
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

        async def put(number: int) -> None:
            offset = (number - 1) * part_size
            part, _ = await self.staging.put_part(current[0].ref, number, offset, min(part_size, size - offset),
                                           src_path, crcs[number - 1], priority)
            parts = tuple(sorted((*current[0].parts, part), key=lambda p: p.number))
            current[0] = replace(current[0], parts=parts)
            if progress is not None:
                progress(current[0])

        try:
            await for_each(todo, put, self.parts_in_flight)
        except BaseException:
            if progress is None:  # nobody can resume it: do not leave it behind
                with trio.move_on_after(30, shield=True):
                    await self.abandon(current[0])
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
            await self.abandon(resume, "the file changed since")
            return None
        held = await self.call(self.store.list_parts, resume.ref)
        if held is None:
            await self.abandon(resume, "the interrupted upload is gone from the store")
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

    async def abandon(self, state: UploadState | None, why: str = "") -> None:
        """Throw a staged upload or spill away (best effort; None: nothing staged): the one way to, for a
        state just staged or one a journal row remembers. Aborted, and a spill's hidden object (which a
        commit interrupted after completing it leaves) deleted; what fails is left for a sweep."""
        if state is None:
            return
        if why:
            log.info("upload of %s: %s; aborting the interrupted upload", state.key, why)
        await self.staging.abort(state.ref)
        if state.spilled:
            try:
                await self.call(self.store.delete, state.key)
            except BackendError as exc:
                log.warning("could not remove the spilled start of %s: %s; it is removed later", state.key, exc)
                self.leftovers.cleanup_failed()

    async def commit_upload(self, staged: StagedUpload, *, priority: Priority = Priority.UPLOAD) -> None:
        """Make a staged upload the object at its key, atomically. Below the multipart threshold, one PUT of
        the bytes the scan checked, as put_files puts a small file."""
        if staged.state is None:
            small = SmallFile(staged.key, staged.src_path, staged.meta, _unchanged, (staged.size, staged.checksum))
            (outcome,) = await self.put_files([small], size=staged.size, commit=lambda read: read, priority=priority)
            if isinstance(outcome, BaseException):
                raise outcome
            return
        state = staged.state
        await self.staging.complete(state.ref, state.parts, state.size, state.checksum)
        self.leftovers.finished(state.ref)

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
        await self.bandwidth.up.take(size)  # all their bytes, before the memory, as a part does
        granted = await self.memory.acquire(size, priority)
        self._stats.parts_up += 1
        try:
            read = await self._read_files(files)
            outcomes: list[PutFile | BaseException | None] = [
                item if isinstance(item, BaseException) else None for item in read
            ]
            wanted = commit([i for i, item in enumerate(read) if not isinstance(item, BaseException)])
            staged = [(files[i], read[i]) for i in wanted]
            put = (await self.staging.gated_once(self._put_read, (staged,), self.staging.part_threads, True)
                   if staged else [])
            for index, outcome in zip(wanted, put, strict=True):
                outcomes[index] = outcome
                if isinstance(outcome, TransientBackendError) and not isinstance(outcome, SourceChangedError):
                    self._stats.retries += 1
                    try:
                        item = read[index]
                        outcomes[index] = await self.staging.retry(self._put_one, files[index], item,
                                                            limiter=self.staging.part_threads,
                                                            sends=len(item) if isinstance(item, bytes) else 0)
                    except Exception as exc:
                        outcomes[index] = exc
        finally:
            self._stats.parts_up -= 1
            self.memory.release(granted)
        self._moved(sum(o.size for o in outcomes if isinstance(o, PutFile)), 0)
        return outcomes

    async def _read_files(self, files: Sequence[SmallFile]) -> list[bytes | BaseException]:
        """put_files' first hop: each file's bytes, or why it cannot be put."""
        def read() -> list[bytes | BaseException]:
            return [read_whole(small.src_path, small.key, small.changed) for small in files]

        return await trio.to_thread.run_sync(read, limiter=self.staging.part_threads)

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
        if small.expected is not None and small.expected != (len(data), checksum):
            raise SourceChangedError(f"{small.key}: the file changed while it was being uploaded")
        self.store.put_object(small.key, data, small.meta, checksum)
        return PutFile(len(data), checksum)

    # -- downloads --------------------------------------------------------------------------------------

    async def fetch_range(
        self, key: str, fd: int, offset: int, length: int, *, if_match: str | None = None,
        priority: Priority = Priority.READ, piece_size: int = RANGE_PIECE,
    ) -> FetchedRange:
        """One ranged GET of the object, written to fd at the same offset, under the download cap and the
        memory budget, in pieces of `piece_size` (see RANGE_PIECE)."""
        # Under a cap, a slot of the window first (bandwidth.py): ranges slowed to the cap must not hold
        # every part thread and the memory budget; the bytes themselves are paced as they arrive.
        async with self.bandwidth.down.window(priority, self.download_part_size):
            granted = await self.memory.acquire(length, priority)
            self._stats.parts_down += 1
            try:
                # Not abandoned: it writes into the caller's descriptor, which must outlive the thread.
                fetched = await self.staging.retry(self._get_and_write, key, fd, offset, length, if_match, piece_size,
                                            limiter=self.staging.part_threads, abandon=False, gated=False)
            finally:
                self._stats.parts_down -= 1
                self.memory.release(granted)
        self._moved(0, fetched.length)
        return fetched

    def _get_and_write(
        self, key: str, fd: int, offset: int, length: int, if_match: str | None, piece_size: int,
    ) -> FetchedRange:
        # Streamed: each piece is checksummed and written while it is still in the CPU's cache, and the
        # range is never one buffer of its own (see RANGE_PIECE).
        writer = RangeWriter(fd, offset)
        answer = self.store.get_range(key, offset, length, if_match=if_match, sink=self.staging.paced(writer),
                                      piece_size=piece_size)
        expected = min(length, max(0, answer.size - offset))
        if writer.written != expected:
            raise TransientBackendError(f"download {key}: got {writer.written} of {expected} bytes")
        return FetchedRange(offset, writer.written, writer.crc, answer.size, answer.etag, answer.checksum)


