"""Filesystem: the POSIX semantics of the mount as one object, which mount/adapter.py and the daemon call. It
owns no state of its own: it wires the modules of this package, each the owner of one concern, and hands
every request to its owner (write and read without a hop of their own: they are the hot path)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import trio

from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor
from ckptfs.fs.announce import Announcements
from ckptfs.fs.attributes import Attributes
from ckptfs.fs.changes import Changes
from ckptfs.fs.data_path import DataPath
from ckptfs.fs.handle_table import HandleTable, OpenHandle
from ckptfs.fs.interface import (
    Announcer,
    Attr,
    BackingFiles,
    DirEntry,
    FetchFn,
    Lister,
    Moved,
    ReadStreams,
    SetAttrs,
    StatFs,
)
from ckptfs.fs.kernel_cache import KernelCache
from ckptfs.fs.listing import Listing, NothingToList
from ckptfs.fs.namespace import Namespace, RenameEntries
from ckptfs.fs.open_files import OpenFiles
from ckptfs.fs.references import References
from ckptfs.fs.requests import KernelRequests
from ckptfs.fs.takeover import Takeover
from ckptfs.journal import Inode, Journal


class Filesystem:
    # The data path's own methods (bound in __init__): a write costs what it did when they lived here.
    write: Callable[[int, int, bytes], int]
    read: Callable[[int, int, int], Awaitable[bytes]]

    def __init__(
        self,
        journal: Journal,
        cache: CacheDir,
        fetch: FetchFn,
        notify_drain: Callable[[], None] = lambda: None,
        evictor: Evictor | None = None,
        lister: Lister | None = None,
        streams: ReadStreams[Any] | None = None,
        wait_uploaded: Callable[[str], Awaitable[None]] | None = None,
        discard_upload: Callable[[str], None] = lambda state: None,
        failure_of: Callable[[int], str | None] = lambda inode_id: None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.streams = streams
        self._open_files = open_files = OpenFiles()
        self.handles = open_files.handles
        self.evictor = evictor if evictor is not None else Evictor(journal, cache, in_use=open_files.in_use)
        self.lister: Lister = lister if lister is not None else NothingToList()
        self._changes = Changes(journal, cache, notify_drain, open_files)
        self._kernel_cache = KernelCache(cache, open_files.handles)
        self._references = References(journal, cache, open_files, self._changes, self.evictor, streams,
                                      discard_upload)
        self._namespace = Namespace(journal, cache, self._references, self.lister, notify_drain)
        self._listing = Listing(journal, cache, self.lister, self._namespace)
        self._takeover = Takeover(journal, cache, streams, open_files, self._kernel_cache, self._changes,
                                  self._references)
        self._announcements = Announcements(journal, open_files.handles)
        self._data_path = DataPath(
            journal, cache, fetch, notify_drain, self.evictor, streams, wait_uploaded, open_files, self._changes,
            self._kernel_cache, self._references, self._namespace, self._takeover, self._announcements,
        )
        self._attributes = Attributes(journal, cache, self._data_path, self._changes, notify_drain, failure_of)
        # What the FUSE adapter calls for the requests that change names or open files.
        self.requests = KernelRequests(self._namespace, self._listing, self._data_path, self._attributes,
                                       open_files, self._takeover, self._references, self._announcements)
        self.write = self._data_path.write
        self.read = self._data_path.read

    # -- set by the daemon once the mount is up ------------------------------------------------------------

    @property
    def handle_table(self) -> HandleTable | None:
        """Where open handles are recorded for a daemon that takes the mount over (None: nowhere)."""
        return self._open_files.handle_table

    @handle_table.setter
    def handle_table(self, table: HandleTable | None) -> None:
        self._open_files.handle_table = table

    @property
    def backing(self) -> BackingFiles | None:
        """The kernel's registry of backing files: FUSE passthrough (None: off)."""
        return self._kernel_cache.backing

    @backing.setter
    def backing(self, backing: BackingFiles | None) -> None:
        self._kernel_cache.backing = backing

    @property
    def listing(self) -> Listing:
        """Directories as the store lists them (its cross-node wait before a directory's rename or rmdir)."""
        return self._listing

    @property
    def announcer(self) -> Announcer | None:
        """Cross-node ordering (None: off)."""
        return self._announcements.announcer

    @announcer.setter
    def announcer(self, announcer: Announcer | None) -> None:
        self._announcements.announcer = announcer

    @property
    def on_fsync(self) -> Callable[[int], None]:
        """Called with the inode id after each fsync of a file (gateway mode: its upload is due now)."""
        return self._data_path.on_fsync

    @on_fsync.setter
    def on_fsync(self, hook: Callable[[int], None]) -> None:
        self._data_path.on_fsync = hook

    # -- counters for status and metrics --------------------------------------------------------------------

    @property
    def passthrough_opens(self) -> int:
        return self._kernel_cache.passthrough_opens

    @property
    def passthrough_errors(self) -> int:
        return self._kernel_cache.passthrough_errors

    @property
    def cache_hits(self) -> int:
        return self._data_path.cache_hits

    @property
    def cache_misses(self) -> int:
        return self._data_path.cache_misses

    def passthrough_files(self) -> int:
        return self._kernel_cache.passthrough_files()

    # -- open_files.py ---------------------------------------------------------------------------------------

    def in_use(self, inode_id: int) -> bool:
        return self._open_files.in_use(inode_id)

    def inode_of(self, fh: int) -> int:
        return self._open_files.get(fh).inode_id

    def open_writers(self) -> int:
        return self._open_files.open_writers()

    # -- namespace.py ---------------------------------------------------------------------------------------

    def lookup(self, parent_id: int, raw_name: bytes) -> Attr:
        return self._namespace.lookup(parent_id, raw_name)

    def find(self, parent_id: int, raw_name: bytes) -> Attr | None:
        return self._namespace.find(parent_id, raw_name)

    def mkdir(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        return self._namespace.mkdir(parent_id, raw_name, mode, uid, gid)

    def symlink(self, parent_id: int, raw_name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        return self._namespace.symlink(parent_id, raw_name, target, uid, gid)

    def readlink(self, inode_id: int) -> bytes:
        return self._namespace.readlink(inode_id)

    def link(self) -> None:
        self._namespace.link()

    def unlink(self, parent_id: int, raw_name: bytes) -> None:
        self._namespace.unlink(parent_id, raw_name)

    def rmdir(self, parent_id: int, raw_name: bytes) -> None:
        self._namespace.rmdir(parent_id, raw_name)

    def rename(
        self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes, flags: int,
        entries: RenameEntries | None = None,
    ) -> Moved | None:
        return self._namespace.rename(old_parent_id, raw_old, new_parent_id, raw_new, flags, entries)

    def vanished(self, inode: Inode) -> None:
        self._namespace.vanished(inode)

    # -- listing.py -----------------------------------------------------------------------------------------

    async def ensure_listed(self, inode_id: int) -> None:
        await self._listing.ensure_listed(inode_id)

    def fresh_for(self, inode_id: int) -> float:
        """How long the kernel may keep the names of this directory: while its listing is fresh."""
        return self.lister.fresh_for(inode_id)

    async def prepare_rename(self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes
                             ) -> RenameEntries | None:
        """Lists what the rename needs listed; returns what rename() may take as `entries` (see there)."""
        return await self._listing.prepare_rename(old_parent_id, raw_old, new_parent_id, raw_new)

    async def prepare_rmdir(self, parent_id: int, raw_name: bytes) -> None:
        await self._listing.prepare_rmdir(parent_id, raw_name)

    def opendir(self, inode_id: int) -> int:
        return self._listing.opendir(inode_id)

    def readdir(self, inode_id: int, after_id: int, limit: int = 1000) -> Iterator[DirEntry]:
        return self._listing.readdir(inode_id, after_id, limit)

    # -- references.py --------------------------------------------------------------------------------------

    def remember_many(self, inode_ids: Sequence[int]) -> None:
        """The kernel now holds a reference to each of these inodes (a readdirplus reply reported them)."""
        self._references.remember_many(inode_ids)

    def forget(self, inode_id: int, count: int) -> None:
        self._references.forget(inode_id, count)

    def forget_many(self, forgotten: Sequence[tuple[int, int]]) -> None:
        """The kernel gave back these (inode, count) references at once."""
        self._references.forget_many(forgotten)

    # -- attributes.py --------------------------------------------------------------------------------------

    def getattr(self, inode_id: int) -> Attr:
        return self._attributes.getattr(inode_id)

    async def setattr(self, inode_id: int, changes: SetAttrs, fh: int | None) -> Attr:
        return await self._attributes.setattr(inode_id, changes, fh)

    def statfs(self) -> StatFs:
        return self._attributes.statfs()

    def getxattr(self, inode_id: int, name: bytes) -> bytes:
        return self._attributes.getxattr(inode_id, name)

    def listxattr(self, inode_id: int) -> list[bytes]:
        return self._attributes.listxattr(inode_id)

    def setxattr(self, inode_id: int, name: bytes) -> None:
        self._attributes.setxattr(inode_id, name)

    # -- data_path.py (read and write: bound in __init__) ---------------------------------------------------

    def create(self, parent_id: int, raw_name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[int, Attr]:
        return self._data_path.create(parent_id, raw_name, mode, flags, uid, gid)

    def mknod(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        return self._data_path.mknod(parent_id, raw_name, mode, uid, gid)

    async def open(self, inode_id: int, flags: int) -> int:
        return await self._data_path.open(inode_id, flags)

    async def wait_for_room(self, needed: int = 0) -> None:
        await self._data_path.wait_for_room(needed)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        await self._data_path.fallocate(fh, mode, offset, length)

    def release(self, fh: int) -> None:
        self._data_path.release(fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._data_path.fsync(fh, datasync)

    def fsyncdir(self) -> None:
        self.journal.sync()

    def stop_writes(self) -> None:
        self._data_path.stop_writes()

    def close_all(self) -> None:
        self._data_path.close_all()

    # -- kernel_cache.py ------------------------------------------------------------------------------------

    def caching(self, fh: int) -> tuple[bool, bool]:
        return self._kernel_cache.caching(fh)

    def backing_of(self, fh: int) -> int:
        return self._kernel_cache.backing_of(fh)

    # -- changes.py -----------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self._changes.run(task_status=task_status)

    # -- takeover.py ----------------------------------------------------------------------------------------

    def handed_out(self, fh: int, request: int = 0) -> None:
        self._takeover.handed_out(fh, request)

    def unanswered(self, request: int) -> int | None:
        return self._takeover.unanswered(request)

    def restore_handles(self, records: list[OpenHandle]) -> int:
        return self._takeover.restore_handles(records)

    def restored_writers(self) -> list[tuple[int, str]]:
        return self._takeover.restored_writers()

    # -- announce.py ----------------------------------------------------------------------------------------

    async def announce_writer(self, fh: int) -> None:
        await self._announcements.announce_writer(fh)

    async def announce(self, inode_id: int | None, path: str | None = None, directory: bool = False) -> None:
        await self._announcements.announce(inode_id, path, directory)
