"""Server-side copies on the engine's plumbing: in one request where the store can, else part by part into
a staged upload (stores that copy at most so much at once: S3's 5 GiB), and metadata rewrites that are
copies onto the object itself on such stores. Renames of uploaded files (drain/namespace_jobs.py) and spills
committed on stores that cannot complete an upload at another key use them. The store copies the bytes
itself: none pass through this node, so copies take no tokens of the bandwidth caps (bandwidth.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import trio

from ckptfs.backends.base import ObjectMeta, UploadPart
from ckptfs.errors import NotFoundBackendError, TooLargeToCopyError, TransientBackendError, UploadGoneError
from ckptfs.transfer.contracts import UPLOAD_SPREAD, MiB, plan_part_size
from ckptfs.transfer.pool import for_each

if TYPE_CHECKING:
    from ckptfs.transfer.staging import StagedUploads

COPY_PART_SIZE = 512 * MiB  # server-side part copies of an object larger than the store copies at once


class Copies:
    """The engine's copies (`Transfers.copies`), on the store calls every upload is made of."""

    def __init__(self, staging: StagedUploads) -> None:
        self.staging = staging

    async def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None,
                   checksum: str | None = None) -> None:
        """Server-side copy (ObjectStore.copy): dst_key appears atomically, with `meta` and `checksum` as its
        metadata if given, else the source's. An object larger than the store copies in one request goes part
        by part: open_upload, copy_part in parallel (pinned to the source's version), complete. Raises
        NotFoundBackendError only if the source is missing."""
        try:
            await self.staging.call(self.staging.store.copy, src_key, dst_key, meta, checksum)
            return
        except TooLargeToCopyError:
            pass
        source = await self.staging.call(self.staging.store.head, src_key)
        if source is None:
            raise NotFoundBackendError(f"copy {src_key}: no such object")
        # What is not given stays the source's, as in a copy in one request.
        meta = meta if meta is not None else ObjectMeta(source.mtime_ns, source.mode)
        checksum = checksum if checksum is not None else source.checksum
        limits = self.staging.store.limits
        part_size = plan_part_size(source.size, COPY_PART_SIZE, UPLOAD_SPREAD, min_part=limits.min_part_size,
                                   max_parts=limits.max_parts)
        copy_part = functools.partial(self.staging.store.copy_part, if_match=source.etag)
        ref = await self.staging.open_upload(dst_key, meta, checksum)
        parts: list[UploadPart] = []

        async def copy_one(numbered: tuple[int, int]) -> None:
            number, offset = numbered
            length = min(part_size, source.size - offset)
            parts.append(await self.staging.retry(copy_part, ref, number, src_key, offset, length,
                                                  limiter=self.staging.part_threads))

        try:
            await for_each(enumerate(range(0, source.size, part_size), start=1), copy_one, UPLOAD_SPREAD)
            await self.staging.complete(ref, sorted(parts, key=lambda p: p.number), source.size, checksum)
        except BaseException as exc:
            with trio.move_on_after(30, shield=True):
                await self.staging.abort(ref)
            if isinstance(exc, UploadGoneError):  # the staged copy went, not the source (a NotFound to callers)
                raise TransientBackendError(f"copy {src_key} to {dst_key}: {exc}") from exc
            raise
        self.staging.leftovers.finished(ref)

    async def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """ObjectStore.set_meta; where the store rewrites metadata by copying an object onto itself and the
        object is larger than it copies in one request, a copy onto itself part by part (copy)."""
        try:
            await self.staging.call(self.staging.store.set_meta, key, meta)
        except TooLargeToCopyError:
            await self.copy(key, key, meta)
