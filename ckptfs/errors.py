"""The error types of ckptfs, and the record of the unexpected errors the daemon survived (Faults).

Inner layers raise these; each is translated exactly once at the edge that owns the translation:
`FsError` becomes a `pyfuse3.FUSEError` in mount/adapter.py, `BackendError` decides retry-or-report in the drain
and is mapped to an errno by `BACKEND_ERRNO` where a FUSE request waits on the store (a fetch), and
`CkptfsError` becomes one line on stderr and an exit code in cli/__init__.py.
"""

from __future__ import annotations

import errno
import time


class CkptfsError(Exception):
    """A failure the user can act on: the message names the problem and the fix."""

    exit_code = 1


class UsageError(CkptfsError):
    """Bad command-line or configuration input."""

    exit_code = 2


class StoreCheckError(CkptfsError):
    """The store failed its mount-time check (ObjectStore.check), one attempt: the message names the problem
    and the fix. `transient`: another attempt may pass (a dropped connection, a busy server); `busy`: the
    store answered that it is busy (throttling, 5xx), so it is there and worth waiting for."""

    def __init__(self, message: str, cause: BackendError | None = None, *, busy: bool = False) -> None:
        super().__init__(message)
        self.transient = isinstance(cause, TransientBackendError)
        self.busy = busy


class NoDaemonError(CkptfsError):
    """No ckptfs daemon serves this mountpoint (no control socket, or nobody listening on it)."""


class DaemonError(CkptfsError):
    """The daemon did not answer, or answered that it could not do what was asked."""


class NotDurableError(CkptfsError, TimeoutError):
    """A wait for durability ran out of time: `remaining_count` entries (the first of them in `remaining`)
    were still not in the store. A TimeoutError, so `except TimeoutError` catches it too."""

    exit_code = 3

    def __init__(self, timeout: float | None, remaining_count: int, remaining: list[str]) -> None:
        super().__init__(
            f"not durable after {timeout}s: {remaining_count} entries pending, e.g. " + ", ".join(remaining[:5])
        )
        self.timeout = timeout
        self.remaining_count = remaining_count
        self.remaining = remaining


class NotDrainedError(CkptfsError):
    """An unmount finished with entries not yet in the store; they stay journaled in the cache dir and
    upload at the next mount."""

    exit_code = 3

    def __init__(self, mountpoint: object, remaining_count: int, cache_dir: str | None) -> None:
        super().__init__(
            f"{mountpoint} unmounted, but {remaining_count} entries are not yet in the store;"
            f" they stay journaled in {cache_dir} and upload at the next mount"
        )
        self.remaining_count = remaining_count
        self.cache_dir = cache_dir


class FsError(Exception):
    """A POSIX error for one filesystem request; `errno` is what the caller of the syscall sees."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(err, message or errno.errorcode.get(err, str(err)))
        self.errno = err
        self.message = message

    def __str__(self) -> str:
        return f"[{errno.errorcode.get(self.errno, self.errno)}] {self.message}"


class BackendError(Exception):
    """An object store call failed. Subclasses say whether retrying can help."""


class TransientBackendError(BackendError):
    """Worth retrying with backoff: 5xx, throttling, dropped connections, timeouts."""


class ObjectChangedError(TransientBackendError):
    """The object was replaced between two requests of one transfer (a ranged read pinned to its etag)."""


class PermanentBackendError(BackendError):
    """Retrying the same call will not help until an operator acts (no bucket, bad config)."""


class AuthBackendError(PermanentBackendError):
    """Credentials are missing, wrong or not allowed to do this."""


class NotFoundBackendError(BackendError):
    """The key (or the bucket) does not exist."""


class UploadGoneError(NotFoundBackendError):
    """The store no longer has the staged upload (aborted, expired, or completed): no part can be added to
    it, nor can it be completed. After a complete whose answer was lost, the object may be at its key all
    the same: the engine checks that (StagedUploads.complete), not the store."""


class TooLargeToCopyError(PermanentBackendError):
    """The object is larger than the store copies in one request (PartLimits.max_copy_size): the engine
    copies it part by part instead (ObjectStore.copy_part, Transfers.copies)."""


# How a store failure looks to a process blocked in a FUSE request (a read-through fetch).
BACKEND_ERRNO: dict[type[BackendError], int] = {
    NotFoundBackendError: errno.ENOENT,
    AuthBackendError: errno.EACCES,
    PermanentBackendError: errno.EIO,
    TransientBackendError: errno.EIO,
    BackendError: errno.EIO,
}


def errno_for_backend_error(exc: BackendError) -> int:
    for cls in type(exc).__mro__:
        if cls in BACKEND_ERRNO:
            return BACKEND_ERRNO[cls]
    return errno.EIO


class Faults:
    """Unexpected errors that one entry, one request or one background task met and that the daemon
    survived (ckptfs_internal_errors): counted by where they happened (a bounded set of names: "drain",
    "fuse", "evictor", ...), the last one kept for `ckptfs status`."""

    __slots__ = ("counts", "last", "last_at")

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.last: str | None = None
        self.last_at: float | None = None

    def record(self, where: str, message: str) -> None:
        self.counts[where] = self.counts.get(where, 0) + 1
        self.last = f"{where}: {message}"
        self.last_at = time.time()
