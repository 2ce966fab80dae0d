"""The evictor: keeps the cache within its budget, and makes writers wait when it cannot.

Owns: which clean files leave the cache (least recently used first; never dirty, uploading or open ones),
when (above a high-water mark, down to a low-water mark, so that writers rarely meet a full cache), and
back-pressure: a write that finds the cache over its budget waits here until eviction or the drain makes
room, up to `dirty_wait`, then fails with ENOSPC. While writers wait it asks the drain (through
`on_pressure`) to upload at once, ignoring upload_delay, and to spill files still open for writing.

An evicted file keeps its inode and becomes 'remote': the next read fetches what it needs (fetch/). A clean
file whose cache file no longer matches the journal's record (written through a handle the kernel kept
after an earlier daemon died without a takeover) is never evicted: it becomes dirty and is uploaded again.
The files that were open for writing at such a death are watched (a stat a round) until nothing holds
their cache file open any more, or they have been unchanged for STALE_QUIET, so that what such handles
write later is uploaded too; a watched file is never evicted.
Partial files of remote objects (fetch/) count against the budget too: those no handle has open are
dropped like clean files, and chunks of open ones that no reader is near are punched out.
Files a prefetch brought in (fetch/prefetch.py) are `kept`: never evicted until a handle opens them (a
restart reads them) or `ckptfs prefetch --release` lets them go; the journal records them, so a daemon that
restarts keeps them too (KeptFiles).
Everything here runs in the trio thread; eviction itself is a journal update and an unlink.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import trio

from ckptfs.cache.directory import CacheDir
from ckptfs.config import human_size
from ckptfs.errors import FsError
from ckptfs.journal import CLEAN, FILE, REMOTE, Inode, Journal, JournalFull, rewritten

log = logging.getLogger(__name__)

# Eviction starts above HIGH_WATER x limit and goes down to LOW_WATER x limit.
HIGH_WATER = 0.95
LOW_WATER = 0.90
# How often the budget is re-measured against the filesystem (others may fill it).
MEASURE_INTERVAL = 1.0
# How often a waiting writer re-checks for room the drain made (an upload finishing makes a file evictable).
WAIT_POLL = 0.05
# Back-pressure episodes are logged at most this often.
LOG_INTERVAL = 30.0
# A cache filesystem short of min_free is warned about at most this often.
SQUEEZE_LOG_INTERVAL = 600.0
# A file left open for writing by a daemon that died without a takeover is watched until its cache file has
# been unchanged this long (seconds): a job whose mount went away stops writing soon after.
STALE_QUIET = 600.0


def held_open_elsewhere(path: str) -> bool:
    """Is the file open anywhere but here: by a process, or by the kernel for a writer's handle it kept after
    a daemon died (FUSE passthrough's backing file)? A write lease is granted only to a file's one opener
    (fcntl(2), F_SETLEASE), so it is taken and let go at once. A lease is broken with SIGIO to its holder,
    whose default action ends the process: an open that comes in the moment it is held must not, so SIGIO
    is ignored (this process uses no signal-driven I/O). Unknown (leases off, not the main thread) counts as
    held."""
    if threading.current_thread() is not threading.main_thread():
        return True
    if signal.getsignal(signal.SIGIO) is not signal.SIG_IGN:
        signal.signal(signal.SIGIO, signal.SIG_IGN)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return True
    else:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)


@dataclass
class EvictStats:
    evicted_files: int = 0
    evicted_bytes: int = 0
    waits: int = 0  # writes (and fetches) that had to wait for room
    wait_seconds: float = 0.0
    enospc: int = 0  # waits that gave up after dirty_wait


class DroppablePartials(Protocol):
    """Partial files of remote objects being read (fetch.PartialFiles): more room the evictor can make."""

    def droppable(self) -> list[int]:
        """Inode ids whose partial file no handle has open: dropped like clean files (LRU)."""
        ...

    def drop(self, inode_id: int) -> int:
        """Remove that partial file; the bytes freed."""
        ...

    def punch(self, wanted: int, *, keep_read_ahead: bool = False) -> int:
        """Free chunks of open partial files that no reader is near; the bytes freed."""
        ...


KEPT_META = "prefetch_kept"  # the journal's meta key of the kept files' inode ids (a JSON list)


class KeptFiles(set[int]):
    """The inode ids of the files a prefetch keeps in the cache until they are read (fetch/prefetch.py),
    and whether they changed since the journal last recorded them (`changed`). A keep starts with the
    prefetch and is recorded then; one that ends (an open, a release, a removal) is recorded by the
    evictor's next round, never on the request's path: a daemon killed in between keeps that file again
    after its restart, until it is read or released (a keep longer, never shorter)."""

    changed = False

    def update(self, *others: Iterable[int]) -> None:
        super().update(*others)
        self.changed = True

    def discard(self, item: object) -> None:
        if item in self:
            super().discard(item)
            self.changed = True

    def save(self, journal: Journal) -> None:
        """Record them in the journal if they changed (a full cache filesystem: the next round tries again)."""
        if not self.changed:
            return
        try:
            with journal.transaction():
                journal.set_meta(KEPT_META, json.dumps(sorted(self)))
        except JournalFull:
            return
        self.changed = False

    def load(self, journal: Journal, cached: Iterable[int]) -> None:
        """At start-up: the ones the journal recorded that still have a cache file (`cached`)."""
        try:
            recorded = {int(inode_id) for inode_id in json.loads(journal.get_meta(KEPT_META) or "[]")}
        except (ValueError, TypeError) as exc:  # not what save() writes: start with no keeps, and say so
            log.warning("the journal's record of the prefetched files kept in the cache is unreadable (%s);"
                        " they are evictable again", exc)
            recorded = set()
            self.changed = True
        super().update(recorded & set(cached))
        self.changed = self.changed or len(self) != len(recorded)


class Evictor:
    def __init__(
        self,
        journal: Journal,
        cache: CacheDir,
        *,
        in_use: Callable[[int], bool],
        dirty_wait: float = 600.0,
        on_pressure: Callable[[bool], None] = lambda on: None,
        on_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.in_use = in_use
        self.dirty_wait = dirty_wait
        self.on_pressure = on_pressure
        self.on_changed = on_changed  # a file became dirty here (written behind the daemon): the drain's work
        self.stats = EvictStats()
        self.forget_kernel_attrs: Callable[[int], None] = lambda inode_id: None  # set by the daemon
        # inode id -> when it was last opened or closed (monotonic seconds, or the data file's atime
        # for files not touched since start-up: both only order files, never compared to a clock).
        self.last_used: dict[int, float] = {}
        self._kick = trio.Event()
        self._room = trio.Event()
        self._waiters = 0
        self._pressure = False
        self._logged_at = -LOG_INTERVAL
        self._squeezed = False
        self._squeeze_logged_at = -SQUEEZE_LOG_INTERVAL
        self.partials: DroppablePartials | None = None  # set by the fetcher
        # inode id -> since when (time.time()) its cache file has been seen unchanged: files a writer the
        # kernel kept after a daemon died may still change (journal.copies.stale_writers, set by drain/recovery.py).
        self.stale: dict[int, float] = {}
        self._warned_stale: set[int] = set()
        # Files a prefetch wants in the cache until they are read (fetch/prefetch.py): never evicted. An open
        # takes a file out (touch); so do a release and a removal (forget). Journaled: a restart keeps them.
        self.kept = KeptFiles()

    def start(self, atimes: dict[int, float]) -> None:
        """Seed the LRU order with the data files' access times (from CacheDir.scan at start-up)."""
        offset = time.monotonic() - time.time()
        self.last_used = {inode_id: atime + offset for inode_id, atime in atimes.items()}
        self.stale = self.journal.copies.stale_writers()
        self.kept.load(self.journal, atimes)

    def touch(self, inode_id: int, *, opened: bool = True) -> None:
        """The file was used now (LRU). `opened`: a handle opened or closed it, which ends a prefetch's
        keep: it was read once, and from now on it leaves the cache like any other file."""
        self.last_used[inode_id] = time.monotonic()
        if opened:
            self.kept.discard(inode_id)

    def forget(self, inode_id: int) -> None:
        self.last_used.pop(inode_id, None)
        self.kept.discard(inode_id)

    @property
    def waiting(self) -> int:
        return self._waiters

    # -- the background task ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await self._rounds()
        finally:
            with contextlib.suppress(Exception):  # the daemon's stop: what a round did not record yet
                self.kept.save(self.journal)

    async def _rounds(self) -> None:
        while True:
            with trio.move_on_after(WAIT_POLL if self._waiters else MEASURE_INTERVAL):
                await self._kick.wait()
            self._kick = trio.Event()
            self.kept.save(self.journal)
            self.cache.measure()
            self.cache.remeasure_all()
            if self.stale:
                self.watch_stale_writers(time.time())
            self._note_squeeze()
            self.evict_if_needed()
            self._set_pressure(self._waiters > 0 or self.cache.used > self.cache.limit)
            room, self._room = self._room, trio.Event()
            room.set()

    def kick(self) -> None:
        self._kick.set()

    def _note_squeeze(self) -> None:
        squeezed = self.cache.squeezed
        if squeezed == self._squeezed:
            return
        self._squeezed = squeezed
        now = time.monotonic()
        if squeezed and now - self._squeeze_logged_at >= SQUEEZE_LOG_INTERVAL:
            # Free space hovering around min_free flips this every second: say it once per interval.
            self._squeeze_logged_at = now
            log.warning(
                "the filesystem of the cache dir %s has %s free and min_free keeps %s of it: the cache is down"
                " to %s, and files being written are uploaded in parts while they are written (a write into a"
                " part already uploaded fails with EIO). Free space on that filesystem, or lower --min-free",
                self.cache.root, human_size(self.cache.free_bytes), human_size(self.cache.min_free_bytes),
                human_size(int(self.cache.limit)),
            )
        elif not squeezed:
            log.debug("the cache filesystem has room again: the cache budget is %s", human_size(int(self.cache.limit)))

    def watch(self, inode_ids: set[int], now: float) -> None:
        """Watch these files from now on (and the next daemons, through the journal): a writer the kernel
        keeps may write them without the daemon."""
        self.stale.update(dict.fromkeys(inode_ids, now))
        with contextlib.suppress(JournalFull), self.journal.transaction():
            self.journal.copies.set_stale_writers(self.stale)

    def watch_stale_writers(self, now: float) -> None:
        """One round of the watch: a watched file written since the journal's record becomes dirty (a new
        version: an upload in flight does not count it clean); one unchanged for STALE_QUIET, or gone, is
        no longer watched."""
        before = dict(self.stale)
        try:
            for inode_id, quiet_since in before.items():
                inode = self.journal.names.get(inode_id)
                if inode is None or inode.kind != FILE or inode.path is None or inode.state == REMOTE:
                    del self.stale[inode_id]
                    continue
                entry = self.cache.files.get(inode_id)
                if inode.closed_at is None or (entry is not None and (entry.sealed or entry.freed)):
                    # A writer of this daemon records its close; a spill punches its own cache file.
                    continue
                try:
                    st = os.stat(self.cache.data_path(inode_id))
                except FileNotFoundError:
                    del self.stale[inode_id]
                    continue
                try:
                    changed = self._rewritten_behind(inode, st, now)
                except JournalFull:
                    continue  # the next round tries again: this task must not die of a full cache filesystem
                if not held_open_elsewhere(self.cache.data_path(inode_id)):
                    # Its writer is gone (nothing holds the cache file open any more): what it wrote is
                    # journaled above, and nothing can write it behind the journal again.
                    del self.stale[inode_id]
                elif changed:
                    self.stale[inode_id] = now
                elif now - quiet_since >= STALE_QUIET:
                    del self.stale[inode_id]
        finally:
            if self.stale != before:
                with contextlib.suppress(JournalFull), self.journal.transaction():
                    self.journal.copies.set_stale_writers(self.stale)

    def _rewritten_behind(self, inode: Inode, st: os.stat_result, now: float) -> bool:
        """If the cache file changed behind the journal's record, journal a new dirty version of it."""
        if not rewritten(inode, st):
            return False
        # Once per file: such a writer may go on writing for a while.
        (log.debug if inode.id in self._warned_stale else log.warning)(
            "%s changed without the daemon (a writer the kernel kept after a daemon died, or a shared mmap"
            " written after its close): uploading it again", inode.path,
        )
        self._warned_stale.add(inode.id)
        with self.journal.transaction():
            self.journal.copies.rewritten_behind(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns, now=now)
        self.cache.observe(inode.id, st)
        self.on_changed()
        return True

    def evict_if_needed(self) -> int:
        """Evict least recently used clean files while the cache is above its high-water mark."""
        limit = self.cache.limit
        if self.cache.used <= limit * HIGH_WATER:
            return 0
        return self.evict(self.cache.used - int(limit * LOW_WATER))

    def evict(self, wanted: int, *, punch: bool = True) -> int:
        """Evict clean, closed files and partial files no handle has open, least recently used first,
        then punch chunks of open partial files no reader is near, until `wanted` bytes are freed or no
        candidate is left; return the bytes freed. Synchronous: nothing can open a file meanwhile."""
        freed = 0
        if wanted <= 0:
            return 0
        candidates = self.journal.copies.clean_files()
        partial = set(self.partials.droppable()) if self.partials is not None else set()
        candidates.extend(partial)
        candidates.sort(key=lambda inode_id: self.last_used.get(inode_id, 0.0))
        for inode_id in candidates:
            if freed >= wanted:
                break
            if inode_id in partial and self.partials is not None:
                freed += self.partials.drop(inode_id)
                continue
            if self.in_use(inode_id) or inode_id in self.stale or inode_id in self.kept:
                continue
            try:
                freed += self._evict_one(inode_id)
            except JournalFull:  # see _evict_one
                break
        if punch and freed < wanted and self.partials is not None:
            freed += self.partials.punch(wanted - freed)
        return freed

    def evict_if_clean(self, inode_id: int) -> None:
        """Evict this file now if it is clean and closed (a spilled file once its upload completed:
        its start is punched out, so only the store's copy is whole)."""
        if not self.in_use(inode_id) and inode_id not in self.kept:
            with contextlib.suppress(JournalFull):  # the LRU rounds evict it later
                self._evict_one(inode_id)

    def _evict_one(self, inode_id: int) -> int:
        entry = self.cache.files.get(inode_id)
        try:
            st = os.stat(self.cache.data_path(inode_id))
        except FileNotFoundError:
            return 0
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.state != CLEAN:
            return 0
        if not (entry is not None and (entry.sealed or entry.freed)) and self._rewritten_behind(inode, st, time.time()):
            # Only the cache file holds those bytes: upload them, and watch the file for more.
            self.watch({inode_id}, time.time())
            return 0
        # Evicting frees room, but the journal must record it first: when the cache filesystem is too full
        # for that (others filled it), JournalFull leaves the file until something else makes room.
        with self.journal.transaction():
            if not self.journal.copies.mark_evicted(inode_id, size=st.st_size, mtime_ns=st.st_mtime_ns):
                return 0
        charge = entry.charge if entry is not None else st.st_size
        self.cache.remove_data(inode_id)
        # Its attributes now come from the journal (st_blocks from the size): the kernel's go
        # (mount/adapter.py forget_kernel_attrs, which takes no lock a request holds: safe in the trio thread).
        self.forget_kernel_attrs(inode_id)
        self.last_used.pop(inode_id, None)
        self.stats.evicted_files += 1
        self.stats.evicted_bytes += charge
        log.debug("evicted inode %d (%d bytes)", inode_id, charge)
        return charge

    def _set_pressure(self, on: bool) -> None:
        # Repeated while on: the drain looks for more to spill each time.
        if on or on != self._pressure:
            self._pressure = on
            self.on_pressure(on)

    # -- back-pressure --------------------------------------------------------------------------------

    async def wait_for_room(self, needed: int = 0, *, what: str = "a write") -> None:
        """Return once `needed` more bytes fit in the budget (0: once the cache is back within it).
        Evicts first; then waits for the drain, up to dirty_wait; then raises FsError(ENOSPC)."""
        if self._fits(needed):
            return
        self.evict(self.cache.used + needed - int(self.cache.limit * LOW_WATER))
        if self._fits(needed):
            return
        self.stats.waits += 1
        self._waiters += 1
        started = trio.current_time()
        self._set_pressure(True)
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL:
            self._logged_at = now
            log.info(
                "cache full (%s used of a %s budget, mostly data not yet uploaded): writes wait for the drain"
                " for up to %ss", human_size(self.cache.used), human_size(int(self.cache.limit)), self.dirty_wait,
            )
        try:
            with trio.move_on_after(self.dirty_wait):
                # The evictor task re-checks every WAIT_POLL while someone waits, and wakes us after each
                # round: kicking it once is enough (kicking it every round would spin both).
                self.kick()
                while not self._fits(needed):
                    await self._room.wait()
                    # The evictor's own rounds evict only above the high-water mark; a waiter that needs
                    # more (a chunk of a read) evicts for itself once files it waits for became clean.
                    self.evict(self.cache.used + needed - int(self.cache.limit * LOW_WATER))
                return
            self.stats.enospc += 1
            fix = (
                "free space on the cache dir's filesystem or lower --min-free" if self.cache.squeezed
                else "raise cache_size or dirty_wait"
            )
            log.error(
                "%s gave up after waiting %ss for room in the cache (%s used of %s): ENOSPC. The drain is"
                " not keeping up or the store refuses uploads (see ckptfs status); %s",
                what, self.dirty_wait, human_size(self.cache.used), human_size(int(self.cache.limit)), fix,
            )
            raise FsError(errno.ENOSPC, "cache full of data not yet uploaded")
        finally:
            self._waiters -= 1
            self.stats.wait_seconds += trio.current_time() - started
            self.kick()

    def _fits(self, needed: int) -> bool:
        return self.cache.used + needed <= self.cache.limit

