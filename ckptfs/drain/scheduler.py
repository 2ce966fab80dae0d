"""The drain's scheduler: scans the journal for work and chooses the jobs that may start, in order, for
dispatch.py to run as slots free up. `Drain` is also what the rest of ckptfs talks to.

Owns: the rounds of scan and dispatch (rate-limited, woken by notify/mount_changed), choosing the jobs of
a scan in order (what is due; the rules of ordering.py decide what must still wait; under a preemption
notice preemption.py's order), and the fault isolation that keeps one entry's failure that entry's.
Running the jobs (slots, claimed keys, small uploads in batches, a job's end) is dispatch.py's; retries and
parking are retries.py's; the jobs are uploads.py's, spills.py's and namespace_jobs.py's; flush waiters
durability.py's; aborts and sweeps cleanup.py's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from ckptfs.cache.directory import CacheDir
from ckptfs.drain import ordering
from ckptfs.drain.cleanup import Cleanup
from ckptfs.drain.dispatch import Dispatcher
from ckptfs.drain.durability import Durability, FlushResult
from ckptfs.drain.namespace_jobs import NamespaceJobs
from ckptfs.drain.object_records import ObjectRecords
from ckptfs.drain.open_uploads import OpenUploads
from ckptfs.drain.ordering import CommitMarkers, Job, below, keyed
from ckptfs.drain.preemption import REPLAN_INTERVAL, Preemption, choose
from ckptfs.drain.retries import Parked, Retries
from ckptfs.drain.spill_jobs import SpillJobs
from ckptfs.drain.stats import DrainStats
from ckptfs.drain.uploads import SMALL_FILE, Uploads
from ckptfs.errors import Faults
from ckptfs.journal import DIR, FILE, Inode, Journal, journal_unusable
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

SCAN_LIMIT = 2000
# Scans start at least this far apart, however often the filesystem notifies.
MIN_SCAN_INTERVAL = 0.02
# During a burst of namespace changes, scans its own notifications cause start at least this far apart: a
# scan is six queries, some of which read every file waiting out upload_delay, and it runs on the thread
# that answers the writer's next create (a scan every MIN_SCAN_INTERVAL took an eighth of that thread in
# bench's small-file workload). What a burst notifies is not due at once anyway (upload_delay); a flush,
# cache pressure and finished jobs (notify) still wake the drain at once.
BURST_SCAN_INTERVAL = 0.25
# While a file is open for writing and early spills are on, the drain looks this often whether it has grown
# by a part (writes do not notify it).
EARLY_SPILL_POLL = 0.25
# A burst of namespace changes (a save writing many small files) has ended once the mount has seen none for
# this long: small files wait for that (see Drain.mount_changed), at most small_file_wait seconds.
BURST_QUIET = 0.5
# After an unexpected error in the scan itself, the next scan waits this long (doubling up to the cap).
SCAN_FAILURE_PAUSE = 1.0
SCAN_FAILURE_PAUSE_CAP = 30.0


class Drain:
    def __init__(
        self,
        journal: Journal,
        cache: CacheDir,
        engine: Transfers,
        *,
        transfers: int = 8,
        upload_delay: float = 2.0,
        small_file_wait: float = 10.0,
        commit_markers: tuple[str, ...] = (),
        upload_while_writing: str = "off",
        open_upload_idle: float | None = None,
        clock: Callable[[], float] = time.time,
        faults: Faults | None = None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.upload_delay = upload_delay
        self.small_file_wait = small_file_wait
        self.markers = CommitMarkers(commit_markers)
        self.clock = clock
        self.stats = DrainStats()
        self.faults = faults if faults is not None else Faults()
        self._new_work = trio.Event()
        self._urgent = trio.Event()  # notify(), not mount_changed(): scan without the burst's coalescing
        self._changed_at = -math.inf  # trio time of the mount's last namespace change (mount_changed)
        # The earliest retry of an entry whose job could not be chosen in this scan (_isolated): its scan's due.
        self._choice_retry_at = math.inf
        # Whether a closed commit marker must still wait for other nodes (nodes.PeerRecords.blocks); the
        # drain is notified when that may have changed.
        self.waits_for_nodes: Callable[[Inode], bool] = lambda inode: False
        # Why a commit marker still waits for other nodes (None: it does not), for flush's answer.
        self.why_marker_waits: Callable[[Inode], str | None] = lambda inode: None

        self.retries = Retries(journal, self.stats, self.faults, engine.store.url)
        self.records = ObjectRecords(journal, self.markers)
        self.preemption = Preemption(journal, self.markers)
        # Gateway mode: files still open for writing are uploaded once idle (None: only after their close).
        self.open_uploads = OpenUploads(journal, cache, open_upload_idle)
        self.cleanup = Cleanup(engine, notify=self.notify)
        self.durability = Durability(journal, self.cleanup, self.retries, self.markers, notify=self.notify,
                                     why_marker_waits=lambda inode: self.why_marker_waits(inode),
                                     note_open_changes=self.open_uploads.note_changes)
        self.cleanup.progressed = self.durability.progressed
        self.spills = SpillJobs(
            journal, cache, engine, self.records, self.markers, self.stats, discard_upload=self.discard_upload,
            # Early spills stage files being written while the cache has room, where the store can place
            # them at their key without a copy (see UploadState.early).
            early=upload_while_writing == "on" or (
                upload_while_writing == "auto" and engine.store.limits.completes_anywhere),
        )
        self.uploads = Uploads(journal, cache, engine, self.records, self.spills, self.retries, self.markers,
                               self.stats, self.open_uploads, marker_blocked=self._marker_blocked)
        self.namespace = NamespaceJobs(journal, engine, self.records, self.retries, self.stats, clock=clock,
                                   marker_blocked=self._marker_blocked)
        # The jobs running now, and the batches of small uploads (its lane) waiting for the writer to let them.
        self.dispatcher = Dispatcher(transfers, self.uploads, self.spills, self.namespace, self.retries,
                                     self.durability, notify=self.notify, pressed=self._pressed)
        self.lane = self.dispatcher.lane

    # -- what the rest of ckptfs calls -----------------------------------------------------------------

    def notify(self) -> None:
        """Something in the journal may have become work."""
        self.stats.idle = False
        self._new_work.set()
        self._urgent.set()
        self.lane.wake()

    def mount_changed(self) -> None:
        """The fs package, after each change that may be work: a file closed after writing, a name created, renamed
        or removed. While these keep coming (a save writing many small files), small files wait for a
        pause of BURST_QUIET before they are uploaded, for at most small_file_wait seconds beyond
        upload_delay: their uploads are mostly fixed cost per file (a request, its signing, a journal
        update), CPU and GIL that the writer waiting on each create and close would otherwise share. Large
        files and everything else go on as before; a flush, cache pressure and shutdown do not wait."""
        self._changed_at = trio.current_time()
        self.stats.idle = False
        self._new_work.set()
        self.preemption.stale = True  # a close may complete a step: the next scan replans

    def fsynced(self, inode_id: int) -> None:
        """A file was fsynced (an NFS server's COMMIT arrives so): in gateway mode, a file open for writing
        is due for upload now."""
        if self.open_uploads.enabled:
            self.open_uploads.fsynced(inode_id)
            self.notify()

    def set_pressure(self, on: bool) -> None:
        """The cache is full (cache/evictor.py calls this every round while it is): upload closed files at once,
        ignoring upload_delay, and spill files being written, until it is not."""
        self.spills.pressure = on
        if on:
            self.notify()  # each round of the evictor: a file may have grown enough to spill since

    @property
    def foreground_at(self) -> Callable[[], float]:
        """time.perf_counter() at the end of the FUSE layer's last request (lane.py; the daemon wires it)."""
        return self.lane.foreground_at

    @foreground_at.setter
    def foreground_at(self, clock: Callable[[], float]) -> None:
        self.lane.foreground_at = clock

    def preempt(self) -> None:
        """A preemption notice: from now on, the newest complete step first (preemption.py), upload_delay
        ignored. It lasts until the daemon ends."""
        if not self.preemption.active:
            log.warning("preemption notice: uploading the newest complete step first; deletes and steps still"
                        " being written wait")
        self.preemption.begin(trio.current_time())
        self.notify()

    def is_commit_marker(self, name: str | None) -> bool:
        return self.markers.match(name)

    def in_flight(self) -> int:
        return len(self.dispatcher.running) - self.lane.waiting

    def discard_upload(self, state_text: str) -> None:
        """A file with a staged upload or spill (its journaled `upload_state`) was removed: abort it."""
        self.cleanup.discard_upload(state_text)

    async def wait_durable(self, paths: list[str] | None) -> None:
        """See Durability.wait_durable."""
        await self.durability.wait_durable(paths)

    def pending(self, paths: list[str] | None) -> list[str]:
        """See Durability.pending."""
        return self.durability.pending(paths)

    async def flush(self, paths: list[str] | None, deadline: float) -> FlushResult:
        return await self.durability.flush(paths, deadline)

    def failure_of(self, inode_id: int) -> str | None:
        return self.retries.failure_of(inode_id)

    def failing(self) -> list[tuple[str, Parked]]:
        return self.retries.failing()

    def markers_held(self) -> list[tuple[str, str]]:
        """(commit marker, the failing entry that holds it back) for every pending marker a parked job holds
        back (ordering.held_by): what `ckptfs status` names and ckptfs_markers_held counts."""
        failing = [p.inode_id for p in self.retries.parked.values() if p.job != "delete"]
        if not failing:
            return []
        failing_inodes = list(self.journal.names.get_many(failing).values())
        held = []
        for inode in self.journal.work.pending_uploads():
            if inode.path is not None and self.markers.match(inode.name):
                by = ordering.held_by(inode, failing_inodes)
                if by is not None:
                    held.append((inode.path, by))
        return held

    @property
    def spill_room(self) -> int:
        return self.spills.room

    @property
    def on_spilled(self) -> Callable[[int], None]:
        """Called with an inode id once a spilled file is uploaded: its local copy has holes, evict it."""
        return self.spills.on_spilled

    @on_spilled.setter
    def on_spilled(self, hook: Callable[[int], None]) -> None:
        self.spills.on_spilled = hook

    @property
    def on_marker_uploaded(self) -> Callable[[Inode], None]:
        """Called once a commit marker is in the store: a checkpoint is complete (retention runs then)."""
        return self.records.on_marker_uploaded

    @on_marker_uploaded.setter
    def on_marker_uploaded(self, hook: Callable[[Inode], None]) -> None:
        self.records.on_marker_uploaded = hook

    # -- rounds ----------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Scan and dispatch until cancelled. Nothing but an unusable journal ends it: a job's failure is
        the job's (dispatch.py), one entry's failure in a scan is that entry's (_isolated), and any other
        failure of a round is logged, counted, and the next round comes after a pause."""
        pause = SCAN_FAILURE_PAUSE
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.lane.run, nursery)
            nursery.start_soon(self._guarded, "sweep", self.cleanup.sweep_at_start)
            task_status.started()
            while True:
                try:
                    await self._round(nursery)
                    pause = SCAN_FAILURE_PAUSE
                except Exception as exc:
                    if journal_unusable(exc):
                        raise
                    log.error("the drain's scan failed unexpectedly; scanning again in %.0f s", pause, exc_info=exc)
                    self._fault("scan", exc)
                    await trio.sleep(pause)
                    pause = min(pause * 2, SCAN_FAILURE_PAUSE_CAP)

    async def _round(self, nursery: trio.Nursery) -> None:
        self._new_work = trio.Event()
        self._urgent = trio.Event()
        scanned_at = trio.current_time()
        scan_began = self.clock()
        while self.cleanup.discarded:
            nursery.start_soon(self._guarded, "abort", self.cleanup.abort_discarded, self.cleanup.discarded.pop())
        sweep_at = self.cleanup.sweep_wanted_at()
        if sweep_at <= scanned_at:
            nursery.start_soon(self._guarded, "sweep", self.cleanup.sweep)
            sweep_at = math.inf
        jobs, next_due = self._scan()
        next_due = min(next_due, sweep_at)
        if not await self.dispatcher.dispatch(jobs, nursery, scanned_at, self._new_work):
            self.stats.scans += 1
            self.stats.last_scan_at = scan_began
            self.stats.idle = not self._new_work.is_set()
            self.stats.next_scan_at = None if next_due == math.inf else self.clock() + next_due - trio.current_time()
            try:
                with trio.move_on_at(next_due):
                    await self._new_work.wait()
            finally:
                self.stats.idle = False
        # Coalesce a burst of notifications (thousands of small files closing) into one scan.
        await trio.sleep_until(scanned_at + MIN_SCAN_INTERVAL)
        if self._in_burst() and not self._urgent.is_set():
            with trio.move_on_at(scanned_at + BURST_SCAN_INTERVAL):
                await self._urgent.wait()

    def _in_burst(self) -> bool:
        """The mount is in a burst of namespace changes and nothing presses (no flush waits, no cache
        pressure): the burst's own notifications need no scan of their own."""
        return (trio.current_time() < self._changed_at + BURST_QUIET and not self.spills.pressure
                and not self.durability.waiting and not self.preemption.active)

    async def _guarded(self, what: str, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """A background step whose unexpected failure is logged and counted, never the drain's end (an
        abort or a sweep not done now is done later: the store's leftovers are swept again)."""
        try:
            await fn(*args)
        except Exception as exc:
            if journal_unusable(exc):
                raise
            log.error("the drain's %s failed unexpectedly", what, exc_info=exc)
            self._fault(what, exc)

    def _fault(self, what: str, exc: BaseException) -> None:
        message = f"{what}: {exc!r}"
        self.faults.record("drain", message)
        self.stats.errors += 1
        self.stats.last_error = message
        self.stats.last_error_at = time.time()

    @contextmanager
    def _isolated(self, kind: str, inode: Inode) -> Iterator[None]:
        """Choosing the job of one entry: an unexpected error there is that entry's failure (logged with
        it, counted, retried later like a failed job), not the end of the scan of all the others."""
        try:
            yield
        except Exception as exc:
            if journal_unusable(exc):
                raise
            self.retries.failed_unexpectedly(Job(kind, inode.id, ()), exc, entry=inode.path)
            # Nothing else may wake the drain for it: the scan that chose this round is due again then.
            self._choice_retry_at = min(self._choice_retry_at, self.retries.due_at((kind, inode.id)))

    # -- choosing jobs -----------------------------------------------------------------------------------

    def _scan(self) -> tuple[list[Job], float]:
        """Work that may start now, in order, and the trio time at which more becomes due. Reads only
        rows that are due, so thousands of files waiting out upload_delay cost nothing per scan."""
        now_wall = self.clock()
        now = trio.current_time()
        next_due = math.inf
        jobs: list[Job] = []
        self._choice_retry_at = math.inf
        pressure = self.spills.pressure
        cut_off = math.inf if pressure or self.durability.waiting or self.preemption.active else (
            now_wall - self.upload_delay)
        small_cut_off = cut_off
        if cut_off != math.inf:
            next_close = self.journal.work.next_close_after(cut_off)
            if next_close is not None:
                next_due = now + (next_close + self.upload_delay - now_wall)
            burst_ends = self._changed_at + BURST_QUIET
            if self.small_file_wait > 0 and now < burst_ends:
                # In a burst (mount_changed): small files only once they waited small_file_wait too. The
                # scans the burst's own notifications cause, and one when it ends, pick up the rest.
                small_cut_off = cut_off - self.small_file_wait
                next_due = min(next_due, burst_ends)
        if self.lane.waiting:
            # The small lane has uploads queued: it needs no more yet, and the scan does not read the small
            # files it holds (thousands of rows at every round of a save). Its last batch's end rescans.
            small_cut_off = -math.inf

        def waiting(job_id: tuple[str, int], inode: Inode | None = None) -> bool:
            nonlocal next_due
            if inode is not None and self.retries.parked:
                self.retries.unpark_if_changed(job_id, inode)
            if job_id in self.dispatcher.running:
                return True
            retry_at = self.retries.due_at(job_id)
            if retry_at > now:
                next_due = min(next_due, retry_at)
                return True
            return False

        misplaced = self.journal.work.misplaced(SCAN_LIMIT)
        unmarked = ordering.unmarked_dirs(
            self.journal.work.dirs_to_upload() + [inode for inode in misplaced if inode.kind == DIR], self.markers,
            retrying=lambda inode_id: any(self.retries.due_at((kind, inode_id)) > now for kind in ("upload", "move")))
        for inode, key in keyed(self.journal.work.uploads_due(cut_off, SCAN_LIMIT, small=(SMALL_FILE, small_cut_off))):
            if waiting(("upload", inode.id), inode) or ("spill", inode.id) in self.dispatcher.running:
                continue
            with self._isolated("upload", inode):
                if self._marker_blocked(inode) or (unmarked and below(key, unmarked)):
                    continue
                if self._target_taken(inode, key):
                    continue
                small = (inode.kind == FILE and inode.size <= SMALL_FILE and inode.upload_state is None
                         and not self.markers.match(inode.name))
                jobs.append(Job("upload", inode.id, (key,), small, inode.size))
        open_files_wanted = pressure or self.spills.early or self.open_uploads.enabled
        open_ids = self.journal.copies.open_dirty_files() if open_files_wanted else []
        if self.open_uploads.enabled:
            next_due = min(next_due, self._scan_open(open_ids, jobs, unmarked, waiting, now, now_wall))
        if pressure or self.spills.early:
            for inode_id in open_ids:
                if waiting(("spill", inode_id)) or ("upload", inode_id) in self.dispatcher.running:
                    continue
                if self.spills.spillable(inode_id) >= self.spills.part_size:
                    if unmarked and below(self._path(inode_id), unmarked):
                        continue
                    jobs.append(Job("spill", inode_id, ()))
                elif not pressure:
                    # Writes do not notify the drain (the write path stays free of it): look again soon.
                    next_due = min(next_due, now + EARLY_SPILL_POLL)
        for inode, key in keyed(misplaced):
            if inode.remote_key is None or waiting(("move", inode.id), inode):
                continue
            with self._isolated("move", inode):
                if self._marker_blocked(inode) or (unmarked and below(key, unmarked)):
                    continue
                if self._target_taken(inode, key) and not ordering.breaks_move_cycle(
                        inode, key, self.journal.work.key_owner):
                    continue
                jobs.append(Job("move", inode.id, (inode.remote_key, key)))
        for inode, key in keyed(self.journal.work.meta_stale(SCAN_LIMIT)):
            if waiting(("meta", inode.id), inode):
                continue
            jobs.append(Job("meta", inode.id, (key,)))
        for delete in self.journal.deletes.pending_deletes(SCAN_LIMIT):
            if waiting(("delete", delete.id)):
                continue
            jobs.append(Job("delete", delete.id, (delete.key,)))
        if self.preemption.active:
            jobs = self._preempt_order(jobs)
            next_due = min(next_due, now + REPLAN_INTERVAL)  # a step may become complete
        return jobs, min(next_due, self._choice_retry_at)

    def _preempt_order(self, jobs: list[Job]) -> list[Job]:
        """Under a notice: the jobs of a scan that may start, in the order of preemption.choose; running
        uploads and spills it leaves out are cut short (they resume from their saved parts)."""
        self.preemption.replan_if_due(trio.current_time())
        running = self.dispatcher.running
        ids = {job.ident for job in jobs if job.kind != "delete"} | {i for k, i in running if k != "delete"}
        inodes = self.journal.names.get_many(ids)

        def rank(kind: str, ident: int) -> int | None:
            inode = inodes.get(ident)
            return None if inode is None else self.preemption.rank_of(inode.path)

        chosen, cut = choose(jobs, running, rank, self.preemption.other_rank)
        self.dispatcher.cut(cut)
        return chosen

    def _scan_open(
        self, open_ids: list[int], jobs: list[Job], unmarked: set[str],
        waiting: Callable[[tuple[str, int]], bool], now: float, now_wall: float,
    ) -> float:
        """Gateway mode: add the uploads of files open for writing that are due (idle, fsynced, or any
        while a flush waits); the trio time at which the next one becomes due."""
        # Writes never notify the drain (with passthrough the daemon does not even see them): look again soon.
        next_due = now + self.open_uploads.poll_interval if open_ids else math.inf
        # A full cache does not hurry them: a file open for writing stays in the cache whether uploaded or not.
        urgent = bool(self.durability.waiting)
        self.open_uploads.forget_gone(open_ids)
        for inode in self.journal.names.get_many(open_ids).values():
            if (inode.key is None or waiting(("upload", inode.id))
                    or ("spill", inode.id) in self.dispatcher.running):
                continue
            due_at = self.open_uploads.due_at(inode, urgent)
            if due_at is None:
                continue
            if due_at > now_wall:
                next_due = min(next_due, now + (due_at - now_wall))
                continue
            with self._isolated("upload", inode):
                if self._marker_blocked(inode) or (unmarked and below(inode.key, unmarked)):
                    continue
                if self._target_taken(inode, inode.key):
                    continue
                jobs.append(Job("upload", inode.id, (inode.key,), False, inode.size))
        return next_due

    def _path(self, inode_id: int) -> str:
        inode = self.journal.names.get(inode_id)
        return inode.path if inode is not None and inode.path is not None else ""

    def _marker_blocked(self, inode: Inode) -> bool:
        """ordering.marker_blocked, with the journal's work and the other nodes as they are now. Its
        completion rescans."""
        if not self.markers.match(inode.name):
            return False
        step = self.preemption.step_dir(inode) if self.preemption.active else None
        if step is not None:
            # Under a notice a step's marker waits for its own step only (preemption.py).
            return self.waits_for_nodes(inode) or bool(self.journal.work.work_before_under(inode.seq, step, 1))
        return ordering.marker_blocked(inode, self.markers, self.waits_for_nodes,
                                       lambda seq: bool(self.journal.work.work_before(seq, 1))) or (
            # Gateway mode: also the files whose last change is older than the marker's, open or not.
            self.open_uploads.enabled and self.open_uploads.holds_back(inode, self.journal.copies.open_pending_files()))

    def _target_taken(self, inode: Inode, key: str) -> bool:
        """ordering.target_taken, with the journal's owner of `key` now."""
        return ordering.target_taken(inode, self.journal.work.key_owner(key))

    def _pressed(self) -> bool:
        """A flush waits or the cache needs room: small uploads do not wait for a lull in the writer's
        requests then (lane.py)."""
        return self.spills.pressure or bool(self.durability.waiting) or self.preemption.active
