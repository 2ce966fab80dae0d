"""The cache directory: its layout, its lock, the data file of every inode, and space accounting.

Layout (all 0700 / 0600):
    CACHE_DIR/lock         flock()ed by the one daemon using this cache dir
    CACHE_DIR/journal.db   the journal (journal.py owns its contents)
    CACHE_DIR/data/<id>    the content of file inode <id>, byte for byte; its size and mtime are the file's
    CACHE_DIR/tmp/         partial downloads, renamed into data/ once complete

It knows inode ids but not the namespace or file states (the journal has those), nor any object store.
"""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from ckptfs.errors import CkptfsError


@dataclass(frozen=True)
class SpaceInfo:
    total_bytes: int
    free_bytes: int
    block_size: int
    total_files: int
    free_files: int


class CacheDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.tmp_dir = root / "tmp"
        self.journal_path = root / "journal.db"
        self._lock_fd: int | None = None
        self._data_dir_str = str(self.data_dir) + "/"

    def prepare(self) -> None:
        """Create the layout (0700) and check that it is writable; raise a CkptfsError naming the fix."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root.chmod(0o700)
            for sub in (self.data_dir, self.tmp_dir):
                sub.mkdir(mode=0o700, exist_ok=True)
            probe = self.tmp_dir / ".write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except PermissionError:
            raise CkptfsError(
                f"cache dir {self.root} is not writable by this user; choose another with --cache-dir"
            ) from None
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise CkptfsError(
                    f"cache dir {self.root} is on a read-only filesystem; choose another with --cache-dir"
                ) from None
            raise CkptfsError(f"cache dir {self.root} cannot be used: {exc.strerror}") from None

    def lock(self) -> None:
        """Take the cache dir for this process; a second daemon on it gets a clear error."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise CkptfsError(
                f"cache dir {self.root} is in use by another ckptfs daemon (pid {holder or 'unknown'});"
                " unmount that one first or choose another --cache-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def data_path(self, inode_id: int) -> str:
        return self._data_dir_str + str(inode_id)

    def tmp_path(self, inode_id: int) -> str:
        return str(self.tmp_dir / f"{inode_id}.part")

    def create_data(self, inode_id: int) -> None:
        fd = os.open(self.data_path(inode_id), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.close(fd)

    def remove_data(self, inode_id: int) -> None:
        try:
            os.unlink(self.data_path(inode_id))
        except FileNotFoundError:
            pass

    def has_data(self, inode_id: int) -> bool:
        return os.path.exists(self.data_path(inode_id))

    def data_ids(self) -> set[int]:
        ids = set()
        for name in os.listdir(self.data_dir):
            if name.isdigit():
                ids.add(int(name))
        return ids

    def clear_tmp(self) -> None:
        for name in os.listdir(self.tmp_dir):
            os.unlink(self.tmp_dir / name)

    def sync_data_dir(self) -> None:
        """Make the directory entries of data files durable (after creating one that must survive)."""
        fd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def space(self) -> SpaceInfo:
        st = os.statvfs(self.root)
        return SpaceInfo(
            total_bytes=st.f_blocks * st.f_frsize,
            free_bytes=st.f_bavail * st.f_frsize,
            block_size=st.f_frsize,
            total_files=st.f_files,
            free_files=st.f_favail,
        )
