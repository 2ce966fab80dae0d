"""What callers hand the engine and get back: priorities, small files, staged uploads, fetched ranges,
statistics, and the part size a file gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from ckptfs.backends.base import ObjectMeta, UploadState
from ckptfs.transfer.bandwidth import LimitNow

MiB = 1 << 20
# Parts of one file in parallel that the part size aims for (boto3's default concurrency is 10).
UPLOAD_SPREAD = 8


class Priority(IntEnum):
    """Who waits for a transfer; lower goes first."""

    READ = 0  # a process is blocked in read() on these bytes
    READAHEAD = 1  # a sequential reader will want them soon
    UPLOAD = 2  # the background drain
    MARKER = 3  # commit markers: after everything else


@dataclass(frozen=True)
class SmallFile:
    """A small closed file for put_files: read whole, PUT in one request. `changed` (called in the worker
    thread, after the read) says whether the file may have changed since the caller chose it; `expected`,
    the (size, checksum) its bytes must have (what stage_upload's scan found)."""

    key: str
    src_path: str
    meta: ObjectMeta
    changed: Callable[[], bool]
    expected: tuple[int, str] | None = None


@dataclass(frozen=True)
class PutFile:
    """What put_files put at a key: the bytes the file held, their checksum."""

    size: int
    checksum: str


@dataclass(frozen=True)
class StagedUpload:
    """An upload whose bytes are in the store (or, below the multipart threshold, checked locally) but not
    yet visible at `key`. `state` is the staged multipart upload, None for a one-request upload at commit."""

    key: str
    size: int
    checksum: str
    meta: ObjectMeta
    src_path: str
    state: UploadState | None


@dataclass(frozen=True)
class FetchedRange:
    """What one ranged download wrote into a local file."""

    offset: int
    length: int  # bytes written (fewer than asked at the object's end)
    crc: int  # CRC32 of those bytes
    size: int  # the whole object's size
    etag: str | None  # the object's version: pass it as if_match to read more of the same
    checksum: str | None  # the whole object's checksum from its metadata, if any


@dataclass
class TransferStats:
    parts_up: int = 0  # part uploads in flight now
    parts_down: int = 0  # ranged downloads in flight now
    bytes_up: int = 0  # since start
    bytes_down: int = 0
    up_bytes_per_second: float = 0.0  # over the last RATE_WINDOW seconds
    down_bytes_per_second: float = 0.0
    retries: int = 0
    memory_in_use: int = 0
    memory_budget: int = 0
    memory_peak: int = 0
    memory_waiters: int = 0
    upload_limit: LimitNow | None = None  # the caps in effect (filled in by Transfers.statistics)
    download_limit: LimitNow | None = None


def plan_part_size(size: int, part_size: int, spread: int, *, min_part: int, max_parts: int) -> int:
    """The part size for a file of `size` bytes: the configured size, smaller for mid-size files so that
    `spread` parts can go in parallel (never below the store's minimum), and larger when the file would
    need more parts than the store allows. Whole MiB."""
    ps = max(min_part, part_size)
    if spread > 1:
        share = -(-size // spread)
        ps = min(ps, max(min_part, -(-share // MiB) * MiB))
    needed = -(-size // max_parts)
    return max(ps, -(-needed // MiB) * MiB)
