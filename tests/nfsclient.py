"""A real NFSv4 client for the tests: libnfs (Debian's libnfs13, the library behind libnfs-utils' nfs-cp and
nfs-ls) through ctypes, with the calls libnfs-utils has no tool for (fsync, rename, mkdir, stat of a handle
held open). Synchronous: each call is one or more NFS compounds, answered before it returns. No kernel NFS
client is needed: libnfs speaks the protocol over its own TCP connection.

What libnfs 4.0 does over NFSv4, on any server (a plain directory exported by ganesha too):
- a WRITE of more than about 3.9 KiB cannot be encoded ("ZDR error: Failed to encode COMPOUND4args"), so
  pwrite() here sends MAX_WRITE bytes a call, and nfs-cp fails on any file larger than that ("Failed to
  write to dest file");
- open() with O_CREAT and without O_TRUNC is an EXCLUSIVE4 create: the server keeps the verifier in the
  new file's times (a year near 2104) until a write or SETATTR sets them; with O_TRUNC it is a GUARDED4
  create, which fails with NFS4ERR_EXIST on a name that exists (open it without O_CREAT instead);
- it does not reconnect to a restarted server (File.send_handle stands in for a client that kept its
  handle)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any

LIBRARY = "libnfs.so.13"
MAX_WRITE = 2048  # bytes a WRITE: more than about 3.9 KiB fails in libnfs 4.0 (see above)


class _Url(ctypes.Structure):
    _fields_ = [("server", ctypes.c_char_p), ("path", ctypes.c_char_p), ("file", ctypes.c_char_p)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "dev", "ino", "mode", "nlink", "uid", "gid", "rdev", "size", "blksize", "blocks", "atime", "mtime",
        "ctime", "atime_nsec", "mtime_nsec", "ctime_nsec", "used")]


class _Fh(ctypes.Structure):
    _fields_ = [("len", ctypes.c_int), ("val", ctypes.c_void_p)]


class _Timeval(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("usec", ctypes.c_long)]


class _Dirent(ctypes.Structure):
    pass


_Dirent._fields_ = [
    ("next", ctypes.POINTER(_Dirent)), ("name", ctypes.c_char_p), ("inode", ctypes.c_uint64),
    ("type", ctypes.c_uint32), ("mode", ctypes.c_uint32), ("size", ctypes.c_uint64),
    ("atime", _Timeval), ("mtime", _Timeval), ("ctime", _Timeval),
]


def available() -> str | None:
    """None when libnfs can be loaded, else why not."""
    try:
        _lib()
    except OSError as exc:
        return f"libnfs is not installed ({exc}); scripts/install.sh test installs libnfs-utils"
    return None


_LIB: Any = None


def _lib() -> Any:
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
        p, i, c, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint64
        for name, res, args in (
            ("nfs_init_context", p, []), ("nfs_destroy_context", None, [p]), ("nfs_get_error", c, [p]),
            ("nfs_set_version", i, [p, i]), ("nfs_set_timeout", None, [p, i]),
            ("nfs_set_autoreconnect", None, [p, i]),
            ("nfs_parse_url_dir", ctypes.POINTER(_Url), [p, c]), ("nfs_destroy_url", None, [ctypes.POINTER(_Url)]),
            ("nfs_mount", i, [p, c, c]), ("nfs_umount", i, [p]),
            ("nfs_open", i, [p, c, i, ctypes.POINTER(p)]), ("nfs_open2", i, [p, c, i, i, ctypes.POINTER(p)]),
            ("nfs_close", i, [p, p]), ("nfs_pwrite", i, [p, p, u64, u64, c]), ("nfs_pread", i, [p, p, u64, u64, p]),
            ("nfs_fsync", i, [p, p]), ("nfs_fstat64", i, [p, p, ctypes.POINTER(_Stat)]),
            ("nfs_stat64", i, [p, c, ctypes.POINTER(_Stat)]), ("nfs_rename", i, [p, c, c]),
            ("nfs_mkdir", i, [p, c]), ("nfs_rmdir", i, [p, c]), ("nfs_unlink", i, [p, c]),
            ("nfs_opendir", i, [p, c, ctypes.POINTER(p)]), ("nfs_readdir", ctypes.POINTER(_Dirent), [p, p]),
            ("nfs_closedir", None, [p, p]), ("nfs_get_fh", ctypes.POINTER(_Fh), [p]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _LIB = lib
    return _LIB


class NfsError(OSError):
    """A call failed: errno from the NFS status, and libnfs's message (it names the NFS4ERR_*)."""


@dataclass(frozen=True)
class Stat:
    ino: int
    mode: int
    nlink: int
    size: int
    mtime: float


class Client:
    """One NFSv4 mount of `url` (nfs://host/export?nfsport=N): paths are relative to the export root."""

    def __init__(self, url: str, timeout_ms: int = 20_000) -> None:
        lib = self._lib = _lib()
        self._ctx = lib.nfs_init_context()
        if not self._ctx:
            raise OSError("nfs_init_context failed")
        lib.nfs_set_version(self._ctx, 4)
        lib.nfs_set_timeout(self._ctx, timeout_ms)
        # A server that restarts is reconnected to (-1: retries without end, within each call's timeout), as
        # a kernel client does: the file handles it holds are sent to the new server.
        lib.nfs_set_autoreconnect(self._ctx, -1)
        parsed = lib.nfs_parse_url_dir(self._ctx, url.encode())
        if not parsed:
            self._fail(-22, f"parse {url}")
        try:
            self._check(lib.nfs_mount(self._ctx, parsed.contents.server, parsed.contents.path), f"mount {url}")
        finally:
            lib.nfs_destroy_url(parsed)

    def close(self) -> None:
        if self._ctx:
            self._lib.nfs_destroy_context(self._ctx)
            self._ctx = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, rc: int, what: str) -> None:
        message = self._lib.nfs_get_error(self._ctx)
        raise NfsError(-rc, f"{what}: {os.strerror(-rc)} ({(message or b'').decode(errors='replace')})")

    def _check(self, rc: int, what: str) -> int:
        if rc < 0:
            self._fail(rc, what)
        return rc

    @staticmethod
    def _path(path: str) -> bytes:
        return ("/" + path.lstrip("/")).encode()

    def create(self, path: str, mode: int = 0o644, flags: int = os.O_RDWR | os.O_CREAT | os.O_TRUNC) -> File:
        """open(2) with O_CREAT: an OPEN4 with UNCHECKED4 create (EXCLUSIVE4 with O_EXCL in `flags`)."""
        fh = ctypes.c_void_p()
        self._check(self._lib.nfs_open2(self._ctx, self._path(path), flags, mode, ctypes.byref(fh)),
                    f"create {path}")
        return File(self, fh, path)

    def open(self, path: str, flags: int = os.O_RDONLY) -> File:
        fh = ctypes.c_void_p()
        self._check(self._lib.nfs_open(self._ctx, self._path(path), flags, ctypes.byref(fh)), f"open {path}")
        return File(self, fh, path)

    def write_file(self, path: str, data: bytes, fsync: bool = False) -> None:
        with self.create(path) as f:
            f.pwrite(data, 0)
            if fsync:
                f.fsync()

    def read_file(self, path: str) -> bytes:
        with self.open(path) as f:
            return f.read_all()

    def stat(self, path: str) -> Stat:
        st = _Stat()
        self._check(self._lib.nfs_stat64(self._ctx, self._path(path), ctypes.byref(st)), f"stat {path}")
        return _stat(st)

    def rename(self, old: str, new: str) -> None:
        self._check(self._lib.nfs_rename(self._ctx, self._path(old), self._path(new)), f"rename {old} {new}")

    def mkdir(self, path: str) -> None:
        self._check(self._lib.nfs_mkdir(self._ctx, self._path(path)), f"mkdir {path}")

    def rmdir(self, path: str) -> None:
        self._check(self._lib.nfs_rmdir(self._ctx, self._path(path)), f"rmdir {path}")

    def unlink(self, path: str) -> None:
        self._check(self._lib.nfs_unlink(self._ctx, self._path(path)), f"unlink {path}")

    def listdir(self, path: str = "") -> dict[str, Stat]:
        """Each entry's name and attributes as READDIR returned them ("." and ".." left out)."""
        d = ctypes.c_void_p()
        self._check(self._lib.nfs_opendir(self._ctx, self._path(path), ctypes.byref(d)), f"opendir {path}")
        entries: dict[str, Stat] = {}
        try:
            while ent := self._lib.nfs_readdir(self._ctx, d):
                e = ent.contents
                name = e.name.decode()
                if name not in (".", ".."):
                    entries[name] = Stat(e.inode, e.mode, 0, e.size, e.mtime.sec + e.mtime.usec / 1e6)
        finally:
            self._lib.nfs_closedir(self._ctx, d)
        return entries


def _stat(st: _Stat) -> Stat:
    return Stat(st.ino, st.mode, st.nlink, st.size, st.mtime + st.mtime_nsec / 1e9)


class File:
    """An open file: its NFSv4 file handle and open state, held until close()."""

    def __init__(self, client: Client, fh: ctypes.c_void_p, path: str) -> None:
        self._client, self._fh, self.path = client, fh, path
        self._own: tuple[int, int | None] | None = None  # its own handle, while it sends another
        self._kept: ctypes.Array[ctypes.c_char] | None = None

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pwrite(self, data: bytes, offset: int) -> None:
        c = self._client
        done = 0
        while done < len(data):
            chunk = data[done:done + MAX_WRITE]
            done += c._check(c._lib.nfs_pwrite(c._ctx, self._fh, offset + done, len(chunk), chunk),
                             f"write {self.path}")

    def pread(self, size: int, offset: int) -> bytes:
        c = self._client
        buf = ctypes.create_string_buffer(size)
        n = c._check(c._lib.nfs_pread(c._ctx, self._fh, offset, size, buf), f"read {self.path}")
        return buf.raw[:n]

    def read_all(self) -> bytes:
        parts = []
        offset = 0
        while chunk := self.pread(1 << 20, offset):
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)

    def handle(self) -> bytes:
        """The NFS file handle the server gave for this file."""
        fh = self._client._lib.nfs_get_fh(self._fh).contents
        return ctypes.string_at(fh.val, fh.len)

    def send_handle(self, handle: bytes) -> None:
        """From now on this file's requests carry `handle` (one this client or another got before, say from a
        server since restarted): what a client that kept a handle sends. libnfs 4.0 cannot reconnect to a
        restarted NFSv4 server by itself, nor open a file by its handle; requests that need no open state
        (fstat: PUTFH + GETATTR) are then about the file `handle` names."""
        fh = self._client._lib.nfs_get_fh(self._fh).contents
        if self._own is None:
            self._own = (fh.len, fh.val)
        self._kept = ctypes.create_string_buffer(handle, len(handle))
        fh.len, fh.val = len(handle), ctypes.cast(self._kept, ctypes.c_void_p)

    def fsync(self) -> None:
        c = self._client
        c._check(c._lib.nfs_fsync(c._ctx, self._fh), f"fsync {self.path}")

    def fstat(self) -> Stat:
        c = self._client
        st = _Stat()
        c._check(c._lib.nfs_fstat64(c._ctx, self._fh, ctypes.byref(st)), f"fstat {self.path}")
        return _stat(st)

    def close(self) -> None:
        if self._fh:
            c = self._client
            if self._own is not None:  # libnfs frees the handle it holds: give its own back
                fh = c._lib.nfs_get_fh(self._fh).contents
                fh.len, fh.val = self._own
            rc = c._lib.nfs_close(c._ctx, self._fh)
            self._fh = ctypes.c_void_p()
            c._check(rc, f"close {self.path}")
