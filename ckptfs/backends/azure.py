"""AzureBlobStore: the `az://container[/prefix]` backend, Azure Blob Storage (block blobs) through
azure-storage-blob.

Credentials, in the order users of the Azure CLI and SDKs expect them (the first that is set wins):
  1. AZURE_STORAGE_CONNECTION_STRING (Azurite's development string works);
  2. AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY (shared key) or AZURE_STORAGE_SAS_TOKEN;
  3. AZURE_STORAGE_ACCOUNT alone: azure-identity's DefaultAzureCredential (environment service principal,
     workload identity on AKS, managed identity on a VM, `az login`).
The blob endpoint is https://ACCOUNT.blob.core.windows.net, the connection string's BlobEndpoint, or
`endpoint_url` (--endpoint-url: sovereign clouds, private endpoints, Azurite).

Layout and metadata (x-ms-meta-*), the names S3Store uses where Azure allows them: `mtime`
"<seconds>.<9 digits>", `mode` the decimal st_mode with its type bits; Azure metadata names must be C#
identifiers, so the checksum is `ckptfs_checksum` and a symlink's target `ckptfs_symlink` (percent-encoded;
the body is SYMLINK_BODY). A directory is a zero-byte `dir/` blob. Listings ask for metadata
(include=metadata), so `listing_has_metadata` is true. The etag is the blob's ETag, which Azure changes
on every write, metadata included.

Staged uploads are the block-blob protocol: blocks staged on the destination blob itself (invisible until
committed), each with its transactional MD5 (validate_content: the server rejects a block whose bytes do
not match), then Put Block List with the metadata: the blob appears, or is replaced, atomically. Block
ids are "<upload id>-<part number>" (one length for every upload, as Azure requires), so list_parts
(Get Block List, uncommitted) tells this upload's blocks from another writer's. Uncommitted blocks belong
to a blob and have no owner, so each upload has a marker blob `<prefix>/.ckptfs-tmp.uploads/<owner>/<upload
id>` (JSON: key, metadata), written before the first block and deleted after the commit or abort;
`list_leftovers` lists only this owner's markers. Azure cannot delete uncommitted blocks: an abort removes
the marker, and the blocks go with the blob's next commit or Azure's garbage collection after a week
(docs/design/stores.md).

Notes (base.py) are block blobs at `<prefix>/.ckptfs-tmp.notes/<name>`, each written by one Put Blob with
its MD5 (validate_content): a new version replaces the old atomically, and a read gets one. Azure listings
are strongly consistent, so list_notes sees every note whose Put Blob has returned. Notes are not under
`.ckptfs-tmp.uploads/`, the only directory list_leftovers and the upload cleanups list or delete in.

Requests: every one goes through the store's AzureWire (azurewire.py), which AzureBlobStore owns: the
clients made from the credential chain above, the container and the prefix, the translation of every SDK
failure (azureerrors.py, once, in the wire) and the client made anew after an expired token. This module
owns what the requests mean: the layout above, the staged uploads and their markers, reads, listings,
copies, metadata and notes. Every method makes one attempt (the SDK retries once); the callers retry.
"""

from __future__ import annotations

import builtins
import logging
import stat
import time
from collections.abc import Iterator, Sequence
from typing import Any

from azure.core import MatchConditions
from azure.storage.blob import BlobBlock, ContentSettings

from ckptfs.backends.azureerrors import check_message, error_code_of
from ckptfs.backends.azurewire import MAX_BLOCK_SIZE, AzureWire
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
    CONTENT_TYPE,
    MAX_SYMLINK_TARGET,
    SYMLINK_BODY,
    WholeCopies,
    check_key,
    encode_target,
    info_from_metadata,
    is_bookkeeping,
    metadata_of,
    new_upload,
    ns_of,
    parse_bookkeeping,
    type_bits_of,
)
from ckptfs.checksums import crc_text
from ckptfs.errors import (
    BackendError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    StoreCheckError,
    TransientBackendError,
    UploadGoneError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
MAX_BLOCKS = 50_000  # committed blocks per blob
META_CHECKSUM = "ckptfs_checksum"
META_SYMLINK = "ckptfs_symlink"
MARKER_DIR = f"{TEMP_PREFIX}uploads/"
COPY_POLL_SECONDS = 600.0  # a pending server-side copy is abandoned (and retried by the caller) after this


def _etag(value: str | None) -> str | None:
    """ETags quoted, as Get Blob Properties returns them (List Blobs returns them bare)."""
    if not value:
        return None
    return value if value.startswith('"') else f'"{value}"'


# -- the store -------------------------------------------------------------------------------------------


class AzureBlobStore(WholeCopies):
    listing_has_metadata = True  # List Blobs with include=metadata
    left_behind = False  # set when a cleanup fails (from any thread); the engine's sweep resets it
    limits = PartLimits(min_part_size=1 * MiB, max_part_size=MAX_BLOCK_SIZE, max_parts=MAX_BLOCKS,
                        reusable_buffers=False)

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        owner: str = "anon",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        pool_size: int = 64,
    ) -> None:
        self.wire = AzureWire(container, prefix, endpoint_url=endpoint_url, connect_timeout=connect_timeout,
                              read_timeout=read_timeout, pool_size=pool_size)
        # Plain values of the wire's, for messages, `ckptfs status` (credentials) and the tests.
        self.container, self.prefix, self.url = self.wire.container, self.wire.prefix, self.wire.url
        self.endpoint_url, self.credentials = self.wire.endpoint_url, self.wire.credentials
        self.owner = owner

    def __repr__(self) -> str:
        return f"AzureBlobStore({self.url!r}, endpoint={self.endpoint_url!r})"

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            self.wire.probe()
        except BackendError as exc:
            message = check_message(exc, url=self.url, container=self.container, endpoint_url=self.endpoint_url,
                                    credential_source=self.wire.credential_source)
            raise StoreCheckError(message, exc, busy=error_code_of(exc)[1] in BUSY_STATUSES) from None

    # -- staged uploads: blocks on the blob itself, bracketed by this owner's marker -------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[META_CHECKSUM] = checksum
        self.wire.upload_blob(self.wire.full(key), data, metadata, f"upload {key}")

    def _marker_name(self, upload: UploadRef) -> str:
        return f"{self.prefix}{MARKER_DIR}{upload.marker or f'{self.owner}/{upload.upload_id}'}"

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        upload, body = new_upload(key, meta, checksum, owner=self.owner, checksum_key=META_CHECKSUM)
        # Create-only (If-None-Match: *): a random id never meets an existing marker, and a retry after a
        # lost answer finds its own (409), which is as good as written.
        try:
            self.wire.upload_blob(self._marker_name(upload), body, None, f"start upload of {key}", overwrite=False)
        except TransientBackendError as exc:
            if error_code_of(exc)[0] != "BlobAlreadyExists":
                # It may have been written with every answer lost; a retry starts another: the next sweep
                # removes this one.
                self.left_behind = True
                raise
        return upload

    @staticmethod
    def _block_id(upload: UploadRef, number: int) -> str:
        return f"{upload.upload_id}-{number:05d}"

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        block_id = self._block_id(upload, number)
        # validate_content: the block's MD5 travels in Content-MD5 and the service checks it.
        # bytes already (reusable_buffers=False): the SDK's Content-MD5 takes bytes or a stream only.
        self.wire.renewing(f"upload part {number} of {upload.key}", lambda: self.wire.blob(
            self.wire.full(upload.key)).stage_block(block_id, bytes(data), length=len(data), validate_content=True))
        return UploadPart(number, block_id, crc_text(crc))

    def _read_marker(self, upload: UploadRef) -> dict[str, Any] | None:
        try:
            return parse_bookkeeping(self.wire.request(f"read the marker of the upload of {upload.key}", lambda: (
                self.wire.blob(self._marker_name(upload)).download_blob().readall())))
        except NotFoundBackendError:
            return None

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        if self._read_marker(upload) is None:
            return None
        mine = f"{upload.upload_id}-"
        try:
            _committed, uncommitted = self.wire.request(f"list parts of {upload.key}", lambda: self.wire.blob(
                self.wire.full(upload.key)).get_block_list("uncommitted"))
        except NotFoundBackendError:
            return {}
        parts: dict[int, tuple[str, int]] = {}
        for block in uncommitted:
            if block.id.startswith(mine) and block.id[len(mine):].isdigit():
                parts[int(block.id[len(mine):])] = (block.id, int(block.size))
        return parts

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        if key is not None or meta is not None:
            raise ValueError("this store completes an upload at the key and with the metadata it was opened with")
        what = f"complete upload of {upload.key}"
        marker = self._read_marker(upload)
        if marker is None:  # aborted, or a complete whose answer was lost got through (the engine checks)
            raise UploadGoneError(f"{what}: the staged upload is gone")
        metadata = {str(k): str(v) for k, v in (marker.get("metadata") or {}).items()}
        blocks = [BlobBlock(block_id=p.etag) for p in sorted(parts, key=lambda p: p.number)]
        try:
            # A retry after a lost answer commits the same ids again: they are committed blocks by then,
            # which Put Block List ('latest') accepts, so the same object results.
            self.wire.renewing(what, lambda: self.wire.blob(self.wire.full(upload.key)).commit_block_list(
                blocks, metadata=metadata or None, content_settings=ContentSettings(content_type=CONTENT_TYPE)))
        except PermanentBackendError as exc:
            if error_code_of(exc)[0] != "InvalidBlockList":
                raise
            # The staged blocks are gone: another writer committed the blob (which discards them), or this
            # commit got through before and its answer was lost (the engine checks which).
            raise UploadGoneError(f"{what}: the staged blocks are gone") from exc
        self._delete_marker(upload)

    def _delete_marker(self, upload: UploadRef) -> None:
        try:
            self.wire.delete_name(self._marker_name(upload), "delete upload marker")
        except BackendError as exc:  # harmless: the engine's next sweep finds it in list_leftovers
            log.debug("could not delete the upload marker of %s: %s", upload.key, exc)
            self.left_behind = True

    def abort_upload(self, upload: UploadRef) -> None:
        """Forget the upload: its marker goes. Azure has no call to drop uncommitted blocks; they go with the
        blob's next commit or Azure's garbage collection of uncommitted blocks after a week."""
        self.wire.delete_name(self._marker_name(upload), f"abort upload of {upload.key}")

    def list_leftovers(self) -> list[UploadRef]:
        mine = f"{self.prefix}{MARKER_DIR}{self.owner}/"
        found = []
        for name in self.wire.list_names(mine):
            upload_id = name[len(mine):]
            if not upload_id or "/" in upload_id:
                continue
            ref = UploadRef("", upload_id, f"{self.owner}/{upload_id}")
            marker = self._read_marker(ref)
            if marker is None:
                continue
            key = marker.get("key")
            found.append(UploadRef(key if isinstance(key, str) else "", upload_id, ref.marker))
        return found

    # -- reads ----------------------------------------------------------------------------------------------

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        what = f"download {key}"
        condition: dict[str, Any] = {}
        if if_match:
            condition = {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        blob = self.wire.blob(self.wire.full(key))

        def download() -> tuple[Any, bytes]:
            downloader = blob.download_blob(offset=offset, length=max(length, 1), **condition)
            return downloader, downloader.readall()

        try:
            downloader, data = self.wire.request(what, download)
            props = downloader.properties
            content_range = props.content_range or ""
            total = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else int(props.size)
        except BackendError as exc:
            code, status = error_code_of(exc)
            if status == 412:
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            if code != "InvalidRange" and status != 416:
                raise
            # Past the end (an empty blob has no byte 0): its properties tell size and version.
            props = self.wire.request(what, lambda: blob.get_blob_properties(**condition))
            data, total = b"", int(props.size)
        data = data[:length] if length > 0 else b""
        if sink is not None:  # the SDK gathers the whole range in memory anyway (one GET up to 32 MiB)
            if data:
                sink(data)
            data = b""
        return RangeRead(data, total, _etag(props.etag), (props.metadata or {}).get(META_CHECKSUM))

    def _info(self, key: str, props: Any) -> ObjectInfo:
        return info_from_metadata(key, int(props.size or 0), props.metadata,
                                  fallback_mtime_ns=ns_of(props.last_modified), etag=_etag(props.etag),
                                  checksum_key=META_CHECKSUM, symlink_key=META_SYMLINK)

    def _props(self, key: str, what: str) -> Any:
        try:
            return self.wire.request(what, lambda: self.wire.blob(self.wire.full(key)).get_blob_properties())
        except NotFoundBackendError:
            return None

    def head(self, key: str) -> ObjectInfo | None:
        props = self._props(key, f"head {key}")
        return None if props is None else self._info(key, props)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        for props in self.wire.iter_blobs(f"list {self.url}", self.prefix + prefix, metadata=True):
            key = props.name[skip:]
            if not key or key == prefix or is_bookkeeping(key):
                continue
            yield self._info(key, props)

    def list_dir(self, prefix: str = "") -> DirListing:
        full = self.prefix + prefix
        skip = len(self.prefix)
        entries: list[ObjectInfo] = []
        subdirs: list[str] = []
        marker = False
        blobs, prefixes = self.wire.list_level(f"list {self.url}/{prefix}", full)
        for common in prefixes:
            name = common[len(full):][:-1]
            if not name.startswith(TEMP_PREFIX):
                subdirs.append(name)
        for item in blobs:
            key = item.name[skip:]
            if key == prefix:
                marker = True
            elif not key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                info = self._info(key, item)
                if info.kind != DIR:
                    entries.append(info)
        return DirListing(entries, subdirs, marker)

    # -- other writes -----------------------------------------------------------------------------------------

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        check_key(dst_key)
        what = f"copy {src_key} to {dst_key}"
        source = self._props(src_key, what)
        if source is None:
            raise NotFoundBackendError(f"{what}: no such object")
        metadata = dict(source.metadata or {})
        if meta is not None:
            metadata.update(metadata_of(meta, type_bits_of(metadata, META_SYMLINK)))
            if checksum is not None:
                metadata[META_CHECKSUM] = checksum
        status = self.wire.request(what, lambda: self._copy_and_wait(what, src_key, dst_key, source, metadata))
        if status not in ("success", None):
            raise TransientBackendError(f"{what}: the server-side copy ended {status}")

    def _copy_and_wait(self, what: str, src_key: str, dst_key: str, source: Any, metadata: dict[str, str]) -> Any:
        """Start the server-side copy of the version `source` (its properties) and poll it to its end; its
        final status. Sent through the wire's `request`, which maps the SDK's failures."""
        dest = self.wire.blob(self.wire.full(dst_key))
        # Pinned to the version read: a source replaced meanwhile fails the copy (and the caller retries).
        answer = dest.start_copy_from_url(self.wire.blob(self.wire.full(src_key)).url, metadata=metadata or None,
                                          source_etag=source.etag, source_match_condition=MatchConditions.IfNotModified)
        status = answer.get("copy_status")
        deadline = time.monotonic() + COPY_POLL_SECONDS
        delay = 0.05
        while status == "pending":  # a large copy completes in the background: poll it
            if time.monotonic() > deadline:
                dest.abort_copy(str(answer["copy_id"]))
                raise TransientBackendError(f"{what}: the server-side copy did not finish in"
                                            f" {COPY_POLL_SECONDS:.0f}s")
            time.sleep(delay)
            delay = min(1.0, delay * 2)
            status = dest.get_blob_properties().copy.status
        return status

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Set Blob Metadata with mtime and mode replaced and the rest (checksum, symlink target) kept,
        pinned to the ETag read so a concurrent write is not undone. Azure changes the ETag."""
        what = f"set metadata of {key}"
        props = self._props(key, what)
        if props is None:
            raise NotFoundBackendError(f"{what}: no such object")
        metadata = dict(props.metadata or {})
        type_bits = stat.S_IFDIR if key.endswith("/") else type_bits_of(metadata, META_SYMLINK)
        metadata.update(metadata_of(meta if type_bits != stat.S_IFLNK else ObjectMeta(meta.mtime_ns, 0o777),
                                    type_bits))
        self.wire.request(what, lambda: self.wire.blob(self.wire.full(key)).set_blob_metadata(
            metadata, etag=props.etag, match_condition=MatchConditions.IfNotModified))

    def delete(self, key: str) -> None:
        self.wire.delete_name(self.wire.full(key), f"delete {key}")

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self.wire.upload_blob(self.wire.full(key), b"", metadata_of(meta, stat.S_IFDIR), f"create directory {key}")

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than Azure metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = metadata_of(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK)
        metadata[META_SYMLINK] = encoded
        self.wire.upload_blob(self.wire.full(key), SYMLINK_BODY, metadata, f"create symlink {key}")

    # -- notes: blobs below .ckptfs-tmp.notes/, one request each ---------------------------------------------

    def _note_blob_name(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        # A note is small: below the SDK's max_single_put_size (64 MiB) upload_blob is one Put Blob.
        self.wire.upload_blob(self._note_blob_name(name), bytes(data), None, f"write note {name}")

    def get_note(self, name: str) -> bytes | None:
        try:
            data: bytes = self.wire.request(f"read note {name}", lambda: self.wire.blob(
                self._note_blob_name(name)).download_blob().readall())
        except NotFoundBackendError:
            return None
        return data

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """One attempt (not retried here, unlike the store's own listings): the caller retries the listing."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        blobs = self.wire.iter_blobs(f"list notes {prefix!r}", full)
        return listed_note_names((props.name for props in blobs), base)

    def delete_note(self, name: str) -> None:
        self.wire.delete_name(self._note_blob_name(name), f"delete note {name}")


__all__ = ["AzureBlobStore"]
