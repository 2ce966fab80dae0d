"""GcsStore: the `gs://bucket[/prefix]` backend, Google Cloud Storage through google-cloud-storage (the JSON
API) and Application Default Credentials.

Credentials and endpoint, as users of the SDK expect: Application Default Credentials
(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, the metadata server on GCE and
GKE workload identity); the project from GOOGLE_CLOUD_PROJECT or the credentials (listing and writing
objects needs none). An emulator is reached through STORAGE_EMULATOR_HOST=http://HOST:PORT (the SDK then
uses anonymous credentials), or `endpoint_url`: ADC there too, anonymous for a plain-http endpoint.

Layout and metadata (custom metadata, x-goog-meta-*), the same names and formats as S3Store:
  - a file is an object; `mtime` "<seconds>.<9 digits>", `mode` the decimal st_mode with its type bits,
    `ckptfs-checksum` the whole-file "crc32:<hex>";
  - a directory is a zero-byte `dir/` marker object with `mtime` and `mode`;
  - a symlink is an object holding SYMLINK_BODY, its target percent-encoded in `ckptfs-symlink`.
Listings carry every object's metadata, so `listing_has_metadata` is true and `list` needs no HEADs.
The `etag` ckptfs sees is the object's generation (it changes exactly when the bytes are replaced).

Staged uploads are part objects under `<prefix>/.ckptfs-tmp.parts/<owner>/<upload id>/` (a manifest with
the key and metadata, then `p<number>` with its CRC32C, which the server checks), composed into the key
with the metadata in one atomic step (a tree of composes above 32 parts, every source pinned to the
generation its put_part wrote), then removed, manifest first. `list_leftovers` lists only `<owner>/`.
docs/design/stores.md says why not XML multipart or a resumable session.

Notes (base.py) are objects at `<prefix>/.ckptfs-tmp.notes/<name>`, each written by one upload with its
CRC32C (a new generation replaces the old atomically; a read gets one generation). GCS listings are strongly
consistent, so list_notes sees every note whose upload has returned. Notes are not under `.ckptfs-tmp.parts/`,
the only directory list_leftovers and the upload cleanups list or delete in.

Requests: every one goes through the store's GcsWire (gcswire.py), which GcsStore owns and shares with its
ComposedUploads: the client, the bucket and the prefix, the CRC32C of every upload, and the translation of
every SDK failure (gcserrors.py, once, in the wire). This module owns what the requests mean: the layout
above, reads (with the cache of known versions), listings, copies, metadata and notes; the staged uploads
are gcsuploads.py's. Every method makes one attempt: the SDK's own retries are off for the transfer
primitives and on for listings; the callers retry.
"""

from __future__ import annotations

import builtins
import functools
import logging
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from google.cloud import storage

from ckptfs.backends.base import (
    BUSY_STATUSES,
    DIR,
    NOTES_DIR,
    RANGE_PIECE,
    TEMP_PREFIX,
    DirListing,
    ObjectInfo,
    ObjectMeta,
    PartLimits,
    RangeRead,
    RangeSink,
    UploadPart,
    UploadRef,
    check_note_name,
    check_note_prefix,
    listed_note_names,
)
from ckptfs.backends.common import (
    MAX_SYMLINK_TARGET,
    META_CHECKSUM,
    META_SYMLINK,
    SYMLINK_BODY,
    WholeCopies,
    check_key,
    encode_target,
    info_from_metadata,
    is_bookkeeping,
    metadata_of,
    ns_of,
    type_bits_of,
)
from ckptfs.backends.gcserrors import check_message, status_of
from ckptfs.backends.gcsuploads import ComposedUploads
from ckptfs.backends.gcswire import GcsWire
from ckptfs.errors import (
    BackendError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    StoreCheckError,
    TransientBackendError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
MAX_PARTS = 1024  # the most components a composite object may have
VERSION_CACHE = 4096  # (key, generation) -> (size, checksum) of recently read objects


# -- the store -------------------------------------------------------------------------------------------


class GcsStore(WholeCopies):
    listing_has_metadata = True  # objects.list returns each object's custom metadata
    # Compose has no minimum part size; 5 MiB keeps the part count (and the emulators) reasonable.
    limits = PartLimits(min_part_size=5 * MiB, max_part_size=5 * GiB, max_parts=MAX_PARTS, reusable_buffers=False,
                        completes_anywhere=True)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        owner: str = "anon",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        pool_size: int = 64,
    ) -> None:
        self.wire = GcsWire(bucket, prefix, endpoint_url=endpoint_url, connect_timeout=connect_timeout,
                            read_timeout=read_timeout, pool_size=pool_size)
        # Plain values of the wire's, for messages, `ckptfs status` (credentials) and the tests.
        self.bucket_name, self.prefix, self.url = self.wire.bucket_name, self.wire.prefix, self.wire.url
        self.endpoint_url, self.credentials = self.wire.endpoint_url, self.wire.credentials
        self._lock = threading.Lock()
        self._versions: OrderedDict[tuple[str, int], tuple[int, str | None]] = OrderedDict()
        self.uploads = ComposedUploads(self.wire, owner)

    @property
    def owner(self) -> str:
        """ObjectStore.owner, kept by the uploads (gcsuploads.py), which tag and find this owner's uploads by it;
        the daemon sets it after the store is made."""
        return self.uploads.owner

    @owner.setter
    def owner(self, value: str) -> None:
        self.uploads.owner = value

    @property
    def left_behind(self) -> bool:
        """Something of this owner may be left in the bucket (the uploads know: gcsuploads.py)."""
        return self.uploads.left_behind

    @left_behind.setter
    def left_behind(self, value: bool) -> None:
        self.uploads.left_behind = value

    def __repr__(self) -> str:
        return f"GcsStore({self.url!r}, endpoint={self.wire.endpoint()!r})"

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            self.wire.probe()
        except BackendError as exc:
            message = check_message(exc, url=self.url, bucket=self.bucket_name, endpoint_url=self.wire.endpoint())
            raise StoreCheckError(message, exc, busy=status_of(exc) in BUSY_STATUSES) from None

    # -- writes of whole objects ------------------------------------------------------------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[META_CHECKSUM] = checksum
        self.wire.upload_bytes(self.wire.new_blob(self.wire.full(key), metadata), data, f"upload {key}")

    # -- staged uploads: part objects composed into the key (gcsuploads.py) ------------------------------

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        return self.uploads.open(key, meta, checksum)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        return self.uploads.put_part(upload, number, data, crc)

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        return self.uploads.list_parts(upload)

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        self.uploads.complete(upload, parts, size, checksum, key=key, meta=meta)

    def abort_upload(self, upload: UploadRef) -> None:
        self.uploads.abort(upload)

    def list_leftovers(self) -> list[UploadRef]:
        return self.uploads.leftovers()

    # -- reads ----------------------------------------------------------------------------------------------

    def _get_blob(self, key: str, what: str, **kwargs: Any) -> storage.Blob | None:
        return self.wire.get_blob(self.wire.full(key), what, **kwargs)

    def _version(self, key: str, if_match: str | None) -> tuple[int, int, str | None]:
        """(generation, size, checksum) of the object, pinned to generation `if_match` if given; an object's
        generation never changes its bytes or checksum, so a ranged read of a known version needs one GET."""
        what = f"download {key}"
        if if_match:
            with self._lock:
                known = self._versions.get((key, int(if_match)))
            if known is not None:
                return int(if_match), known[0], known[1]
        try:
            blob = self._get_blob(key, what, **({"if_generation_match": int(if_match)} if if_match else {}))
        except TransientBackendError as exc:
            if status_of(exc) == 412:
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            raise
        if blob is None:
            raise NotFoundBackendError(f"{what}: no such object")
        if if_match and int(blob.generation or 0) != int(if_match):  # emulators ignore the precondition here
            raise ObjectChangedError(f"{what}: the object was replaced during the download")
        generation, size = int(blob.generation or 0), int(blob.size or 0)
        checksum = (blob.metadata or {}).get(META_CHECKSUM)
        with self._lock:
            self._versions[(key, generation)] = (size, checksum)
            while len(self._versions) > VERSION_CACHE:
                self._versions.popitem(last=False)
        return generation, size, checksum

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        what = f"download {key}"
        generation, size, checksum = self._version(key, if_match)
        end = min(size, offset + length)
        if end <= offset:
            return RangeRead(b"", size, str(generation), checksum)
        # Both the generation (fake-gcs-server ignores ifGenerationMatch on media reads) and the precondition.
        blob = self.wire.blob(self.wire.full(key), generation=generation)
        try:
            data = self.wire.download(blob, what, start=offset, end=end - 1, if_generation_match=generation,
                                      checksum=None, raw_download=True)
        except BackendError as exc:
            # 412, or 404 for a generation no longer kept: that version is gone (replaced, or deleted).
            if status_of(exc) == 412 or (if_match and status_of(exc) == 404):
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            raise
        if sink is not None:  # the SDK gathers the whole range in memory anyway (download_as_bytes)
            if data:
                sink(data)
            data = b""
        return RangeRead(data, size, str(generation), checksum)

    def _info(self, key: str, blob: storage.Blob) -> ObjectInfo:
        return info_from_metadata(key, int(blob.size or 0), blob.metadata, fallback_mtime_ns=ns_of(blob.updated),
                                  etag=str(blob.generation), checksum_key=META_CHECKSUM, symlink_key=META_SYMLINK)

    def head(self, key: str) -> ObjectInfo | None:
        blob = self._get_blob(key, f"head {key}")
        return None if blob is None else self._info(key, blob)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        for blob in self.wire.iter_blobs(f"list {self.url}", self.prefix + prefix):
            key = blob.name[skip:]
            if not key or key == prefix or is_bookkeeping(key):
                continue
            yield self._info(key, blob)

    def list_dir(self, prefix: str = "") -> DirListing:
        full = self.prefix + prefix
        skip = len(self.prefix)
        entries: list[ObjectInfo] = []
        subdirs: list[str] = []
        marker = False
        blobs, prefixes = self.wire.list_level(f"list {self.url}/{prefix}", full)
        for blob in blobs:
            key = blob.name[skip:]
            if key == prefix:
                marker = True
            elif not key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                info = self._info(key, blob)
                if info.kind != DIR:
                    entries.append(info)
        for common in prefixes:
            name = common[len(full):][:-1]
            if not name.startswith(TEMP_PREFIX):
                subdirs.append(name)
        return DirListing(entries, subdirs, marker)

    # -- other writes -----------------------------------------------------------------------------------------

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        check_key(dst_key)
        what = f"copy {src_key} to {dst_key}"
        source = self._get_blob(src_key, what)
        if source is None:
            raise NotFoundBackendError(f"{what}: no such object")
        metadata = dict(source.metadata or {})
        if meta is not None:
            metadata.update(metadata_of(meta, type_bits_of(metadata, META_SYMLINK)))
            if checksum is not None:
                metadata[META_CHECKSUM] = checksum
        dest = self.wire.new_blob(self.wire.full(dst_key), metadata)
        token: str | None = None
        while True:  # a rewrite of a large object (or across locations) takes several calls
            token, _done, _total = self.wire.request(what, functools.partial(
                dest.rewrite, source, token=token, if_source_generation_match=source.generation, retry=None,
                timeout=self.wire.timeout))
            if token is None:
                break

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Patch mtime and mode in place (GCS edits metadata without touching the bytes or the generation);
        pinned to the metageneration read, so a concurrent edit makes it fail (and retry) rather than mix."""
        what = f"set metadata of {key}"
        blob = self._get_blob(key, what)
        if blob is None:
            raise NotFoundBackendError(f"{what}: no such object")
        metadata = dict(blob.metadata or {})
        type_bits = stat.S_IFDIR if key.endswith("/") else type_bits_of(metadata, META_SYMLINK)
        # The whole dict, not just the two keys: GCS merges a patch, gcp-storage-emulator replaces.
        metadata.update(metadata_of(meta if type_bits != stat.S_IFLNK else ObjectMeta(meta.mtime_ns, 0o777),
                                    type_bits))
        blob.metadata = metadata
        self.wire.request(what, lambda: blob.patch(if_metageneration_match=blob.metageneration, retry=None,
                                                   timeout=self.wire.timeout))

    def delete(self, key: str) -> None:
        self.wire.delete_name(self.wire.full(key), f"delete {key}")

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self.wire.upload_bytes(self.wire.new_blob(self.wire.full(key), metadata_of(meta, stat.S_IFDIR)), b"",
                           f"create directory {key}")

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than GCS metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = metadata_of(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK)
        metadata[META_SYMLINK] = encoded
        self.wire.upload_bytes(self.wire.new_blob(self.wire.full(key), metadata), SYMLINK_BODY, f"create symlink {key}")

    # -- notes: objects below .ckptfs-tmp.notes/, one request each ------------------------------------------

    def _note_blob_name(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        self.wire.upload_bytes(self.wire.new_blob(self._note_blob_name(name)), bytes(data), f"write note {name}")

    def get_note(self, name: str) -> bytes | None:
        try:
            return self.wire.download(self.wire.blob(self._note_blob_name(name)), f"read note {name}")
        except NotFoundBackendError:
            return None

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """One attempt (retry=None, unlike the store's own listings): the caller retries the whole listing."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        blobs = self.wire.iter_blobs(f"list notes {prefix!r}", full, patient=False)
        return listed_note_names((blob.name for blob in blobs), base)

    def delete_note(self, name: str) -> None:
        self.wire.delete_name(self._note_blob_name(name), f"delete note {name}")


__all__ = ["GcsStore"]
