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

Owner markers (s3markers.py): each multipart upload has a small marker object
`<prefix>/.ckptfs-tmp.uploads/<owner>/<token>`, so that `list_leftovers` reports this owner's uploads and
never another node's. `list` hides every key component starting with TEMP_PREFIX.

Copies: CopyObject copies at most 5 GiB (`limits.max_copy_size`); above it `copy` and `set_meta` raise
TooLargeToCopyError and the engine copies part by part (open_upload, `copy_part` = UploadPartCopy, complete).

Notes (base.py) are plain objects at `<prefix>/.ckptfs-tmp.notes/<name>`, each written by one PutObject
(atomic: a GET sees the old object or the new) with its CRC32 for the server to verify. S3's listings are
strongly consistent (AWS since 2020, SeaweedFS and moto by construction), so list_notes sees every note
whose PutObject has returned. They are apart from the markers' `.ckptfs-tmp.uploads/`, which is all that
list_leftovers and the sweeps ever list.

Errors: every SDK failure is translated once (s3errors.py). Every method makes one attempt (botocore
retries once, standard mode); the callers retry.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import logging
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from ckptfs.backends.base import (
    DIR,
    FILE,
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
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    META_CHECKSUM,
    META_SYMLINK,
    check_key,
    check_upload_key,
    encode_target,
    info_from_metadata,
    is_bookkeeping,
    metadata_of,
    ns_of,
    type_bits_of,
)
from ckptfs.backends.s3creds import RenewingCredentials, renewing_session
from ckptfs.backends.s3errors import check_message, is_busy, is_code, is_expired_credential, mapped
from ckptfs.backends.s3markers import UploadMarkers
from ckptfs.checksums import crc32, crc_of, crc_text
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    StoreCheckError,
    TooLargeToCopyError,
    TransientBackendError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000
MAX_COPY_SIZE = 5 * GiB  # the largest object one CopyObject may copy

SYMLINK_BODY = b"ckptfs symlink; its target is in the metadata x-amz-meta-ckptfs-symlink\n"
SYMLINK_ETAG = f'"{hashlib.md5(SYMLINK_BODY).hexdigest()}"'
MAX_SYMLINK_TARGET = 1536  # encoded bytes; AWS allows 2 KiB of user metadata in all


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


def _send_without_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for `100 Continue` before every body it sends as a stream (every PutObject), and reads
    that interim answer one byte per system call: about 50 calls per request, each giving up the GIL that
    the FUSE thread and the other uploads are waiting for (in a drain of 2,000 small files, 770,000 futex
    calls). A PutObject body is at most the multipart threshold: sending it to a server that refuses it
    costs little, so it goes at once. Expect is not a signed header."""
    request.headers.pop("Expect", None)


def _crc_b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _metadata(meta: ObjectMeta, type_bits: int, **extra: str) -> dict[str, str]:
    return {**metadata_of(meta, type_bits), **extra}


def _is_plain_md5(etag: str) -> bool:
    tag = etag.strip('"')
    return len(tag) == 32 and all(c in "0123456789abcdef" for c in tag)


# -- the store -------------------------------------------------------------------------------------------


class S3Store:
    listing_has_metadata = False  # listings carry LastModified and no user metadata
    left_behind = False

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        owner: str = "anon",
        copy_threshold: int = MAX_COPY_SIZE,
        max_pool_connections: int = 64,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        session: boto3.session.Session | None = None,
    ) -> None:
        """`session`: the boto3 session its clients are made from; by default a new one whose clients sign with
        RenewingCredentials (s3creds.py). A process that opens many stores (the tests' contract suites) may
        share one: a new session loads botocore's S3 model again, about a quarter of a CPU-second; a shared
        one keeps the credentials it resolved first, refreshed by botocore alone."""
        self.bucket = bucket
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"s3://{bucket}/{clean}" if clean else f"s3://{bucket}"
        self.owner = owner
        # The largest object copied in one request: CopyObject's limit (lower only in tests).
        self.limits = PartLimits(min_part_size=MIN_PART_SIZE, max_part_size=MAX_PART_SIZE, max_parts=MAX_PARTS,
                                 max_copy_size=min(copy_threshold, MAX_COPY_SIZE))
        self.markers = UploadMarkers(self)
        self.endpoint_url = _without_userinfo(
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        self.credentials: RenewingCredentials | None = None
        if session is None:
            # STS is asked in the bucket's region where known (regional STS endpoints, botocore's default).
            sts_region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            botocore_session, self.credentials = renewing_session(sts_region)
            session = boto3.session.Session(botocore_session=botocore_session)
        self._session = session
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
        # Listings and reads of upload markers ride out throttling with botocore's own retry, as GCS's
        # listings do with the SDK's: a listing of many pages, or a sweep that reads every marker, made of
        # requests that fail one time in ten would never get through whole if each made one attempt.
        self._patient_client = self._session.client(
            "s3", endpoint_url=self.endpoint_url,
            config=config.merge(botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 5})))

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"

    # -- keys ---------------------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key

    # -- requests: one each, its failure a BackendError ----------------------------------------------------

    def _call(self, what: str, method: str, *, patient: bool = False, **kwargs: Any) -> Any:
        """One request (botocore's own retry aside: `patient`, the listings' retry), its failure a
        BackendError. A request whose credential the server rejects as expired is sent once more with a
        credential fetched anew, here and not by the caller: an upload part (or a complete) that meets an
        expired session goes on, and the drain never counts it as a failure."""
        client = self._patient_client if patient else self._client
        signed_with = self.credentials.in_use() if self.credentials is not None else None
        try:
            with mapped(what):
                return getattr(client, method)(Bucket=self.bucket, **kwargs)
        except AuthBackendError as exc:
            if not self._renewed_after(exc, signed_with):
                raise
        with mapped(what):
            return getattr(client, method)(Bucket=self.bucket, **kwargs)

    def _renewed_after(self, exc: AuthBackendError, signed_with: str | None) -> bool:
        """After `exc`: was it an expired credential, now fetched anew (so the request may go again)?"""
        if self.credentials is None or not is_expired_credential(exc):
            return False
        with mapped(f"refresh the credential after {exc}"):
            self.credentials.renew_after_rejection(signed_with, str(exc))
        return True

    def _pages(self, what: str, method: str, *, patient: bool = True, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The pages of a listing, one request each (`patient`: with the listings' retry). A listing whose
        first page meets an expired credential starts again once with a new one, as `_call` does."""
        client = self._patient_client if patient else self._client
        signed_with = self.credentials.in_use() if self.credentials is not None else None
        pages = 0
        try:
            with mapped(what):
                for page in client.get_paginator(method).paginate(Bucket=self.bucket, **kwargs):
                    pages += 1
                    yield page
                return
        except AuthBackendError as exc:
            if pages or not self._renewed_after(exc, signed_with):
                raise
        with mapped(what):
            yield from client.get_paginator(method).paginate(Bucket=self.bucket, **kwargs)

    def _listed(self, full_prefix: str) -> Iterator[dict[str, Any]]:
        """Every object below `full_prefix` (a full key prefix), as ListObjectsV2 lists it."""
        for page in self._pages(f"list {self.url}", "list_objects_v2", Prefix=full_prefix):
            yield from page.get("Contents", [])

    def _get_bytes(self, what: str, full_key: str, *, patient: bool = False) -> bytes:
        """The whole object at `full_key` (one response is one version of it); NotFoundBackendError if none."""
        body = self._call(what, "get_object", patient=patient, Key=full_key)["Body"]
        try:
            with mapped(what):
                data: bytes = body.read()
        finally:
            body.close()
        return data

    def _put_small(self, what: str, full_key: str, body: bytes, **kwargs: Any) -> None:
        """One PutObject of a small body, with its CRC32 for the server to verify."""
        self._call(what, "put_object", Key=full_key, Body=body, ContentLength=len(body),
                   ChecksumCRC32=_crc_b64(crc32(body)), **kwargs)

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        if self._session.get_credentials() is None:
            raise StoreCheckError(
                f"no AWS credentials found for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                " or AWS_PROFILE, or run with an instance/pod role"
            )
        try:
            self._call(f"list {self.url}", "list_objects_v2", Prefix=self.prefix, MaxKeys=1)
        except BackendError as exc:
            message = check_message(exc, url=self.url, bucket=self.bucket, region=self.region,
                                    endpoint_url=self.endpoint_url)
            raise StoreCheckError(message, exc, busy=is_busy(exc)) from None

    # -- staged uploads: multipart uploads bracketed by owner markers ---------------------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum})
        self._put_small(f"upload {key}", self._full(key), data, Metadata=metadata)

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        check_upload_key(key)
        metadata = {} if meta is None else _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum or ""})
        upload_id, marker = self.markers.begin(key, lambda: self._call(
            f"start upload of {key}", "create_multipart_upload", Key=self._full(key), Metadata=metadata,
            ChecksumAlgorithm="CRC32"))
        return UploadRef(key, upload_id, marker)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        response = self._call(
            f"upload part {number} of {upload.key}", "upload_part", Key=self._full(upload.key),
            UploadId=upload.upload_id, PartNumber=number, Body=data, ContentLength=len(data),
            ChecksumCRC32=_crc_b64(crc),
        )
        return UploadPart(number, response["ETag"], crc_text(crc))

    def copy_part(self, upload: UploadRef, number: int, src_key: str, offset: int, length: int,
                  if_match: str | None = None) -> UploadPart:
        what = f"copy part {number} of {src_key} to {upload.key}"
        condition: dict[str, Any] = {"CopySourceIfMatch": if_match} if if_match else {}
        try:
            response = self._call(
                what, "upload_part_copy", Key=self._full(upload.key), UploadId=upload.upload_id, PartNumber=number,
                CopySource={"Bucket": self.bucket, "Key": self._full(src_key)},
                CopySourceRange=f"bytes={offset}-{offset + length - 1}", **condition,
            )
        except TransientBackendError as exc:
            if is_code(exc, "PreconditionFailed"):
                raise ObjectChangedError(f"{what}: the source was replaced during the copy") from exc
            raise
        result = response["CopyPartResult"]
        # The server's CRC32 of the part where it computes one (AWS and SeaweedFS do for an upload opened with
        # CRC32, and then want it back at complete; moto does not).
        crc = result.get("ChecksumCRC32")
        return UploadPart(number, result["ETag"], crc_text(int.from_bytes(base64.b64decode(crc), "big")) if crc else "")

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        parts: dict[int, tuple[str, int]] = {}
        try:
            for page in self._pages(f"list parts of {upload.key}", "list_parts", Key=self._full(upload.key),
                                    UploadId=upload.upload_id):
                for part in page.get("Parts", []):
                    parts[int(part["PartNumber"])] = (part["ETag"].strip('"'), int(part["Size"]))
        except NotFoundBackendError:  # NoSuchUpload: the upload is gone
            return None
        return parts

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        if key is not None or meta is not None:
            raise ValueError("this store completes an upload at the key and with the metadata it was opened with")
        body = [{"PartNumber": p.number, "ETag": p.etag, **({"ChecksumCRC32": _crc_b64(crc_of(p.checksum))}
                                                               if p.checksum else {})}
                for p in parts]
        # NoSuchUpload (UploadGoneError): aborted, or a complete retried after its answer was lost got through
        # (the engine checks which).
        self._call(f"complete upload of {upload.key}", "complete_multipart_upload", Key=self._full(upload.key),
                   UploadId=upload.upload_id, MultipartUpload={"Parts": body})
        self.markers.delete(upload.marker)

    def abort_upload(self, upload: UploadRef) -> None:
        if upload.upload_id:
            self.markers.abort(upload.key, upload.upload_id)
        if upload.marker:
            self.markers.delete(upload.marker)

    def list_leftovers(self) -> list[UploadRef]:
        return self.markers.leftovers()

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
            if is_code(exc, "PreconditionFailed"):
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            if not is_code(exc, "InvalidRange"):
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
                with mapped(what):
                    data = body.read()
            else:
                while True:
                    with mapped(what):
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
        return info_from_metadata(key, int(response.get("ContentLength", 0)), response.get("Metadata"),
                                  fallback_mtime_ns=ns_of(response.get("LastModified")), etag=response.get("ETag"),
                                  checksum_key=META_CHECKSUM, symlink_key=META_SYMLINK)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        skip = len(self.prefix)
        for obj in self._listed(self.prefix + prefix):
            key = obj["Key"][skip:]
            if not key or key == prefix or is_bookkeeping(key):
                continue
            info = self._listed_info(key, obj)
            if info is not None:
                yield info

    def _listed_info(self, key: str, obj: dict[str, Any]) -> ObjectInfo | None:
        size = int(obj.get("Size", 0))
        etag = obj.get("ETag") or ""
        mtime = ns_of(obj.get("LastModified"))
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
        for page in self._pages(f"list {self.url}/{prefix}", "list_objects_v2", Prefix=full, Delimiter="/"):
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
        return DirListing(entries, subdirs, marker)

    # -- other writes -----------------------------------------------------------------------------------------

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        check_key(dst_key)
        source = self._head_raw(src_key)
        if source is None:
            raise NotFoundBackendError(f"copy {src_key}: no such object")
        metadata = None
        if meta is not None:
            metadata = dict(source.get("Metadata") or {})
            metadata.update(_metadata(meta, type_bits_of(metadata, META_SYMLINK)))
            if checksum is not None:
                metadata[META_CHECKSUM] = checksum
        self._copy(src_key, dst_key, source, metadata=metadata)

    def _copy(self, src_key: str, dst_key: str, source: dict[str, Any], metadata: dict[str, str] | None) -> None:
        """Server-side copy of the version `source` (a HEAD answer) of src_key; new metadata if given."""
        size = int(source.get("ContentLength", 0))
        assert self.limits.max_copy_size is not None
        if size > self.limits.max_copy_size:
            raise TooLargeToCopyError(f"copy {src_key} to {dst_key}: {size} bytes, more than one request copies")
        extra: dict[str, Any] = {}
        if metadata is not None:
            extra = {"MetadataDirective": "REPLACE", "Metadata": metadata}
            if source.get("ContentType"):
                extra["ContentType"] = source["ContentType"]
        self._call(f"copy {src_key} to {dst_key}", "copy_object", Key=self._full(dst_key),
                   CopySource={"Bucket": self.bucket, "Key": self._full(src_key)}, CopySourceIfMatch=source["ETag"],
                   **extra)

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Rewrite mtime and mode: a copy of the object onto itself with replaced metadata (S3 cannot edit
        metadata in place); the bytes, the checksum and the symlink target are kept. Above max_copy_size:
        TooLargeToCopyError (the engine copies it onto itself part by part)."""
        source = self._head_raw(key)
        if source is None:
            raise NotFoundBackendError(f"set metadata of {key}: no such object")
        if key.endswith("/"):  # a marker has no bytes to keep: write it anew (SeaweedFS cannot copy one)
            self.put_dir(key, meta)
            return
        metadata = dict(source.get("Metadata") or {})
        metadata.update(_metadata(meta, type_bits_of(metadata, META_SYMLINK)))
        self._copy(key, key, source, metadata=metadata)

    def delete(self, key: str) -> None:
        try:
            self._call(f"delete {key}", "delete_object", Key=self._full(key))
        except NotFoundBackendError:
            pass

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self._call(f"create directory {key}", "put_object", Key=self._full(key), Body=b"",
                   Metadata=_metadata(meta, stat.S_IFDIR))

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than S3 metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = _metadata(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK, **{META_SYMLINK: encoded})
        self._put_small(f"create symlink {key}", self._full(key), SYMLINK_BODY, Metadata=metadata)

    # -- notes: objects below .ckptfs-tmp.notes/, one request each ------------------------------------------

    def _note_key(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        self._put_small(f"write note {name}", self._note_key(name), data)

    def get_note(self, name: str) -> bytes | None:
        try:
            return self._get_bytes(f"read note {name}", self._note_key(name))
        except NotFoundBackendError:
            return None

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """Page by page, one request each (the caller retries the whole listing)."""
        base = f"{self.prefix}{NOTES_DIR}"
        keys = [obj["Key"] for page in self._pages(f"list notes {prefix!r}", "list_objects_v2", patient=False,
                                                   Prefix=base + check_note_prefix(prefix))
                for obj in page.get("Contents", [])]
        return listed_note_names(keys, base)

    def delete_note(self, name: str) -> None:
        try:
            self._call(f"delete note {name}", "delete_object", Key=self._note_key(name))
        except NotFoundBackendError:
            pass


__all__ = ["S3Store"]
