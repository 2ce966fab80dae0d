"""The object store protocol every backend implements, the value types it speaks, and the retry policy.

Stores know keys, bytes and a little metadata (mtime, mode); never inodes, paths of the mount or the
journal. Every method is blocking and thread-safe: callers run them in worker threads
(`trio.to_thread.run_sync`). Keys are relative to the store's prefix, use '/' as separator, and a key
ending in '/' is a directory marker.

Uploads are two-phase so that the drain can check, between the phases, that what it copied is still the
current content under the current name: `stage_upload` does the slow part (copying bytes, uploading parts),
`commit_upload` makes the object appear at its key atomically (rename, multipart complete), and
`abort_upload` throws a staged upload away. Nothing becomes visible at a final key before commit.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ckptfs.errors import TransientBackendError

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"


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
    checksum: str | None = None


@dataclass
class StagedUpload:
    """An upload whose bytes are in the store but not yet visible at `key`."""

    key: str
    size: int
    checksum: str
    handle: Any  # store-specific: a temp path, a multipart upload id, ...


class ObjectStore(Protocol):
    url: str
    # Identifies the cache dir that stages uploads through this store object. Leftovers of interrupted
    # uploads carry it, so that the next daemon on the same cache dir removes its own (and only its own).
    owner: str

    def check(self) -> None:
        """Verify the store exists and is usable; raise CkptfsError naming the problem and the fix."""

    def stage_upload(self, key: str, src_path: str, meta: ObjectMeta) -> StagedUpload: ...

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
        """Every object below prefix (recursively), in no particular order."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def abort_stale_uploads(self) -> int:
        """Remove what interrupted uploads of `owner` left behind; return how many. Called at start-up,
        before any upload of this daemon begins."""
        ...


T = TypeVar("T")


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
