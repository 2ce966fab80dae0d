"""Helpers every store shares, written once: the SDK error -> BackendError mapping of a call, the checks of
the keys a store may write, times, the JSON of the bookkeeping objects, and the object metadata formats of
the cloud stores (mtime and mode written the way rclone and s3fs write them, the symlink body, the
ObjectInfo built from a metadata dict). No SDK is imported here, so every store works with only its own SDK
installed.
"""

from __future__ import annotations

import json
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, unquote

from ckptfs.backends.base import (
    DIR,
    FILE,
    SYMLINK,
    TEMP_PREFIX,
    CredentialState,
    ObjectInfo,
    ObjectMeta,
    UploadPart,
    UploadRef,
)
from ckptfs.errors import BackendError, PermanentBackendError

META_MTIME = "mtime"
META_MODE = "mode"
# S3 and GCS; Azure's metadata names must be C# identifiers (azure.py: ckptfs_checksum, ckptfs_symlink).
META_CHECKSUM = "ckptfs-checksum"
META_SYMLINK = "ckptfs-symlink"
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
CONTENT_TYPE = "application/octet-stream"
# GCS and Azure (S3 names its metadata header in its own body, and allows less metadata).
SYMLINK_BODY = b"ckptfs symlink; its target is in the object's metadata (ckptfs-symlink)\n"
MAX_SYMLINK_TARGET = 4096  # encoded bytes; GCS allows 8 KiB of custom metadata, Azure 8 KiB of headers
SPILL_PREFIX = f"{TEMP_PREFIX}spill."


# -- errors -----------------------------------------------------------------------------------------------


class ErrorMap:
    """`with mapped(what):` turns an SDK failure inside into the BackendError `translate` makes of it (once:
    a BackendError passes unchanged), chained to the original."""

    def __init__(self, sdk_errors: tuple[type[BaseException], ...],
                 translate: Callable[[BaseException, str], BackendError]) -> None:
        self.sdk_errors = sdk_errors
        self.translate = translate

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        try:
            yield
        except BackendError:
            raise
        except self.sdk_errors as exc:
            raise self.translate(exc, what) from exc


class SdkCredentialReport:
    """What `ckptfs status` says of a credential its SDK refreshes by itself (GCS: google-auth refreshes
    before the expiry, 3 min 45 s ahead, and once more on a 401; an external_account (workload identity
    federation) reads its subject token file on every refresh. Azure: azure-core's bearer policy fetches
    a token from azure-identity 5 minutes before the expiry; WorkloadIdentityCredential re-reads
    AZURE_FEDERATED_TOKEN_FILE). `source()` names the credential; `sdk_credentials`, once the client is made,
    is the SDK's object, whose `expiry` (google-auth: a naive UTC datetime) is shown where it has one."""

    def __init__(self, source: Callable[[], str]) -> None:
        self.source = source
        self.sdk_credentials: Any = None
        self.renewals_after_rejection = 0  # clients made anew because the store said the token expired

    def state(self) -> CredentialState:
        credentials = self.sdk_credentials
        expiry = getattr(credentials, "expiry", None)
        expires_at = expiry.replace(tzinfo=expiry.tzinfo or UTC).timestamp() if isinstance(expiry, datetime) else None
        detail = f"{type(credentials).__module__}.{type(credentials).__name__}" if credentials is not None else ""
        return CredentialState(source=self.source() or "not resolved yet", detail=detail, expires_at=expires_at,
                               fetched_at=None, refreshes=self.renewals_after_rejection,
                               renewals_after_rejection=self.renewals_after_rejection, last_error=None)


class WholeCopies:
    """What a store whose `copy` takes objects of any size (limits.max_copy_size None) says to copy_part."""

    def copy_part(self, upload: UploadRef, number: int, src_key: str, offset: int, length: int,
                  if_match: str | None = None) -> UploadPart:
        raise PermanentBackendError(f"{type(self).__name__} copies objects whole, never part by part")


# -- keys -------------------------------------------------------------------------------------------------


def is_bookkeeping(key: str) -> bool:
    """Does a component of `key` start with TEMP_PREFIX (a store's or the engine's own object)?"""
    return any(part.startswith(TEMP_PREFIX) for part in key.split("/"))


def check_key(key: str) -> None:
    """PermanentBackendError unless ckptfs may write `key`: not empty, relative, no bookkeeping component."""
    if not key or key.startswith("/") or is_bookkeeping(key):
        raise PermanentBackendError(f"{key!r}: not a key ckptfs may write (names starting with {TEMP_PREFIX}"
                                    " are reserved)")


def check_upload_key(key: str) -> None:
    """check_key, but a spill's hidden staging key (the engine's `.ckptfs-tmp.spill.*`) is fine too."""
    if not key.rsplit("/", 1)[-1].startswith(SPILL_PREFIX):
        check_key(key)


# -- times and bookkeeping objects ------------------------------------------------------------------------


def ns_of(when: datetime | None) -> int:
    """A service's timestamp in ns since the epoch (0 if it gave none)."""
    return int(when.timestamp() * 1e9) if when is not None else 0


def bookkeeping_body(**fields: Any) -> bytes:
    """The JSON body of an upload marker or manifest."""
    return json.dumps(fields).encode()


def new_upload(key: str, meta: ObjectMeta | None, checksum: str | None, *, owner: str,
               checksum_key: str) -> tuple[UploadRef, bytes]:
    """A staged upload of `key` with a fresh id, and the body of the bookkeeping object a store keeps for it
    (GCS's manifest, Azure's marker: the key, the metadata the object gets at complete, the owner)."""
    check_upload_key(key)
    metadata: dict[str, str] = {}
    if meta is not None:
        metadata = metadata_of(meta, stat.S_IFREG)
        metadata[checksum_key] = checksum or ""
    upload_id = secrets.token_hex(8)
    return UploadRef(key, upload_id, f"{owner}/{upload_id}"), bookkeeping_body(key=key, metadata=metadata, owner=owner)


def parse_bookkeeping(data: bytes) -> dict[str, Any]:
    """The fields of an upload marker or manifest; {} if it is garbled (it then only needs removing)."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


# -- object metadata, the same on S3, GCS and Azure ----------------------------------------------------------


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


def metadata_of(meta: ObjectMeta, type_bits: int) -> dict[str, str]:
    return {META_MTIME: format_mtime(meta.mtime_ns), META_MODE: str(type_bits | (meta.mode & 0o7777))}


def encode_target(target: str) -> str:
    return quote(target, safe="/._-~+=:@,")


def decode_target(text: str) -> str:
    return unquote(text)


def type_bits_of(metadata: Mapping[str, str], symlink_key: str) -> int:
    return stat.S_IFLNK if symlink_key in metadata else stat.S_IFREG


def info_from_metadata(
    key: str, size: int, metadata: Mapping[str, str] | None, *, fallback_mtime_ns: int, etag: str | None,
    checksum_key: str, symlink_key: str,
) -> ObjectInfo:
    """The ObjectInfo of an object from its size, custom metadata and the service's own modification time
    (used when the metadata has no mtime: an object written by another tool)."""
    metadata = metadata or {}
    mtime = parse_mtime(metadata.get(META_MTIME))
    if mtime is None:
        mtime = fallback_mtime_ns
    try:
        mode = int(metadata[META_MODE]) & 0o7777
    except (KeyError, ValueError):
        mode = -1
    if key.endswith("/"):
        return ObjectInfo(key, DIR, 0, mtime, DEFAULT_DIR_MODE if mode < 0 else mode, etag=etag)
    if symlink_key in metadata:
        return ObjectInfo(key, SYMLINK, 0, mtime, 0o777, target=decode_target(metadata[symlink_key]), etag=etag)
    return ObjectInfo(key, FILE, size, mtime, DEFAULT_FILE_MODE if mode < 0 else mode,
                      checksum=metadata.get(checksum_key), etag=etag)
