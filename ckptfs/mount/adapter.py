"""The pyfuse3 adapter: converts FUSE requests to Filesystem calls and results back to FUSE replies.

Owns only type conversion and error translation: every request goes through one wrapper (`_timed`, or
the inline copy in the hot read/write) whose `_fuse_error` turns whatever it raised into a FUSEError, here
and nowhere else. A handler never lets an exception reach pyfuse3: that would end the FUSE session.
No POSIX semantics live here (the fs package has them: what a request the kernel sent again after a
takeover means is fs/requests.py's, whether passthrough works fs/kernel_cache.py's probe), and no store is
reached from here. It also gives the fs package this pyfuse3's registry of backing files for FUSE
passthrough (KernelBackingFiles) and names the backing id in open and create replies; when a handle gets
one is fs/kernel_cache.py's decision. How long the kernel may keep names, attributes and directory listings is
said here (the replies' timeouts, FOPEN_CACHE_DIR); what drops them early is the forget_kernel_* notifications.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import pyfuse3
from pyfuse3 import (
    EntryAttributes,
    FileHandleT,
    FileInfo,
    FileNameT,
    FlagT,
    InodeT,
    ModeT,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    StatvfsData,
    XAttrNameT,
)

from ckptfs.control.metrics import OpStats
from ckptfs.errors import Faults, FsError
from ckptfs.fs import Attr, Filesystem, RoomNeeded, SetAttrs
from ckptfs.journal import JournalFull, journal_unusable

log = logging.getLogger(__name__)

# How long the kernel may answer from what it holds without asking the daemon. Nothing changes this node's
# namespace behind the kernel's back without telling it (the listing of another node's changes, refresh,
# retention, eviction drop what they change: forget_kernel_*), so attributes are kept long, as s3ql does
# (300 s; JuiceFS and mountpoint-s3 keep 1 s by default because their other writers tell nobody). An entry
# is kept as long as its directory's listing is fresh (Lister.fresh_for: refresh_interval after it), so a
# name another node deleted or replaced is looked up, and its directory listed again, as it would be
# without the kernel's cache; never longer than MAX_TIMEOUT.
ATTR_TIMEOUT = 300.0
MAX_TIMEOUT = 3600.0
# How long the kernel may answer a lookup of a missing name without asking (a negative entry). 0: it asks
# every time, as after ENOENT. Another node's new file is found by listing a directory again (after
# refresh_interval, or `ckptfs refresh`), which a cached miss would hide for up to this long.
NEGATIVE_TIMEOUT = 0.0
# st_blksize tells stdio how much to buffer: 1 MiB matches the largest FUSE write request, so buffered
# small writes arrive as 1 MiB requests (bench/: buffered 16 KiB writes ran 2x faster than with 128 KiB).
BLOCK_SIZE = 1024 * 1024
# Entries readdir reads from the journal at a time: about what one kernel buffer of readdirplus holds.
READDIR_BATCH = 1000
TIMED_OPS = (
    "lookup", "getattr", "setattr", "readlink", "mknod", "link", "mkdir", "symlink", "unlink", "rmdir", "rename",
    "create", "open", "flush", "release", "fsync", "opendir", "readdir", "fsyncdir", "statfs", "getxattr", "listxattr",
    "setxattr", "removexattr", "fallocate",
)


def _request_id(ctx: RequestContext) -> int:
    """The kernel's id of the request (its high bit set when it was sent again after a takeover: see
    fs/requests.py); 0 from builds of pyfuse3 without it (the stock one)."""
    return int(getattr(ctx, "unique", 0))


def inode_generation(owner_tag: str) -> int:
    """The generation of every inode of the journal whose owner tag (a random hex id, made with the journal)
    this is. Inode numbers are never used twice in a journal (AUTOINCREMENT), so one generation a journal
    suffices: a file handle (an NFS client's, name_to_handle_at's) is stale only once its inode is gone or
    when it comes from another journal, whose numbers mean other files (the cache dir made anew). 32 bits:
    what the kernel keeps of it in a handle."""
    return int(owner_tag[:8], 16) & 0xFFFFFFFF


def _entry(attr: Attr, generation: int, entry_timeout: float = 0.0) -> pyfuse3.EntryAttributes:
    """`entry_timeout`: how long the kernel may keep the name (0 for a getattr or setattr reply, which
    has none)."""
    entry = _entry_template(generation, entry_timeout)
    _fill(entry, attr)
    return entry


def _entry_template(generation: int, entry_timeout: float) -> pyfuse3.EntryAttributes:
    """What every entry's reply carries alike: the generation, the timeouts, the block size."""
    entry = pyfuse3.EntryAttributes()
    entry.generation = generation
    entry.entry_timeout = entry_timeout
    entry.attr_timeout = ATTR_TIMEOUT
    entry.st_rdev = 0
    entry.st_blksize = BLOCK_SIZE
    return entry


def _fill(entry: pyfuse3.EntryAttributes, attr: Attr) -> None:
    # One unpacking of the tuple, not ten attribute reads: readdirplus fills this once per entry.
    (entry.st_ino, entry.st_mode, entry.st_nlink, entry.st_uid, entry.st_gid, entry.st_size, entry.st_blocks,
     entry.st_atime_ns, entry.st_mtime_ns, entry.st_ctime_ns) = attr


def _negative_entry() -> pyfuse3.EntryAttributes:
    """The answer to a lookup of a name that does not exist: inode 0, which the kernel keeps as a negative
    entry for NEGATIVE_TIMEOUT (ENOENT, the exception it takes to raise it, costs a miss more)."""
    entry = pyfuse3.EntryAttributes()
    entry.st_ino = 0
    entry.entry_timeout = NEGATIVE_TIMEOUT
    entry.attr_timeout = 0
    return entry


def _fuse_error(
    exc: BaseException, op: str, faults: Faults, on_journal_failure: Callable[[BaseException], None]
) -> pyfuse3.FUSEError:
    """The one error path of every request: what the caller of the syscall sees. An FsError carries its
    errno; an OSError from the cache directory its own (EMFILE when out of file descriptors, ENOSPC, EIO);
    anything else is a bug here, answered with EIO, one traceback (the log handler rate-limits repeats)
    and a count in `faults`, instead of ending the FUSE session, which would take the mount away from
    every process using it. A journal that cannot be used any more is answered EIO too, and reported to
    `on_journal_failure`, which ends the daemon."""
    if isinstance(exc, pyfuse3.FUSEError):
        return exc
    if isinstance(exc, FsError):
        if exc.errno in (errno.EIO, errno.ENOSPC):
            log.warning("%s failed: %s", op, exc)
        else:
            log.debug("%s failed: %s", op, exc)
        return pyfuse3.FUSEError(exc.errno)
    if isinstance(exc, OSError) and exc.errno:
        # Running out of file descriptors or cache space is for an operator to act on; the rest is the
        # cache filesystem's own answer, passed on.
        level = logging.WARNING if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EIO) else logging.DEBUG
        log.log(level, "%s failed: %s", op, exc)
        return pyfuse3.FUSEError(exc.errno)
    if isinstance(exc, JournalFull):
        # The cache filesystem is full and the journal cannot grow: a full disk, not a bug. What is already
        # committed stays; this request changes nothing.
        log.warning("%s failed: the journal cannot grow, the cache filesystem is full (%s)", op, exc)
        return pyfuse3.FUSEError(errno.ENOSPC)
    if journal_unusable(exc):
        on_journal_failure(exc)
        return pyfuse3.FUSEError(errno.EIO)
    log.error("%s failed unexpectedly; answering EIO", op, exc_info=exc)
    faults.record("fuse", f"{op}: {exc!r}")
    return pyfuse3.FUSEError(errno.EIO)


# The names a pyfuse3 built with the project's passthrough addition has (scripts/build-fuse.sh,
# scripts/pyfuse3-passthrough.patch); looked up by name, since the stock build, which lacks them, works too.
_BACKING_ID = "backing_id"
_NOFLUSH = "noflush"  # FOPEN_NOFLUSH: the kernel sends no FLUSH at this handle's close()
_HAS_NOFLUSH = hasattr(pyfuse3.FileInfo(), _NOFLUSH)
_CACHE_READDIR = "cache_readdir"  # FOPEN_CACHE_DIR, with opendir answered by a FileInfo
_HAS_CACHE_READDIR = hasattr(pyfuse3.FileInfo(), _CACHE_READDIR)


class KernelBackingFiles:
    """fs.BackingFiles of a pyfuse3 built with passthrough support."""

    def open(self, fd: int) -> int:
        return int(getattr(pyfuse3, "backing_open")(fd))  # noqa: B009

    def close(self, backing_id: int) -> None:
        getattr(pyfuse3, "backing_close")(backing_id)  # noqa: B009


def passthrough_build() -> bool:
    """pyfuse3 was built with the project's passthrough addition (else it is the stock one)."""
    return bool(getattr(pyfuse3, "PASSTHROUGH_BUILD", False)) and hasattr(pyfuse3, "backing_open")


def passthrough_granted() -> bool:
    """The kernel granted FUSE_PASSTHROUGH at INIT (asked for when enable_passthrough is set)."""
    return passthrough_build() and bool(getattr(pyfuse3, "passthrough_enabled")())  # noqa: B009


def kernel_backing_files() -> KernelBackingFiles | None:
    """This pyfuse3's registry of backing files for FUSE passthrough: None for a build without it (the
    stock one). Whether the kernel grants it, and whether it lets this process register one, is probed by
    fs.kernel_cache.probe_passthrough."""
    return KernelBackingFiles() if passthrough_build() else None


# -- telling the kernel what the daemon changed behind its back (FUSE notifications) --------------------------
# Every change not made by a FUSE request: another node's files a listing brought in, replaced or removed
# (lister.DirLister), `ckptfs refresh`, retention (retention/pruner.py), eviction (cache/evictor.py), a file the drain
# removes because its object vanished, what recovery changed after a takeover (daemon.py). The rules:
# forget_kernel_entry queues (pyfuse3's notification thread sends it): safe inside a request handler, where
# the kernel may hold the directory's lock the notification needs. forget_kernel_entry_now and
# forget_kernel_data block until the kernel has acted: call them in a worker thread, never in the trio
# thread, where a request the kernel waits for would never run. forget_kernel_attrs takes no lock a request
# holds: safe anywhere. Each ignores a kernel that holds nothing of the inode (ENOENT) and a process without
# a FUSE session.


def forget_kernel_data(inode_id: int) -> None:
    """Drop the inode's attributes and cached pages: a file's data, a directory's cached listing."""
    with contextlib.suppress(OSError, RuntimeError):  # ENOENT: the kernel holds nothing of it
        pyfuse3.invalidate_inode(inode_id)


def forget_kernel_attrs(inode_id: int) -> None:
    """Drop the inode's attributes (its size, blocks or times changed), keeping its pages."""
    with contextlib.suppress(OSError, RuntimeError):
        pyfuse3.invalidate_inode(inode_id, attr_only=True)


def forget_kernel_entry(parent_id: int, name: str) -> None:
    """Drop a name (and, for a directory, the names below it that nothing uses), queued."""
    with contextlib.suppress(RuntimeError):
        pyfuse3.invalidate_entry_async(parent_id, name.encode(), ignore_enoent=True)


def forget_kernel_entry_now(parent_id: int, name: str) -> None:
    """Drop a name, as forget_kernel_entry, and return once the kernel has."""
    with contextlib.suppress(OSError, RuntimeError):  # ENOENT: the kernel does not hold the name
        pyfuse3.invalidate_entry(parent_id, name.encode())


class FuseOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False  # write() must reach the cache file before it returns (see SEMANTICS)
    # Ask the kernel for FUSE passthrough at INIT (a pyfuse3 built with it reads this; the stock one
    # ignores it). The daemon turns it off with `passthrough = "off"`.
    enable_passthrough = True
    # FUSE_CAP_HANDLE_KILLPRIV_V2 (same builds): we drop setuid/setgid ourselves (journal.names.mark_dirty, fs
    # setattr of the owner), and the kernel stops asking for security.capability before every write: one
    # request per write(2) on the daemon's path, and the one request a passthrough write still made.
    handle_killpriv_v2 = True

    def __init__(
        self, fs: Filesystem, *, faults: Faults | None = None,
        on_journal_failure: Callable[[BaseException], None] = lambda exc: None, generation: int = 0,
    ) -> None:
        super().__init__()
        self.fs = fs
        self.generation = generation  # of every inode: inode_generation() of the journal's owner tag
        self.faults = faults if faults is not None else Faults()
        self.on_journal_failure = on_journal_failure
        # Count, errors and time of every request, per operation (ckptfs_fuse_* metrics). read and write
        # keep theirs inline; the others are wrapped here, on the instance, where pyfuse3 looks them up.
        self.op_stats = OpStats()
        for op in TIMED_OPS:
            setattr(self, op, self._timed(op, getattr(self, op)))

    def _timed(self, op: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        record = self.op_stats.record

        async def timed(*args: Any) -> Any:
            started = time.perf_counter()
            failed = True
            try:
                result = await method(*args)
                failed = False
                return result
            except Exception as exc:  # trio.Cancelled is a BaseException: it passes
                raise _fuse_error(exc, op, self.faults, self.on_journal_failure) from None
            finally:
                record(op, started, failed)

        return timed

    async def lookup(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> EntryAttributes:
        await self.fs.ensure_listed(parent_inode)
        attr = self.fs.find(parent_inode, name)
        if attr is None:
            return _negative_entry()
        return _entry(attr, self.generation, self._kept_for(parent_inode))

    def _kept_for(self, parent_inode: int) -> float:
        """The entry timeout of a name in this directory: as long as its listing stays fresh."""
        return min(self.fs.fresh_for(parent_inode), MAX_TIMEOUT)

    async def getattr(self, inode: InodeT, ctx: RequestContext) -> EntryAttributes:
        return _entry(self.fs.getattr(inode), self.generation)

    async def setattr(
        self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields, fh: FileHandleT | None, ctx: RequestContext
    ) -> EntryAttributes:
        changes = SetAttrs(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return _entry(await self.fs.setattr(inode, changes, fh), self.generation)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        try:
            self.fs.forget_many(inode_list)
        except Exception:
            log.exception("forget of %d inodes failed", len(inode_list))

    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        return self.fs.readlink(inode)

    async def mknod(
        self, parent_inode: InodeT, name: FileNameT, mode: ModeT, rdev: int, ctx: RequestContext
    ) -> EntryAttributes:
        return _entry(self.fs.mknod(parent_inode, name, mode, ctx.uid, ctx.gid), self.generation,
                      self._kept_for(parent_inode))

    async def link(
        self, inode: InodeT, new_parent_inode: InodeT, new_name: FileNameT, ctx: RequestContext
    ) -> EntryAttributes:
        self.fs.link()
        raise AssertionError("link() always raises")

    async def mkdir(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, ctx: RequestContext) -> EntryAttributes:
        attr = await self.fs.requests.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid, _request_id(ctx))
        return _entry(attr, self.generation, self._kept_for(parent_inode))

    async def symlink(
        self, parent_inode: InodeT, name: FileNameT, target: FileNameT, ctx: RequestContext
    ) -> EntryAttributes:
        attr = await self.fs.requests.symlink(parent_inode, name, target, ctx.uid, ctx.gid, _request_id(ctx))
        return _entry(attr, self.generation, self._kept_for(parent_inode))

    async def unlink(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        self.fs.requests.unlink(parent_inode, name, _request_id(ctx))

    async def rmdir(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        await self.fs.requests.rmdir(parent_inode, name, _request_id(ctx))

    async def rename(
        self,
        parent_inode_old: InodeT,
        name_old: FileNameT,
        parent_inode_new: InodeT,
        name_new: FileNameT,
        flags: FlagT,
        ctx: RequestContext,
    ) -> None:
        await self.fs.requests.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, _request_id(ctx))

    async def create(
        self, parent_inode: InodeT, name: FileNameT, mode: ModeT, flags: FlagT, ctx: RequestContext
    ) -> tuple[FileInfo, EntryAttributes]:
        fh, attr = await self.fs.requests.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid, _request_id(ctx))
        return self._file_info(fh, ctx), _entry(attr, self.generation, self._kept_for(parent_inode))

    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        return self._file_info(await self.fs.requests.open(inode, flags, _request_id(ctx)), ctx)

    def _file_info(self, fh: int, ctx: RequestContext) -> FileInfo:
        direct_io, keep_cache = self.fs.caching(fh)
        info = pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=keep_cache)
        backing = self.fs.backing_of(fh)
        if backing:
            setattr(info, _BACKING_ID, backing)
        if _HAS_NOFLUSH:
            setattr(info, _NOFLUSH, True)
        self.fs.handed_out(fh, _request_id(ctx))
        return info

    async def read(self, fh: FileHandleT, off: int, size: int) -> bytes:
        started = time.perf_counter()
        failed = True
        try:
            data = await self.fs.read(fh, off, size)
            failed = False
            return data
        except Exception as exc:
            raise _fuse_error(exc, "read", self.faults, self.on_journal_failure) from None
        finally:
            self.op_stats.record("read", started, failed)

    async def write(self, fh: FileHandleT, off: int, buf: bytes) -> int:
        started = time.perf_counter()
        failed = True
        try:
            while True:
                try:
                    written = self.fs.write(fh, off, buf)
                    failed = False
                    return written
                except RoomNeeded:
                    pass
                await self.fs.wait_for_room()
        except Exception as exc:
            raise _fuse_error(exc, "write", self.faults, self.on_journal_failure) from None
        finally:
            self.op_stats.record("write", started, failed)

    async def flush(self, fh: FileHandleT) -> None:
        # Nothing to do at close() (RELEASE records the close; cross-node ordering announced a writer at its
        # open). Handles are opened with FOPEN_NOFLUSH where this pyfuse3 can say so (_file_info); else
        # ENOSYS tells the kernel to stop sending FLUSH altogether: one round trip less for every close(),
        # one of the six a small file cost the writer.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: FileHandleT) -> None:
        self.fs.release(fh)

    async def fsync(self, fh: FileHandleT, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    async def fallocate(self, fh: FileHandleT, mode: int, offset: int, length: int) -> None:
        # Called by a pyfuse3 with the project's addition (scripts/pyfuse3-passthrough.patch); with the stock
        # one, libfuse answers ENOSYS and the kernel EOPNOTSUPP to every fallocate(2), as it always did.
        # Also for handles with passthrough: the kernel never passes FALLOCATE to the backing file itself.
        await self.fs.fallocate(fh, mode, offset, length)

    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        await self.fs.ensure_listed(inode)
        fh = self.fs.opendir(inode)
        if not _HAS_CACHE_READDIR:
            return fh
        # The kernel keeps the listing in its page cache (FOPEN_CACHE_DIR) and does not drop it at the next
        # opendir (FOPEN_KEEP_CACHE): a directory read again is answered without a READDIRPLUS. It drops it
        # itself when it changes the directory (create, unlink, rename, ... in it) or sees its mtime change;
        # what changes it behind the kernel's back (another node's changes, retention, refresh) drops it
        # with forget_kernel_data of the directory. Every opendir still comes here, and lists the store
        # again first if the listing is stale, so a cached listing is never older than the journal's.
        info = pyfuse3.FileInfo(fh=fh, keep_cache=True)
        setattr(info, _CACHE_READDIR, True)
        return cast(FileHandleT, info)  # the stock pyfuse3's signature knows only the handle

    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken) -> None:
        # Always a READDIRPLUS (pyfuse3 turns READDIRPLUS_AUTO off): each entry's attributes cost Python time
        # here, once per uncached read of the listing, and spare the kernel a LOOKUP per name afterwards.
        # One EntryAttributes for the whole reply, refilled per entry: readdir_reply copies it into the
        # reply buffer (a walk of a big tree sends every entry through here). The entries are read lazily,
        # so those that no longer fit in the kernel's buffer cost a journal row, not their attributes.
        reply = pyfuse3.readdir_reply
        # A directory's handle is its inode (Filesystem.opendir).
        entry = _entry_template(self.generation, self._kept_for(fh))
        after = start_id
        # The inodes the kernel took a reference to, counted at once when the reply is done.
        sent: list[int] = []
        sent_one = sent.append
        try:
            while True:
                before = len(sent)
                for name, attr, next_id in self.fs.readdir(fh, after, READDIR_BATCH):
                    _fill(entry, attr)
                    if not reply(token, name, entry, next_id):
                        return
                    sent_one(attr.ino)
                    after = next_id
                if len(sent) - before < READDIR_BATCH:
                    return
        finally:
            self.fs.remember_many(sent)

    async def releasedir(self, fh: FileHandleT) -> None:
        return None

    async def fsyncdir(self, fh: FileHandleT, datasync: bool) -> None:
        self.fs.fsyncdir()

    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        info = self.fs.statfs()
        data = pyfuse3.StatvfsData()
        data.f_bsize = info.block_size
        data.f_frsize = info.block_size
        data.f_blocks = info.blocks
        data.f_bfree = info.blocks_free
        data.f_bavail = info.blocks_free
        data.f_files = info.files
        data.f_ffree = info.files_free
        data.f_favail = info.files_free
        data.f_namemax = info.name_max
        return data

    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        return self.fs.getxattr(inode, name)  # ENODATA is ENOATTR on Linux

    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> Sequence[XAttrNameT]:
        return self.fs.listxattr(inode)

    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes, ctx: RequestContext) -> None:
        self.fs.setxattr(inode, name)

    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        self.fs.setxattr(inode, name)
