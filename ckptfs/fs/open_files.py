"""The table of open handles: which handle number names which open file (OpenFile), the lowest free number
first (so that the mapped record of them, fs/handle_table.py, stays as small as the most files ever open at once),
and how many handles and writers each inode has open (an inode with open handles is in use: never evicted
nor purged)."""

from __future__ import annotations

import errno
import heapq

from ckptfs.cache.directory import CacheFile
from ckptfs.errors import FsError
from ckptfs.fs.handle_table import HandleTable
from ckptfs.fs.interface import PartialReader


class OpenFile:
    """One open() of a file: the cache file descriptor, its space accounting entry, whether this handle
    has dirtied the file, whether it bypasses the kernel's page cache (write-only handles do: see
    KernelCache.caching), and for a read-only open of a remote file, its reader of the partial file."""

    __slots__ = ("backing", "direct", "dirtied", "fd", "inode_id", "local", "reader", "shed_to", "writable")

    def __init__(
        self, inode_id: int, fd: int, local: CacheFile, writable: bool, dirtied: bool, direct: bool,
        reader: PartialReader | None = None, backing: int = 0,
    ) -> None:
        self.inode_id = inode_id
        self.fd = fd
        self.local = local
        self.writable = writable
        self.dirtied = dirtied
        self.direct = direct
        self.reader = reader
        self.shed_to = 0  # with a reader: the cache file's pages below this were advised away
        # The kernel's backing id of the cache file when the kernel reads and writes it itself (FUSE
        # passthrough: no read or write of this handle reaches the daemon); 0 when they do.
        self.backing = backing


class OpenFiles:
    def __init__(self) -> None:
        self.handles: dict[int, OpenFile] = {}
        # Handle numbers: the lowest free one first, so the handle table (fs/handle_table.py) stays small.
        self._next_fh = 1
        self._free_fhs: list[int] = []
        # Where open handles are recorded for a daemon that takes the mount over (None: nowhere).
        self.handle_table: HandleTable | None = None
        self.open_count: dict[int, int] = {}
        self.writer_count: dict[int, int] = {}

    def get(self, fh: int) -> OpenFile:
        try:
            return self.handles[fh]
        except KeyError:
            # Only a handle the kernel kept across a takeover whose file could not be restored
            raise FsError(errno.EBADF, f"no open handle {fh}") from None

    def take_fh(self) -> int:
        if self._free_fhs:
            return heapq.heappop(self._free_fhs)
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def give_back_fh(self, fh: int) -> None:
        heapq.heappush(self._free_fhs, fh)

    def renumber(self) -> None:
        """After handles were restored under their old numbers: the free ones are those between them."""
        used = set(self.handles)
        self._next_fh = max(used, default=0) + 1
        self._free_fhs = [fh for fh in range(1, self._next_fh) if fh not in used]
        heapq.heapify(self._free_fhs)

    def count_open(self, inode_id: int) -> None:
        self.open_count[inode_id] = self.open_count.get(inode_id, 0) + 1

    def uncount_open(self, inode_id: int) -> bool:
        """One handle of the inode fewer; True if it was the last."""
        opens = self.open_count[inode_id] - 1
        if opens:
            self.open_count[inode_id] = opens
            return False
        del self.open_count[inode_id]
        return True

    def count_writer(self, inode_id: int) -> int:
        """One writer of the inode more; returns how many there were before."""
        writers = self.writer_count.get(inode_id, 0)
        self.writer_count[inode_id] = writers + 1
        return writers

    def uncount_writer(self, inode_id: int) -> bool:
        """One writer of the inode fewer; True if it was the last."""
        writers = self.writer_count[inode_id] - 1
        if writers:
            self.writer_count[inode_id] = writers
            return False
        del self.writer_count[inode_id]
        return True

    def in_use(self, inode_id: int) -> bool:
        """Open handles refer to the inode's data file: it must not be evicted."""
        return inode_id in self.open_count

    def open_writers(self) -> int:
        return len(self.writer_count)
