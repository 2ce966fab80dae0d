"""The data path: handles and what goes through them. open and create (a cache file's descriptor, the
data fetched or streamed first for a remote file), read, write, fallocate, fsync and release, and the
back-pressure of a full cache.

The write path (`write`) is the hot path: one dict lookup, one budget compare, one pwrite, no SQL. The
journal learns that a file changed at the first write of each open handle (`_first_write`), and its final
size at release. A write that finds the cache over its budget raises RoomNeeded before it writes anything;
the caller awaits wait_for_room() and writes again (back-pressure, see cache/evictor.py).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ckptfs.cache.directory import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    FALLOC_FL_ZERO_RANGE,
    CacheDir,
    CacheFile,
    fallocate_fd,
    punch_hole_fd,
)
from ckptfs.cache.evictor import Evictor
from ckptfs.errors import FsError
from ckptfs.fs.announce import Announcements
from ckptfs.fs.changes import Changes
from ckptfs.fs.inodes import attr_of, existing
from ckptfs.fs.interface import Attr, FetchFn, PartialReader, ReadStreams, RoomNeeded
from ckptfs.fs.kernel_cache import KernelCache
from ckptfs.fs.namespace import Namespace
from ckptfs.fs.open_files import OpenFile, OpenFiles
from ckptfs.fs.references import References
from ckptfs.fs.takeover import Takeover
from ckptfs.journal import CLEAN, DIR, FILE, REMOTE, Inode, Journal, JournalFull

log = logging.getLogger(__name__)

# A read of a file opened while it was remote (streamed from the store) leaves the bytes it served in the
# kernel's page cache of the mount's file; the cache file's own pages of them are a second copy, as large
# as the checkpoint. Those more than SHED_LAG behind the reader are advised away every SHED_STEP: the first
# advice starts their writeback (dirty pages are never dropped), the next one, SHED_LAG later, drops them.
SHED_LAG = 32 << 20
SHED_STEP = 8 << 20

# The fallocate(2) modes a file open for writing takes (docs/SEMANTICS.md, "fallocate"): allocate (and extend),
# allocate keeping the size, punch a hole, zero a range (extending or not). The kernel itself answers any other
# (COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE, WRITE_ZEROES) with EOPNOTSUPP without asking (fs/fuse/file.c).
FALLOCATE_MODES = frozenset({
    0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE,
    FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
})


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


def _unreserved(local: CacheFile, start: int, end: int) -> int:
    """At most how many bytes of [start, end) of a data file are not stored yet, from its accounting: those
    past its end (less what was reserved there before), and within it at most its holes."""
    within = max(0, min(end, local.size) - start)
    past = max(0, end - max(local.size, start))
    return min(within, local.holes) + max(0, past - local.beyond)


def _fallocate_cache_file(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with `mode` (one of FALLOCATE_MODES) on a cache file. Its filesystem's own answer goes to
    the caller as it is (EOPNOTSUPP where it has no fallocate at all: the application's posix_fallocate then
    writes zeros through the mount, as on such a local filesystem), but for ZERO_RANGE, which tmpfs lacks: the
    same bytes are had by punching the range out and allocating it again (the kernel holds the inode's lock
    for the request, so no write of the mount comes in between)."""
    try:
        fallocate_fd(fd, mode, offset, length)
    except OSError as exc:
        if not (mode & FALLOC_FL_ZERO_RANGE and exc.errno == errno.EOPNOTSUPP):
            raise
        punch_hole_fd(fd, offset, length)
        fallocate_fd(fd, mode & FALLOC_FL_KEEP_SIZE, offset, length)


class DataPath:
    def __init__(
        self, journal: Journal, cache: CacheDir, fetch: FetchFn, notify_drain: Callable[[], None],
        evictor: Evictor, streams: ReadStreams[Any] | None, wait_uploaded: Callable[[str], Awaitable[None]] | None,
        open_files: OpenFiles, changes: Changes, kernel_cache: KernelCache, references: References,
        namespace: Namespace, takeover: Takeover, announcements: Announcements,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self._fetch = fetch
        self._notify_drain = notify_drain
        self.evictor = evictor
        # Streaming reads of remote files; None: an open fetches the whole file first.
        self.streams = streams
        # Returns once the file at a path is in the store (the drain's wait_durable); None: never waits.
        self._wait_uploaded = wait_uploaded
        self._open_files = open_files
        self.handles = open_files.handles
        self._changes = changes
        self._kernel_cache = kernel_cache
        self._references = references
        self._namespace = namespace
        self._takeover = takeover
        self._announcements = announcements
        self.writes_allowed = True
        # Called with the inode id after an fsync (the drain: in gateway mode the file is due for upload).
        self.on_fsync: Callable[[int], None] = lambda inode_id: None
        self.cache_hits = 0  # opens served from local data
        self.cache_misses = 0  # opens that downloaded the file

    def _check_writable(self) -> None:
        if not self.writes_allowed:
            raise FsError(errno.EROFS, "ckptfs is shutting down; no new files are opened for writing")

    def stop_writes(self) -> None:
        """Shutdown: new opens for writing fail with EROFS; open handles keep working."""
        self.writes_allowed = False

    def create(self, parent_id: int, raw_name: bytes, mode: int, flags: int, uid: int, gid: int) -> tuple[int, Attr]:
        self._check_writable()
        parent, name = self._namespace.check_new_entry(parent_id, raw_name)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        with self.journal.transaction():
            inode = self.journal.names.create_inode(
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
        self._changes.mark_changed(inode.id)
        fh = self._new_handle(inode.id, fd, flags, dirtied=True)
        if writable:
            self._announcements.writer_opened(fh, inode.path)
        self._references.remember(inode.id)
        if not writable:
            self._changes.closed(inode.id)
        else:
            self._notify_drain()  # as Changes.begin_change: a file being written
        return fh, attr_of(self.journal, self.cache, inode)

    def mknod(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int) -> Attr:
        """mknod(S_IFREG) makes an empty regular file, as create() + release() would leave it (the kernel
        sends MKNOD for mknod(2) and on some create paths). Devices, FIFOs and sockets get EPERM."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM, "device nodes, FIFOs and sockets cannot be stored in an object store")
        fh, attr = self.create(parent_id, raw_name, mode, os.O_WRONLY, uid, gid)
        self.release(fh)
        return attr

    async def open(self, inode_id: int, flags: int) -> int:
        inode = existing(self.journal, inode_id)
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
        await self.make_local(inode, keep_content=not truncate)
        # Re-check after the await: the file may have been removed while it was fetched, or (a cache
        # under heavy pressure) evicted again before this open came back to it.
        inode = existing(self.journal, inode_id)
        while inode.state == REMOTE:
            await self.make_local(inode, keep_content=not truncate)
            inode = existing(self.journal, inode_id)
        if (not truncate and self.cache.file(inode_id).freed and inode_id not in self._open_files.writer_count
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
            self._changes.begin_change(inode_id)
            dirtied = True
            try:
                os.ftruncate(fd, 0)
            except OSError as exc:
                os.close(fd)  # no handle will own it; the file stays marked changed until its next close
                raise FsError(exc.errno or errno.EIO, f"truncate of cache file: {exc.strerror}") from None
            self.cache.resize(inode_id, 0)
        fh = self._new_handle(inode_id, fd, flags, dirtied)
        if writable:
            self._announcements.writer_opened(fh, inode.path)
        return fh

    async def make_local(self, inode: Inode, *, keep_content: bool) -> None:
        """Give a remote-only file a cache file: fetched, or empty when its content is about to go (then
        the change has begun: see Changes.begin_change)."""
        if inode.state != REMOTE:
            return
        if keep_content:
            await self._fetch(inode)
        else:
            if self.streams is not None:
                self.streams.discard(inode.id)  # its readers keep the old version's partial file
            os.close(self.cache.create_data(inode.id))
            self._changes.begin_change(inode.id, emptied_remote=True)

    async def _reopen_after_spill(self, inode: Inode) -> bool:
        """A closed file whose start was spilled (uploaded and punched out of the cache to make room, then
        the writer closed it, or the daemon restarted): its only whole copy will be the store's. Wait for
        its upload, then evict the punched data file, so that the open reads the store's copy. True if
        the caller should open again; False if it stays as it is (a handle keeps it, no drain to wait on)."""
        if self._wait_uploaded is None or inode.path is None:
            return False
        with trio.move_on_after(self.evictor.dirty_wait):
            await self._wait_uploaded(inode.path)
        current = self.journal.names.get(inode.id)
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

    def _new_handle(
            self, inode_id: int, fd: int, flags: int, dirtied: bool, reader: PartialReader | None = None) -> int:
        fh = self._open_files.take_fh()
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # A partial file is not a data file yet: its chunks are the fetcher's to account.
        local = self.cache.file(inode_id) if reader is None else CacheFile(inode_id, 0)
        backing = 0 if reader is not None else self._kernel_cache.choose(inode_id, fd, local, writable)
        direct = not backing and (flags & os.O_ACCMODE) == os.O_WRONLY
        if backing and writable and not dirtied:
            # Its writes bypass the daemon: the content is changing from now on.
            self._changes.begin_change(inode_id)
            dirtied = True
        self._kernel_cache.opened(inode_id, backing, writable, direct, dirtied)
        self.handles[fh] = OpenFile(inode_id, fd, local, writable, dirtied, direct, reader, backing)
        self.evictor.touch(inode_id)
        self._open_files.count_open(inode_id)
        if writable:
            writers = self._open_files.count_writer(inode_id)
            if writers == 0 and not dirtied:
                with self.journal.transaction():
                    self.journal.names.mark_open_for_write(inode_id)
        return fh

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._open_files.get(fh)
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

    def _first_write(self, fh: int, handle: OpenFile) -> None:
        if not handle.writable:
            raise FsError(errno.EBADF, "file is not open for writing")
        self._changes.begin_change(handle.inode_id)
        handle.dirtied = True
        if self._open_files.handle_table is not None:
            self._open_files.handle_table.dirtied(fh)
        if handle.direct:
            self._kernel_cache.bypassed(handle.inode_id)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) of a file open for writing, applied to its cache file. The file changes as by a write
        (dirty, a new version; mtime and ctime; its size journaled when it changed), so the drain uploads what
        it then holds: zeros where space was reserved, a hole punched or a range zeroed. The space it reserves
        is charged to the cache budget and must fit first (back-pressure, then ENOSPC, as for writes); a hole
        punched gives room back. The kernel sends FALLOCATE here also for handles it reads and writes itself
        (FUSE passthrough): the cache file is their backing file."""
        handle = self._open_files.get(fh)
        if not handle.writable:  # (the kernel checks it first: only a request sent again could get here)
            raise FsError(errno.EBADF, "file is not open for writing")
        if mode not in FALLOCATE_MODES:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported")
        if offset < 0 or length <= 0:
            raise FsError(errno.EINVAL, "fallocate of a negative offset or of no bytes")
        end = offset + length
        local = handle.local
        changes_bytes = bool(mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE))
        while True:
            if changes_bytes and offset < local.sealed:
                raise FsError(errno.EIO, "this part of the file was already uploaded to make room in the cache"
                                         " (a spill) and can no longer change")
            # The spilled start's bytes are in the store and stay as they are: nothing to reserve there.
            start = offset if changes_bytes else max(offset, local.sealed)
            if start >= end:
                return
            self.cache.observe(handle.inode_id, os.fstat(handle.fd))  # (passthrough writes: the daemon saw none)
            needed = 0 if mode & FALLOC_FL_PUNCH_HOLE else _unreserved(local, start, end)
            if needed > self.cache.limit:
                raise FsError(errno.ENOSPC, f"fallocate of {needed} bytes: more than the whole cache budget"
                                            f" ({int(self.cache.limit)} bytes)")
            if needed == 0 or self.cache.used + needed <= self.cache.limit:
                break  # (nothing to reserve needs no room, also when writes made the cache overshoot)
            # Back-pressure as for a write, but for all of it: a write may overshoot the budget by one request
            # (<= 1 MiB), a preallocation by no more than it.
            await self.evictor.wait_for_room(needed, what="an fallocate")
        if not handle.dirtied:
            self._first_write(fh, handle)
        fd = handle.fd
        before = os.fstat(fd)
        if not mode & FALLOC_FL_PUNCH_HOLE:
            local.preallocated = True  # see CacheFile.preallocated (also if it fails: some may be reserved)
        try:
            _fallocate_cache_file(fd, mode, start, end - start)
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"fallocate of cache file: {exc.strerror}") from None
        finally:
            self.cache.observe(handle.inode_id, os.fstat(fd))
        st = os.fstat(fd)
        mtime_ns = st.st_mtime_ns
        if mtime_ns == before.st_mtime_ns:
            # ext4 marks the file modified for every mode; a cache filesystem that does not is told to, since
            # the file's mtime is its cache file's (and ctime follows).
            mtime_ns = time.time_ns()
            os.utime(fd, ns=(st.st_atime_ns, mtime_ns))
        if st.st_size != before.st_size:
            # As a truncate: the journal knows the new size at once (a kill -9 loses nothing either way: the
            # cache file of a dirty file is the truth at recovery).
            with self.journal.transaction():
                self.journal.names.set_attrs(handle.inode_id, size=st.st_size, mtime_ns=mtime_ns)

    async def wait_for_room(self, needed: int = 0) -> None:
        """Back-pressure: wait until `needed` more bytes fit in the cache budget (FsError ENOSPC after
        dirty_wait)."""
        await self.evictor.wait_for_room(needed)

    def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            # A release the kernel sent again after a takeover, which the daemon before had done
            log.debug("release of handle %d, which is not open", fh)
            return
        self._announcements.forget(fh)
        os.close(handle.fd)
        inode_id = handle.inode_id
        if handle.reader is not None and self.streams is not None:
            self.streams.close_reader(handle.reader)
        self._kernel_cache.released(handle)
        try:
            if handle.writable and self._open_files.uncount_writer(inode_id):
                self._changes.closed(inode_id)
        finally:
            self._forget_open(inode_id, handle)
            if handle.writable:
                self._announcements.writer_released(inode_id)
            if self._open_files.handle_table is not None:
                self._open_files.handle_table.drop(fh)
            self._takeover.released(fh)
            self._open_files.give_back_fh(fh)

    def _forget_open(self, inode_id: int, handle: OpenFile) -> None:
        if self._open_files.uncount_open(inode_id):
            self.evictor.touch(inode_id)
            if handle.local.freed:
                self.evictor.evict_if_clean(inode_id)  # a spilled file whose upload finished while open
            self._references.maybe_purge(inode_id)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self._open_files.get(fh)
        if handle.reader is not None and not handle.reader.complete:
            return  # a partial file of a remote file: nothing of it is local state to make durable
        sync = os.fdatasync if datasync else os.fsync
        await trio.to_thread.run_sync(sync, handle.fd)
        await trio.to_thread.run_sync(self.cache.sync_data_dir)
        inode = self.journal.names.get(handle.inode_id)
        if inode is not None and inode.kind == FILE:
            st = os.fstat(handle.fd)
            self.cache.observe(inode.id, st)
            with self.journal.transaction():
                self.journal.names.set_attrs(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns)
        self.journal.sync()
        self.on_fsync(handle.inode_id)

    def close_all(self) -> None:
        """After unmount: close every handle (the kernel will send no more releases). A close the journal
        cannot record (cache filesystem full) is left to the recovery at the next start, which takes
        every file for closed. The kernel keeps the backing file of a passthrough writer after the
        connection went, and its writes go on into the cache file: such files are watched (cache/evictor.py)."""
        kept = {h.inode_id for h in self.handles.values() if h.writable and h.backing}
        for fh in list(self.handles):
            try:
                self.release(fh)
            except JournalFull:
                pass
        if kept:
            self.evictor.watch(kept, time.time())
