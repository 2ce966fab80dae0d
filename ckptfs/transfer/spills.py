"""Spills: the start of a file still being written, staged in the store at a hidden key (SPILL_PREFIX)
part by part while the writer goes on, then committed at the file's key once it is closed: completed there
where the store can, else completed at the hidden key, copied and deleted. The drain decides when
(drain/spill_jobs.py); this is how, on the engine's plumbing."""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ckptfs.backends.base import ObjectMeta, UploadPart, UploadState
from ckptfs.checksums import combine_crcs, crc_of, crc_text, whole_crc
from ckptfs.errors import BackendError, NotFoundBackendError, PermanentBackendError
from ckptfs.transfer.contracts import Priority
from ckptfs.transfer.leftovers import SPILL_PREFIX
from ckptfs.transfer.local_io import SourceChangedError, fdatasync_path, source_error
from ckptfs.transfer.pool import for_each, parallel

if TYPE_CHECKING:
    from ckptfs.transfer.copies import Copies
    from ckptfs.transfer.staging import StagedUploads


class Spills:
    """The engine's spills (`Transfers.spills`), on the store calls every upload is made of and the copies."""

    def __init__(self, staging: StagedUploads, copies: Copies) -> None:
        self.staging = staging
        self.copies = copies

    async def begin(self, part_size: int, *, early: bool = False) -> UploadState:
        key = f"{SPILL_PREFIX}{self.staging.store.owner}.{secrets.token_hex(8)}"
        ref = await self.staging.open_upload(key, None, None)
        limits = self.staging.store.limits
        part_size = min(max(part_size, limits.min_part_size), limits.max_part_size)
        return UploadState(key=key, upload_id=ref.upload_id, marker=ref.marker, size=0, checksum="", mtime_ns=0,
                           mode=0, part_size=part_size, spilled=True, early=early)

    async def matches(self, state: UploadState, src_path: str) -> bool:
        """Are the first state.size bytes of src_path still the ones the spill staged? (An early spill's
        parts stay in the cache, and a writer may have changed them since.) Also syncs src_path to disk, as
        stage_upload's `sync_source` does: the caller is about to call it a clean copy."""
        try:
            fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise source_error(exc, state.key) from exc
        try:
            async with parallel() as nursery:
                nursery.start_soon(self.staging.sync_source, fd, state.key)
                if not state.size:
                    return True
                try:
                    crcs = await self.staging.scan(fd, state.size, state.part_size, state.key)
                except SourceChangedError:  # shorter than what was staged
                    return False
        finally:
            os.close(fd)
        return crc_text(whole_crc(crcs, state.part_size, state.size)) == state.checksum

    async def stage(
        self, state: UploadState, src_path: str, end: int, *, priority: Priority = Priority.UPLOAD,
        sync_source: bool = False,
    ) -> UploadState:
        """Stage src_path's bytes from state.size up to `end`, in parts of state.part_size in parallel as for
        any upload; return the new state. Nothing is journaled in between: after a crash they are all staged
        again, under the same part numbers. `sync_source` then fdatasyncs src_path: a file being written goes
        to disk a batch at a time, not all at once before it is called clean (matches)."""
        part_size = state.part_size
        offsets = list(range(state.size, end, part_size))
        first = len(state.parts) + 1
        if first + len(offsets) - 1 > self.staging.store.limits.max_parts:
            raise PermanentBackendError(f"a spilled file needs more than {self.staging.store.limits.max_parts} parts;"
                                        " raise part_size")
        done: list[tuple[UploadPart, int]] = []

        async def put(index: int) -> None:
            offset = offsets[index]
            done.append(await self.staging.put_part(state.ref, first + index, offset, min(part_size, end - offset),
                                             src_path, None, priority))

        await for_each(range(len(offsets)), put, self.staging.parts_in_flight)
        if sync_source:
            await trio.to_thread.run_sync(fdatasync_path, src_path, state.key, limiter=self.staging.part_threads)
        done.sort(key=lambda item: item[0].number)
        pieces = [(crc, min(part_size, end - offset)) for (_, crc), offset in zip(done, offsets, strict=True)]
        whole = combine_crcs(pieces, crc_of(state.checksum))
        return replace(state, size=end, parts=(*state.parts, *(part for part, _ in done)), checksum=crc_text(whole))

    async def commit(self, state: UploadState, key: str, meta: ObjectMeta) -> None:
        """Make the staged bytes the object at `key`, atomically, with `meta` and the whole checksum: where
        the store can, by completing the upload there; else by completing it at its hidden key, copying it to
        `key` and deleting the hidden object."""
        if self.staging.store.limits.completes_anywhere:
            await self.staging.complete(state.ref, state.parts, state.size, state.checksum, key=key, meta=meta)
            self.staging.leftovers.finished(state.ref)
            return
        try:
            await self.staging.complete(state.ref, state.parts, state.size, None)
        except BackendError:
            if await self.staging.holds(key, state.size, state.checksum):  # a retried commit: the first one got through
                await self.staging.call(self.staging.store.delete, state.key)  # if its delete of the spill did not
                self.staging.leftovers.finished(state.ref)
                return
            raise
        try:
            await self.copies.copy(state.key, key, meta, state.checksum)
        except NotFoundBackendError:
            if await self.staging.holds(key, state.size, state.checksum):  # a retried commit: the first one copied it
                self.staging.leftovers.finished(state.ref)
                return
            raise NotFoundBackendError(f"{key}: the spilled upload is gone") from None
        await self.staging.call(self.staging.store.delete, state.key)
        self.staging.leftovers.finished(state.ref)
