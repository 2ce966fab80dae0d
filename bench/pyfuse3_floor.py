#!/usr/bin/env python3
"""The floor of a pyfuse3 + trio daemon (issue 31): the least a Python FUSE filesystem built like ckptfs can
do per request, as a benchmark anchor beside libfuse's C passthrough_ll.

A minimal filesystem with ckptfs's FUSE setup (the same pyfuse3 build, trio, kernel passthrough of file
data with a backing file per open, FOPEN_NOFLUSH, handle_killpriv_v2, default timeouts of 1 s) and nothing
else: the namespace is a dict in memory, file data lives in `SOURCE/<inode>` (written by the kernel through
passthrough, as ckptfs's cache files are), no journal, no drain, no metrics. Enough operations for the
small-file workload and its check: lookup, getattr, setattr (truncate), mkdir, create, open, release,
rename, unlink, rmdir, readdir, statfs. What ckptfs costs above this is its own work per request (journal,
cache files, bookkeeping); what this costs above passthrough_ll is Python, trio and pyfuse3's dispatch.

Run:  python bench/pyfuse3_floor.py SOURCE MOUNTPOINT   (foreground; unmount with `fusermount3 -u`)
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyfuse3
import trio

TIMEOUT = 1.0  # the entry and attribute timeouts ckptfs answers with


@dataclass
class Node:
    ino: int
    mode: int
    parent: int
    name: bytes
    size: int = 0
    mtime_ns: int = field(default_factory=time.time_ns)
    children: dict[bytes, int] = field(default_factory=dict)  # directories only


class Floor(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_passthrough = True
    handle_killpriv_v2 = True

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source
        self.nodes = {pyfuse3.ROOT_INODE: Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, 0, b"")}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.open_fds: dict[int, tuple[int, int, int]] = {}  # fh -> (inode, fd, backing id)
        self.next_fh = 1

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = node.ino
        entry.entry_timeout = TIMEOUT
        entry.attr_timeout = TIMEOUT
        entry.st_mode = node.mode
        entry.st_nlink = 2 if stat.S_ISDIR(node.mode) else 1
        entry.st_uid = entry.st_gid = 0
        entry.st_size = node.size
        entry.st_blksize = 1 << 20
        entry.st_blocks = (node.size + 511) // 512
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = node.mtime_ns
        return entry

    def _child(self, parent: int, name: bytes) -> Node:
        ino = self.nodes[parent].children.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.nodes[ino]

    def _add(self, parent: int, name: bytes, mode: int) -> Node:
        children = self.nodes[parent].children
        if name in children:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = Node(self.next_ino, mode, parent, name)
        self.next_ino += 1
        self.nodes[node.ino] = node
        children[name] = node.ino
        return node

    def _handle(self, node: Node, flags: int) -> pyfuse3.FileInfo:
        fd = os.open(f"{self.source}/{node.ino}", (flags & ~os.O_EXCL) | os.O_CREAT | os.O_CLOEXEC, 0o600)
        backing = getattr(pyfuse3, "backing_open")(fd)  # noqa: B009
        fh = self.next_fh
        self.next_fh += 1
        self.open_fds[fh] = (node.ino, fd, backing)
        info = pyfuse3.FileInfo(fh=fh)
        info.backing_id = backing
        info.noflush = True
        return info

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        ino = self.nodes[parent_inode].children.get(name)
        if ino is None:
            entry = pyfuse3.EntryAttributes()
            entry.st_ino = 0  # a negative entry with timeout 0, as ckptfs answers a miss
            return entry
        return self._entry(self.nodes[ino])

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self.nodes[inode])

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.nodes[inode]
        if fields.update_size:
            os.truncate(f"{self.source}/{inode}", attr.st_size)
            node.size = attr.st_size
        return self._entry(node)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self._add(parent_inode, name, stat.S_IFDIR | mode))

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        node = self._add(parent_inode, name, stat.S_IFREG | mode)
        return self._handle(node, flags), self._entry(node)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return self._handle(self.nodes[inode], flags)

    async def release(self, fh: int) -> None:
        ino, fd, backing = self.open_fds.pop(fh)
        getattr(pyfuse3, "backing_close")(backing)  # noqa: B009
        self.nodes[ino].size = os.fstat(fd).st_size
        os.close(fd)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        node = self._child(parent_inode_old, name_old)
        target = self.nodes[parent_inode_new].children.get(name_new)
        if target is not None:
            await self._remove(parent_inode_new, name_new)
        del self.nodes[parent_inode_old].children[name_old]
        self.nodes[parent_inode_new].children[name_new] = node.ino
        node.parent, node.name = parent_inode_new, name_new

    async def _remove(self, parent_inode: int, name: bytes) -> None:
        node = self._child(parent_inode, name)
        if node.children:
            raise pyfuse3.FUSEError(errno.ENOTEMPTY)
        del self.nodes[parent_inode].children[name]
        del self.nodes[node.ino]
        if not stat.S_ISDIR(node.mode):
            os.unlink(f"{self.source}/{node.ino}")

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self._remove(parent_inode, name)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = sorted(self.nodes[fh].children.items(), key=lambda item: item[1])
        for name, ino in entries:
            if ino <= start_id:
                continue
            if not pyfuse3.readdir_reply(token, name, self._entry(self.nodes[ino]), ino):
                return

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        disk = os.statvfs(self.source)
        data = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
                     "f_favail", "f_namemax"):
            setattr(data, name, getattr(disk, name))
        return data


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    source, mountpoint = sys.argv[1], sys.argv[2]
    if not getattr(pyfuse3, "PASSTHROUGH_BUILD", False):
        raise SystemExit("pyfuse3_floor needs ckptfs's pyfuse3 build with passthrough (scripts/install.sh)")
    options = set(pyfuse3.default_options) - {"default_permissions"}
    options.add("fsname=pyfuse3-floor")
    pyfuse3.init(Floor(source), mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)


if __name__ == "__main__":
    main()
