"""Object metadata formats shared by the cloud stores that are not S3 (gcs.py, azure.py): mtime and mode
written the way S3Store writes them (rclone's "<seconds>.<9 digits>", s3fs's decimal st_mode with its
type bits), the fixed symlink body, and the ObjectInfo built from a metadata dict. No SDK is imported here,
so either store works with only its own SDK installed. s3.py keeps its own copies (the same formats), so
this module never has to import boto3.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from urllib.parse import quote, unquote

from ckptfs.backends.base import DIR, FILE, SYMLINK, ObjectInfo, ObjectMeta

META_MTIME = "mtime"
META_MODE = "mode"
DEFAULT_FILE_MODE = 0o644
DEFAULT_DIR_MODE = 0o755
SYMLINK_BODY = b"ckptfs symlink; its target is in the object's metadata (ckptfs-symlink)\n"
MAX_SYMLINK_TARGET = 4096  # encoded bytes; GCS allows 8 KiB of custom metadata, Azure 8 KiB of headers


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
