"""The error types of ckptfs, and nothing else.

Inner layers raise these; each is translated exactly once at the edge that owns the translation:
`FsError` becomes a `pyfuse3.FUSEError` in fuse_ops.py, `BackendError` decides retry-or-report in the drain
and is mapped to an errno by `BACKEND_ERRNO` where a FUSE request waits on the store (a fetch), and
`CkptfsError` becomes one line on stderr and an exit code in cli.py.
"""

from __future__ import annotations

import errno


class CkptfsError(Exception):
    """A failure the user can act on: the message names the problem and the fix."""

    exit_code = 1


class UsageError(CkptfsError):
    """Bad command-line or configuration input."""

    exit_code = 2


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
