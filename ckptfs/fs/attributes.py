"""Attributes of an inode and of the filesystem: getattr, setattr (mode, owner, times, and truncate, which
changes content), the read-only ckptfs xattrs (a file's state, why the drain parked it), and statfs (the
cache budget as the filesystem's size)."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable

from ckptfs.cache.directory import CacheDir
from ckptfs.errors import FsError
from ckptfs.fs.changes import Changes
from ckptfs.fs.data_path import DataPath
from ckptfs.fs.inodes import attr_of, existing
from ckptfs.fs.interface import Attr, SetAttrs, StatFs
from ckptfs.fs.namespace import NAME_MAX
from ckptfs.journal import DIR, FILE, REMOTE, Journal

STATE_XATTR = b"user.ckptfs.state"
# Present while the drain has parked a job of the file after it failed unexpectedly again and again: why.
ERROR_XATTR = b"user.ckptfs.error"


class Attributes:
    def __init__(self, journal: Journal, cache: CacheDir, data_path: DataPath, changes: Changes,
                 notify_drain: Callable[[], None], failure_of: Callable[[int], str | None]) -> None:
        self.journal = journal
        self.cache = cache
        self._data_path = data_path
        self._changes = changes
        self._notify_drain = notify_drain
        # Why the drain parked the inode's upload, move or metadata update (None: it did not).
        self._failure_of = failure_of

    def getattr(self, inode_id: int) -> Attr:
        return attr_of(self.journal, self.cache, existing(self.journal, inode_id))

    async def setattr(self, inode_id: int, changes: SetAttrs, fh: int | None) -> Attr:
        inode = existing(self.journal, inode_id)
        now = time.time_ns()
        if changes.size is not None:
            if inode.kind != FILE:
                raise FsError(errno.EISDIR if inode.kind == DIR else errno.EINVAL, "not a regular file")
            await self._data_path.make_local(inode, keep_content=changes.size > 0)
            try:
                if 0 < changes.size < self.cache.file(inode_id).sealed:
                    raise FsError(errno.EIO, "the start of this file was already uploaded to make room in the"
                                             " cache (a spill): it can be truncated to 0 or beyond that part only")
                self._changes.begin_change(inode_id)
                # Growing a file by truncate writes nothing: the filesystem under the cache stores a hole, and
                # the budget charges none of it (cache.resize). Writes into it are charged as they come. A
                # size the cache filesystem cannot hold fails here at once (EFBIG).
                try:
                    os.truncate(self.cache.data_path(inode_id), changes.size)
                except OSError as exc:
                    raise FsError(exc.errno or errno.EIO, f"truncate: {exc.strerror}") from None
                self.cache.resize(inode_id, changes.size)
            finally:
                # Also when it failed: a change begun and never ended would look open for writing for ever
                # (never uploaded; a flush waiting for it).
                self._changes.end_change_if_unopened(inode_id)
        columns: dict[str, object] = {}
        if changes.mode is not None:
            columns["mode"] = (inode.mode & ~0o7777) | (changes.mode & 0o7777)
        if changes.uid is not None:
            columns["uid"] = changes.uid
        if changes.gid is not None:
            columns["gid"] = changes.gid
        if (changes.uid is not None or changes.gid is not None) and changes.mode is None and inode.kind == FILE:
            # A change of owner drops setuid and setgid (the kernel leaves that to us: see mount/adapter.py).
            columns["mode"] = inode.mode & ~(stat.S_ISUID | stat.S_ISGID)
        if changes.mtime_ns is not None or changes.atime_ns is not None:
            current = attr_of(self.journal, self.cache, existing(self.journal, inode_id))
            mtime = changes.mtime_ns if changes.mtime_ns is not None else current.mtime_ns
            atime = changes.atime_ns if changes.atime_ns is not None else current.atime_ns
            columns["mtime_ns"] = mtime
            if inode.kind == FILE and existing(self.journal, inode_id).state != REMOTE:
                try:
                    os.utime(self.cache.data_path(inode_id), ns=(atime, mtime))
                except OSError as exc:
                    raise FsError(exc.errno or errno.EIO, f"utime of cache file: {exc.strerror}") from None
            else:
                # No cache file to keep it: the journal does (both times, so that setting one keeps the other).
                columns["atime_ns"] = atime
        if columns or changes.size is not None:
            columns["ctime_ns"] = now
            with self.journal.transaction():
                self.journal.names.set_attrs(inode_id, **columns)
                if "mode" in columns or changes.mtime_ns is not None:
                    # Mode and mtime travel with the object: an uploaded one needs its metadata rewritten.
                    self.journal.work.mark_meta_dirty(inode_id)
            self._notify_drain()
        return attr_of(self.journal, self.cache, existing(self.journal, inode_id))

    def statfs(self) -> StatFs:
        """The cache budget as the filesystem's size: `df` on the mount shows how much more can be
        written before writes wait for the drain (clean files count as free: they can be evicted)."""
        try:
            space = self.cache.space()
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"statvfs of the cache dir: {exc.strerror}") from None
        block = space.block_size
        limit = self.cache.limit
        if limit == float("inf"):
            return StatFs(block, space.total_bytes // block, space.free_bytes // block,
                          space.total_files, space.free_files, NAME_MAX)
        evictable = self.journal.copies.clean_bytes()
        free = max(0, int(limit) - self.cache.used + evictable)
        return StatFs(block, int(limit) // block, min(free, int(limit)) // block,
                      space.total_files, space.free_files, NAME_MAX)

    def getxattr(self, inode_id: int, name: bytes) -> bytes:
        if name == STATE_XATTR:
            return existing(self.journal, inode_id).state.encode()
        if name == ERROR_XATTR:
            existing(self.journal, inode_id)
            failure = self._failure_of(inode_id)
            if failure is not None:
                return failure.encode()
        # The kernel asks for security.capability before every write(2): answer without SQL.
        raise FsError(errno.ENODATA, "no such attribute")

    def listxattr(self, inode_id: int) -> list[bytes]:
        existing(self.journal, inode_id)
        return [STATE_XATTR] if self._failure_of(inode_id) is None else [STATE_XATTR, ERROR_XATTR]

    def setxattr(self, inode_id: int, name: bytes) -> None:
        existing(self.journal, inode_id)
        if name in (STATE_XATTR, ERROR_XATTR):
            raise FsError(errno.EPERM, f"{name.decode()} is read-only")
        raise FsError(errno.ENOTSUP, "extended attributes are not stored")
