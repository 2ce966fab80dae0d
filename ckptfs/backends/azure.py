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

Errors: every SDK failure is translated once (azureerrors.py). Every method makes one attempt (the SDK
retries once); the callers retry.
"""

from __future__ import annotations

import builtins
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import requests
import requests.adapters
from azure.core import MatchConditions
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobBlock, BlobClient, BlobPrefix, BlobServiceClient, ContainerClient, ContentSettings

from ckptfs.backends.azureerrors import check_message, error_code_of, is_expired_credential, mapped
from ckptfs.backends.base import (
    BUSY_STATUSES,
    DIR,
    NOTES_DIR,
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
    SdkCredentialReport,
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
    AuthBackendError,
    BackendError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    StoreCheckError,
    TransientBackendError,
    UploadGoneError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
MAX_BLOCK_SIZE = 4000 * MiB  # Put Block, service version 2019-12-12 and later
MAX_BLOCKS = 50_000  # committed blocks per blob
META_CHECKSUM = "ckptfs_checksum"
META_SYMLINK = "ckptfs_symlink"
MARKER_DIR = f"{TEMP_PREFIX}uploads/"
AZURE_RETRY_BACKOFF = 1  # seconds before the SDK's own retry, +- as much at random (ExponentialRetry)
COPY_POLL_SECONDS = 600.0  # a pending server-side copy is abandoned (and retried by the caller) after this


def _etag(value: str | None) -> str | None:
    """ETags quoted, as Get Blob Properties returns them (List Blobs returns them bare)."""
    if not value:
        return None
    return value if value.startswith('"') else f'"{value}"'


def _parse_connection_string(text: str) -> dict[str, str]:
    pairs = (part.split("=", 1) for part in text.split(";") if "=" in part)
    return {k.strip().lower(): v.strip() for k, v in pairs}


# -- the store -------------------------------------------------------------------------------------------


class AzureBlobStore(WholeCopies):
    listing_has_metadata = True  # List Blobs with include=metadata
    left_behind = False
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
        self.container = container
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"az://{container}/{clean}" if clean else f"az://{container}"
        self.owner = owner
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_size = pool_size
        self.credential_source = ""  # which of the credential chain is used (for messages; never the secret)
        self.credentials = SdkCredentialReport(lambda: self.credential_source)
        self._lock = threading.Lock()
        self._container_obj: ContainerClient | None = None

    def __repr__(self) -> str:
        return f"AzureBlobStore({self.url!r}, endpoint={self.endpoint_url!r})"

    # -- the client, made on first use -----------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        session = requests.Session()
        # The default pool holds 10 connections; parallel blocks need more (and urllib3 warns otherwise).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool_size, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return {
            "transport": RequestsTransport(session=session, session_owner=False,
                                           connection_timeout=self.connect_timeout, read_timeout=self.read_timeout),
            "retry_total": 1,  # ckptfs retries on its own (per part in transfer.py)
            # The SDK's one retry comes after 0-2 s, as botocore's and GCS's first do: its default is 15 s
            # (+-3), which stalled every part that met a busy answer or a dropped connection that long.
            "initial_backoff": AZURE_RETRY_BACKOFF,
            "random_jitter_range": AZURE_RETRY_BACKOFF,
            "max_single_get_size": MAX_BLOCK_SIZE,  # a ranged read is one GET
            "connection_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
        }

    def _make_service(self) -> BlobServiceClient:
        kwargs = self._client_kwargs()
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        account = os.environ.get("AZURE_STORAGE_ACCOUNT")
        if conn:
            self.credential_source = "AZURE_STORAGE_CONNECTION_STRING"
            if not self.endpoint_url:
                return BlobServiceClient.from_connection_string(conn, **kwargs)
            parts = _parse_connection_string(conn)
            credential: Any = None
            if parts.get("accountkey"):
                credential = {"account_name": parts.get("accountname", ""), "account_key": parts["accountkey"]}
            elif parts.get("sharedaccesssignature"):
                credential = parts["sharedaccesssignature"]
            return BlobServiceClient(self.endpoint_url, credential=credential, **kwargs)
        if not account and not self.endpoint_url:
            raise AuthBackendError(f"no Azure storage account for {self.url}")
        account_url = self.endpoint_url or f"https://{account}.blob.core.windows.net"
        key = os.environ.get("AZURE_STORAGE_KEY")
        sas = os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        if key:
            self.credential_source = "AZURE_STORAGE_KEY"
            return BlobServiceClient(account_url, credential={"account_name": account or "", "account_key": key},
                                     **kwargs)
        if sas:
            self.credential_source = "AZURE_STORAGE_SAS_TOKEN"
            return BlobServiceClient(account_url, credential=sas.lstrip("?"), **kwargs)
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise AuthBackendError(
                f"no Azure credentials for {self.url}: set AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or install"
                " azure-identity (pip install 'ckptfs[azure]') for managed identity / az login"
            ) from None
        self.credential_source = "DefaultAzureCredential"
        return BlobServiceClient(account_url, credential=DefaultAzureCredential(), **kwargs)

    def _container(self) -> ContainerClient:
        with self._lock:
            if self._container_obj is None:
                with mapped(f"connect to {self.url}"):
                    self._container_obj = self._make_service().get_container_client(self.container)
            return self._container_obj

    def _blob(self, name: str) -> BlobClient:
        return self._container().get_blob_client(name)

    def _renewing(self, what: str, request: Callable[[], T]) -> T:
        """`request()`, its failure a BackendError; if Azure answers that the token expired (the credential's
        cache believed it valid: a skewed clock, a token revoked), once more with a client made anew, whose
        new DefaultAzureCredential fetches a new token (the SDK's bearer policy would keep sending the old
        one until 5 minutes before the expiry it was told). Every part and the commit go on; the drain never
        sees it. Many requests that meet it at once make one new client."""
        failed_on = self._container_obj
        try:
            with mapped(what):
                return request()
        except AuthBackendError as exc:
            if not is_expired_credential(exc):
                raise
            with self._lock:
                if self._container_obj is failed_on:
                    log.info("Azure rejected the %s token as expired (%s); making the client anew",
                             self.credential_source, exc)
                    self._container_obj = None
                    self.credentials.renewals_after_rejection += 1
        with mapped(what):
            return request()

    # -- keys ---------------------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key


    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            self._probe()
        except BackendError as exc:
            message = check_message(exc, url=self.url, container=self.container, endpoint_url=self.endpoint_url,
                                    credential_source=self.credential_source)
            raise StoreCheckError(message, exc, busy=error_code_of(exc)[1] in BUSY_STATUSES) from None

    def _probe(self) -> None:
        container = self._container()
        with mapped(f"list {self.url}"):
            pages = container.list_blobs(name_starts_with=self.prefix, results_per_page=1).by_page()
            next(pages, None)

    # -- staged uploads: blocks on the blob itself, bracketed by this owner's marker -------------------------

    def _upload_blob(self, name: str, data: bytes, metadata: dict[str, str] | None, what: str,
                     overwrite: bool = True, **kwargs: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._renewing(what, lambda: self._blob(name).upload_blob(
            data, length=len(data), overwrite=overwrite, metadata=metadata, validate_content=True,
            content_settings=ContentSettings(content_type=CONTENT_TYPE), **kwargs))
        return result

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[META_CHECKSUM] = checksum
        self._upload_blob(self._full(key), data, metadata, f"upload {key}")

    def _marker_name(self, upload: UploadRef) -> str:
        return f"{self.prefix}{MARKER_DIR}{upload.marker or f'{self.owner}/{upload.upload_id}'}"

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        upload, body = new_upload(key, meta, checksum, owner=self.owner, checksum_key=META_CHECKSUM)
        # Create-only (If-None-Match: *): a random id never meets an existing marker, and a retry after a
        # lost answer finds its own (409), which is as good as written.
        try:
            self._upload_blob(self._marker_name(upload), body, None, f"start upload of {key}", overwrite=False)
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
        self._renewing(f"upload part {number} of {upload.key}", lambda: self._blob(self._full(upload.key)).stage_block(
            block_id, bytes(data), length=len(data), validate_content=True))
        return UploadPart(number, block_id, crc_text(crc))

    def _read_marker(self, upload: UploadRef) -> dict[str, Any] | None:
        try:
            with mapped(f"read the marker of the upload of {upload.key}"):
                return parse_bookkeeping(self._blob(self._marker_name(upload)).download_blob().readall())
        except NotFoundBackendError:
            return None

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        if self._read_marker(upload) is None:
            return None
        mine = f"{upload.upload_id}-"
        try:
            with mapped(f"list parts of {upload.key}"):
                _committed, uncommitted = self._blob(self._full(upload.key)).get_block_list("uncommitted")
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
            self._renewing(what, lambda: self._blob(self._full(upload.key)).commit_block_list(
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
            self._delete_name(self._marker_name(upload), "delete upload marker")
        except BackendError as exc:  # harmless: the engine's next sweep finds it in list_leftovers
            log.debug("could not delete the upload marker of %s: %s", upload.key, exc)
            self.left_behind = True

    def abort_upload(self, upload: UploadRef) -> None:
        """Forget the upload: its marker goes. Azure has no call to drop uncommitted blocks; they go with the
        blob's next commit or Azure's garbage collection of uncommitted blocks after a week."""
        self._delete_name(self._marker_name(upload), f"abort upload of {upload.key}")

    def list_leftovers(self) -> list[UploadRef]:
        mine = f"{self.prefix}{MARKER_DIR}{self.owner}/"
        found = []
        for name in self._list_names(mine):
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

    def _list_names(self, full_prefix: str) -> list[str]:
        with mapped(f"list {self.url}"):
            return [b.name for b in self._container().list_blobs(name_starts_with=full_prefix)]

    # -- reads ----------------------------------------------------------------------------------------------

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
    ) -> RangeRead:
        what = f"download {key}"
        condition: dict[str, Any] = {}
        if if_match:
            condition = {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        blob = self._blob(self._full(key))
        try:
            with mapped(what):
                downloader = blob.download_blob(offset=offset, length=max(length, 1), **condition)
                data = downloader.readall()
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
            with mapped(what):
                props = blob.get_blob_properties(**condition)
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
            with mapped(what):
                return self._blob(self._full(key)).get_blob_properties()
        except NotFoundBackendError:
            return None

    def head(self, key: str) -> ObjectInfo | None:
        props = self._props(key, f"head {key}")
        return None if props is None else self._info(key, props)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        with mapped(f"list {self.url}"):
            for props in self._container().list_blobs(name_starts_with=self.prefix + prefix, include=["metadata"]):
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
        with mapped(f"list {self.url}/{prefix}"):
            for item in self._container().walk_blobs(name_starts_with=full, include=["metadata"], delimiter="/"):
                if isinstance(item, BlobPrefix):
                    name = item.name[len(full):][:-1]
                    if not name.startswith(TEMP_PREFIX):
                        subdirs.append(name)
                    continue
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
        dest = self._blob(self._full(dst_key))
        with mapped(what):
            # Pinned to the version read: a source replaced meanwhile fails the copy (and the caller retries).
            answer = dest.start_copy_from_url(self._blob(self._full(src_key)).url, metadata=metadata or None,
                                              source_etag=source.etag,
                                              source_match_condition=MatchConditions.IfNotModified)
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
        if status not in ("success", None):
            raise TransientBackendError(f"{what}: the server-side copy ended {status}")

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
        with mapped(what):
            self._blob(self._full(key)).set_blob_metadata(metadata, etag=props.etag,
                                                          match_condition=MatchConditions.IfNotModified)

    def _delete_name(self, name: str, what: str) -> None:
        try:
            with mapped(what):
                self._blob(name).delete_blob()
        except NotFoundBackendError:
            pass

    def delete(self, key: str) -> None:
        self._delete_name(self._full(key), f"delete {key}")

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self._upload_blob(self._full(key), b"", metadata_of(meta, stat.S_IFDIR), f"create directory {key}")

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than Azure metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = metadata_of(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK)
        metadata[META_SYMLINK] = encoded
        self._upload_blob(self._full(key), SYMLINK_BODY, metadata, f"create symlink {key}")

    # -- notes: blobs below .ckptfs-tmp.notes/, one request each ---------------------------------------------

    def _note_blob_name(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        # A note is small: below the SDK's max_single_put_size (64 MiB) upload_blob is one Put Blob.
        self._upload_blob(self._note_blob_name(name), bytes(data), None, f"write note {name}")

    def get_note(self, name: str) -> bytes | None:
        try:
            with mapped(f"read note {name}"):
                data: bytes = self._blob(self._note_blob_name(name)).download_blob().readall()
        except NotFoundBackendError:
            return None
        return data

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """One attempt (not retried here, unlike the store's own listings): the caller retries the listing."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        with mapped(f"list notes {prefix!r}"):
            return listed_note_names((props.name for props in self._container().list_blobs(name_starts_with=full)),
                                     base)

    def delete_note(self, name: str) -> None:
        self._delete_name(self._note_blob_name(name), f"delete note {name}")


__all__ = ["AzureBlobStore"]
