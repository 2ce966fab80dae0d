"""An inode as requests see it: found by id (ENOENT if it is gone), as a directory (ENOTDIR), and its
attributes, from the journal's row and, for a file with local data, from its cache file."""

from __future__ import annotations

import errno
import logging
import os

from ckptfs.cache.directory import CacheDir
from ckptfs.errors import FsError
from ckptfs.fs.interface import Attr
from ckptfs.journal import DIR, FILE, REMOTE, Inode, Journal

log = logging.getLogger(__name__)


def existing(journal: Journal, inode_id: int) -> Inode:
    inode = journal.names.get(inode_id)
    if inode is None:
        raise FsError(errno.ENOENT, f"inode {inode_id} does not exist")
    return inode


def directory(journal: Journal, inode_id: int) -> Inode:
    return as_directory(journal.names.get(inode_id), inode_id)


def as_directory(inode: Inode | None, inode_id: int) -> Inode:
    """`inode`, the row of `inode_id` read by the caller, as directory() checks it."""
    if inode is None:
        raise FsError(errno.ENOENT, f"inode {inode_id} does not exist")
    if inode.kind != DIR:
        raise FsError(errno.ENOTDIR, f"{inode.path!r} is not a directory")
    if inode.path is None:
        raise FsError(errno.ENOENT, "directory was removed")
    return inode


def attr_of(journal: Journal, cache: CacheDir, inode: Inode) -> Attr:
    """The attributes of `inode`. A directory's link count is 2 plus its subdirectories (each one's '..'),
    as on a local filesystem: find and fts read it to know how many subdirectories to expect."""
    linked = inode.path is not None
    if inode.kind == FILE and inode.state != REMOTE:
        return local_attr(cache, inode.id, inode.mode, inode.uid, inode.gid, inode.ctime_ns, linked=linked)
    subdirectories = journal.names.subdirectory_count(inode.id) if inode.kind == DIR and linked else 0
    return journal_attr(inode.id, inode.kind, inode.mode, inode.uid, inode.gid, inode.size, inode.atime_ns,
                        inode.mtime_ns, inode.ctime_ns, inode.target, linked=linked, subdirectories=subdirectories)


def local_attr(cache: CacheDir, ino: int, mode: int, uid: int, gid: int, ctime_ns: int, *, linked: bool = True
               ) -> Attr:
    """The attributes of a file with local data: size and times from its cache file."""
    try:
        st = os.stat(cache.data_path(ino))
    except FileNotFoundError:
        log.error("cache file of inode %d is missing", ino)
        raise FsError(errno.EIO, "cache file missing") from None
    # Writes change the cache file's ctime; namespace and attribute changes the journal's.
    ctime = max(st.st_ctime_ns, ctime_ns)
    return Attr(ino, mode, 1 if linked else 0, uid, gid, st.st_size, st.st_blocks, st.st_atime_ns, st.st_mtime_ns,
                ctime)


def journal_attr(
    ino: int, kind: str, mode: int, uid: int, gid: int, size: int, atime_ns: int | None, mtime_ns: int,
    ctime_ns: int, target: str | None, *, linked: bool = True, subdirectories: int = 0,
) -> Attr:
    """The attributes of an inode without local data (a directory, a symlink, a file only in the store):
    all in its journal row, but a directory's `subdirectories`, which its link count counts. An atime
    never set (None) reads as the mtime."""
    if target is not None:
        size = len(target.encode())
    nlink = (2 + subdirectories if kind == DIR else 1) if linked else 0
    atime = mtime_ns if atime_ns is None else atime_ns
    return _new_tuple(Attr, (ino, mode, nlink, uid, gid, size, (size + 511) // 512, atime, mtime_ns, ctime_ns))


_new_tuple = tuple.__new__
