"""The object store protocol every backend implements, the value types it speaks, and the retry policy.

Stores know keys, bytes and a little metadata (mtime, mode); never inodes, paths of the mount or the
journal. Every method is blocking and thread-safe: callers run them in worker threads
(`trio.to_thread.run_sync`). Keys are relative to the store's prefix, use '/' as separator, and a key
ending in '/' is a directory marker.

Uploads are two-phase so that the drain can check, between the phases, that what it copied is still the
current content under the current name: `stage_upload` does the slow part (copying bytes, uploading parts),
`commit_upload` makes the object appear at its key atomically (rename, multipart complete), and
`abort_upload` throws a staged upload away. Nothing becomes visible at a final key before commit.

Resume (optional for a store; S3 implements it, file:// simply stages afresh): a store whose staged uploads
live server-side (a multipart upload) reports its progress through `stage_upload(progress=...)` as an
`UploadState`, which the caller may persist (`to_json()`); after a crash it passes the state back as
`stage_upload(resume=...)` and the store continues from the finished parts when the upload still exists and
the file is unchanged, else it throws the old upload away and starts afresh. At start-up,
`abort_stale_uploads(keep=...)` spares the upload ids the caller means to resume.

Spills (optional; file:// and S3 implement them): a file still being written whose start must leave the
cache is uploaded in parts, in order, into a hidden staging area (`spill_begin`, `spill_part`), and once
complete it is moved to its key atomically (`spill_commit`), whatever the key is by then. The state is an
UploadState with `spilled` set, `size` the bytes staged so far and `checksum` the running CRC32 of them.

Basenames starting with TEMP_PREFIX are reserved for the stores' own bookkeeping (temp files, upload
markers): `list` never returns them and a key containing such a component must not be written.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ckptfs.errors import TransientBackendError

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
TEMP_PREFIX = ".ckptfs-tmp."


@dataclass(frozen=True)
class ObjectMeta:
    """What travels with an object besides its bytes."""

    mtime_ns: int
    mode: int  # permission bits only


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    kind: str  # FILE, DIR (a directory marker) or SYMLINK
    size: int
    mtime_ns: int
    mode: int
    target: str | None = None  # symlink target
    checksum: str | None = None  # whole-content checksum ('crc32:<hex>') when the store knows it
    etag: str | None = None  # changes whenever the object is replaced (object stores); None for file://


@dataclass(frozen=True)
class DirListing:
    """One level of the store below a directory prefix."""

    entries: list[ObjectInfo]  # files and symlinks directly below (keys include the prefix)
    subdirs: list[str]  # names of directories directly below (with or without a marker object)
    marker: bool  # the directory itself has a marker object (always true for file:// directories)


@dataclass
class StagedUpload:
    """An upload whose bytes are in the store but not yet visible at `key`."""

    key: str
    size: int
    checksum: str
    handle: Any  # store-specific: a temp path, a multipart UploadState, ...


@dataclass(frozen=True)
class UploadPart:
    """One finished part of a staged multipart upload."""

    number: int  # 1-based
    etag: str
    checksum: str  # the part's checksum as the store verified it (S3: base64 big-endian CRC32)


@dataclass(frozen=True)
class UploadState:
    """Everything needed to continue (or throw away) a staged multipart upload in a later process.

    Persist it with to_json(); pass it back as `stage_upload(resume=...)` or keep its `upload_id` alive
    across start-up with `abort_stale_uploads(keep=...)`."""

    key: str
    upload_id: str
    marker: str  # the store's owner marker of this upload (S3: the marker object's name)
    size: int
    checksum: str  # whole-file checksum, also in the object's metadata
    mtime_ns: int
    mode: int
    part_size: int
    parts: tuple[UploadPart, ...] = field(default=())
    spilled: bool = False  # a spill (see the module docstring), not a staged upload of a closed file
    punched: int = 0  # a spill: bytes at the file's start its owner freed locally (at most `size`)

    def to_json(self) -> str:
        data = {k: v for k, v in self.__dict__.items() if k != "parts"}
        data["parts"] = [[p.number, p.etag, p.checksum] for p in self.parts]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UploadState:
        data = json.loads(text)
        parts = tuple(UploadPart(int(n), str(e), str(c)) for n, e, c in data.pop("parts"))
        return cls(**data, parts=parts)


ProgressCallback = Callable[[UploadState], None]


class ObjectStore(Protocol):
    url: str
    # Identifies the cache dir that stages uploads through this store object. Leftovers of interrupted
    # uploads carry it, so that the next daemon on the same cache dir removes its own (and only its own).
    owner: str
    # True if list() reports each object's own mtime and mode (file://); False where a listing carries no
    # metadata (object stores report the upload time and a default mode; head() has the real values).
    listing_has_metadata: bool

    def check(self) -> None:
        """Verify the store exists and is usable; raise CkptfsError naming the problem and the fix."""

    def stage_upload(
        self, key: str, src_path: str, meta: ObjectMeta, *,
        resume: UploadState | None = None, progress: ProgressCallback | None = None,
    ) -> StagedUpload:
        """Copy src_path's bytes into the store, invisible until commit. `progress` (optional) is called,
        from worker threads but one call at a time, with the state of a server-side staged upload after
        it is created and after each finished part; when given, a failed stage leaves that upload for the
        caller to resume or abort, else the store aborts it. `resume` continues an earlier state (see the
        module docstring); a store without resumable uploads ignores both and stages afresh."""
        ...

    def commit_upload(self, staged: StagedUpload) -> None: ...

    def abort_upload(self, staged: StagedUpload) -> None: ...

    def download(self, key: str, dst_path: str) -> str:
        """Write the object's bytes to dst_path (created or truncated); return its checksum."""
        ...

    def copy(self, src_key: str, dst_key: str) -> None:
        """Server-side copy; dst appears atomically. Raises NotFoundBackendError if src is missing."""
        ...

    def delete(self, key: str) -> None:
        """Delete an object or directory marker; a missing key is not an error."""
        ...

    def put_dir(self, key: str, meta: ObjectMeta) -> None: ...

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None: ...

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Rewrite the metadata (mode, mtime) of an existing object without changing its bytes.
        Raises NotFoundBackendError if the key is missing."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below the directory `prefix` (recursively), in no particular order. A directory
        with no marker object of its own may be missing (object stores list only `dir/` markers). Object
        stores report the upload time as mtime and a default mode: their listings carry no metadata;
        head() has the exact values."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list_dir(self, prefix: str = "") -> DirListing:
        """The files, symlinks and subdirectory names directly below the directory `prefix` ('' for the
        root, else ending in '/'), listing metadata as list() does. Missing prefix: an empty listing."""
        ...

    def abort_stale_uploads(self, keep: Collection[str] = ()) -> int:
        """Remove what interrupted uploads of `owner` left behind, except the staged uploads whose
        `UploadState.upload_id` is in `keep` (to be resumed); return how many. Called at start-up, before
        any upload of this daemon begins. Never touches other owners' uploads."""
        ...

    def spill_begin(self, part_size: int) -> UploadState:
        """Open a hidden staging area for a file still being written (see the module docstring)."""
        ...

    def spill_part(self, state: UploadState, src_path: str, length: int) -> UploadState:
        """Stage the next `length` bytes of src_path (from offset state.size); return the new state."""
        ...

    def spill_commit(self, state: UploadState, key: str, meta: ObjectMeta) -> None:
        """Make the staged bytes the object at `key`, atomically, with `meta` and the whole checksum."""
        ...

    def spill_abort(self, state: UploadState) -> None: ...


T = TypeVar("T")


def crc_of(checksum: str) -> int:
    """The CRC32 in a 'crc32:<hex>' checksum ('' for nothing yet: 0)."""
    return int(checksum.split(":", 1)[1], 16) if checksum else 0


def crc_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


def read_range(path: str, offset: int, length: int) -> bytes:
    """Exactly `length` bytes of `path` from `offset` (a spill reads what was written, never past it)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        done = 0
        while done < length:
            chunk = os.pread(fd, length - done, offset + done)
            if not chunk:
                raise TransientBackendError(f"{path} is shorter than expected")
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def backoff_delays(base: float = 0.2, cap: float = 30.0) -> Iterator[float]:
    """Exponential backoff with full jitter, forever."""
    attempt = 0
    while True:
        yield random.uniform(0, min(cap, base * 2**attempt))
        attempt += 1


def retry_transient(call: Callable[[], T], *, attempts: int = 5, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run a blocking store call, retrying TransientBackendError a few times with backoff.
    The drain retries forever on top of this; this is for calls that a request waits on."""
    delays = backoff_delays()
    for attempt in range(attempts):
        try:
            return call()
        except TransientBackendError:
            if attempt == attempts - 1:
                raise
            sleep(next(delays))
    raise AssertionError("unreachable")
