"""The namespace: which names exist and what they may be (name and path limits a store key sets), and the
operations that change it: lookup, mkdir, symlink, unlink, rmdir, rename, and an entry another node
deleted from the shared store (vanished). Each change is one journal transaction; the drain learns of it
from there."""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Callable
from typing import NamedTuple

from ckptfs.cache.directory import CacheDir
from ckptfs.errors import FsError
from ckptfs.fs.inodes import as_directory, attr_of, directory, existing
from ckptfs.fs.interface import Attr, Lister, Moved
from ckptfs.fs.references import References
from ckptfs.journal import DIR, ROOT_ID, SYMLINK, Inode, Journal

NAME_MAX = 255
# S3 keys are at most 1024 bytes; leave room for a prefix.
PATH_MAX_BYTES = 1000
# Stores keep their own bookkeeping (temp files, upload markers) under names with this prefix.
RESERVED_PREFIX = b".ckptfs-tmp."
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def decode_name(raw: bytes) -> str:
    if len(raw) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
    if raw in (b"", b".", b"..") or b"/" in raw or b"\0" in raw:
        raise FsError(errno.EINVAL, f"invalid name {raw!r}")
    if raw.startswith(RESERVED_PREFIX):
        raise FsError(errno.EINVAL, f"names starting with {RESERVED_PREFIX.decode()} are reserved for ckptfs")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FsError(errno.EINVAL, f"name {raw!r} is not UTF-8; object stores keep UTF-8 keys only") from None


def child_path(parent: Inode, name: str) -> str:
    path = f"{parent.path}/{name}" if parent.path else name
    if len(path.encode()) > PATH_MAX_BYTES:
        raise FsError(errno.ENAMETOOLONG, f"path longer than {PATH_MAX_BYTES} bytes")
    return path


class RenameEntries(NamedTuple):
    """What a rename reads before it changes anything: both directories, the entry it moves and the one it
    replaces (None: the new name is free)."""

    old_parent: Inode
    source: Inode
    new_parent: Inode
    new_name: str
    target: Inode | None


class Namespace:
    def __init__(self, journal: Journal, cache: CacheDir, references: References, lister: Lister,
                 notify_drain: Callable[[], None]) -> None:
        self.journal = journal
        self.cache = cache
        self._references = references
        self._lister = lister
        self._notify_drain = notify_drain

    def lookup(self, parent_id: int, raw_name: bytes) -> Attr:
        attr = self.find(parent_id, raw_name)
        if attr is None:
            raise FsError(errno.ENOENT, f"no entry {raw_name!r}")
        return attr

    def find(self, parent_id: int, raw_name: bytes) -> Attr | None:
        """lookup, with None for a name that does not exist: the kernel's LOOKUP before the create of every
        new name misses, and an exception per miss is most of what a miss costs."""
        if raw_name == b"." or raw_name == b"..":
            inode: Inode | None = self._by_number(parent_id, raw_name)
        else:
            inode = self.dir_and_child(parent_id, raw_name)[1]
        if inode is None:
            return None
        self._references.remember(inode.id)
        return attr_of(self.journal, self.cache, inode)

    def _by_number(self, inode_id: int, raw_name: bytes) -> Inode:
        """The kernel's lookups for file handles (an NFS server's, name_to_handle_at's) of an inode it forgot:
        "." is the inode itself, of any kind (a file handle's), ".." a directory's parent (to connect it to
        the tree). An inode that is gone, and the parent of a directory removed since, is ESTALE: the handle
        names nothing any more. An unlinked inode still held (open, or known to the kernel) is found."""
        inode = self.journal.names.get(inode_id)
        if inode is None:
            raise FsError(errno.ESTALE, f"inode {inode_id} is gone")
        if raw_name == b".":
            return inode
        if inode.kind != DIR:
            raise FsError(errno.ENOTDIR, f"{inode.path!r} is not a directory")
        if inode.id == ROOT_ID:
            return inode
        if inode.parent is None:
            raise FsError(errno.ESTALE, f"directory {inode_id} was removed")
        return existing(self.journal, inode.parent)

    def child(self, parent: Inode, raw_name: bytes) -> Inode | None:
        """The entry `raw_name` of `parent`, None if there is none. A name or path too long to exist is
        ENAMETOOLONG, as on a local filesystem (stat, unlink, chmod of it), not a miss: the caller learns
        that the name can never work here."""
        if len(raw_name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            return None  # it could not have been created
        inode = self.journal.names.lookup(parent.id, name)
        if inode is None:
            child_path(parent, name)  # ENAMETOOLONG beyond the store's key limit
        return inode

    def dir_and_child(self, parent_id: int, raw_name: bytes) -> tuple[Inode, Inode | None]:
        """directory(parent_id) and child() of it, read with one journal statement, with their errors in
        the same order (the directory's first)."""
        if len(raw_name) > NAME_MAX:
            return (parent := directory(self.journal, parent_id)), self.child(parent, raw_name)
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            return directory(self.journal, parent_id), None  # it could not have been created
        parent_row, inode = self.journal.names.dir_and_child(parent_id, name)
        parent = as_directory(parent_row, parent_id)
        if inode is None:
            child_path(parent, name)  # ENAMETOOLONG beyond the store's key limit
        return parent, inode

    def existing_child_of(self, parent_id: int, raw_name: bytes) -> Inode:
        inode = self.dir_and_child(parent_id, raw_name)[1]
        if inode is None:
            raise FsError(errno.ENOENT, f"no entry {raw_name!r}")
        return inode

    def _dir_and_new_name(self, parent_id: int, raw_name: bytes) -> tuple[Inode, str, Inode | None]:
        """The directory, the decoded name and what holds the name now (None: it is free), read with one
        journal statement; a missing directory is the first error, a name that cannot be one the next."""
        try:
            name = decode_name(raw_name)
        except FsError:
            directory(self.journal, parent_id)
            raise
        parent_row, found = self.journal.names.dir_and_child(parent_id, name)
        return as_directory(parent_row, parent_id), name, found

    def check_new_entry(self, parent_id: int, raw_name: bytes) -> tuple[Inode, str]:
        parent, name, found = self._dir_and_new_name(parent_id, raw_name)
        child_path(parent, name)
        if found is not None:
            raise FsError(errno.EEXIST, f"{name!r} exists")
        return parent, name

    def vanished(self, inode: Inode) -> None:
        """Someone deleted this entry's object from the shared store: it goes here too (open handles and
        the kernel's references keep the inode until they are let go, as after an unlink)."""
        with self.journal.transaction():
            self.journal.names.detach(inode._replace(remote_key=None))
        self._references.maybe_purge(inode.id)

    def mkdir(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        parent, name = self.check_new_entry(parent_id, raw_name)
        with self.journal.transaction():
            inode = self.journal.names.create_inode(
                parent, name, DIR, stat.S_IFDIR | (mode & 0o7777), uid, gid, closed_at=time.time()
            )
        self._lister.mark_listed(inode.id)
        self._references.remember(inode.id)
        self._notify_drain()
        return attr_of(self.journal, self.cache, inode)

    def symlink(self, parent_id: int, raw_name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        parent, name = self.check_new_entry(parent_id, raw_name)
        try:
            target_text = target.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError(errno.EINVAL, "symlink target is not UTF-8") from None
        with self.journal.transaction():
            inode = self.journal.names.create_inode(
                parent, name, SYMLINK, stat.S_IFLNK | 0o777, uid, gid, target=target_text, closed_at=time.time()
            )
        self._references.remember(inode.id)
        self._notify_drain()
        return attr_of(self.journal, self.cache, inode)

    def readlink(self, inode_id: int) -> bytes:
        inode = existing(self.journal, inode_id)
        if inode.kind != SYMLINK or inode.target is None:
            raise FsError(errno.EINVAL, "not a symlink")
        return inode.target.encode()

    def link(self) -> None:
        raise FsError(errno.EPERM, "hard links are not supported")

    def unlink(self, parent_id: int, raw_name: bytes) -> None:
        inode = self.existing_child_of(parent_id, raw_name)
        if inode.kind == DIR:
            raise FsError(errno.EISDIR, f"{inode.path!r} is a directory")
        self._remove(inode)

    def rmdir(self, parent_id: int, raw_name: bytes) -> None:
        inode = self.existing_child_of(parent_id, raw_name)
        if inode.kind != DIR:
            raise FsError(errno.ENOTDIR, f"{inode.path!r} is not a directory")
        if self.journal.names.has_children(inode.id):
            raise FsError(errno.ENOTEMPTY, f"{inode.path!r} is not empty")
        self._remove(inode)

    def _remove(self, inode: Inode) -> None:
        with self.journal.transaction():
            self.journal.names.detach(inode)
            if inode.kind == DIR:
                self.journal.names.forget_folder(inode.path, inode.remote_key)
        self._references.maybe_purge(inode.id)
        self._notify_drain()

    def rename_entries(self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes
                       ) -> RenameEntries:
        """What a rename reads, in two journal statements (or the error it fails with)."""
        old_parent, source = self.dir_and_child(old_parent_id, raw_old)
        if source is None:
            raise FsError(errno.ENOENT, f"no entry {raw_old!r}")
        if new_parent_id == old_parent_id:
            new_name = decode_name(raw_new)
            new_parent = old_parent
            target = self.journal.names.lookup(new_parent_id, new_name)
        else:
            new_parent, new_name, target = self._dir_and_new_name(new_parent_id, raw_new)
        child_path(new_parent, new_name)
        return RenameEntries(old_parent, source, new_parent, new_name, target)

    def rename(
        self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes, flags: int,
        entries: RenameEntries | None = None,
    ) -> Moved | None:
        """Returns what moved (for cross-node ordering), None if nothing did (a rename onto itself).
        `entries`: what rename_entries() returned for these names, read since the last await (the
        journal cannot have changed since), else they are read here."""
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        if entries is None:
            entries = self.rename_entries(old_parent_id, raw_old, new_parent_id, raw_new)
        _, source, new_parent, new_name, target = entries
        if target is not None and target.id == source.id:
            return None
        if target is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST, f"{target.path!r} exists")
        if source.kind == DIR and self.journal.names.is_ancestor(source.id, new_parent_id):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if source.kind == DIR and source.path is not None:
            # Moving a tree deeper lengthens every path in it; none may outgrow what a store key holds.
            new_path_bytes = len(child_path(new_parent, new_name).encode())
            growth = new_path_bytes - len(source.path.encode())
            if self.journal.names.longest_path_under(source.path) + growth > PATH_MAX_BYTES:
                raise FsError(errno.ENAMETOOLONG, f"a path below {source.path!r} would exceed {PATH_MAX_BYTES} bytes")
        if target is not None:
            if target.kind == DIR and source.kind != DIR:
                raise FsError(errno.EISDIR, f"{target.path!r} is a directory")
            if target.kind != DIR and source.kind == DIR:
                raise FsError(errno.ENOTDIR, f"{target.path!r} is not a directory")
            if target.kind == DIR and self.journal.names.has_children(target.id):
                raise FsError(errno.ENOTEMPTY, f"{target.path!r} is not empty")
        # One transaction: a crash leaves either the old or the new namespace, never a mix. A file moved to
        # a free name is one statement, which is a transaction of its own.
        if target is None and source.kind != DIR:
            self.journal.names.move(source, new_parent, new_name)
        else:
            with self.journal.transaction():
                if target is not None:
                    self.journal.names.detach(target)
                self.journal.names.move(source, new_parent, new_name)
        if target is not None:
            self._references.maybe_purge(target.id)
        self._notify_drain()
        return Moved(source.id, child_path(new_parent, new_name), source.kind == DIR)
