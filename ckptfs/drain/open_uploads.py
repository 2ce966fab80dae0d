"""Uploads of files still open for writing (gateway mode: `idle_upload`, `gateway`), for a mount that an NFS
server exports: the server keeps files open long after its clients closed them, and never closes some.

Owns: when such a file is due (idle for `idle` seconds, FSYNC_QUIET after an fsync, at once while a flush waits), the
snapshot an upload of it commits (the cache file's identity, size, mtime and ctime, taken once every write in
flight has ended and the file's pages are written back, and again after staging: a difference throws the
staged copy away), which snapshot the store holds (in memory: a restart uploads such files again at their
close, which recovery records), the content version a flush or a new snapshot needs (a new one once the file
changed since the store's copy), and what a commit marker waits for in gateway mode (the files whose last
change is older than the marker's). The upload itself is uploads.py's, with its content-version checks.

Why the cache file and not the writes: with FUSE passthrough the kernel writes the cache file itself, so the
daemon never sees a write; its mtime and ctime are the clock of the idle time and the witness of a change.
A write or an mmap fault updates them before it changes a byte (file_update_time, page_mkwrite on ext4, xfs
and btrfs), and after the fsync every mapped page is write-protected again, so a change after the first
snapshot shows in the second, provided the snapshot's timestamps are older than the moment the snapshot
began by more than the filesystem clock's granularity (QUIET; a whole second where the filesystem keeps
whole seconds). A write still copying when the snapshot begins holds the inode lock, which lseek(SEEK_DATA)
waits for (ext4, tmpfs, btrfs).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptfs.cache.directory import CacheDir
from ckptfs.journal import FILE, Inode, Journal

# A snapshot holds if the file's last change is at least this much older than the moment the snapshot
# began: longer than a tick of the kernel's coarse clock (4 ms at HZ=250, 10 ms at HZ=100), so that any later
# change gets a later timestamp.
QUIET = 0.05
# The same on a filesystem whose timestamps are whole seconds (ext4 with 128-byte inodes, some FUSE ones).
COARSE_QUIET = 1.05
# An fsync (an NFS COMMIT) makes an open file due once its last write is this old (at most `idle`): the
# Linux NFS client also COMMITs in the middle of a long write, whenever its writeback has caught up, and a
# snapshot taken in such a gap would stage the start of a file still being saved, for nothing.
FSYNC_QUIET = 1.0
# After a snapshot that a change spoilt, a file due at once (fsync, flush) waits this long after its last
# change, doubling per spoilt snapshot up to `idle`: a writer that keeps writing is not staged over and over.
RETRY_QUIET = 0.1
# Writes never tell the drain: it looks at the files open for writing every idle/4 seconds, within these.
POLL_BOUNDS = (0.05, 1.0)


@dataclass(frozen=True)
class Snapshot:
    """What identifies one content of a cache file: a write, a truncate, an mmap fault or a replaced file
    changes at least one of these."""

    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @property
    def changed_ns(self) -> int:
        return max(self.mtime_ns, self.ctime_ns)

    def quiet(self) -> float:
        """Seconds its last change must lie behind a snapshot's start (the filesystem's clock granularity)."""
        return COARSE_QUIET if self.mtime_ns % 1_000_000_000 == 0 and self.ctime_ns % 1_000_000_000 == 0 else QUIET


def snapshot_of(st: os.stat_result) -> Snapshot:
    return Snapshot(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settle(path: str) -> tuple[float, Snapshot]:
    """For a worker thread: wait for writes in flight, write the file's dirty pages back (which
    write-protects mapped ones, so that the next mmap write updates mtime), and take its snapshot; with the
    wall time at which this began."""
    began = time.time()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            os.lseek(fd, 0, os.SEEK_DATA)  # takes the inode lock a buffered write holds
        except OSError as exc:
            if exc.errno not in (errno.ENXIO, errno.EINVAL):  # no data at all; no SEEK_DATA here
                raise
        os.fsync(fd)
        return began, snapshot_of(os.fstat(fd))
    finally:
        os.close(fd)


def stat_snapshot(path: str) -> Snapshot | None:
    try:
        return snapshot_of(os.stat(path))
    except FileNotFoundError:
        return None


class OpenUploads:
    def __init__(self, journal: Journal, cache: CacheDir, idle: float | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.journal = journal
        self.cache = cache
        self.idle = idle if idle is not None else 0.0
        self.enabled = idle is not None
        self.clock = clock
        # The snapshot whose content the store holds, per file open for writing (and closed since, until
        # its close is recorded as that upload).
        self._stored: dict[int, Snapshot] = {}
        # The snapshot an upload is staging now, per file.
        self._staging: dict[int, Snapshot] = {}
        # Files fsynced while open (an NFS COMMIT): due at once.
        self._fsynced: set[int] = set()
        # Snapshots a change spoilt, per file, since its last upload (RETRY_QUIET).
        self._spoilt: dict[int, int] = {}

    @property
    def poll_interval(self) -> float:
        return min(max(self.idle / 4, POLL_BOUNDS[0]), POLL_BOUNDS[1])

    def path(self, inode_id: int) -> str:
        return str(self.cache.data_path(inode_id))

    def current(self, inode_id: int) -> Snapshot | None:
        return stat_snapshot(self.path(inode_id))

    # -- when ----------------------------------------------------------------------------------------

    def fsynced(self, inode_id: int) -> None:
        self._fsynced.add(inode_id)

    def in_store(self, inode: Inode, snap: Snapshot) -> bool:
        """Does the store hold this snapshot of the file, at its current key (not renamed since)?"""
        return snap == self._stored.get(inode.id) and inode.remote_key == inode.key

    def due_at(self, inode: Inode, urgent: bool) -> float | None:
        """The wall time at which this open file's upload is due; None: the store holds it as it is (or
        it is gone). `urgent`: a flush waits, so the idle time does not count."""
        inode_id = inode.id
        snap = self.current(inode_id)
        if snap is None or self.in_store(inode, snap) or snap == self._staging.get(inode_id):
            self._fsynced.discard(inode_id)
            return None
        changed = snap.changed_ns / 1e9
        if urgent or inode_id in self._fsynced:
            wait = 0.0 if urgent else min(self.idle, FSYNC_QUIET)
            if inode_id in self._spoilt:
                wait = max(wait, min(self.idle, RETRY_QUIET * 2 ** self._spoilt[inode_id]))
            return changed + max(wait, snap.quiet())
        return changed + max(self.idle, snap.quiet())

    # -- an upload's snapshot ----------------------------------------------------------------------------

    def holds(self, began: float, snap: Snapshot) -> bool:
        """Is `snap`, taken by settle() from `began` on, one that any later change would alter?"""
        return snap.changed_ns < (began - snap.quiet()) * 1e9

    def staging(self, inode_id: int, snap: Snapshot) -> None:
        self._staging[inode_id] = snap

    def staged(self, inode_id: int, snap: Snapshot, *, committed: bool) -> None:
        """The upload of `snap` ended: committed (the store holds it now) or thrown away."""
        if self._staging.get(inode_id) == snap:
            del self._staging[inode_id]
        if committed:
            self._stored[inode_id] = snap
            self._spoilt.pop(inode_id, None)
            self._fsynced.discard(inode_id)
        else:
            self._spoilt[inode_id] = min(self._spoilt.get(inode_id, 0) + 1, 16)

    def unchanged_since_upload(self, inode: Inode, key: str) -> bool:
        """A closed file whose content the store got while it was open, unchanged since: its close needs no
        upload of its own."""
        stored = self._stored.pop(inode.id, None)
        self._spoilt.pop(inode.id, None)
        self._fsynced.discard(inode.id)
        return (stored is not None and inode.uploaded_version == inode.version and inode.remote_key == key
                and self.current(inode.id) == stored)

    def forget_gone(self, open_ids: Iterable[int]) -> None:
        """Drop what is kept of files no longer open for writing and no longer pending (removed, or their
        close recorded otherwise)."""
        keep = set(open_ids)
        for inode_id in [i for i in self._stored if i not in keep]:
            inode = self.journal.names.get(inode_id)
            if inode is None or inode.path is None or inode.state not in ("dirty", "uploading"):
                del self._stored[inode_id]
        for gone in [i for i in (*self._spoilt, *self._fsynced) if i not in keep and i not in self._stored]:
            self._spoilt.pop(gone, None)
            self._fsynced.discard(gone)

    # -- versions and markers ----------------------------------------------------------------------------

    def note_changes(self, inode_ids: Iterable[int]) -> None:
        """Before a flush takes what is pending: an open file whose content changed since the store's copy
        (or since the snapshot being staged) gets a new content version, so that the flush waits for an
        upload of its content as it is now, not for the older one."""
        if not self.enabled:
            return
        for inode_id in inode_ids:
            snap = self.current(inode_id)
            if snap is None or snap in (self._stored.get(inode_id), self._staging.get(inode_id)):
                continue
            with self.journal.transaction():
                self.journal.work.new_content_version(inode_id)

    def holds_back(self, marker: Inode, open_ids: Iterable[int]) -> bool:
        """Gateway ordering of a commit marker: does a file whose last change is older than the marker's
        (by the cache files' ctime) still lack that content in the store? A file open for writing counts
        unless the store holds its current snapshot; a closed pending file counts too (its seq may be
        later than the marker's: the server closed it after the marker was written)."""
        mine = self.current(marker.id)
        if mine is None:
            return False
        for inode in self.journal.names.get_many([i for i in open_ids if i != marker.id]).values():
            snap = self.current(inode.id)
            if snap is not None and snap.changed_ns <= mine.changed_ns and not self.in_store(inode, snap):
                return True
        for inode in self.journal.work.closed_pending_after(marker.seq):
            if inode.id == marker.id or inode.kind != FILE:
                continue
            snap = self.current(inode.id)
            if snap is not None and snap.changed_ns <= mine.changed_ns:
                return True
        return False
