"""GcsStore's staged uploads (gcs.py): part objects composed into the key. Owned by GcsStore; every request
goes through the store's GcsWire (gcswire.py), never through the store.

Everything an upload writes is under `<prefix>/.ckptfs-tmp.parts/<owner>/<upload id>/`: `open` writes a
manifest there (JSON: key and metadata; create-only, so a retried open finds its own), `put_part` writes
`p<number>` with its CRC32C in the request (the server rejects a part whose bytes do not match),
`list_parts` lists them, and `complete` composes them (at most 32 sources per call, so above 32 parts in a
tree of intermediate objects `c<level>-<n>`), every source pinned to the generation its put_part wrote,
into the key with the metadata, in one atomic step, then deletes the upload's directory, manifest first (a
part that lands after an abort sees its manifest gone and removes itself). An upload whose manifest is gone
is gone (UploadGoneError). `leftovers` lists only this owner's directory, so it never touches another
node's uploads. docs/design/stores.md says why part objects and compose.
"""

from __future__ import annotations

import logging
import stat
import threading
from collections.abc import Sequence
from typing import Any

from google.cloud import storage

from ckptfs.backends.base import TEMP_PREFIX, ObjectMeta, UploadPart, UploadRef
from ckptfs.backends.common import (
    META_CHECKSUM,
    check_key,
    metadata_of,
    new_upload,
    parse_bookkeeping,
)
from ckptfs.backends.gcserrors import status_of
from ckptfs.backends.gcswire import GcsWire
from ckptfs.checksums import crc_text
from ckptfs.errors import (
    BackendError,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
    UploadGoneError,
)

log = logging.getLogger(__name__)

MAX_COMPOSE_SOURCES = 32  # GCS's limit per compose request
PARTS_DIR = f"{TEMP_PREFIX}parts/"
MANIFEST = "manifest"


class ComposedUploads:
    """The staged uploads of one GcsStore, and whether a cleanup of them failed."""

    def __init__(self, wire: GcsWire, owner: str) -> None:
        self._wire = wire
        self.owner = owner
        # ObjectStore.left_behind, which GcsStore reads and the engine's sweep resets through the store.
        self.left_behind = False
        # put_part calls in progress per upload id: an abort waits for this process's to settle.
        self._parts_busy: dict[str, int] = {}
        self._parts_idle = threading.Condition(threading.Lock())

    def _upload_dir(self, upload: UploadRef) -> str:
        return f"{self._wire.prefix}{PARTS_DIR}{upload.marker or f'{self.owner}/{upload.upload_id}'}/"

    def open(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        upload, body = new_upload(key, meta, checksum, owner=self.owner, checksum_key=META_CHECKSUM)
        # Create-only: a random id never meets an existing manifest, and a retry after a lost answer finds
        # its own manifest already there (412), which is as good as written.
        try:
            manifest = self._wire.new_blob(self._upload_dir(upload) + MANIFEST)
            self._wire.upload_bytes(manifest, body, f"start upload of {key}", if_generation_match=0)
        except TransientBackendError as exc:
            if status_of(exc) != 412:
                # It may have been written with every answer lost; a retry starts another: the next sweep
                # removes this one.
                self.left_behind = True
                raise
        return upload

    def _part_name(self, upload: UploadRef, number: int) -> str:
        return f"{self._upload_dir(upload)}p{number:05d}"

    def put_part(self, upload: UploadRef, number: int, data: bytes | bytearray, crc: int) -> UploadPart:
        with self._parts_idle:
            self._parts_busy[upload.upload_id] = self._parts_busy.get(upload.upload_id, 0) + 1
        try:
            return self._put_part(upload, number, bytes(data), crc)  # bytes already (reusable_buffers=False)
        finally:
            with self._parts_idle:
                left = self._parts_busy[upload.upload_id] - 1
                if left:
                    self._parts_busy[upload.upload_id] = left
                else:
                    del self._parts_busy[upload.upload_id]
                self._parts_idle.notify_all()

    def _put_part(self, upload: UploadRef, number: int, data: bytes, crc: int) -> UploadPart:
        what = f"upload part {number} of {upload.key}"
        blob = self._wire.new_blob(self._part_name(upload, number))
        self._wire.upload_bytes(blob, data, what)
        # An abort that ran meanwhile (it removes the manifest first) must not leave this part behind.
        manifest = self._wire.blob(self._upload_dir(upload) + MANIFEST)
        gone = not self._wire.request(what, lambda: manifest.exists(retry=None, timeout=self._wire.timeout))
        if gone:
            self._wire.delete_name(blob.name, what)
            raise UploadGoneError(f"{what}: the staged upload is gone")
        return UploadPart(number, str(blob.generation), crc_text(crc))

    def _read_manifest(self, upload: UploadRef) -> dict[str, Any] | None:
        blob = self._wire.blob(self._upload_dir(upload) + MANIFEST)
        try:
            return parse_bookkeeping(self._wire.download(blob, f"read the manifest of the upload of {upload.key}"))
        except NotFoundBackendError:
            return None

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        if self._read_manifest(upload) is None:
            return None
        parts: dict[int, tuple[str, int]] = {}
        directory = self._upload_dir(upload)
        for blob in self._wire.list_names(directory + "p"):
            tail = blob.name[len(directory) + 1:]
            if tail.isdigit():
                parts[int(tail)] = (str(blob.generation), int(blob.size or 0))
        return parts

    def complete(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        if key is None:
            key = upload.key
        else:
            check_key(key)
        what = f"complete upload of {key}"
        manifest = self._read_manifest(upload)
        if manifest is None:  # aborted, or a complete whose answer was lost got through (the engine checks)
            raise UploadGoneError(f"{what}: the staged upload is gone")
        if meta is not None:  # a compose sets the new object's metadata, so it can be any
            metadata = metadata_of(meta, stat.S_IFREG)
            metadata[META_CHECKSUM] = checksum or ""
        else:
            metadata = {str(k): str(v) for k, v in (manifest.get("metadata") or {}).items()}
        dest = self._wire.new_blob(self._wire.full(key), metadata)
        sources = [self._wire.blob(self._part_name(upload, p.number), generation=int(p.etag))
                   for p in sorted(parts, key=lambda p: p.number)]
        try:
            if not sources:
                self._wire.upload_bytes(dest, b"", what)
            else:
                self._compose_tree(upload, sources, dest, what)
        except (NotFoundBackendError, TransientBackendError) as exc:
            # A part gone (404), or one not of the generation staged (412) because the upload went meanwhile
            # (a retried complete whose first try got through removes the manifest, then the parts).
            if status_of(exc) == 404 or (status_of(exc) == 412 and self._read_manifest(upload) is None):
                raise UploadGoneError(f"{what}: the staged upload is gone") from exc
            raise
        if int(dest.size or 0) != size:
            raise PermanentBackendError(f"{what}: the composed object has {dest.size} bytes, expected {size}")
        self._remove_upload(upload)

    def _compose_tree(self, upload: UploadRef, sources: list[storage.Blob], dest: storage.Blob, what: str) -> None:
        """Compose `sources` into `dest`, at most 32 per request: groups of 32 into intermediate objects in the
        upload's directory, level by level, then the last <= 32 into dest. Every source is pinned to its
        generation, so only the bytes whose part upload succeeded (and was verified) end up in the object."""
        level = 0
        while len(sources) > MAX_COMPOSE_SOURCES:
            composed = []
            for index in range(0, len(sources), MAX_COMPOSE_SOURCES):
                group = sources[index:index + MAX_COMPOSE_SOURCES]
                if len(group) == 1:
                    composed.append(group[0])
                    continue
                middle = self._wire.new_blob(f"{self._upload_dir(upload)}c{level}-{index // MAX_COMPOSE_SOURCES:05d}")
                self._compose(middle, group, what)
                composed.append(self._wire.blob(middle.name, generation=middle.generation))
            sources = composed
            level += 1
        self._compose(dest, sources, what)

    def _compose(self, dest: storage.Blob, sources: list[storage.Blob], what: str) -> None:
        self._wire.request(what, lambda: dest.compose(
            sources, if_source_generation_match=[s.generation for s in sources], retry=None,
            timeout=self._wire.timeout))

    def _remove_upload(self, upload: UploadRef) -> None:
        """Best effort: what is left is this owner's, and the engine's next sweep removes it."""
        try:
            self._delete_upload_dir(upload)
        except BackendError as exc:
            log.debug("could not remove the parts of %s: %s", upload.key, exc)
            self.left_behind = True

    def _delete_upload_dir(self, upload: UploadRef) -> None:
        directory = self._upload_dir(upload)
        # The manifest first: a put_part finishing after this sees it gone and removes its own part, and
        # the parts listed next are all there are (list_leftovers still finds a crash's remains by the id).
        self._wire.delete_name(directory + MANIFEST, f"abort upload of {upload.key}")
        for blob in self._wire.list_names(directory):
            self._wire.delete_name(blob.name, f"remove a part of the upload of {upload.key}")

    def abort(self, upload: UploadRef) -> None:
        """Remove the upload's directory. Unlike an S3 abort, nothing stops a part still being written (by
        a thread the engine gave up on) from landing after the listing: such a part sees the manifest gone
        and removes itself, and this process's parts are waited for (up to one request's timeout), so the
        directory is empty when this returns."""
        self._wire.delete_name(self._upload_dir(upload) + MANIFEST, f"abort upload of {upload.key}")
        with self._parts_idle:
            self._parts_idle.wait_for(lambda: upload.upload_id not in self._parts_busy,
                                      timeout=sum(self._wire.timeout))
        self._delete_upload_dir(upload)

    def leftovers(self) -> list[UploadRef]:
        mine = f"{self._wire.prefix}{PARTS_DIR}{self.owner}/"
        ids: dict[str, bool] = {}
        for blob in self._wire.list_names(mine):
            upload_id, _, rest = blob.name[len(mine):].partition("/")
            if upload_id:
                ids[upload_id] = ids.get(upload_id, False) or rest == MANIFEST
        found = []
        for upload_id, has_manifest in sorted(ids.items()):
            ref = UploadRef("", upload_id, f"{self.owner}/{upload_id}")
            manifest = self._read_manifest(ref) if has_manifest else None
            key = manifest.get("key") if manifest else None
            found.append(UploadRef(key if isinstance(key, str) else "", upload_id, ref.marker))
        return found
