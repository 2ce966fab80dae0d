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

Requests: every one goes through the store's S3Wire (s3wire.py), which S3Store owns and shares with its
UploadMarkers: the clients, the bucket and the prefix, the translation of every SDK failure (s3errors.py,
once, in the wire) and the refresh-once of an expired credential. This module owns what the requests mean:
the layout above, the staged uploads' primitives, reads, listings, copies and notes. Every method makes one
attempt (botocore retries once, standard mode); the callers retry.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import logging
import stat
from collections.abc import Iterator, Sequence
from typing import Any

import boto3

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
from ckptfs.backends.s3errors import check_message, is_busy, is_code
from ckptfs.backends.s3markers import UploadMarkers
from ckptfs.backends.s3wire import S3Wire, crc_b64
from ckptfs.checksums import crc_of, crc_text
from ckptfs.errors import (
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


def _metadata(meta: ObjectMeta, type_bits: int, **extra: str) -> dict[str, str]:
    return {**metadata_of(meta, type_bits), **extra}


def _is_plain_md5(etag: str) -> bool:
    tag = etag.strip('"')
    return len(tag) == 32 and all(c in "0123456789abcdef" for c in tag)


# -- the store -------------------------------------------------------------------------------------------


class S3Store:
    listing_has_metadata = False  # listings carry LastModified and no user metadata

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
        self.wire = S3Wire(bucket, prefix, endpoint_url=endpoint_url, region=region,
                           max_pool_connections=max_pool_connections, connect_timeout=connect_timeout,
                           read_timeout=read_timeout, session=session)
        # Plain values of the wire's, for messages, `ckptfs status` (credentials) and the tests.
        self.bucket, self.prefix, self.url = self.wire.bucket, self.wire.prefix, self.wire.url
        self.endpoint_url, self.region = self.wire.endpoint_url, self.wire.region
        self.credentials = self.wire.credentials
        # The largest object copied in one request: CopyObject's limit (lower only in tests).
        self.limits = PartLimits(min_part_size=MIN_PART_SIZE, max_part_size=MAX_PART_SIZE, max_parts=MAX_PARTS,
                                 max_copy_size=min(copy_threshold, MAX_COPY_SIZE))
        self.markers = UploadMarkers(self.wire, owner)

    @property
    def owner(self) -> str:
        """ObjectStore.owner, kept by the markers (s3markers.py), which tag and find this owner's uploads by it;
        the daemon sets it after the store is made."""
        return self.markers.owner

    @owner.setter
    def owner(self, value: str) -> None:
        self.markers.owner = value

    @property
    def left_behind(self) -> bool:
        """Something of this owner may be left in the bucket (the markers know: s3markers.py)."""
        return self.markers.left_behind

    @left_behind.setter
    def left_behind(self, value: bool) -> None:
        self.markers.left_behind = value

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint_url!r})"

    # -- check ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        if not self.wire.has_credentials():
            raise StoreCheckError(
                f"no AWS credentials found for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                " or AWS_PROFILE, or run with an instance/pod role"
            )
        try:
            self.wire.call(f"list {self.url}", "list_objects_v2", Prefix=self.prefix, MaxKeys=1)
        except BackendError as exc:
            message = check_message(exc, url=self.url, bucket=self.bucket, region=self.region,
                                    endpoint_url=self.endpoint_url)
            raise StoreCheckError(message, exc, busy=is_busy(exc)) from None

    # -- staged uploads: multipart uploads bracketed by owner markers ---------------------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        check_key(key)
        metadata = _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum})
        self.wire.put_small(f"upload {key}", self.wire.full(key), data, Metadata=metadata)

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        check_upload_key(key)
        metadata = {} if meta is None else _metadata(meta, stat.S_IFREG, **{META_CHECKSUM: checksum or ""})
        upload_id, marker = self.markers.begin(key, lambda: self.wire.call(
            f"start upload of {key}", "create_multipart_upload", Key=self.wire.full(key), Metadata=metadata,
            ChecksumAlgorithm="CRC32"))
        return UploadRef(key, upload_id, marker)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        response = self.wire.call(
            f"upload part {number} of {upload.key}", "upload_part", Key=self.wire.full(upload.key),
            UploadId=upload.upload_id, PartNumber=number, Body=data, ContentLength=len(data),
            ChecksumCRC32=crc_b64(crc),
        )
        return UploadPart(number, response["ETag"], crc_text(crc))

    def copy_part(self, upload: UploadRef, number: int, src_key: str, offset: int, length: int,
                  if_match: str | None = None) -> UploadPart:
        what = f"copy part {number} of {src_key} to {upload.key}"
        condition: dict[str, Any] = {"CopySourceIfMatch": if_match} if if_match else {}
        try:
            response = self.wire.call(
                what, "upload_part_copy", Key=self.wire.full(upload.key), UploadId=upload.upload_id, PartNumber=number,
                CopySource={"Bucket": self.bucket, "Key": self.wire.full(src_key)},
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
            for page in self.wire.pages(f"list parts of {upload.key}", "list_parts", Key=self.wire.full(upload.key),
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
        body = [{"PartNumber": p.number, "ETag": p.etag, **({"ChecksumCRC32": crc_b64(crc_of(p.checksum))}
                                                               if p.checksum else {})}
                for p in parts]
        # NoSuchUpload (UploadGoneError): aborted, or a complete retried after its answer was lost got through
        # (the engine checks which).
        self.wire.call(f"complete upload of {upload.key}", "complete_multipart_upload", Key=self.wire.full(upload.key),
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
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        what = f"download {key}"
        args: dict[str, Any] = {"Key": self.wire.full(key), "Range": f"bytes={offset}-{offset + max(length, 1) - 1}"}
        if if_match:
            args["IfMatch"] = if_match
        try:
            response = self.wire.call(what, "get_object", **args)
        except BackendError as exc:
            if is_code(exc, "PreconditionFailed"):
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from exc
            if not is_code(exc, "InvalidRange"):
                raise
            # Past the end (an empty object has no byte 0): read what there is to learn its size and version.
            response = self.wire.call(what, "get_object", Key=self.wire.full(key))
            response["Body"].close()
            if if_match and response["ETag"] != if_match:
                raise ObjectChangedError(f"{what}: the object was replaced during the download") from None
            return RangeRead(b"", int(response["ContentLength"]), response["ETag"],
                             (response.get("Metadata") or {}).get(META_CHECKSUM))
        content_range = response.get("ContentRange") or ""
        total = int(content_range.rsplit("/", 1)[1]) if "/" in content_range else int(response["ContentLength"])
        data = self.wire.read_body(what, response["Body"], sink, piece_size)
        return RangeRead(data, total, response["ETag"], (response.get("Metadata") or {}).get(META_CHECKSUM))

    def _head_raw(self, key: str) -> dict[str, Any] | None:
        try:
            response: dict[str, Any] = self.wire.call(f"head {key}", "head_object", Key=self.wire.full(key))
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
        for obj in self.wire.listed(self.prefix + prefix):
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
        for page in self.wire.pages(f"list {self.url}/{prefix}", "list_objects_v2", Prefix=full, Delimiter="/"):
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
        self.wire.call(f"copy {src_key} to {dst_key}", "copy_object", Key=self.wire.full(dst_key),
                   CopySource={"Bucket": self.bucket, "Key": self.wire.full(src_key)}, CopySourceIfMatch=source["ETag"],
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
            self.wire.call(f"delete {key}", "delete_object", Key=self.wire.full(key))
        except NotFoundBackendError:
            pass

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        if not key.endswith("/"):
            key += "/"
        check_key(key.rstrip("/"))
        self.wire.call(f"create directory {key}", "put_object", Key=self.wire.full(key), Body=b"",
                   Metadata=_metadata(meta, stat.S_IFDIR))

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        check_key(key)
        encoded = encode_target(target)
        if len(encoded) > MAX_SYMLINK_TARGET:
            raise PermanentBackendError(f"symlink {key}: its target is longer than S3 metadata can hold"
                                        f" ({len(encoded)} > {MAX_SYMLINK_TARGET} bytes encoded)")
        metadata = _metadata(ObjectMeta(meta.mtime_ns, 0o777), stat.S_IFLNK, **{META_SYMLINK: encoded})
        self.wire.put_small(f"create symlink {key}", self.wire.full(key), SYMLINK_BODY, Metadata=metadata)

    # -- notes: objects below .ckptfs-tmp.notes/, one request each ------------------------------------------

    def _note_key(self, name: str) -> str:
        return f"{self.prefix}{NOTES_DIR}{check_note_name(name)}"

    def put_note(self, name: str, data: bytes) -> None:
        self.wire.put_small(f"write note {name}", self._note_key(name), data)

    def get_note(self, name: str) -> bytes | None:
        try:
            return self.wire.get_bytes(f"read note {name}", self._note_key(name))
        except NotFoundBackendError:
            return None

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """Page by page, one request each (the caller retries the whole listing)."""
        base = f"{self.prefix}{NOTES_DIR}"
        keys = [obj["Key"] for page in self.wire.pages(f"list notes {prefix!r}", "list_objects_v2", patient=False,
                                                   Prefix=base + check_note_prefix(prefix))
                for obj in page.get("Contents", [])]
        return listed_note_names(keys, base)

    def delete_note(self, name: str) -> None:
        try:
            self.wire.call(f"delete note {name}", "delete_object", Key=self._note_key(name))
        except NotFoundBackendError:
            pass


__all__ = ["S3Store"]
