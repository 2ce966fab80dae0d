"""POSIX semantics of the mount, testable without a kernel.

Owns: name validation, the namespace operations (create, mkdir, rename, unlink, ...), open handles and
their file descriptors on cache files, lookup counts, and the rules for when a file becomes dirty and when
it is handed to the drain. It changes persistent state only through the journal and reads/writes file data
only through cache files (a read-only open of a remote file reads its partial file, whose chunks the
fetcher brings in as reads need them: `read` waits for them). It never talks to an object store (the
fetcher does that for it) and never imports pyfuse3: fuse_ops.py translates its results and FsError into FUSE replies.

The write path (`write`) is the hot path: one dict lookup, one budget compare, one pwrite, no SQL. The
journal learns that a file changed at the first write of each open handle (`_first_write`), and its final
size at release. A write that finds the cache over its budget raises RoomNeeded before it writes anything;
the caller awaits wait_for_room() and writes again (back-pressure, see evict.py).
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import trio

from ckptfs.cache import CacheDir, CacheFile
from ckptfs.errors import BackendError, FsError, errno_for_backend_error
from ckptfs.evict import Evictor
from ckptfs.handles import HandleTable, OpenHandle
from ckptfs.journal import CLEAN, DIR, FILE, REMOTE, ROOT_ID, SYMLINK, Inode, Journal, JournalFull

log = logging.getLogger(__name__)

NAME_MAX = 255
# S3 keys are at most 1024 bytes; leave room for a prefix.
PATH_MAX_BYTES = 1000
STATE_XATTR = b"user.ckptfs.state"
# Present while the drain has parked a job of the file after it failed unexpectedly again and again: why.
ERROR_XATTR = b"user.ckptfs.error"
CLOSE_RETRY_INTERVAL = 1.0  # seconds between attempts to record closes a full journal refused
# Stores keep their own bookkeeping (temp files, upload markers) under names with this prefix.
RESERVED_PREFIX = b".ckptfs-tmp."
# A handle that can write gets passthrough only while the cache budget has at least this much room, and
# PASSTHROUGH_ROOM_SHARE of the budget: its writes no longer wait for room (see Filesystem._passthrough).
PASSTHROUGH_ROOM = 1 << 30
PASSTHROUGH_ROOM_SHARE = 0.1
# FUSE_UNIQUE_RESEND: the high bit of a request id marks a request the kernel sent again after a takeover
RESENT = 1 << 63
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Attr(NamedTuple):
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


class DirEntry(NamedTuple):
    name: bytes
    attr: Attr
    next_id: int


class StatFs(NamedTuple):
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int


class RoomNeeded(Exception):
    """The cache is over its budget: await Filesystem.wait_for_room(), then repeat the write."""


# A read of a file opened while it was remote (streamed from the store) leaves the bytes it served in the
# kernel's page cache of the mount's file; the cache file's own pages of them are a second copy, as large
# as the checkpoint. Those more than SHED_LAG behind the reader are advised away every SHED_STEP: the first
# advice starts their writeback (dirty pages are never dropped), the next one, SHED_LAG later, drops them.
SHED_LAG = 32 << 20
SHED_STEP = 8 << 20


def _shed_served_pages(handle: OpenFile, offset: int, served_to: int) -> None:
    if offset < handle.shed_to:
        # A jump back (torch.load reads a zip's directory at the end first): shed from here on.
        handle.shed_to = offset
        return
    mark = served_to - SHED_LAG
    if mark - handle.shed_to >= SHED_STEP:
        start = max(0, handle.shed_to - SHED_LAG)
        os.posix_fadvise(handle.fd, start, mark - start, os.POSIX_FADV_DONTNEED)
        handle.shed_to = mark


class OpenFile:
    """One open() of a file: the cache file descriptor, its space accounting entry, whether this handle
    has dirtied the file, whether it bypasses the kernel's page cache (write-only handles do: see
    Filesystem.caching), and for a read-only open of a remote file, its reader of the partial file."""

    __slots__ = ("backing", "direct", "dirtied", "fd", "inode_id", "local", "reader", "shed_to", "writable")

    def __init__(
        self, inode_id: int, fd: int, local: CacheFile, writable: bool, dirtied: bool, direct: bool,
        reader: Reader | None = None, backing: int = 0,
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


@dataclass
class SetAttrs:
    """The fields of a setattr request that are to change (None = leave alone)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


FetchFn = Callable[[Inode], Awaitable[None]]


class Reader(Protocol):
    """One handle's reader of a remote file's partial file (fetch.Reader)."""

    @property
    def path(self) -> str: ...

    @property
    def complete(self) -> bool: ...


R = TypeVar("R", bound=Reader)


class ReadStreams(Protocol[R]):
    """Streaming reads of remote files (fetch.Fetcher): partial files filled as reads need them."""

    def open_reader(self, inode: Inode) -> R: ...

    def close_reader(self, reader: R) -> None: ...

    async def wait_readable(self, reader: R, offset: int, size: int) -> None: ...

    def discard(self, inode_id: int) -> None: ...


class BackingFiles(Protocol):
    """The kernel's registry of backing files for FUSE passthrough (fuse_ops.py implements it)."""

    def open(self, fd: int) -> int:
        """Register the open file `fd` with the kernel; its backing id for an open or create reply."""

    def close(self, backing_id: int) -> None: ...


class Lister(Protocol):
    """Reads the store's namespace into the journal, a directory at a time (recovery.DirLister)."""

    async def ensure(self, inode_id: int, *, required: bool = False) -> None: ...

    def mark_listed(self, inode_id: int) -> None: ...


class _NothingToList:
    async def ensure(self, inode_id: int, *, required: bool = False) -> None:
        return None

    def mark_listed(self, inode_id: int) -> None:
        return None


def _decode_name(raw: bytes) -> str:
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


class Moved(NamedTuple):
    inode_id: int
    path: str
    directory: bool


class Announcer(Protocol):
    """Makes this node's pending work known to the other nodes before the request returns (nodes.py)."""

    async def cover(self, inode_id: int, path: str, *, directory: bool = False, writer: bool = False) -> None: ...

    def released(self, inode_id: int) -> None: ...


class Filesystem:
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
        self._fetch = fetch
        # Streaming reads of remote files; None: an open fetches the whole file first.
        self.streams = streams
        self._notify_drain = notify_drain
        # Returns once the file at a path is in the store (the drain's wait_durable); None: never waits.
        self._wait_uploaded = wait_uploaded
        # Takes the journaled upload_state of a purged file: its staged upload or spill is to be aborted.
        self._discard_upload = discard_upload
        # Why the drain parked the inode's upload, move or metadata update (None: it did not).
        self._failure_of = failure_of
        self.evictor = evictor if evictor is not None else Evictor(journal, cache, in_use=self.in_use)
        self.lister: Lister = lister if lister is not None else _NothingToList()
        self.handles: dict[int, OpenFile] = {}
        # Handle numbers: the lowest free one first, so the handle table (handles.py) stays small.
        self._next_fh = 1
        self._free_fhs: list[int] = []
        # Where open handles are recorded for a daemon that takes the mount over (None: nowhere).
        self.handle_table: HandleTable | None = None
        self._open_count: dict[int, int] = {}
        self._writer_count: dict[int, int] = {}
        self._lookup_count: dict[int, int] = {}
        # After a takeover the kernel holds references this daemon never counted: an unlinked inode is
        # purged only once the kernel forgot it (it sends FORGET when it evicts an inode, with its full
        # count), `_counted` holds those.
        self._refs_inherited = False
        self._counted: set[int] = set()
        # Restored handles by the id of the open or create request they answered (see unanswered)
        self._unanswered: dict[int, int] = {}
        # Inodes written since their last close by any handle: their close queues an upload.
        self._changed: set[int] = set()
        # Closes the journal could not record (the cache filesystem was full), with whether the content
        # changed; retried by run() until it can. Meanwhile the drain takes such a file for one still open.
        self._unrecorded_closes: dict[int, bool] = {}
        self._close_retry = trio.Event()
        # Inodes written through page-cache-bypassing handles since the kernel's cached pages were dropped.
        self._uncached_writes: set[int] = set()
        # FUSE passthrough (None: off). All passthrough handles of an inode share one backing id, the
        # kernel's rule, registered at the first and closed after the last: inode -> [backing id, handles].
        self.backing: BackingFiles | None = None
        self._backing_ids: dict[int, list[int]] = {}
        # Handles per inode that go through the kernel's page cache of the FUSE file (neither direct nor
        # passthrough): while there are any, the kernel refuses passthrough opens of the inode (ETXTBSY).
        self._cached_opens: dict[int, int] = {}
        self.passthrough_opens = 0  # handles opened with passthrough since start
        self.passthrough_errors = 0  # registrations the kernel refused (the open then goes through us)
        self.writes_allowed = True
        self.cache_hits = 0  # opens served from local data
        self.cache_misses = 0  # opens that downloaded the file
        self.uid = os.getuid()
        self.gid = os.getgid()
        # Cross-node ordering (None: off): opens for writing, new directories and symlinks and renames are
        # announced before they return; handle -> path of a writer to announce (announce_writer).
        self.announcer: Announcer | None = None
        self._to_announce: dict[int, str] = {}

    # -- helpers ---------------------------------------------------------------------------------------

    def _get(self, inode_id: int) -> Inode:
        inode = self.journal.get(inode_id)
        if inode is None:
            raise FsError(errno.ENOENT, f"inode {inode_id} does not exist")
        return inode

    def _dir(self, inode_id: int) -> Inode:
        inode = self._get(inode_id)
        if inode.kind != DIR:
            raise FsError(errno.ENOTDIR, f"{inode.path!r} is not a directory")
        if inode.path is None:
            raise FsError(errno.ENOENT, "directory was removed")
        return inode

    def _child_path(self, parent: Inode, name: str) -> str:
        path = f"{parent.path}/{name}" if parent.path else name
        if len(path.encode()) > PATH_MAX_BYTES:
            raise FsError(errno.ENAMETOOLONG, f"path longer than {PATH_MAX_BYTES} bytes")
        return path

    def attr(self, inode: Inode) -> Attr:
        if inode.kind == FILE and inode.state != REMOTE:
            try:
                st = os.stat(self.cache.data_path(inode.id))
            except FileNotFoundError:
                log.error("cache file of %s (inode %d) is missing", inode.path, inode.id)
                raise FsError(errno.EIO, "cache file missing") from None
            size, blocks, atime, mtime = st.st_size, st.st_blocks, st.st_atime_ns, st.st_mtime_ns
            # Writes change the cache file's ctime; namespace and attribute changes the journal's.
            ctime = max(st.st_ctime_ns, inode.ctime_ns)
        else:
            size = len(inode.target.encode()) if inode.target is not None else inode.size
            blocks = (size + 511) // 512
            atime = mtime = inode.mtime_ns
            ctime = inode.ctime_ns
        nlink = 0 if inode.path is None else (2 if inode.kind == DIR else 1)
        return Attr(inode.id, inode.mode, nlink, inode.uid, inode.gid, size, blocks, atime, mtime, ctime)

    def _remember(self, inode_id: int) -> None:
        self._lookup_count[inode_id] = self._lookup_count.get(inode_id, 0) + 1

    def _maybe_purge(self, inode_id: int) -> None:
        """Drop an unlinked inode once neither the kernel nor an open handle refers to it."""
        if self._lookup_count.get(inode_id, 0) or self._open_count.get(inode_id, 0):
            return
        if self._refs_inherited and inode_id not in self._counted:
            return
        inode = self.journal.get(inode_id)
        if inode is None or inode.parent is not None or inode_id == ROOT_ID:
            return
        with self.journal.transaction():
            self.journal.purge(inode_id)
        self._counted.discard(inode_id)
        if inode.upload_state is not None:
            self._discard_upload(inode.upload_state)
        self._changed.discard(inode_id)
        if inode.kind == FILE:
            self.cache.remove_data(inode_id)
            self.evictor.forget(inode_id)
            if self.streams is not None:
                self.streams.discard(inode_id)

    # -- namespace -----------------------------------------------------------------------------------

    def lookup(self, parent_id: int, raw_name: bytes) -> Attr:
        parent = self._dir(parent_id)
        if raw_name == b".":
            inode = parent
        elif raw_name == b"..":
            inode = self._get(parent.parent or ROOT_ID)
        else:
            inode = self._existing_child(parent, raw_name)
        self._remember(inode.id)
        return self.attr(inode)

    async def ensure_listed(self, inode_id: int) -> None:
        """Before a lookup in or a readdir of a directory: the store's entries of it are in the journal."""
        await self.lister.ensure(inode_id)

    async def _list_required(self, inode_id: int) -> None:
        try:
            await self.lister.ensure(inode_id, required=True)
        except BackendError as exc:
            raise FsError(errno_for_backend_error(exc), f"cannot list the store: {exc}") from None

    async def _list_tree(self, inode_id: int) -> None:
        """Every directory at and below `inode_id` is listed from the store, so the journal knows the whole
        subtree. Re-read after each await: entries may come and go while a listing runs."""
        pending = [inode_id]
        while pending:
            directory = pending.pop()
            await self._list_required(directory)
            pending.extend(c.id for c in self.journal.all_children(directory) if c.kind == DIR)

    async def prepare_rename(self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes) -> None:
        """Before rename(): the journal knows everything the rename moves or replaces. Listing is lazy, so a
        directory this node never looked into has no entries here yet; renamed as it is, its objects would
        stay at the old keys and the new name would be empty (a rename in the store is a move of every
        object, each journaled). So its whole subtree is listed first, and a directory it replaces is
        listed too (rename over a non-empty directory is ENOTEMPTY). A big remote tree makes the rename
        slower, never wrong; a store that cannot be listed fails the rename instead of losing entries."""
        await self._list_required(old_parent_id)
        await self._list_required(new_parent_id)
        source = self._maybe_child(old_parent_id, raw_old)
        if source is not None and source.kind == DIR:
            await self._list_tree(source.id)
        target = self._maybe_child(new_parent_id, raw_new)
        if target is not None and target.kind == DIR:
            await self._list_required(target.id)

    async def prepare_rmdir(self, parent_id: int, raw_name: bytes) -> None:
        """Before rmdir(): the directory is listed, so one with objects only in the store is ENOTEMPTY."""
        await self._list_required(parent_id)
        inode = self._maybe_child(parent_id, raw_name)
        if inode is not None and inode.kind == DIR:
            await self._list_required(inode.id)

    def _maybe_child(self, parent_id: int, raw_name: bytes) -> Inode | None:
        try:
            return self._existing_child(self._dir(parent_id), raw_name)
        except FsError:
            return None  # rename()/rmdir() report it

    def vanished(self, inode: Inode) -> None:
        """Someone deleted this entry's object from the shared store: it goes here too (open handles and
        the kernel's references keep the inode until they are let go, as after an unlink)."""
        with self.journal.transaction():
            self.journal.detach(inode._replace(remote_key=None))
        self._maybe_purge(inode.id)

    def getattr(self, inode_id: int) -> Attr:
        return self.attr(self._get(inode_id))

    def forget(self, inode_id: int, count: int) -> None:
        left = self._lookup_count.get(inode_id, 0) - count
        if left > 0:
            self._lookup_count[inode_id] = left
        else:
            self._lookup_count.pop(inode_id, None)
            if self._refs_inherited:
                self._counted.add(inode_id)
            self._maybe_purge(inode_id)

    def _check_new_entry(self, parent_id: int, raw_name: bytes) -> tuple[Inode, str]:
        parent = self._dir(parent_id)
        name = _decode_name(raw_name)
        self._child_path(parent, name)
        if self.journal.lookup(parent_id, name) is not None:
            raise FsError(errno.EEXIST, f"{name!r} exists")
        return parent, name

    def mkdir(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        parent, name = self._check_new_entry(parent_id, raw_name)
        with self.journal.transaction():
            inode = self.journal.create_inode(
                parent, name, DIR, stat.S_IFDIR | (mode & 0o7777), uid, gid, closed_at=time.time()
            )
        self.lister.mark_listed(inode.id)
        self._remember(inode.id)
        self._notify_drain()
        return self.attr(inode)

    def symlink(self, parent_id: int, raw_name: bytes, target: bytes, uid: int, gid: int) -> Attr:
        parent, name = self._check_new_entry(parent_id, raw_name)
        try:
            target_text = target.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError(errno.EINVAL, "symlink target is not UTF-8") from None
        with self.journal.transaction():
            inode = self.journal.create_inode(
                parent, name, SYMLINK, stat.S_IFLNK | 0o777, uid, gid, target=target_text, closed_at=time.time()
            )
        self._remember(inode.id)
        self._notify_drain()
        return self.attr(inode)

    def readlink(self, inode_id: int) -> bytes:
        inode = self._get(inode_id)
        if inode.kind != SYMLINK or inode.target is None:
            raise FsError(errno.EINVAL, "not a symlink")
        return inode.target.encode()

    def mknod(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """mknod(S_IFREG) makes an empty regular file, as create() + release() would leave it (the kernel
        sends MKNOD for mknod(2) and on some create paths). Devices, FIFOs and sockets get EPERM."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM, "device nodes, FIFOs and sockets cannot be stored in an object store")
        fh, attr = self.create(parent_id, raw_name, mode, os.O_WRONLY, uid, gid)
        self.release(fh)
        return attr

    def link(self) -> None:
        raise FsError(errno.EPERM, "hard links are not supported")

    def unlink(self, parent_id: int, raw_name: bytes) -> None:
        inode = self._existing_child(self._dir(parent_id), raw_name)
        if inode.kind == DIR:
            raise FsError(errno.EISDIR, f"{inode.path!r} is a directory")
        self._remove(inode)

    def rmdir(self, parent_id: int, raw_name: bytes) -> None:
        inode = self._existing_child(self._dir(parent_id), raw_name)
        if inode.kind != DIR:
            raise FsError(errno.ENOTDIR, f"{inode.path!r} is not a directory")
        if self.journal.has_children(inode.id):
            raise FsError(errno.ENOTEMPTY, f"{inode.path!r} is not empty")
        self._remove(inode)

    def _existing_child(self, parent: Inode, raw_name: bytes) -> Inode:
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise FsError(errno.ENOENT, "no such entry") from None  # it could not have been created
        inode = self.journal.lookup(parent.id, name)
        if inode is None:
            raise FsError(errno.ENOENT, f"no entry {name!r}")
        return inode

    def _remove(self, inode: Inode) -> None:
        with self.journal.transaction():
            self.journal.detach(inode)
            if inode.kind == DIR:
                self.journal.forget_folder(inode.path, inode.remote_key)
        self._maybe_purge(inode.id)
        self._notify_drain()

    def rename(
        self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes, flags: int
    ) -> Moved | None:
        """Returns what moved (for cross-node ordering), None if nothing did (a rename onto itself)."""
        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        if flags & ~RENAME_NOREPLACE:
            raise FsError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        source = self._existing_child(self._dir(old_parent_id), raw_old)
        new_parent = self._dir(new_parent_id)
        new_name = _decode_name(raw_new)
        self._child_path(new_parent, new_name)
        target = self.journal.lookup(new_parent_id, new_name)
        if target is not None and target.id == source.id:
            return None
        if target is not None and flags & RENAME_NOREPLACE:
            raise FsError(errno.EEXIST, f"{target.path!r} exists")
        if source.kind == DIR and self.journal.is_ancestor(source.id, new_parent_id):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if source.kind == DIR and source.path is not None:
            # Moving a tree deeper lengthens every path in it; none may outgrow what a store key holds.
            new_path_bytes = len(self._child_path(new_parent, new_name).encode())
            growth = new_path_bytes - len(source.path.encode())
            if self.journal.longest_path_under(source.path) + growth > PATH_MAX_BYTES:
                raise FsError(errno.ENAMETOOLONG, f"a path below {source.path!r} would exceed {PATH_MAX_BYTES} bytes")
        if target is not None:
            if target.kind == DIR and source.kind != DIR:
                raise FsError(errno.EISDIR, f"{target.path!r} is a directory")
            if target.kind != DIR and source.kind == DIR:
                raise FsError(errno.ENOTDIR, f"{target.path!r} is not a directory")
            if target.kind == DIR and self.journal.has_children(target.id):
                raise FsError(errno.ENOTEMPTY, f"{target.path!r} is not empty")
        # One transaction: a crash leaves either the old or the new namespace, never a mix.
        with self.journal.transaction():
            if target is not None:
                self.journal.detach(target)
            self.journal.move(source, new_parent, new_name)
        if target is not None:
            self._maybe_purge(target.id)
        self._notify_drain()
        return Moved(source.id, self._child_path(new_parent, new_name), source.kind == DIR)

    # -- attributes --------------------------------------------------------------------------------

    async def setattr(self, inode_id: int, changes: SetAttrs, fh: int | None) -> Attr:
        inode = self._get(inode_id)
        now = time.time_ns()
        if changes.size is not None:
            if inode.kind != FILE:
                raise FsError(errno.EISDIR if inode.kind == DIR else errno.EINVAL, "not a regular file")
            await self._make_local(inode, keep_content=changes.size > 0)
            try:
                if 0 < changes.size < self.cache.file(inode_id).sealed:
                    raise FsError(errno.EIO, "the start of this file was already uploaded to make room in the"
                                             " cache (a spill): it can be truncated to 0 or beyond that part only")
                self._begin_change(inode_id)
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
                self._end_change_if_unopened(inode_id)
        columns: dict[str, object] = {}
        if changes.mode is not None:
            columns["mode"] = (inode.mode & ~0o7777) | (changes.mode & 0o7777)
        if changes.uid is not None:
            columns["uid"] = changes.uid
        if changes.gid is not None:
            columns["gid"] = changes.gid
        if (changes.uid is not None or changes.gid is not None) and changes.mode is None and inode.kind == FILE:
            # A change of owner drops setuid and setgid (the kernel leaves that to us: see fuse_ops).
            columns["mode"] = inode.mode & ~(stat.S_ISUID | stat.S_ISGID)
        if changes.mtime_ns is not None or changes.atime_ns is not None:
            current = self.attr(self._get(inode_id))
            mtime = changes.mtime_ns if changes.mtime_ns is not None else current.mtime_ns
            atime = changes.atime_ns if changes.atime_ns is not None else current.atime_ns
            columns["mtime_ns"] = mtime
            if inode.kind == FILE and self._get(inode_id).state != REMOTE:
                try:
                    os.utime(self.cache.data_path(inode_id), ns=(atime, mtime))
                except OSError as exc:
                    raise FsError(exc.errno or errno.EIO, f"utime of cache file: {exc.strerror}") from None
        if columns or changes.size is not None:
            columns["ctime_ns"] = now
            with self.journal.transaction():
                self.journal.set_attrs(inode_id, **columns)
                if "mode" in columns or changes.mtime_ns is not None:
                    # Mode and mtime travel with the object: an uploaded one needs its metadata rewritten.
                    self.journal.mark_meta_dirty(inode_id)
            self._notify_drain()
        return self.attr(self._get(inode_id))

    # -- files -----------------------------------------------------------------------------------------

    async def _make_local(self, inode: Inode, *, keep_content: bool) -> None:
        """Give a remote-only file a cache file: fetched, or empty when its content is about to go (then
        the change has begun: see _begin_change)."""
        if inode.state != REMOTE:
            return
        if keep_content:
            await self._fetch(inode)
        else:
            if self.streams is not None:
                self.streams.discard(inode.id)  # its readers keep the old version's partial file
            os.close(self.cache.create_data(inode.id))
            self._begin_change(inode.id, emptied_remote=True)

    def _begin_change(self, inode_id: int, *, emptied_remote: bool = False) -> None:
        """Record, before the first byte changes, that the content is changing (a new version).
        `emptied_remote`: the file was only in the store and now has an empty cache file; that is recorded
        in the same transaction, since an empty file journaled as a clean copy of the object on its own
        would outlive a kill before the change was recorded (found by the crash harness: the mount then
        showed the file empty and the store kept the old bytes)."""
        if inode_id not in self._changed:
            with self.journal.transaction():
                if emptied_remote:
                    self.journal.finish_fetch(inode_id, size=0, mtime_ns=time.time_ns())
                self.journal.mark_dirty(inode_id)
            self._changed.add(inode_id)
            local = self.cache.files.get(inode_id)
            if local is not None:
                local.changes += 1
            # A file being written may grow large enough to be uploaded while it is written: the drain
            # watches files open for writing from now on (writes themselves never notify it).
            self._notify_drain()

    def _end_change_if_unopened(self, inode_id: int) -> None:
        if not self._writer_count.get(inode_id):
            self._closed(inode_id)

    def _closed(self, inode_id: int) -> None:
        """No writer has the file open any more: record its size, and queue it if it changed."""
        changed = inode_id in self._changed
        self._changed.discard(inode_id)
        try:
            self._record_close(inode_id, changed)
        except JournalFull:
            # The kernel never repeats a release: unrecorded, the file would look open for writing for
            # as long as the daemon runs, never uploaded, and a flush would wait for it for ever.
            self._unrecorded_closes[inode_id] = self._unrecorded_closes.get(inode_id, False) or changed
            self._close_retry.set()
            raise

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Record the closes a full cache filesystem kept out of the journal, once it has room again."""
        task_status.started()
        while True:
            await self._close_retry.wait()
            await trio.sleep(CLOSE_RETRY_INTERVAL)
            try:
                self._record_unrecorded_closes()
            except Exception:
                log.exception("cannot record the close of files; retrying")

    def _record_unrecorded_closes(self) -> None:
        recorded = 0
        for inode_id, changed in list(self._unrecorded_closes.items()):
            if self._writer_count.get(inode_id):
                if changed:  # opened for writing again: its next close records the change
                    self._changed.add(inode_id)
            else:
                try:
                    self._record_close(inode_id, changed)
                except JournalFull:
                    return  # still full
                recorded += 1
            del self._unrecorded_closes[inode_id]
        self._close_retry = trio.Event()
        if recorded:
            log.info("the journal has room again: recorded the close of %d file(s)", recorded)

    def _record_close(self, inode_id: int, changed: bool) -> None:
        inode = self.journal.get(inode_id)
        if inode is None or inode.kind != FILE or inode.state == REMOTE:
            return
        try:
            st = os.stat(self.cache.data_path(inode_id))
        except FileNotFoundError:
            return
        self.cache.observe(inode_id, st)
        with self.journal.transaction():
            self.journal.mark_closed(
                inode_id, size=st.st_size, mtime_ns=st.st_mtime_ns, changed=changed, now=time.time()
            )
        if changed:
            self._notify_drain()

    def _new_handle(self, inode_id: int, fd: int, flags: int, dirtied: bool, reader: Reader | None = None) -> int:
        if self._free_fhs:
            fh = heapq.heappop(self._free_fhs)
        else:
            fh = self._next_fh
            self._next_fh += 1
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # A partial file is not a data file yet: its chunks are the fetcher's to account.
        local = self.cache.file(inode_id) if reader is None else CacheFile(inode_id, 0)
        backing = 0 if reader is not None else self._passthrough(inode_id, fd, local, writable)
        direct = not backing and (flags & os.O_ACCMODE) == os.O_WRONLY
        if backing:
            self.passthrough_opens += 1
            if writable:
                # Its writes bypass the daemon: the content is changing from now on, and the accounting
                # follows the file (its size as it grows, for the budget and for spills).
                if not dirtied:
                    self._begin_change(inode_id)
                    dirtied = True
                self.cache.passthrough_opened(inode_id)
                self._uncached_writes.add(inode_id)  # see caching(): cached pages go stale behind the kernel
        elif not direct:
            self._cached_opens[inode_id] = self._cached_opens.get(inode_id, 0) + 1
        self.handles[fh] = OpenFile(inode_id, fd, local, writable, dirtied, direct, reader, backing)
        self.evictor.touch(inode_id)
        if direct and dirtied:
            self._uncached_writes.add(inode_id)
        self._open_count[inode_id] = self._open_count.get(inode_id, 0) + 1
        if writable:
            writers = self._writer_count.get(inode_id, 0)
            self._writer_count[inode_id] = writers + 1
            if writers == 0 and not dirtied:
                with self.journal.transaction():
                    self.journal.mark_open_for_write(inode_id)
        return fh

    def handed_out(self, fh: int, request: int = 0) -> None:
        """The reply of the kernel's open or create `request` (its id) naming `fh` goes to the kernel now:
        record the handle for a daemon that takes the mount over. Not earlier: a daemon that dies before its
        reply leaves no record of a handle the kernel never got (the kernel sends that open again, and it
        gets a handle of its own). A daemon killed between the record and the reply is what `unanswered` is
        for."""
        if self.handle_table is not None:
            handle = self.handles[fh]
            self.handle_table.put(fh, handle.inode_id, os.O_RDWR if handle.writable else os.O_RDONLY,
                                  handle.backing, dirtied=handle.dirtied, direct=handle.direct,
                                  stream=handle.reader is not None, request=request & ~RESENT)

    def unanswered(self, request: int) -> int | None:
        """The handle a daemon before this one made for the kernel's open or create `request` and died before
        its reply went out: the kernel sent the request again (it never got the handle), and it gets that
        handle now instead of a second one that would keep the file open for ever."""
        fh = self._unanswered.pop(request & ~RESENT, None)
        return fh if fh is not None and fh in self.handles else None

    def inode_of(self, fh: int) -> int:
        return self._handle(fh).inode_id

    def restore_handles(self, records: list[OpenHandle]) -> int:
        """Take over the handles a daemon before this one handed to the kernel (the handle table of a
        connection this daemon took over): each gets its descriptor on the cache file (or a new reader of
        a remote file) and counts as open, for writing as it was. A record whose file is gone is dropped
        (the kernel's later requests on it get EBADF). Returns how many were restored."""
        self._refs_inherited = True
        restored = 0
        for record in records:
            if self._restore_handle(record):
                restored += 1
                if record.request:
                    self._unanswered[record.request] = record.fh
            elif self.handle_table is not None:
                self.handle_table.drop(record.fh)
        used = set(self.handles)
        self._next_fh = max(used, default=0) + 1
        self._free_fhs = [fh for fh in range(1, self._next_fh) if fh not in used]
        heapq.heapify(self._free_fhs)
        return restored

    def _restore_handle(self, record: OpenHandle) -> bool:
        inode_id = record.inode_id
        inode = self.journal.get(inode_id)
        if inode is None or inode.kind != FILE:
            log.warning("an open handle of inode %d could not be taken over: the file is gone", inode_id)
            return False
        reader: Reader | None = None
        try:
            if inode.state == REMOTE:
                if record.writable or self.streams is None:
                    raise FileNotFoundError(errno.ENOENT, "no local copy")
                reader = self.streams.open_reader(inode)
                fd = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
            else:
                fd = os.open(self.cache.data_path(inode_id),
                             (os.O_RDWR if record.writable else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError as exc:
            if reader is not None and self.streams is not None:
                self.streams.close_reader(reader)
            log.warning("an open handle of %s could not be taken over: %s", inode.path, exc.strerror)
            return False
        local = self.cache.file(inode_id) if reader is None else CacheFile(inode_id, 0)
        backing = record.backing if reader is None else 0
        self.handles[record.fh] = OpenFile(inode_id, fd, local, record.writable, record.dirtied, record.direct,
                                           reader, backing)
        self._open_count[inode_id] = self._open_count.get(inode_id, 0) + 1
        if backing:
            held = self._backing_ids.setdefault(inode_id, [backing, 0])
            held[1] += 1
            if record.writable:
                self.cache.passthrough_opened(inode_id)
        elif not record.direct:
            self._cached_opens[inode_id] = self._cached_opens.get(inode_id, 0) + 1
        if record.writable:
            self._writer_count[inode_id] = self._writer_count.get(inode_id, 0) + 1
            if record.dirtied or inode.state != CLEAN:
                # (dirty in the journal: the daemon before may have died between the two records)
                self._changed.add(inode_id)
            if record.direct or backing:
                self._uncached_writes.add(inode_id)
        return True

    def restored_writers(self) -> list[tuple[int, str]]:
        """(inode, path) of the files open for writing, for the cross-node records of a takeover."""
        writers = []
        for inode_id in self._writer_count:
            inode = self.journal.get(inode_id)
            if inode is not None and inode.path is not None:
                writers.append((inode_id, inode.path))
        return writers

    def _check_writable(self) -> None:
        if not self.writes_allowed:
            raise FsError(errno.EROFS, "ckptfs is shutting down; no new files are opened for writing")

    def create(self, parent_id: int, raw_name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[int, Attr]:
        self._check_writable()
        parent, name = self._check_new_entry(parent_id, raw_name)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        with self.journal.transaction():
            inode = self.journal.create_inode(
                parent, name, FILE, stat.S_IFREG | (mode & 0o7777), uid, gid,
                closed_at=None if writable else time.time(),
            )
            # The cache file and its descriptor are made before the journal row commits: a failure
            # (EMFILE, ENOSPC) rolls the row back, so no entry is ever left without a cache file or a
            # cache file without its entry (recovery would remove that as an orphan anyway).
            try:
                fd = self.cache.create_data(inode.id)
            except OSError as exc:
                self.cache.remove_data(inode.id)
                raise FsError(exc.errno or errno.EIO, f"cannot create cache file: {exc.strerror}") from None
        self._changed.add(inode.id)
        fh = self._new_handle(inode.id, fd, flags, dirtied=True)
        if writable and self.announcer is not None and inode.path is not None:
            self._to_announce[fh] = inode.path
        self._remember(inode.id)
        if not writable:
            self._closed(inode.id)
        else:
            self._notify_drain()  # as _begin_change: a file being written
        return fh, self.attr(inode)

    async def open(self, inode_id: int, flags: int) -> int:
        inode = self._get(inode_id)
        if inode.kind == DIR:
            raise FsError(errno.EISDIR, "is a directory")
        if inode.kind != FILE:
            raise FsError(errno.ELOOP, "is a symlink")
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        truncate = writable and bool(flags & os.O_TRUNC)
        if writable:
            self._check_writable()
        if inode.state == REMOTE and not truncate:
            self.cache_misses += 1
        else:
            self.cache_hits += 1
        if inode.state == REMOTE and not writable and self.streams is not None:
            return self._open_stream(inode, flags)
        await self._make_local(inode, keep_content=not truncate)
        # Re-check after the await: the file may have been removed while it was fetched, or (a cache
        # under heavy pressure) evicted again before this open came back to it.
        inode = self._get(inode_id)
        while inode.state == REMOTE:
            await self._make_local(inode, keep_content=not truncate)
            inode = self._get(inode_id)
        if (not truncate and self.cache.file(inode_id).freed and inode_id not in self._writer_count
                and await self._reopen_after_spill(inode)):
            return await self.open(inode_id, flags)
        if writable and not truncate and self.cache.file(inode_id).sealed:
            raise FsError(errno.EBUSY, "the start of this file was uploaded to make room in the cache while it"
                                       " was written; it can be rewritten (O_TRUNC) or changed once uploaded")
        try:
            fd = os.open(self.cache.data_path(inode_id), (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FsError(errno.ENOENT, "file was removed") from None
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"cannot open cache file: {exc.strerror}") from None
        dirtied = False
        if truncate:
            self._begin_change(inode_id)
            dirtied = True
            try:
                os.ftruncate(fd, 0)
            except OSError as exc:
                os.close(fd)  # no handle will own it; the file stays marked changed until its next close
                raise FsError(exc.errno or errno.EIO, f"truncate of cache file: {exc.strerror}") from None
            self.cache.resize(inode_id, 0)
        fh = self._new_handle(inode_id, fd, flags, dirtied)
        if writable and self.announcer is not None and inode.path is not None:
            self._to_announce[fh] = inode.path
        return fh

    async def _reopen_after_spill(self, inode: Inode) -> bool:
        """A closed file whose start was spilled (uploaded and punched out of the cache to make room, then
        the writer closed it, or the daemon restarted): its only whole copy will be the store's. Wait for
        its upload, then evict the punched data file, so that the open reads the store's copy. True if
        the caller should open again; False if it stays as it is (a handle keeps it, no drain to wait on)."""
        if self._wait_uploaded is None or inode.path is None:
            return False
        with trio.move_on_after(self.evictor.dirty_wait):
            await self._wait_uploaded(inode.path)
        current = self.journal.get(inode.id)
        if current is None:
            raise FsError(errno.ENOENT, "file was removed")
        if current.state == CLEAN and self.cache.has_data(inode.id):
            self.evictor.evict_if_clean(inode.id)
        return not self.cache.has_data(inode.id)

    def _open_stream(self, inode: Inode, flags: int) -> int:
        """A read-only open of a remote file: nothing is fetched until it is read."""
        assert self.streams is not None
        reader = self.streams.open_reader(inode)
        try:
            fd = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.streams.close_reader(reader)
            raise FsError(exc.errno or errno.EIO, f"cannot open the partial file: {exc.strerror}") from None
        return self._new_handle(inode.id, fd, flags, False, reader)

    def _handle(self, fh: int) -> OpenFile:
        try:
            return self.handles[fh]
        except KeyError:
            # Only a handle the kernel kept across a takeover whose file could not be restored
            raise FsError(errno.EBADF, f"no open handle {fh}") from None

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handle(fh)
        reader = handle.reader
        if reader is not None and not reader.complete:
            assert self.streams is not None
            await self.streams.wait_readable(reader, offset, size)
        if offset < handle.local.freed:
            raise FsError(errno.EIO, "this part of the file was uploaded and freed from the cache to make room"
                                     " (a spill); it can be read again once the whole file is uploaded")
        data = os.pread(handle.fd, size, offset)
        if reader is not None:
            _shed_served_pages(handle, offset, offset + len(data))
        return data

    def write(self, fh: int, offset: int, data: bytes) -> int:
        try:
            handle = self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF, f"no open handle {fh}") from None
        cache = self.cache
        if cache.used > cache.limit:
            raise RoomNeeded
        if offset < handle.local.sealed:
            raise FsError(errno.EIO, "this part of the file was already uploaded to make room in the cache"
                                     " (a spill) and can no longer change")
        if not handle.dirtied:
            self._first_write(fh, handle)
        try:
            written = os.pwrite(handle.fd, data, offset)
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"write to cache failed: {exc.strerror}") from None
        end = offset + written
        if end > handle.local.size:
            cache.grow(handle.local, offset, end)
        return written

    async def wait_for_room(self, needed: int = 0) -> None:
        """Back-pressure: wait until `needed` more bytes fit in the cache budget (FsError ENOSPC after
        dirty_wait)."""
        await self.evictor.wait_for_room(needed)

    def in_use(self, inode_id: int) -> bool:
        """Open handles refer to the inode's data file: it must not be evicted."""
        return inode_id in self._open_count

    def _first_write(self, fh: int, handle: OpenFile) -> None:
        if not handle.writable:
            raise FsError(errno.EBADF, "file is not open for writing")
        self._begin_change(handle.inode_id)
        handle.dirtied = True
        if self.handle_table is not None:
            self.handle_table.dirtied(fh)
        if handle.direct:
            self._uncached_writes.add(handle.inode_id)

    def caching(self, fh: int) -> tuple[bool, bool]:
        """(direct_io, keep_cache) for a new handle. Write-only handles bypass the kernel's page cache:
        their data reaches the cache file with one copy less (checkpoint writers are write-only). A handle
        that can read keeps the kernel's cached pages unless a write-only handle changed the file since
        they were last dropped; then this open drops them, so that no kernel, old or new, serves stale
        pages after a direct write."""
        handle = self.handles[fh]
        if handle.direct:
            return True, False
        if handle.backing:
            return False, False  # the kernel serves it from the cache file's own pages (no keep_cache)
        inode_id = handle.inode_id
        if inode_id not in self._uncached_writes:
            return False, True
        if not any((h.direct or (h.backing and h.writable)) and h.inode_id == inode_id for h in self.handles.values()):
            self._uncached_writes.discard(inode_id)
        return False, False

    def passthrough_files(self) -> int:
        """Files open with passthrough now."""
        return len(self._backing_ids)

    def backing_of(self, fh: int) -> int:
        """The backing id the open or create reply of a new handle names (0: no passthrough)."""
        return self.handles[fh].backing

    def _passthrough(self, inode_id: int, fd: int, local: CacheFile, writable: bool) -> int:
        """The backing id for a new handle of a file whose bytes are in the cache, or 0 (reads and writes
        then come to the daemon). Passthrough is for files whose bytes are all local (none spilled), and
        for a handle that can write only while the budget has room: its writes no longer wait for it.
        Every handle of an inode that has a backing file gets it too (the kernel allows one backing file
        per inode, and no cached handle beside it), and none while cached handles of the inode are open."""
        if self.backing is None:
            return 0
        held = self._backing_ids.get(inode_id)
        if held is not None:
            held[1] += 1
            return held[0]
        if self._cached_opens.get(inode_id) or local.freed or local.sealed:
            return 0
        if writable:
            room = self.cache.limit - self.cache.used
            if room < PASSTHROUGH_ROOM or room < self.cache.limit * PASSTHROUGH_ROOM_SHARE:
                return 0
        try:
            # The kernel takes the file, not the descriptor, and opens it anew with each handle's own flags
            # (so a read-only first handle serves later writers too).
            backing_id = self.backing.open(fd)
        except OSError as exc:
            self.passthrough_errors += 1
            log.debug("no passthrough for inode %d: %s", inode_id, exc)
            return 0
        self._backing_ids[inode_id] = [backing_id, 1]
        return backing_id

    def _release_backing(self, handle: OpenFile) -> None:
        held = self._backing_ids[handle.inode_id]
        held[1] -= 1
        if held[1]:
            return
        del self._backing_ids[handle.inode_id]
        if self.backing is None:
            return  # the FUSE connection is gone (close_all after unmount), and its backing files with it
        try:
            self.backing.close(held[0])
        except OSError as exc:  # the kernel keeps what open files hold; nothing of ours is lost
            log.warning("cannot release the passthrough backing file %d of inode %d: %s",
                        held[0], handle.inode_id, exc)

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            # A release the kernel sent again after a takeover, which the daemon before had done
            log.debug("release of handle %d, which is not open", fh)
            return
        self._to_announce.pop(fh, None)
        os.close(handle.fd)
        inode_id = handle.inode_id
        if handle.reader is not None and self.streams is not None:
            self.streams.close_reader(handle.reader)
        if handle.backing:
            self._release_backing(handle)
            if handle.writable:
                self.cache.passthrough_closed(inode_id)
        elif not handle.direct:
            cached = self._cached_opens[inode_id] - 1
            if cached:
                self._cached_opens[inode_id] = cached
            else:
                del self._cached_opens[inode_id]
        try:
            if handle.writable:
                writers = self._writer_count[inode_id] - 1
                if writers:
                    self._writer_count[inode_id] = writers
                else:
                    del self._writer_count[inode_id]
                    self._closed(inode_id)
        finally:
            self._forget_open(inode_id, handle)
            if handle.writable and self.announcer is not None:
                self.announcer.released(inode_id)
            if self.handle_table is not None:
                self.handle_table.drop(fh)
            if self._unanswered:  # (after a takeover) the number goes back to the pool: no longer that handle
                self._unanswered = {request: kept for request, kept in self._unanswered.items() if kept != fh}
            heapq.heappush(self._free_fhs, fh)

    async def announce_writer(self, fh: int) -> None:
        """An open for writing: with cross-node ordering, announced before open() returns, so that the
        file's close() is covered (the job's barrier after it orders it before another node's marker)
        without a request of its own. RELEASE, which records the close, ends the writer. create and
        open left the path here (no journal read per file)."""
        path = self._to_announce.pop(fh, None)
        if self.announcer is not None and path is not None:
            await self.announcer.cover(self.handles[fh].inode_id, path, writer=True)

    async def announce(self, inode_id: int | None, path: str | None = None, directory: bool = False) -> None:
        """A new directory or symlink, or a renamed entry: announced before the request returns."""
        if self.announcer is None or inode_id is None:
            return
        if path is None:
            inode = self.journal.get(inode_id)
            if inode is None or inode.path is None:
                return
            path, directory = inode.path, inode.kind == DIR
        await self.announcer.cover(inode_id, path, directory=directory)

    def _forget_open(self, inode_id: int, handle: OpenFile) -> None:
        opens = self._open_count[inode_id] - 1
        if opens:
            self._open_count[inode_id] = opens
        else:
            del self._open_count[inode_id]
            self.evictor.touch(inode_id)
            if handle.local.freed:
                self.evictor.evict_if_clean(inode_id)  # a spilled file whose upload finished while open
            self._maybe_purge(inode_id)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._handle(fh)
        if handle.reader is not None and not handle.reader.complete:
            return  # a partial file of a remote file: nothing of it is local state to make durable
        sync = os.fdatasync if datasync else os.fsync
        await trio.to_thread.run_sync(sync, handle.fd)
        await trio.to_thread.run_sync(self.cache.sync_data_dir)
        inode = self.journal.get(handle.inode_id)
        if inode is not None and inode.kind == FILE:
            st = os.fstat(handle.fd)
            self.cache.observe(inode.id, st)
            with self.journal.transaction():
                self.journal.set_attrs(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns)
        self.journal.sync()

    def fsyncdir(self) -> None:
        self.journal.sync()

    # -- directories ------------------------------------------------------------------------------------

    def opendir(self, inode_id: int) -> int:
        self._dir(inode_id)
        return inode_id

    def readdir(self, inode_id: int, after_id: int, limit: int = 1000) -> list[DirEntry]:
        entries = []
        for child in self.journal.children(inode_id, after_id, limit):
            assert child.name is not None
            entries.append(DirEntry(child.name.encode(), self.attr(child), child.id))
        return entries

    def remember(self, inode_id: int) -> None:
        """The kernel now holds a reference to this inode (readdirplus reported it)."""
        self._remember(inode_id)

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
        evictable = self.journal.clean_bytes()
        free = max(0, int(limit) - self.cache.used + evictable)
        return StatFs(block, int(limit) // block, min(free, int(limit)) // block,
                      space.total_files, space.free_files, NAME_MAX)

    # -- xattrs -------------------------------------------------------------------------------------------

    def getxattr(self, inode_id: int, name: bytes) -> bytes:
        if name == STATE_XATTR:
            return self._get(inode_id).state.encode()
        if name == ERROR_XATTR:
            self._get(inode_id)
            failure = self._failure_of(inode_id)
            if failure is not None:
                return failure.encode()
        # The kernel asks for security.capability before every write(2): answer without SQL.
        raise FsError(errno.ENODATA, "no such attribute")

    def listxattr(self, inode_id: int) -> list[bytes]:
        self._get(inode_id)
        return [STATE_XATTR] if self._failure_of(inode_id) is None else [STATE_XATTR, ERROR_XATTR]

    def setxattr(self, inode_id: int, name: bytes) -> None:
        self._get(inode_id)
        if name in (STATE_XATTR, ERROR_XATTR):
            raise FsError(errno.EPERM, f"{name.decode()} is read-only")
        raise FsError(errno.ENOTSUP, "extended attributes are not stored")

    # -- lifecycle ---------------------------------------------------------------------------------------

    def stop_writes(self) -> None:
        """Shutdown: new opens for writing fail with EROFS; open handles keep working."""
        self.writes_allowed = False

    def open_writers(self) -> int:
        return len(self._writer_count)

    def close_all(self) -> None:
        """After unmount: close every handle (the kernel will send no more releases). A close the journal
        cannot record (cache filesystem full) is left to the recovery at the next start, which takes
        every file for closed."""
        for fh in list(self.handles):
            try:
                self.release(fh)
            except JournalFull:
                pass
