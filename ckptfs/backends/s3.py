"""S3Store: the `s3://bucket[/prefix]` backend, for AWS S3 and S3-compatible stores (MinIO, R2, Ceph,
SeaweedFS), through boto3 and its standard credential chain.

Keys are relative to the prefix. Layout and metadata (x-amz-meta-*), chosen to be readable by peers:
  - a file is an object; `mtime` is "<seconds>.<9 digits>" (rclone's format), `mode` the decimal st_mode
    with its file-type bits (s3fs's format), `ckptfs-checksum` the whole-file "crc32:<hex>" (the format
    LocalStore and the journal use, so fetch.py can compare like with like);
  - a directory is a zero-byte `dir/` marker with `mtime` and `mode` (SeaweedFS keeps markers as
    directories of its filer and drops their metadata: there, directories read back with the defaults);
  - a symlink is an object at its own key whose body is the fixed SYMLINK_BODY and whose target is in
    `ckptfs-symlink` (percent-encoded). Listings carry no metadata, but they carry size and ETag, and the
    ETag of a single PUT is the MD5 of its body: `list` recognises symlinks by (size, ETag) without a
    request, and HEADs only those (plus objects of that exact size whose ETag is not an MD5: SSE-KMS).

Uploads (the primitives of base.py; the transfer engine does the rest): PutObject for small objects;
CreateMultipartUpload with the whole-file checksum in the metadata, UploadPart with x-amz-checksum-crc32
(verified by AWS and SeaweedFS; moto does not check), CompleteMultipartUpload, AbortMultipartUpload,
ListParts for resume. A hidden staging upload (a spill) is created without metadata; `copy` gives the
final object its metadata.

Owner markers: ListMultipartUploads returns no metadata, so an upload cannot carry our `owner` tag itself.
Instead each multipart upload has a small marker object `<prefix>/.ckptfs-tmp.uploads/<owner>/<token>`
(JSON: key, upload id). It is written before CreateMultipartUpload (without the id) and rewritten with the
id right after, and deleted after complete/abort. `list_leftovers` reads this owner's markers and
reports the uploads they name (for a marker without id: the uploads of that key that no marker of any owner
claims). So it never aborts another node's upload, and a crash at any point leaves nothing unaccounted
for. `list` hides every key component starting with TEMP_PREFIX.

Notes (base.py) are plain objects at `<prefix>/.ckptfs-tmp.notes/<name>`, each written by one PutObject
(atomic: a GET sees the old object or the new) with its CRC32 for the server to verify. S3's listings are
strongly consistent (AWS since 2020, SeaweedFS and moto by construction), so list_notes sees every note
whose PutObject has returned. They are apart from the markers' `.ckptfs-tmp.uploads/`, which is all that
list_leftovers and the sweeps ever list.

Errors: every SDK failure is translated once, by `translate_error` (the ERROR_CODES table), into the
BackendError classes. botocore retries once (standard mode); the engine retries transfers; listings and
the upload markers, which the store makes on its own behalf, retry a few times here.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions
import urllib3.exceptions

from ckptfs.backends.base import (
    BUSY_STATUSES,
    DIR,
    FILE,
    NOTES_DIR,
    RANGE_PIECE,
    SYMLINK,
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
from ckptfs.checksums import crc32, crc_of, crc_text
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

T = TypeVar("T")

MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_COPY_SIZE = 5 * GiB  # the largest object one CopyObject may copy
COPY_PARTS_IN_FLIGHT = 8  # server-side part copies of one object above MAX_COPY_SIZE

META_MTIME = "mtime"
META_MODE = "mode"
META_CHECKSUM = "ckptfs-checksum"
META_SYMLINK = "ckptfs-symlink"
SYMLINK_BODY = b"ckptfs symlink; its target is in the metadata x-amz-meta-ckptfs-symlink\n"
SYMLINK_ETAG = f'"{hashlib.md5(SYMLINK_BODY).hexdigest()}"'
MAX_SYMLINK_TARGET = 1536  # encoded bytes; AWS allows 2 KiB of user metadata in all
MARKER_DIR = f"{TEMP_PREFIX}uploads/"
# Seconds of clock difference between us and the server tolerated when telling a lost create's upload
# (started after our request) from older ones.
LOST_CREATE_SKEW = 60.0
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755


# -- error mapping ---------------------------------------------------------------------------------------

# The one table from S3 error codes to our classes. Codes not listed fall back on the HTTP status.
ERROR_CODES: dict[str, type[BackendError]] = {
    # worth retrying: the server is busy or broken, the connection or the request timed out, data was
    # damaged on the way, the object changed between two requests of one transfer, an upload vanished
    **dict.fromkeys(
        ["InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
         "RequestThrottled", "TooManyRequests", "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException",
         "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody", "PreconditionFailed", "OperationAborted",
         "NoSuchUpload", "500", "502", "503", "504"],
        TransientBackendError,
    ),
    # the credentials: missing, wrong, expired or not allowed
    **dict.fromkeys(
        ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
         "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "403", "401"],
        AuthBackendError,
    ),
    # an operator must act: no bucket, wrong region, a request S3 will never accept
    **dict.fromkeys(
        ["NoSuchBucket", "InvalidBucketName", "PermanentRedirect", "AuthorizationHeaderMalformed",
         "RequestTimeTooSkewed", "InvalidArgument", "InvalidRequest", "InvalidDigest", "EntityTooLarge",
         "EntityTooSmall", "MetadataTooLarge", "KeyTooLongError", "MethodNotAllowed", "NotImplemented",
         "InvalidStorageClass", "InvalidObjectState", "InvalidPart", "InvalidPartOrder", "MalformedXML"],
        PermanentBackendError,
    ),
    **dict.fromkeys(["NoSuchKey", "NotFound", "NoSuchVersion", "404"], NotFoundBackendError),
}


def _client_error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def translate_error(exc: BaseException, what: str) -> BackendError:
    """The BackendError that a boto3/botocore/urllib3/socket failure of `what` stands for."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = _client_error_code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "") or "")
        text = f"{what}: {code or status}" + (f" ({message})" if message else "")
        cls = ERROR_CODES.get(code)
        if cls is None:
            if status >= 500 or status in (408, 409, 429):
                cls = TransientBackendError
            elif status == 404:
                cls = NotFoundBackendError
            elif status in (401, 403):
                cls = AuthBackendError
            else:
                cls = PermanentBackendError
        return cls(text)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                        botocore.exceptions.CredentialRetrievalError, botocore.exceptions.NoAuthTokenError)):
        return AuthBackendError(f"{what}: {exc}")
    if isinstance(exc, (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError,
                        botocore.exceptions.IncompleteReadError, botocore.exceptions.ResponseStreamingError,
                        botocore.exceptions.ChecksumError, botocore.exceptions.FlexibleChecksumError,
                        urllib3.exceptions.HTTPError, OSError)):
        return TransientBackendError(f"{what}: {exc}")
    if isinstance(exc, botocore.exceptions.BotoCoreError):  # configuration and parameter problems
        return PermanentBackendError(f"{what}: {exc}")
    return PermanentBackendError(f"{what}: unexpected {type(exc).__name__}: {exc}")


_SDK_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, urllib3.exceptions.HTTPError,
               OSError)


def _without_userinfo(url: str | None) -> str | None:
    """The endpoint without a user:password part. S3 requests are signed with the credentials; botocore
    never uses the URL's user part, but would repeat it in every error message (and so in logs and
    `ckptfs status`). Dropped here, so the store never holds it."""
    if not url:
        return url
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    log.warning("the user:password part of the endpoint URL is ignored: S3 requests are signed with the"
                " credentials from the SDK's chain")
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


@contextmanager
def _mapped(what: str) -> Iterator[None]:
    try:
        yield
    except BackendError:
        raise
    except _SDK_ERRORS as exc:
        raise translate_error(exc, what) from exc


def _busy(exc: BaseException) -> bool:
    """Did the server answer that it is busy (throttling or a passing server error)?"""
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    if not isinstance(cause, botocore.exceptions.ClientError):
        return False
    code, status = _client_error_code(cause)
    return status in BUSY_STATUSES or code in ("SlowDown", "Throttling")


def _is_code(exc: BaseException, *codes: str) -> bool:
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    return isinstance(cause, botocore.exceptions.ClientError) and _client_error_code(cause)[0] in codes


def _send_without_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for `100 Continue` before every body it sends as a stream (every PutObject), and reads
    that interim answer one byte per system call: about 50 calls per request, each giving up the GIL that
    the FUSE thread and the other uploads are waiting for (in a drain of 2,000 small files, 770,000 futex
    calls). A PutObject body is at most the multipart threshold: sending it to a server that refuses it
    costs little, so it goes at once. Expect is not a signed header."""
    request.headers.pop("Expect", None)


# -- checksums -------------------------------------------------------------------------------------------

def _crc_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


# -- metadata --------------------------------------------------------------------------------------------


def format_mtime(mtime_ns: int) -> str:
    sign = "-" if mtime_ns < 0 else ""
    seconds, nanos = divmod(abs(mtime_ns), 10**9)
    return f"{sign}{seconds}.{nanos:09d}"


def parse_mtime(text: str | None) -> int | None:
    """ns from "<s>.<frac>" (ours, rclone's) or "<s>" (s3fs's); None if absent or garbled."""
    if not text:
        return None
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    if not whole.isdigit() or (frac and not frac.isdigit()):
        return None
    return sign * (int(whole) * 10**9 + int((frac + "000000000")[:9]))


def _metadata(meta: ObjectMeta, type_bits: int, **extra: str) -> dict[str, str]:
    out = {META_MTIME: format_mtime(meta.mtime_ns), META_MODE: str(type_bits | (meta.mode & 0o7777))}
    out.update(extra)
    return out


def _is_plain_md5(etag: str) -> bool:
    tag = etag.strip('"')
    return len(tag) == 32 and all(c in "0123456789abcdef" for c in tag)


def _norm_etag(etag: str) -> str:
    return etag.strip('"')


def _ns(when: datetime | None) -> int:
    return int(when.timestamp() * 1e9) if when is not None else 0


# -- parallel work ---------------------------------------------------------------------------------------


def run_parallel(fn: Callable[[T], None], items: Iterable[T], workers: int) -> None:
    """fn(item) for every item on up to `workers` daemon threads, items taken one at a time (so at most
    `workers` are in progress). The first failure stops handing out items and is raised once the busy
    workers have finished. Daemon threads: an abandoned transfer never holds up the process's exit."""
    pending = list(items)
    if workers <= 1 or len(pending) <= 1:
        for item in pending:
            fn(item)
        return
    source = iter(pending)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if errors:
                    return
                item = next(source, _DONE)
            if item is _DONE:
                return
            try:
                fn(item)  # type: ignore[arg-type]
            except BaseException as exc:
                with lock:
                    errors.append(exc)
                return

    threads = [threading.Thread(target=worker, name="ckptfs-s3", daemon=True)
               for _ in range(min(workers, len(pending)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


_DONE = object()


# -- the store -------------------------------------------------------------------------------------------


class S3Store:
    listing_has_metadata = False  # listings carry LastModified and no user metadata
    left_behind = False
    limits = PartLimits(min_part_size=MIN_PART_SIZE, max_part_size=MAX_PART_SIZE, max_parts=MAX_PARTS)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        owner: str = "anon",
        copy_threshold: int = MAX_COPY_SIZE,
        copy_part_size: int = 512 * MiB,
        max_pool_connections: int = 64,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        attempts: int = 5,
    ) -> None:
        self.bucket = bucket
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"s3://{bucket}/{clean}" if clean else f"s3://{bucket}"
        self.owner = owner
        self.copy_threshold = min(copy_threshold, MAX_COPY_SIZE)
        self.copy_part_size = max(MIN_PART_SIZE, copy_part_size)
        self.attempts = max(1, attempts)
        self.endpoint_url = _without_userinfo(
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        self._session = boto3.session.Session()
        self.region = region or os.environ.get("AWS_REGION") or self._session.region_name or "us-east-1"
        config = botocore.config.Config(
            region_name=self.region,
            # ckptfs retries on its own (a few times per part, forever in the drain); botocore once.
            retries={"mode": "standard", "total_max_attempts": 2},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_pool_connections,
            tcp_keepalive=True,
            s3={"addressing_style": "path" if self.endpoint_url else "auto", "payload_signing_enabled": False},
            # We send our own CRC32 with every upload and verify downloads against our own checksum.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._client = self._session.client("s3", endpoint_url=self.endpoint_url, config=config)
        self._client.meta.events.register("before-send.s3.PutObject", _send_without_expect_continue)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"

    # -- keys ---------------------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key

    def _check_key(self, key: str) -> None:
        if not key or key.startswith("/") or any(part.startswith(TEMP_PREFIX) for part in key.split("/")):
            raise PermanentBackendError(f"{key!r}: not a key ckptfs may write (names starting with {TEMP_PREFIX}"
                                        " are reserved)")

    def _where(self) -> str:
        return f" at {self.endpoint_url}" if self.endpoint_url else ""

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        with _mapped(what):
            return getattr(self._client, method)(Bucket=self.bucket, **kwargs)

    def _retrying(self, what: str, method: str, **kwargs: Any) -> Any:
        return retry_transient(lambda: self._call(what, method, **kwargs), attempts=self.attempts)

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        if self._session.get_credentials() is None:
            raise CkptfsError(
                f"no AWS credentials found for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                " or AWS_PROFILE, or run with an instance/pod role"
            )
        try:
            check_patiently(lambda: self._call(f"list {self.url}", "list_objects_v2", Prefix=self.prefix, MaxKeys=1),
                            busy=_busy, attempts=self.attempts, where=f"{self.url}{self._where()}")
        except BackendError as exc:
            raise CkptfsError(self._check_message(exc)) from None

    def _check_message(self, exc: BackendError) -> str:
        cause = exc.__cause__
        code = _client_error_code(cause)[0] if isinstance(cause, botocore.exceptions.ClientError) else ""
        if code == "NoSuchBucket":
            return (f"bucket {self.bucket!r} does not exist{self._where()}; create it (aws s3 mb s3://{self.bucket})"
                    " or fix the URL")
        if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
            return f"bucket {self.bucket!r} is in another region than {self.region}; set AWS_REGION to its region"
        if isinstance(cause, botocore.exceptions.NoCredentialsError):
            return (f"no AWS credentials found for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                    " or AWS_PROFILE, or run with an instance/pod role")
        if isinstance(exc, AuthBackendError):
            reason = {"InvalidAccessKeyId": "the access key is unknown to the server",
                      "SignatureDoesNotMatch": "the secret key is wrong",
                      "ExpiredToken": "the session token has expired"}.get(code, "access denied")
            return (f"cannot use {self.url}{self._where()}: {reason} ({code or 'HTTP 403'}); check the credentials"
                    " (AWS_PROFILE, AWS_ACCESS_KEY_ID, role) and that they may list, read and write this prefix")
        if isinstance(cause, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
                              botocore.exceptions.ConnectionError, urllib3.exceptions.HTTPError, OSError)):
            endpoint = self.endpoint_url or f"the S3 endpoint of region {self.region}"
            return (f"cannot reach {endpoint} for {self.url}: check --endpoint-url / AWS_ENDPOINT_URL and"
                    " the network")
        return f"cannot use {self.url}{self._where()}: {exc}"

    # -- staged uploads: multipart uploads bracketed by owner markers ---------------------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        self._check_key(key)
        metadata = _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum})
        self._call(f"upload {key}", "put_object", Key=self._full(key), Body=data, ContentLength=len(data),
                   ChecksumCRC32=_crc_b64(crc32(data)), Metadata=metadata)

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        if not key.rsplit("/", 1)[-1].startswith(f"{TEMP_PREFIX}spill."):
            self._check_key(key)
        metadata = {} if meta is None else _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum or ""})
        upload_id, marker = self._begin_multipart(key, metadata, checksum_algorithm="CRC32")
        return UploadRef(key, upload_id, marker)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        response = self._call(
            f"upload part {number} of {upload.key}", "upload_part", Key=self._full(upload.key),
            UploadId=upload.upload_id, PartNumber=number, Body=data, ContentLength=len(data),
            ChecksumCRC32=_crc_b64(crc),
        )
        return UploadPart(number, response["ETag"], crc_text(crc))

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        parts: dict[int, tuple[str, int]] = {}
        try:
            with _mapped(f"list parts of {upload.key}"):
                paginator = self._client.get_paginator("list_parts")
                pages = paginator.paginate(Bucket=self.bucket, Key=self._full(upload.key), UploadId=upload.upload_id)
                for page in pages:
                    for part in page.get("Parts", []):
                        parts[int(part["PartNumber"])] = (_norm_etag(part["ETag"]), int(part["Size"]))
        except (NotFoundBackendError, TransientBackendError) as exc:
            if _is_code(exc, "NoSuchUpload", "NoSuchKey", "404"):
                return None
            raise
        return parts

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        if key is not None or meta is not None:
            raise ValueError("this store completes an upload at the key and with the metadata it was opened with")
        body = [{"PartNumber": p.number, "ETag": p.etag, "ChecksumCRC32": _crc_b64(crc_of(p.checksum))}
                for p in parts]
        try:
            self._call(f"complete upload of {upload.key}", "complete_multipart_upload", Key=self._full(upload.key),
                       UploadId=upload.upload_id, MultipartUpload={"Parts": body})
        except BackendError as exc:
            # A retried complete whose first try succeeded finds no upload: check what is at the key.
            if not (_is_code(exc, "NoSuchUpload") and self._holds(upload.key, size, checksum)):
                raise
        self._delete_marker(upload.marker)

    def _holds(self, key: str, size: int, checksum: str | None) -> bool:
        info = self.head(key)
        return info is not None and info.size == size and (checksum is None or info.checksum == checksum)

    def abort_upload(self, upload: UploadRef) -> None:
        if upload.upload_id:
            self._abort_multipart(upload.key, upload.upload_id)
        if upload.marker:
            self._delete_marker(upload.marker)

    def list_leftovers(self) -> list[UploadRef]:
        """This owner's markers, each with the upload it names (or, for a marker written before its
        CreateMultipartUpload answered, the uploads of that key that no marker of any owner claims)."""
        mine = f"{self.prefix}{MARKER_DIR}{self.owner}/"
        found: list[UploadRef] = []
        claimed: set[str] | None = None
        for obj in self._list_raw(mine):
            marker = obj["Key"][len(self.prefix) + len(MARKER_DIR):]
            info = self._read_marker(obj["Key"])
            if info is None:
                continue
            key, upload_id = info.get("key"), info.get("upload_id")
            if not isinstance(key, str) or not key:
                found.append(UploadRef("", "", marker))  # garbled: only the marker to remove
                continue
            if upload_id:
                found.append(UploadRef(key, str(upload_id), marker))
                continue
            if claimed is None:
                claimed = self._claimed_upload_ids()
            orphans = [u for u in self._uploads_of(key) if u not in claimed]
            found += [UploadRef(key, u, "") for u in orphans]
            found.append(UploadRef(key, "", marker))
        return found

    def _begin_multipart(self, key: str, metadata: dict[str, str], checksum_algorithm: str | None) -> tuple[str, str]:
        """CreateMultipartUpload, bracketed by this owner's marker; returns (upload id, marker name)."""
        marker = f"{self.owner}/{secrets.token_hex(8)}"
        self._put_marker(marker, key, None)
        extra = {"ChecksumAlgorithm": checksum_algorithm} if checksum_algorithm else {}
        tries = 0

        def create() -> Any:
            nonlocal tries
            tries += 1
            return self._call(f"start upload of {key}", "create_multipart_upload", Key=self._full(key),
                              Metadata=metadata, **extra)

        started = time.time()
        try:
            response = retry_transient(create, attempts=self.attempts)
        except BaseException:
            self._delete_marker(marker)
            raise
        upload_id = response["UploadId"]
        try:
            self._put_marker(marker, key, upload_id)
        except BaseException:
            self._abort_quietly_raw(key, upload_id, marker)
            raise
        if tries > 1 or response.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            # A retried create may have created an upload whose answer was lost: nothing records it, so
            # find it now (ours are the unclaimed ones for this key that started since) and abort it.
            # Best effort: failing here must not lose the upload just created, which the caller records.
            try:
                retry_transient(lambda: self._abort_lost_creates(key, upload_id, started), attempts=self.attempts)
            except BackendError as exc:
                log.info("could not look for an upload of %s lost to a retried create: %s", key, exc)
        return upload_id, marker

    def _abort_lost_creates(self, key: str, ours: str, since: float) -> None:
        full = self._full(key)
        claimed: set[str] | None = None
        with _mapped(f"list uploads of {key}"):
            paginator = self._client.get_paginator("list_multipart_uploads")
            uploads = [u for page in paginator.paginate(Bucket=self.bucket, Prefix=full)
                       for u in page.get("Uploads", []) if u["Key"] == full and u["UploadId"] != ours]
        for upload in uploads:
            initiated = upload.get("Initiated")
            # Server clocks differ from ours: a minute of slack still spares every older upload.
            if isinstance(initiated, datetime) and initiated.timestamp() < since - LOST_CREATE_SKEW:
                continue
            if claimed is None:
                claimed = self._claimed_upload_ids()
            if upload["UploadId"] in claimed:
                continue
            log.info("aborting an upload of %s whose creation answer was lost", key)
            self._abort_multipart(key, upload["UploadId"])

    def _marker_key(self, marker: str) -> str:
        return f"{self.prefix}{MARKER_DIR}{marker}"

    def _put_marker(self, marker: str, key: str, upload_id: str | None) -> None:
        body = json.dumps({"key": key, "upload_id": upload_id, "owner": self.owner}).encode()
        self._retrying(f"write upload marker of {key}", "put_object", Key=self._marker_key(marker), Body=body,
                       ChecksumCRC32=_crc_b64(crc32(body)))

    def _delete_marker(self, marker: str) -> None:
        try:
            self._retrying("delete upload marker", "delete_object", Key=self._marker_key(marker))
        except BackendError as exc:  # harmless: the engine's next sweep removes it
            log.debug("could not delete upload marker %s: %s", marker, exc)
            self.left_behind = True

    def _read_marker(self, full_key: str) -> dict[str, Any] | None:
        """Retried on its own: a listing reads every marker, and one busy answer must not fail them all."""
        return retry_transient(lambda: self._read_marker_once(full_key), attempts=self.attempts)

    def _read_marker_once(self, full_key: str) -> dict[str, Any] | None:
        try:
            response = self._call("read upload marker", "get_object", Key=full_key)
            with _mapped("read upload marker"):
                data = json.loads(response["Body"].read())
        except NotFoundBackendError:
            return None
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def _abort_quietly_raw(self, key: str, upload_id: str, marker: str) -> None:
        try:
            self._abort_multipart(key, upload_id)
        except BackendError as exc:  # the marker stays: the engine's next sweep aborts it
            log.warning("could not abort the upload of %s: %s", key, exc)
            self.left_behind = True
            return
        self._delete_marker(marker)

    def _abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._retrying(f"abort upload of {key}", "abort_multipart_upload", Key=self._full(key),
                           UploadId=upload_id)
        except BackendError as exc:
            if not _is_code(exc, "NoSuchUpload", "NoSuchKey", "404"):
                raise

    def _uploads_of(self, key: str) -> list[str]:
        full = self._full(key)
        ids = []
        with _mapped(f"list uploads of {key}"):
            paginator = self._client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                ids += [u["UploadId"] for u in page.get("Uploads", []) if u["Key"] == full]
        return ids

    def _claimed_upload_ids(self) -> set[str]:
        claimed = set()
        for obj in self._list_raw(f"{self.prefix}{MARKER_DIR}"):
            info = self._read_marker(obj["Key"])
            if info and info.get("upload_id"):
                claimed.add(str(info["upload_id"]))
        return claimed

    # -- reads ----------------------------------------------------------------------------------------------

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
    ) -> RangeRead:
        what = f"download {key}"
        args: dict[str, Any] = {"Key": self._full(key), "Range": f"bytes={offset}-{offset + max(length, 1) - 1}"}
        if if_match:
            args["IfMatch"] = if_match
        try:
            response = self._call(what, "get_object", **args)
        except BackendError as exc:
            if _is_code(exc, "PreconditionFailed"):
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            if not _is_code(exc, "InvalidRange"):
                raise
            # Past the end (an empty object has no byte 0): read what there is to learn its size and version.
            response = self._call(what, "get_object", Key=self._full(key))
            response["Body"].close()
            if if_match and response["ETag"] != if_match:
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from None
            return RangeRead(b"", int(response["ContentLength"]), response["ETag"],
                             (response.get("Metadata") or {}).get(META_CHECKSUM))
        content_range = response.get("ContentRange") or ""
        total = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else int(response["ContentLength"])
        body = response["Body"]
        data = b""
        try:
            if sink is None:
                with _mapped(what):
                    data = body.read()
            else:
                while True:
                    with _mapped(what):
                        piece = body.read(RANGE_PIECE)
                    if not piece:
                        break
                    sink(piece)
        finally:
            body.close()
        return RangeRead(data, total, response["ETag"], (response.get("Metadata") or {}).get(META_CHECKSUM))

    def _head_raw(self, key: str) -> dict[str, Any] | None:
        try:
            response: dict[str, Any] = self._call(f"head {key}", "head_object", Key=self._full(key))
        except NotFoundBackendError:
            return None
        return response

    def head(self, key: str) -> ObjectInfo | None:
        response = self._head_raw(key)
        if response is None:
            return None
        return self._info(key, response)

    def _info(self, key: str, response: dict[str, Any]) -> ObjectInfo:
        metadata = response.get("Metadata") or {}
        mtime = parse_mtime(metadata.get(META_MTIME))
        if mtime is None:
            mtime = _ns(response.get("LastModified"))
        try:
            mode = int(metadata[META_MODE]) & 0o7777
        except (KeyError, ValueError):
            mode = -1
        etag = response.get("ETag")
        if key.endswith("/"):
            return ObjectInfo(key, DIR, 0, mtime, DEFAULT_DIR_MODE if mode < 0 else mode, etag=etag)
        if META_SYMLINK in metadata:
            return ObjectInfo(key, SYMLINK, 0, mtime, 0o777, target=unquote(metadata[META_SYMLINK]), etag=etag)
        return ObjectInfo(key, FILE, int(response.get("ContentLength", 0)), mtime,
                          DEFAULT_FILE_MODE if mode < 0 else mode, checksum=metadata.get(META_CHECKSUM), etag=etag)

    def _list_raw(self, full_prefix: str) -> Iterator[dict[str, Any]]:
        # Page by page, each retried on transient errors: a listing runs at mount and must ride out throttling.
        token: str | None = None
        while True:
            page_args: dict[str, Any] = {"Prefix": full_prefix}
            if token:
                page_args["ContinuationToken"] = token
            page = self._retrying(f"list {self.url}", "list_objects_v2", **page_args)
            yield from page.get("Contents", [])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        for obj in self._list_raw(self.prefix + prefix):
            key = obj["Key"][skip:]
            if not key or key == prefix or any(part.startswith(TEMP_PREFIX) for part in key.split("/")):
                continue
            info = self._listed_info(key, obj)
            if info is not None:
                yield info

    def _listed_info(self, key: str, obj: dict[str, Any]) -> ObjectInfo | None:
        size = int(obj.get("Size", 0))
        etag = obj.get("ETag") or ""
        mtime = _ns(obj.get("LastModified"))
        if key.endswith("/"):
            return ObjectInfo(key, DIR, 0, mtime, DEFAULT_DIR_MODE, etag=etag or None)
        if size == len(SYMLINK_BODY) and (etag == SYMLINK_ETAG or not _is_plain_md5(etag)):
            return self.head(key)  # a symlink (or a file of just that size): the target is in its metadata
        return ObjectInfo(key, FILE, size, mtime, DEFAULT_FILE_MODE, etag=etag or None)

    def list_dir(self, prefix: str = "") -> DirListing:
        full = self.prefix + prefix
        skip = len(self.prefix)
        entries: list[ObjectInfo] = []
        subdirs: list[str] = []
        marker = False
        token: str | None = None
        while True:
            page_args: dict[str, Any] = {"Prefix": full, "Delimiter": "/"}
            if token:
                page_args["ContinuationToken"] = token
            page = self._retrying(f"list {self.url}/{prefix}", "list_objects_v2", **page_args)
            for obj in page.get("Contents", []):
                key = obj["Key"][skip:]
                if key == prefix:
                    marker = True
                elif not key.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                    info = self._listed_info(key, obj)
                    if info is not None and info.kind != DIR:
                        entries.append(info)
            for common in page.get("CommonPrefixes", []):
                # An empty name ('a//b' below 'a/') is passed on: the caller warns about keys it cannot map.
                name = common["Prefix"][len(full):][:-1]
                if not name.startswith(TEMP_PREFIX):
                    subdirs.append(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return DirListing(entries, subdirs, marker)

    # -- other writes -----------------------------------------------------------------------------------------

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        self._check_key(dst_key)
        source = self._head_raw(src_key)
        if source is None:
            raise NotFoundBackendError(f"copy {src_key}: no such object")
        metadata = None
        if meta is not None:
            metadata = dict(source.get("Metadata") or {})
            type_bits = stat.S_IFLNK if META_SYMLINK in metadata else stat.S_IFREG
            metadata.update(_metadata(meta, type_bits))
            if checksum is not None:
                metadata[META_CHECKSUM] = checksum
        self._copy(src_key, dst_key, source, metadata=metadata)

    def _copy(self, src_key: str, dst_key: str, source: dict[str, Any], metadata: dict[str, str] | None) -> None:
        """Server-side copy of the version `source` (a HEAD answer) of src_key; new metadata if given."""
        size = int(source.get("ContentLength", 0))
        copy_source = {"Bucket": self.bucket, "Key": self._full(src_key)}
        extra: dict[str, Any] = {}
        if metadata is not None:
            extra = {"MetadataDirective": "REPLACE", "Metadata": metadata}
            if source.get("ContentType"):
                extra["ContentType"] = source["ContentType"]
        if size <= self.copy_threshold:
            self._call(f"copy {src_key} to {dst_key}", "copy_object", Key=self._full(dst_key), CopySource=copy_source,
                       CopySourceIfMatch=source["ETag"], **extra)
            return
        # Above 5 GiB: a multipart copy, its parts copied server-side in parallel.
        new_metadata = metadata if metadata is not None else dict(source.get("Metadata") or {})
        upload_id, marker = self._begin_multipart(dst_key, new_metadata, checksum_algorithm=None)
        part_size = max(self.copy_part_size, -(-size // MAX_PARTS))
        etags: dict[int, str] = {}

        def copy_part(number: int) -> None:
            offset = (number - 1) * part_size
            end = min(size, offset + part_size) - 1
            response = self._retrying(
                f"copy part {number} of {src_key} to {dst_key}", "upload_part_copy", Key=self._full(dst_key),
                UploadId=upload_id, PartNumber=number, CopySource=copy_source, CopySourceRange=f"bytes={offset}-{end}",
                CopySourceIfMatch=source["ETag"],
            )
            etags[number] = response["CopyPartResult"]["ETag"]

        try:
            run_parallel(copy_part, range(1, -(-size // part_size) + 1), COPY_PARTS_IN_FLIGHT)
            parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
            self._call(f"complete copy of {src_key} to {dst_key}", "complete_multipart_upload",
                       Key=self._full(dst_key), UploadId=upload_id, MultipartUpload={"Parts": parts})
        except BaseException:
            self._abort_quietly_raw(dst_key, upload_id, marker)
            raise
        self._delete_marker(marker)

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Rewrite mtime and mode: a copy of the object onto itself with replaced metadata (S3 cannot edit
        metadata in place); the bytes, the checksum and the symlink target are kept."""
        source = self._head_raw(key)
        if source is None:
            raise NotFoundBackendError(f"set metadata of {key}: no such object")
        if key.endswith("/"):  # a marker has no bytes to keep: write it anew (SeaweedFS cannot copy one)
            self.put_dir(key, meta)
            return
        metadata = dict(source.get("Metadata") or {})
        type_bits = stat.S_IFLNK if META_SYMLINK in metadata else stat.S_IFREG
        metadata.update(_metadata(meta, type_bits))
        self._copy(key, key, source, metadata=metadata)

    def delete(self, key: str) -> None:
        try:
            self._call(f"delete {key}", "delete_object", Key=self._full(key))
        except NotFoundBackendError:
            pass

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        self._check_key(key.rstrip("/"))
        self._call(f"create directory {key}", "put_object", Key=self._full(key), Body=b"",
                   Metadata=_metadata(meta, stat.S_IFDIR))

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        self._check_key(key)
        encoded = quote(target, safe="/._-~+=:@,")
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than S3 metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = _metadata(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK, **{META_SYMLINK: encoded})
        self._call(f"create symlink {key}", "put_object", Key=self._full(key), Body=SYMLINK_BODY,
                   ChecksumCRC32=_crc_b64(crc32(SYMLINK_BODY)), Metadata=metadata)

    # -- notes: objects below .ckptfs-tmp.notes/, one request each ------------------------------------------

    def _note_key(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        self._call(f"write note {name}", "put_object", Key=self._note_key(name), Body=data, ContentLength=len(data),
                   ChecksumCRC32=_crc_b64(crc32(data)))

    def get_note(self, name: str) -> bytes | None:
        what = f"read note {name}"
        try:
            response = self._call(what, "get_object", Key=self._note_key(name))
        except NotFoundBackendError:
            return None
        body = response["Body"]
        try:
            with _mapped(what):
                data: bytes = body.read()  # one response is one version of the note, whole
        finally:
            body.close()
        return data

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """Page by page, one request each and none retried here (the caller retries the whole listing)."""
        base = f"{self.prefix}{NOTES_DIR}"
        full = base + check_note_prefix(prefix)
        keys: builtins.list[str] = []
        token: str | None = None
        while True:
            page_args: dict[str, Any] = {"Prefix": full}
            if token:
                page_args["ContinuationToken"] = token
            page = self._call(f"list notes {prefix!r}", "list_objects_v2", **page_args)
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return listed_note_names(keys, base)

    def delete_note(self, name: str) -> None:
        try:
            self._call(f"delete note {name}", "delete_object", Key=self._note_key(name))
        except NotFoundBackendError:
            pass


__all__ = ["ERROR_CODES", "S3Store", "translate_error"]
