"""The local side of a transfer, run in worker threads: reading a file to upload (a checksum scan of a part,
a part, a whole small file) and telling a change of the file apart from a failure, and writing the pieces
of a ranged download into a file. The engine (transfer.py) schedules these; they know paths and
descriptors, never the store."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from ckptfs.backends.base import pread_exact, pread_into
from ckptfs.checksums import crc32
from ckptfs.errors import BackendError, NotFoundBackendError, PermanentBackendError, TransientBackendError

IO_CHUNK = 1 << 20  # local reads of the checksum scan, per thread


class SourceChangedError(TransientBackendError):
    """The local file changed while it was being uploaded: retrying the part cannot help, the caller
    starts the upload again once the file is quiet."""


def source_error(exc: OSError, key: str) -> BackendError:
    """What an OSError on the local file of an upload to `key` means for the upload."""
    if exc.errno == errno.ENOENT:
        return NotFoundBackendError(f"{key}: source file vanished")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return PermanentBackendError(f"{key}: {exc.strerror}")
    return TransientBackendError(f"{key}: {exc.strerror}")


def scan_crc(fd: int, offset: int, end: int, key: str, *, sync: bool = False) -> int:
    """The CRC32 of fd's bytes [offset, end), read IO_CHUNK at a time; `sync` then fsyncs fd."""
    crc = 0
    # One buffer per part, reused: the scan holds IO_CHUNK per thread. Sized to the part, so that a small
    # file does not pay for zeroing (and faulting in) a whole chunk it never fills.
    view = memoryview(bytearray(min(IO_CHUNK, end - offset)))
    try:
        while offset < end:
            n = os.preadv(fd, [view[: min(IO_CHUNK, end - offset)]], offset)
            if not n:
                raise SourceChangedError(f"{key}: the file shrank while it was being read")
            crc = crc32(view[:n], crc)
            offset += n
        if sync:
            os.fsync(fd)
    except OSError as exc:
        raise source_error(exc, key) from exc
    return crc


def read_part(src_path: str, key: str, offset: int, length: int, buffer: bytearray | None) -> bytes | bytearray:
    """`length` bytes of src_path from `offset` (into `buffer` when given, of that length), for a part of
    the upload to `key`; SourceChangedError if the file is shorter now."""
    # Each part opens the file itself: a thread abandoned at shutdown never reads a descriptor that was
    # closed and reused meanwhile.
    data: bytes | bytearray
    try:
        fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if buffer is None:
                data = pread_exact(fd, length, offset)
                got = len(data)
            else:
                data = buffer
                got = pread_into(fd, buffer, offset)
        finally:
            os.close(fd)
    except OSError as exc:
        raise source_error(exc, key) from exc
    if got != length:
        raise SourceChangedError(f"{key}: the file changed while it was being uploaded")
    return data


def read_whole(src_path: str, key: str, changed: Callable[[], bool]) -> bytes | BaseException:
    """A small file's bytes, fsynced (the caller will call the local copy clean), or why it cannot be put:
    SourceChangedError if it changed while it was read (`changed`, called after the read, says whether a
    change began since the caller chose it), a BackendError if it cannot be read."""
    try:
        fd = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return source_error(exc, key)
    try:
        size = os.fstat(fd).st_size
        data = pread_exact(fd, size + 1, 0)
        os.fsync(fd)
    except OSError as exc:
        return source_error(exc, key)
    finally:
        os.close(fd)
    # After the read: a change that began before this check may have torn the bytes read; one that begins
    # after it writes after the read (and is caught before the PUT).
    if len(data) != size or changed():
        return SourceChangedError(f"{key}: the file changed while it was being read")
    return data


def fdatasync_path(path: str, key: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise source_error(exc, key) from exc


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class RangeWriter:
    """A RangeSink that writes the pieces of a ranged GET into fd at the range's offset (no fd: -1, only
    the checksum) and keeps the CRC32 of what it got."""

    __slots__ = ("crc", "fd", "offset", "written")

    def __init__(self, fd: int, offset: int) -> None:
        self.fd = fd
        self.offset = offset
        self.written = 0
        self.crc = 0

    def __call__(self, piece: bytes | memoryview) -> None:
        if self.fd >= 0:
            _pwrite_all(self.fd, piece, self.offset + self.written)
        self.crc = crc32(piece, self.crc)
        self.written += len(piece)
