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

Staged uploads are part objects plus compose (docs/design/stores.md says why not XML multipart or a
resumable session): open_upload writes a manifest `<prefix>/.ckptfs-tmp.parts/<owner>/<upload id>/manifest`
(JSON: key and metadata), put_part writes `.../p<number>` with its CRC32C in the request (the server
rejects a part whose bytes do not match), list_parts lists them, complete_upload composes them (at most
32 sources per call, so above 32 parts in a tree of intermediate objects `.../c<level>-<n>`), every source
pinned to the generation its put_part wrote (ifGenerationMatch on each source), into the key with the
metadata, in one atomic step, then deletes the upload's directory, manifest first (a part that lands after
an abort sees its manifest gone and removes itself). Everything an upload
leaves behind is under its owner's directory, so `list_leftovers` lists only `<owner>/` and never touches
another node's uploads. The final key has no create-only precondition: overwriting is the semantics.

Notes (base.py) are objects at `<prefix>/.ckptfs-tmp.notes/<name>`, each written by one upload with its
CRC32C (a new generation replaces the old atomically; a read gets one generation). GCS listings are strongly
consistent, so list_notes sees every note whose upload has returned. Notes are not under `.ckptfs-tmp.parts/`,
the only directory list_leftovers and the upload cleanups list or delete in.

Errors: every SDK failure is translated once, by `translate_error` (the STATUS_ERRORS table keyed by HTTP
status, plus the transport and credential exception classes). The SDK's own retries are off for the
transfer primitives (one attempt per call; transfer.py retries) and on for listings.
"""

from __future__ import annotations

import base64
import builtins
import functools
import json
import logging
import os
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import google.api_core.exceptions as gexc
import google.auth
import google.auth.exceptions
import google_crc32c
import requests
import requests.adapters
import urllib3.exceptions
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
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
    check_patiently,
    listed_note_names,
    retry_transient,
)
from ckptfs.backends.objmeta import (
    MAX_SYMLINK_TARGET,
    SYMLINK_BODY,
    encode_target,
    info_from_metadata,
    metadata_of,
    type_bits_of,
)
from ckptfs.checksums import crc_text
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    CkptfsError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    TransientBackendError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
MAX_COMPOSE_SOURCES = 32  # GCS's limit per compose request
MAX_PARTS = 1024  # the most components a composite object may have
META_CHECKSUM = "ckptfs-checksum"
META_SYMLINK = "ckptfs-symlink"
PARTS_DIR = f"{TEMP_PREFIX}parts/"
MANIFEST = "manifest"
CONTENT_TYPE = "application/octet-stream"
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
VERSION_CACHE = 4096  # (key, generation) -> (size, checksum) of recently read objects
# Listings ride out throttling with the SDK's own retry; the transfer primitives make one attempt.
LIST_RETRY: Retry = DEFAULT_RETRY.with_timeout(60.0)


# -- error mapping ---------------------------------------------------------------------------------------

# The one table from HTTP status to our classes; statuses not listed: >= 500 transient, else permanent.
STATUS_ERRORS: dict[int, type[BackendError]] = {
    400: PermanentBackendError,  # a request GCS will never accept (bad name, bad argument)
    401: AuthBackendError,  # missing or expired credentials
    403: AuthBackendError,  # not allowed (IAM), or billing/project problems
    404: NotFoundBackendError,  # no such object (or bucket: check() tells them apart)
    408: TransientBackendError,  # request timeout
    409: TransientBackendError,  # a concurrent change of the same object
    410: TransientBackendError,  # a resumable session expired: start the call again
    411: PermanentBackendError,
    412: TransientBackendError,  # a precondition (generation) failed: the object changed; re-read and retry
    413: PermanentBackendError,
    416: PermanentBackendError,  # a range outside the object
    429: TransientBackendError,  # rate limited
    500: TransientBackendError,
    502: TransientBackendError,
    503: TransientBackendError,
    504: TransientBackendError,
}


def _status_class(status: int) -> type[BackendError]:
    cls = STATUS_ERRORS.get(status)
    if cls is not None:
        return cls
    return TransientBackendError if status >= 500 else PermanentBackendError


def status_of(exc: BaseException) -> int:
    """The HTTP status of an SDK failure, 0 if it has none (transport, credentials)."""
    if isinstance(exc, BackendError):
        exc = exc.__cause__ or exc
    if isinstance(exc, gexc.GoogleAPICallError):
        return int(exc.code or 0)
    if isinstance(exc, InvalidResponse):
        return int(getattr(exc.response, "status_code", 0) or 0)
    return 0


def translate_error(exc: BaseException, what: str) -> BackendError:
    """The BackendError that a google-cloud-storage / google-auth / requests failure of `what` stands for."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, (gexc.GoogleAPICallError, InvalidResponse)):
        status = status_of(exc)
        message = getattr(exc, "message", None) or str(exc)
        return _status_class(status)(f"{what}: HTTP {status} ({message})")
    if isinstance(exc, gexc.RetryError):  # the SDK's own retries ran out: the last cause decides
        cause = exc.cause
        return translate_error(cause, what) if cause is not None else TransientBackendError(f"{what}: {exc}")
    if isinstance(exc, google.auth.exceptions.RefreshError):
        # A refresh failing on the network (metadata server busy) is worth retrying; a rejected one is not.
        if getattr(exc, "retryable", False):
            return TransientBackendError(f"{what}: refreshing credentials: {exc}")
        return AuthBackendError(f"{what}: refreshing credentials: {exc}")
    if isinstance(exc, google.auth.exceptions.DefaultCredentialsError):
        return AuthBackendError(f"{what}: {exc}")
    if isinstance(exc, (google.auth.exceptions.TransportError, DataCorruption, requests.exceptions.RequestException,
                        urllib3.exceptions.HTTPError, gexc.ServerError, OSError)):
        return TransientBackendError(f"{what}: {type(exc).__name__}: {exc}")
    return PermanentBackendError(f"{what}: unexpected {type(exc).__name__}: {exc}")


_SDK_ERRORS = (gexc.GoogleAPIError, InvalidResponse, DataCorruption, google.auth.exceptions.GoogleAuthError,
               requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError)


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    try:
        yield
    except BackendError:
        raise
    except _SDK_ERRORS as exc:
        raise translate_error(exc, what) from exc


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


def _ns(when: datetime | None) -> int:
    return int(when.timestamp() * 1e9) if when is not None else 0


# -- the store -------------------------------------------------------------------------------------------


class GcsStore:
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
        attempts: int = 5,
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
        self.attempts = max(1, attempts)
        self._lock = threading.Lock()
        self._client_obj: storage.Client | None = None
        self._bucket_obj: storage.Bucket | None = None
        self._versions: OrderedDict[tuple[str, int], tuple[int, str | None]] = OrderedDict()
        # put_part calls in progress per upload id: an abort waits for this process's to settle.
        self._parts_busy: dict[str, int] = {}
        self._parts_idle = threading.Condition(threading.Lock())

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
        # The default pool holds 10 connections; parallel parts need more (and urllib3 warns otherwise).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool_size, max_retries=0)
        client._http.mount("https://", adapter)
        client._http.mount("http://", adapter)
        return client

    def _bucket(self) -> storage.Bucket:
        with self._lock:
            if self._bucket_obj is None:
                with _mapped(f"connect to {self.url}"):
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

    def _check_key(self, key: str) -> None:
        if not key or key.startswith("/") or any(part.startswith(TEMP_PREFIX) for part in key.split("/")):
            raise PermanentBackendError(f"{key!r}: not a key ckptfs may write (names starting with {TEMP_PREFIX}"
                                        " are reserved)")

    def _upload_dir(self, upload: UploadRef) -> str:
        return f"{self.prefix}{PARTS_DIR}{upload.marker or f'{self.owner}/{upload.upload_id}'}/"

    def _where(self) -> str:
        endpoint = self._endpoint()
        return f" at {endpoint}" if endpoint else ""

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        try:
            check_patiently(self._probe, busy=lambda exc: status_of(exc) in BUSY_STATUSES, attempts=2, where=self.url)
        except BackendError as exc:
            raise CkptfsError(self._check_message(exc)) from None

    def _probe(self) -> None:
        bucket = self._bucket()
        with _mapped(f"list {self.url}"):
            iterator = self._client().list_blobs(bucket, prefix=self.prefix, max_results=1, retry=None,
                                                 timeout=self.timeout)
            next(iter(iterator), None)

    def _check_message(self, exc: BackendError) -> str:
        cause = exc.__cause__
        status = status_of(exc)
        if isinstance(cause, google.auth.exceptions.DefaultCredentialsError):
            return (f"no Google credentials found for {self.url}: set GOOGLE_APPLICATION_CREDENTIALS to a service"
                    " account key file, run `gcloud auth application-default login`, or run on GCE/GKE with a"
                    " service account (workload identity)")
        if isinstance(cause, google.auth.exceptions.RefreshError):
            return (f"the Google credentials for {self.url} were rejected ({cause}); renew them"
                    " (gcloud auth application-default login) or fix GOOGLE_APPLICATION_CREDENTIALS")
        if status == 404:
            return (f"bucket {self.bucket_name!r} does not exist{self._where()}; create it"
                    f" (gcloud storage buckets create gs://{self.bucket_name}) or fix the URL")
        if status == 401:
            return (f"cannot use {self.url}{self._where()}: the credentials were rejected (HTTP 401); check"
                    " GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`")
        if status == 403:
            return (f"cannot use {self.url}{self._where()}: access denied (HTTP 403); grant the account"
                    " roles/storage.objectAdmin (or objectUser) on the bucket")
        if status == 0 and isinstance(exc, TransientBackendError):
            endpoint = self._endpoint() or "storage.googleapis.com"
            return (f"cannot reach {endpoint} for {self.url}: check --endpoint-url / STORAGE_EMULATOR_HOST and"
                    " the network")
        return f"cannot use {self.url}{self._where()}: {exc}"

    # -- staged uploads: part objects composed into the key --------------------------------------------------

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
        with _mapped(what):
            blob.upload_from_string(data, content_type=CONTENT_TYPE, retry=None, timeout=self.timeout, **kwargs)
        # And the CRC32C the server computed, in its answer, must be ours (what an emulator that does not
        # verify the request's CRC32C still lets us check).
        if blob.crc32c and blob.crc32c != expected:
            raise TransientBackendError(f"{what}: the server stored CRC32C {blob.crc32c}, the data has {expected}"
                                        " (damaged on the way)")

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        self._check_key(key)
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[META_CHECKSUM] = checksum
        self._upload_bytes(self._new_blob(self._full(key), metadata), data, f"upload {key}")

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        if not key.rsplit("/", 1)[-1].startswith(f"{TEMP_PREFIX}spill."):
            self._check_key(key)
        metadata: dict[str, str] = {}
        if meta is not None:
            metadata = metadata_of(meta, stat.S_IFREG)
            metadata[META_CHECKSUM] = checksum or ""
        upload_id = secrets.token_hex(8)
        upload = UploadRef(key, upload_id, f"{self.owner}/{upload_id}")
        body = json.dumps({"key": key, "metadata": metadata, "owner": self.owner}).encode()
        # Create-only: a random id never meets an existing manifest, and a retry after a lost answer finds
        # its own manifest already there (412), which is as good as written.
        try:
            self._upload_bytes(self._new_blob(self._upload_dir(upload) + MANIFEST), body, f"start upload of {key}",
                               if_generation_match=0)
        except TransientBackendError as exc:
            if status_of(exc) != 412:
                raise
        return upload

    def _part_name(self, upload: UploadRef, number: int) -> str:
        return f"{self._upload_dir(upload)}p{number:05d}"

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
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
        blob = self._new_blob(self._part_name(upload, number))
        self._upload_bytes(blob, data, what)
        # An abort that ran meanwhile (it removes the manifest first) must not leave this part behind.
        manifest = self._bucket().blob(self._upload_dir(upload) + MANIFEST)
        with _mapped(what):
            gone = not manifest.exists(retry=None, timeout=self.timeout)
        if gone:
            self._delete_name(blob.name, what)
            raise TransientBackendError(f"{what}: the staged upload is gone")
        return UploadPart(number, str(blob.generation), crc_text(crc))

    def _read_manifest(self, upload: UploadRef) -> dict[str, Any] | None:
        blob = self._bucket().blob(self._upload_dir(upload) + MANIFEST)
        try:
            with _mapped(f"read the manifest of the upload of {upload.key}"):
                data = json.loads(blob.download_as_bytes(retry=None, timeout=self.timeout))
        except NotFoundBackendError:
            return None
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _list_names(self, full_prefix: str, **kwargs: Any) -> list[storage.Blob]:
        with _mapped(f"list {self.url}"):
            return list(self._client().list_blobs(self._bucket(), prefix=full_prefix, retry=LIST_RETRY,
                                                  timeout=self.timeout, **kwargs))

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        if self._read_manifest(upload) is None:
            return None
        parts: dict[int, tuple[str, int]] = {}
        directory = self._upload_dir(upload)
        for blob in self._list_names(directory + "p"):
            tail = blob.name[len(directory) + 1:]
            if tail.isdigit():
                parts[int(tail)] = (str(blob.generation), int(blob.size or 0))
        return parts

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        if key is None:
            key = upload.key
        else:
            self._check_key(key)
        what = f"complete upload of {key}"
        manifest = self._read_manifest(upload)
        if manifest is None:
            if self._holds(key, size, checksum):  # a retried complete: the first one got through
                return
            raise NotFoundBackendError(f"{what}: the staged upload is gone")
        if meta is not None:  # a compose sets the new object's metadata, so it can be any
            metadata = metadata_of(meta, stat.S_IFREG)
            metadata[META_CHECKSUM] = checksum or ""
        else:
            metadata = {str(k): str(v) for k, v in (manifest.get("metadata") or {}).items()}
        dest = self._new_blob(self._full(key), metadata)
        sources = [self._bucket().blob(self._part_name(upload, p.number), generation=int(p.etag))
                   for p in sorted(parts, key=lambda p: p.number)]
        try:
            if not sources:
                self._upload_bytes(dest, b"", what)
            else:
                self._compose_tree(upload, sources, dest, what)
        except (NotFoundBackendError, TransientBackendError) as exc:
            # A retry after a lost answer whose cleanup already removed parts: the object is there.
            if status_of(exc) in (404, 412) and self._holds(key, size, checksum):
                self._remove_upload(upload)
                return
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
                middle = self._new_blob(f"{self._upload_dir(upload)}c{level}-{index // MAX_COMPOSE_SOURCES:05d}")
                self._compose(middle, group, what)
                composed.append(self._bucket().blob(middle.name, generation=middle.generation))
            sources = composed
            level += 1
        self._compose(dest, sources, what)

    def _compose(self, dest: storage.Blob, sources: list[storage.Blob], what: str) -> None:
        with _mapped(what):
            dest.compose(sources, if_source_generation_match=[s.generation for s in sources], retry=None,
                         timeout=self.timeout)

    def _holds(self, key: str, size: int, checksum: str | None) -> bool:
        info = self.head(key)
        return info is not None and info.size == size and (checksum is None or info.checksum == checksum)

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
        self._delete_name(directory + MANIFEST, f"abort upload of {upload.key}")
        for blob in self._list_names(directory):
            self._delete_name(blob.name, f"remove a part of the upload of {upload.key}")

    def _delete_name(self, name: str, what: str) -> None:
        try:
            with _mapped(what):
                self._bucket().blob(name).delete(retry=None, timeout=self.timeout)
        except NotFoundBackendError:
            pass

    def abort_upload(self, upload: UploadRef) -> None:
        """Remove the upload's directory. Unlike an S3 abort, nothing stops a part still being written (by
        a thread the engine gave up on) from landing after the listing: such a part sees the manifest gone
        and removes itself, and this process's parts are waited for (up to one request's timeout), so the
        directory is empty when this returns."""
        self._delete_name(self._upload_dir(upload) + MANIFEST, f"abort upload of {upload.key}")
        with self._parts_idle:
            self._parts_idle.wait_for(lambda: upload.upload_id not in self._parts_busy, timeout=sum(self.timeout))
        self._delete_upload_dir(upload)

    def list_leftovers(self) -> list[UploadRef]:
        mine = f"{self.prefix}{PARTS_DIR}{self.owner}/"
        ids: dict[str, bool] = {}
        for blob in self._list_names(mine):
            upload_id, _, rest = blob.name[len(mine):].partition("/")
            if upload_id:
                ids[upload_id] = ids.get(upload_id, False) or rest == MANIFEST
        found = []
        for upload_id, has_manifest in sorted(ids.items()):
            ref = UploadRef("", upload_id, f"{self.owner}/{upload_id}")
            # One request per manifest: retried alone, so that a busy store fails none of the others.
            manifest = (retry_transient(functools.partial(self._read_manifest, ref), attempts=self.attempts)
                        if has_manifest else None)
            key = manifest.get("key") if manifest else None
            found.append(UploadRef(key if isinstance(key, str) else "", upload_id, ref.marker))
        return found

    # -- reads ----------------------------------------------------------------------------------------------

    def _get_blob(self, key: str, what: str, **kwargs: Any) -> storage.Blob | None:
        with _mapped(what):
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
            with _mapped(what):
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
        return info_from_metadata(key, int(blob.size or 0), blob.metadata, fallback_mtime_ns=_ns(blob.updated),
                                  etag=str(blob.generation), checksum_key=META_CHECKSUM, symlink_key=META_SYMLINK)

    def head(self, key: str) -> ObjectInfo | None:
        blob = self._get_blob(key, f"head {key}")
        return None if blob is None else self._info(key, blob)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        with _mapped(f"list {self.url}"):
            for blob in self._client().list_blobs(self._bucket(), prefix=self.prefix + prefix, retry=LIST_RETRY,
                                                  timeout=self.timeout):
                key = blob.name[skip:]
                if not key or key == prefix or any(part.startswith(TEMP_PREFIX) for part in key.split("/")):
                    continue
                yield self._info(key, blob)

    def list_dir(self, prefix: str = "") -> DirListing:
        full = self.prefix + prefix
        skip = len(self.prefix)
        entries: list[ObjectInfo] = []
        subdirs: list[str] = []
        marker = False
        with _mapped(f"list {self.url}/{prefix}"):
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
        self._check_key(dst_key)
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
        with _mapped(what):
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
        with _mapped(what):
            blob.patch(if_metageneration_match=blob.metageneration, retry=None, timeout=self.timeout)

    def delete(self, key: str) -> None:
        self._delete_name(self._full(key), f"delete {key}")

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        self._check_key(key.rstrip("/"))
        self._upload_bytes(self._new_blob(self._full(key), metadata_of(meta, stat.S_IFDIR)), b"",
                           f"create directory {key}")

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        self._check_key(key)
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
            with _mapped(f"read note {name}"):
                data: bytes = blob.download_as_bytes(retry=None, timeout=self.timeout)
        except NotFoundBackendError:
            return None
        return data

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """One attempt (retry=None, unlike the store's own listings): the caller retries the whole listing."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        with _mapped(f"list notes {prefix!r}"):
            blobs = self._client().list_blobs(self._bucket(), prefix=full, retry=None, timeout=self.timeout)
            return listed_note_names((blob.name for blob in blobs), base)

    def delete_note(self, name: str) -> None:
        self._delete_name(self._note_blob_name(name), f"delete note {name}")


__all__ = ["STATUS_ERRORS", "GcsStore", "translate_error"]
