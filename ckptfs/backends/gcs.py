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

Errors: every SDK failure is translated once (gcserrors.py). Every method makes one attempt: the SDK's own
retries are off for the transfer primitives and on for listings; the callers retry.
"""

from __future__ import annotations

import base64
import builtins
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import google.auth
import google.auth.exceptions
import google_crc32c
import requests
import requests.adapters
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

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
    META_CHECKSUM,
    META_SYMLINK,
    SYMLINK_BODY,
    SdkCredentialReport,
    WholeCopies,
    check_key,
    encode_target,
    info_from_metadata,
    is_bookkeeping,
    metadata_of,
    ns_of,
    type_bits_of,
)
from ckptfs.backends.gcserrors import check_message, mapped, status_of
from ckptfs.backends.gcsuploads import ComposedUploads
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
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
VERSION_CACHE = 4096  # (key, generation) -> (size, checksum) of recently read objects
# Listings ride out throttling with the SDK's own retry; the transfer primitives make one attempt.
LIST_RETRY: Retry = DEFAULT_RETRY.with_timeout(60.0)


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


# -- the store -------------------------------------------------------------------------------------------


class GcsStore(WholeCopies):
    listing_has_metadata = True  # objects.list returns each object's custom metadata
    left_behind = False
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
        self.bucket_name = bucket
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"gs://{bucket}/{clean}" if clean else f"gs://{bucket}"
        self.owner = owner
        self.endpoint_url = endpoint_url or None
        self.emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
        self.timeout = (connect_timeout, read_timeout)
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._client_obj: storage.Client | None = None
        self._bucket_obj: storage.Bucket | None = None
        self._versions: OrderedDict[tuple[str, int], tuple[int, str | None]] = OrderedDict()
        self.uploads = ComposedUploads(self)
        self.credentials = SdkCredentialReport(self._credential_source)

    def __repr__(self) -> str:
        return f"GcsStore({self.url!r}, endpoint={self._endpoint()!r})"

    def _endpoint(self) -> str | None:
        return self.endpoint_url or self.emulator

    # -- the client, made on first use (ADC may ask the metadata server) -----------------------------------

    def _make_client(self) -> storage.Client:
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT") or None
        options: dict[str, Any] = {}
        credentials: Any = None
        if self.endpoint_url:
            options["api_endpoint"] = self.endpoint_url.rstrip("/")
            if urlsplit(self.endpoint_url).scheme == "http":  # plain http: an emulator, which takes no token
                credentials = AnonymousCredentials()
        if credentials is None and not (self.emulator and not self.endpoint_url):
            credentials, found = google.auth.default(scopes=list(SCOPES))
            project = project or found
        if credentials is not None and project is None:
            project = "<none>"  # object operations need no project
        client = storage.Client(project=project, credentials=credentials,
                                client_options=options or None)
        self.credentials.sdk_credentials = client._credentials
        # The default pool holds 10 connections; parallel parts need more (and urllib3 warns otherwise).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool_size, max_retries=0)
        client._http.mount("https://", adapter)
        client._http.mount("http://", adapter)
        return client

    def _credential_source(self) -> str:
        """"adc:<kind>" (service_account, identity_pool: workload identity federation, compute_engine: the
        metadata server, credentials: an authorized_user ADC file, ...), or "anonymous" (an emulator)."""
        credentials = self.credentials.sdk_credentials
        if credentials is None:
            return ""
        if isinstance(credentials, AnonymousCredentials):
            return "anonymous"
        return "adc:" + type(credentials).__module__.rsplit(".", 1)[-1]

    def _bucket(self) -> storage.Bucket:
        with self._lock:
            if self._bucket_obj is None:
                with mapped(f"connect to {self.url}"):
                    self._client_obj = self._make_client()
                    self._bucket_obj = self._client_obj.bucket(self.bucket_name)
            return self._bucket_obj

    def _client(self) -> storage.Client:
        self._bucket()
        assert self._client_obj is not None
        return self._client_obj

    # -- keys ---------------------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            self._probe()
        except BackendError as exc:
            message = check_message(exc, url=self.url, bucket=self.bucket_name, endpoint_url=self._endpoint())
            raise StoreCheckError(message, exc, busy=status_of(exc) in BUSY_STATUSES) from None

    def _probe(self) -> None:
        bucket = self._bucket()
        with mapped(f"list {self.url}"):
            iterator = self._client().list_blobs(bucket, prefix=self.prefix, max_results=1, retry=None,
                                                 timeout=self.timeout)
            next(iter(iterator), None)

    # -- writes of whole objects ------------------------------------------------------------------------------

    def _new_blob(self, name: str, metadata: dict[str, str] | None = None) -> storage.Blob:
        blob = self._bucket().blob(name)
        blob.content_type = CONTENT_TYPE
        if metadata:
            blob.metadata = metadata
        return blob

    def _upload_bytes(self, blob: storage.Blob, data: bytes, what: str, **kwargs: Any) -> None:
        # The CRC32C goes into the object resource of the request: GCS rejects bytes that do not match it.
        expected = _crc32c_b64(data)
        blob.crc32c = expected
        with mapped(what):
            blob.upload_from_string(data, content_type=CONTENT_TYPE, retry=None, timeout=self.timeout, **kwargs)
        # And the CRC32C the server computed, in its answer, must be ours (what an emulator that does not
        # verify the request's CRC32C still lets us check).
        if blob.crc32c and blob.crc32c != expected:
            raise TransientBackendError(f"{what}: the server stored CRC32C {blob.crc32c}, the data has {expected}"
                                        " (damaged on the way)")

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[META_CHECKSUM] = checksum
        self._upload_bytes(self._new_blob(self._full(key), metadata), data, f"upload {key}")

    def _list_names(self, full_prefix: str, **kwargs: Any) -> list[storage.Blob]:
        with mapped(f"list {self.url}"):
            return list(self._client().list_blobs(self._bucket(), prefix=full_prefix, retry=LIST_RETRY,
                                                  timeout=self.timeout, **kwargs))

    def _delete_name(self, name: str, what: str) -> None:
        try:
            with mapped(what):
                self._bucket().blob(name).delete(retry=None, timeout=self.timeout)
        except NotFoundBackendError:
            pass

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
        with mapped(what):
            blob: storage.Blob | None = self._bucket().get_blob(self._full(key), retry=None, timeout=self.timeout,
                                                                **kwargs)
        return blob

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
    ) -> RangeRead:
        what = f"download {key}"
        generation, size, checksum = self._version(key, if_match)
        end = min(size, offset + length)
        if end <= offset:
            return RangeRead(b"", size, str(generation), checksum)
        # Both the generation (fake-gcs-server ignores ifGenerationMatch on media reads) and the precondition.
        blob = self._bucket().blob(self._full(key), generation=generation)
        try:
            with mapped(what):
                data = blob.download_as_bytes(start=offset, end=end - 1, if_generation_match=generation,
                                              checksum=None, raw_download=True, retry=None, timeout=self.timeout)
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
        with mapped(f"list {self.url}"):
            for blob in self._client().list_blobs(self._bucket(), prefix=self.prefix + prefix, retry=LIST_RETRY,
                                                  timeout=self.timeout):
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
        with mapped(f"list {self.url}/{prefix}"):
            iterator = self._client().list_blobs(self._bucket(), prefix=full, delimiter="/", retry=LIST_RETRY,
                                                 timeout=self.timeout)
            for blob in iterator:
                key = blob.name[skip:]
                if key == prefix:
                    marker = True
                elif not key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                    info = self._info(key, blob)
                    if info.kind != DIR:
                        entries.append(info)
            for common in sorted(iterator.prefixes):
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
        dest = self._new_blob(self._full(dst_key), metadata)
        token: str | None = None
        with mapped(what):
            while True:  # a rewrite of a large object (or across locations) takes several calls
                token, _done, _total = dest.rewrite(source, token=token, if_source_generation_match=source.generation,
                                                    retry=None, timeout=self.timeout)
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
        with mapped(what):
            blob.patch(if_metageneration_match=blob.metageneration, retry=None, timeout=self.timeout)

    def delete(self, key: str) -> None:
        self._delete_name(self._full(key), f"delete {key}")

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self._upload_bytes(self._new_blob(self._full(key), metadata_of(meta, stat.S_IFDIR)), b"",
                           f"create directory {key}")

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than GCS metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = metadata_of(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK)
        metadata[META_SYMLINK] = encoded
        self._upload_bytes(self._new_blob(self._full(key), metadata), SYMLINK_BODY, f"create symlink {key}")

    # -- notes: objects below .ckptfs-tmp.notes/, one request each ------------------------------------------

    def _note_blob_name(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        self._upload_bytes(self._new_blob(self._note_blob_name(name)), bytes(data), f"write note {name}")

    def get_note(self, name: str) -> bytes | None:
        blob = self._bucket().blob(self._note_blob_name(name))
        try:
            with mapped(f"read note {name}"):
                data: bytes = blob.download_as_bytes(retry=None, timeout=self.timeout)
        except NotFoundBackendError:
            return None
        return data

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """One attempt (retry=None, unlike the store's own listings): the caller retries the whole listing."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        with mapped(f"list notes {prefix!r}"):
            blobs = self._client().list_blobs(self._bucket(), prefix=full, retry=None, timeout=self.timeout)
            return listed_note_names((blob.name for blob in blobs), base)

    def delete_note(self, name: str) -> None:
        self._delete_name(self._note_blob_name(name), f"delete note {name}")


__all__ = ["GcsStore"]
