"""The drain: makes the store converge on the journal's namespace, in the background.

Owns: choosing work from the journal (uploads of dirty files, directory markers and symlinks; moves of
objects whose inode was renamed after upload; metadata rewrites after chmod/utime; pending deletes), the
order constraints between them (one operation per store key at a time; no write to a key whose old object
still waits to be moved away; commit markers after everything before them; directory markers deleted after
their contents), write-ahead deletes before every object it creates, journaling the progress of resumable
uploads, retries with backoff, and the waiters of `ckptfs flush`.

It learns its work only from the journal and records results only there; blocking store calls run in
worker threads. Between two awaits a run of journal calls is atomic, so every job re-reads its inode after
each await before it records anything. The protocol is written up in docs/design/drain.md.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import trio
import trio.lowlevel

from ckptfs.backends.base import ObjectMeta, UploadState, backoff_delays
from ckptfs.cache import CacheDir, CacheFile
from ckptfs.errors import (
    BackendError,
    Faults,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
)
from ckptfs.journal import (
    DIR,
    FILE,
    SYMLINK,
    UPLOADING,
    Inode,
    Journal,
    PendingDelete,
    journal_full,
    journal_unusable,
)
from ckptfs.transfer import Priority, PutFile, SmallFile, SourceChangedError, StagedUpload, Transfers

log = logging.getLogger(__name__)

# How far _breaks_move_cycle follows a chain of moves waiting for each other.
MOVE_CYCLE_LIMIT = 1000
SCAN_LIMIT = 2000
# While new work keeps arriving, rescan at most this often (a scan reads up to SCAN_LIMIT rows).
RESCAN_INTERVAL = 0.2
# Scans start at least this far apart, however often the filesystem notifies.
MIN_SCAN_INTERVAL = 0.02
# A flush re-checks the items whose jobs finished at most this often, and all of its items this often.
FLUSH_POLL = 0.05
FULL_CHECK_INTERVAL = 1.0
# A spill leaves this much of the end of a file being written in the cache (a writer may still seek back
# a little, e.g. to patch a header), and takes parts of the engine's part size.
SPILL_LOOKAHEAD = 16 << 20
# While a file is open for writing and early spills are on, the drain looks this often whether it has grown
# by a part (writes do not notify it).
EARLY_SPILL_POLL = 0.25
# Closed files up to SMALL_FILE bytes upload together, up to SMALL_BATCH per job: one journal transaction
# and one worker-thread hop for all of them instead of three and two per file (_upload_small).
SMALL_FILE = 1 << 20
SMALL_BATCH = 64
SMALL_BATCH_BYTES = 16 << 20
# A burst of namespace changes (a save writing many small files) has ended once the mount has seen none for
# this long: small files wait for that (see Drain.mount_changed), at most small_file_wait seconds.
BURST_QUIET = 0.5
# Sweeps of the store's leftovers after one failed: the first this long after, doubling up to the cap.
SWEEP_RETRY_FIRST = 30.0
SWEEP_RETRY_CAP = 600.0
# A flush ends with a sweep if a cleanup failed (so that it leaves nothing of ours but objects behind), for
# at most this long.
SWEEP_AT_FLUSH = 60.0
# A sweep lists only while no store call runs; it holds new calls off for at most this long waiting for
# the running ones (a stalled upload), and else tries again later.
SWEEP_PATIENCE = 5.0
# A job that fails unexpectedly (a bug, not a store error) this many times in a row is parked: retried
# only every PARKED_RETRY seconds, and named by `ckptfs status` and `ckptfs flush` until it succeeds.
PARK_AFTER = 3
PARKED_RETRY = 600.0
# After an unexpected error in the scan itself, the next scan waits this long (doubling up to the cap).
SCAN_FAILURE_PAUSE = 1.0
SCAN_FAILURE_PAUSE_CAP = 30.0


@dataclass(frozen=True)
class Job:
    kind: str  # "upload", "spill", "move", "meta" or "delete"
    ident: int  # inode id, or pending delete id
    keys: tuple[str, ...]  # store keys this job must hold exclusively
    small: bool = False  # an upload of a small closed file: it may go in a batch (_upload_small)
    size: int = 0  # of a small file


class Uploaded(NamedTuple):
    """An object the store now holds for an inode, to be recorded (Drain._record_uploads)."""

    inode_id: int
    key: str
    version: int
    checksum: str | None
    size: int
    write_ahead: int  # the id of the delete queued before the object appeared


@dataclass
class DrainStats:
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0
    moves: int = 0
    deletes: int = 0
    spilled_bytes: int = 0
    errors: int = 0
    errors_by_job: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    last_error_at: float | None = None


@dataclass(frozen=True)
class Parked:
    """A job parked after failing unexpectedly PARK_AFTER times in a row (see Drain.failing)."""

    job: str  # "upload", "move", "meta", ...
    inode_id: int  # the pending delete's id for a "delete" job
    error: str
    since: float  # wall-clock time it was parked
    seq: int  # the inode's seq then: once the entry changes (a close, a rename), it is tried again at once


@dataclass
class FlushResult:
    ok: bool
    remaining: list[str]


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
        clock: Callable[[], float] = time.time,
        faults: Faults | None = None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.store = engine.store
        self.upload_delay = upload_delay
        self.small_file_wait = small_file_wait
        self.commit_markers = commit_markers
        self._marker_pattern = (
            re.compile("|".join(fnmatch.translate(glob) for glob in commit_markers)) if commit_markers else None
        )
        self.clock = clock
        self.stats = DrainStats()
        self.faults = faults if faults is not None else Faults()
        # Unexpected failures in a row per job, and the jobs parked after PARK_AFTER of them.
        self._unexpected: dict[tuple[str, int], int] = {}
        self._parked: dict[tuple[str, int], Parked] = {}
        self._upload_slots = trio.Semaphore(transfers)
        self._other_slots = trio.Semaphore(transfers * 2)
        self._new_work = trio.Event()
        self._changed_at = -math.inf  # trio time of the mount's last namespace change (mount_changed)
        self._progress = trio.Event()
        self._running: set[tuple[str, int]] = set()
        self._busy_keys: set[str] = set()
        self._retry_at: dict[tuple[str, int], float] = {}
        self._attempts: dict[tuple[str, int], int] = {}
        self._expedite = 0
        self._flush_waiters: list[set[tuple[str, int]]] = []
        self._permanent_reported: set[str] = set()
        self._pressure = False
        # Staged uploads and spills of files removed meanwhile: aborted here, so that their parts do not
        # sit in the store until the next start-up's cleanup.
        self._discarded: list[UploadState] = []
        self._discards_running = 0
        # Background sweeps of leftovers while a cleanup failed (an abort, a sweep, the store's own).
        self._sweeps_running = 0
        self._sweep_due = math.inf
        self._sweep_delay = SWEEP_RETRY_FIRST
        self.spill_part_size = engine.part_size
        self.spill_lookahead = SPILL_LOOKAHEAD
        # Early spills: files being written are staged while the cache has room, where the store can then
        # place them at their key without a copy (see UploadState.early).
        self.early_spills = upload_while_writing == "on" or (
            upload_while_writing == "auto" and self.store.limits.completes_anywhere)
        # Called with an inode id once a spilled file is uploaded: its local copy has holes, evict it.
        self.on_spilled: Callable[[int], None] = lambda inode_id: None
        # Called once a commit marker is in the store: a checkpoint is complete (retention runs then).
        self.on_marker_uploaded: Callable[[Inode], None] = lambda inode: None
        # Whether a closed commit marker must still wait for other nodes (nodes.PeerRecords.blocks); the
        # drain is notified when that may have changed.
        self.waits_for_nodes: Callable[[Inode], bool] = lambda inode: False
        # Why a commit marker still waits for other nodes (None: it does not), for flush's answer.
        self.why_marker_waits: Callable[[Inode], str | None] = lambda inode: None

    # -- public ------------------------------------------------------------------------------------------

    def notify(self) -> None:
        """Something in the journal may have become work."""
        self._new_work.set()

    def mount_changed(self) -> None:
        """fs.py, after each change that may be work: a file closed after writing, a name created, renamed
        or removed. While these keep coming (a save writing many small files), small files wait for a
        pause of BURST_QUIET before they are uploaded, for at most small_file_wait seconds beyond
        upload_delay: their uploads are mostly fixed cost per file (a request, its signing, a journal
        update), CPU and GIL that the writer waiting on each create and close would otherwise share. Large
        files and everything else go on as before; a flush, cache pressure and shutdown do not wait."""
        self._changed_at = trio.current_time()
        self._new_work.set()

    def set_pressure(self, on: bool) -> None:
        """The cache is full (evict.py calls this every round while it is): upload closed files at once,
        ignoring upload_delay, and spill files being written, until it is not."""
        if on != self._pressure:
            self._expedite += 1 if on else -1
            self._pressure = on
        if on:
            self.notify()  # each round of the evictor: a file may have grown enough to spill since

    def is_commit_marker(self, name: str | None) -> bool:
        return name is not None and self._marker_pattern is not None and self._marker_pattern.match(name) is not None

    def in_flight(self) -> int:
        return len(self._running)

    def discard_upload(self, state_text: str) -> None:
        """A file with a staged upload or spill (its journaled `upload_state`) was removed: abort it."""
        try:
            state = UploadState.from_json(state_text)
        except (ValueError, KeyError, TypeError):
            return
        self._discarded.append(state)
        self.notify()

    def _forget_upload_state(self, inode_id: int, aborted: UploadState) -> None:
        """Drop the journal's record of an upload just aborted (if it is still that one), so that a purge
        does not hand it to discard_upload again."""
        inode = self.journal.get(inode_id)
        if inode is None or inode.upload_state is None:
            return
        journaled = _journaled_upload_id(inode)
        if journaled is not None and journaled != aborted.upload_id:
            return  # a newer upload's (an unreadable record is dropped too)
        with self.journal.transaction():
            self.journal.save_upload_state(inode_id, None)

    async def _abort_discarded(self, state: UploadState) -> None:
        self._discards_running += 1
        try:
            await self.engine.abort_state(state)
            log.debug("aborted the staged upload of a removed file (%s)", state.key)
        finally:
            self._discards_running -= 1
            self._progress.set()
            self._progress = trio.Event()

    async def _sweep(self) -> None:
        """Remove the leftovers a failed cleanup left (in the background, or at the end of a flush); if the
        store refuses, the background tries again later, backing off."""
        self._sweeps_running += 1
        try:
            removed = await self.engine.sweep_leftovers(patience=SWEEP_PATIENCE)
        except BackendError as exc:
            log.warning("cannot remove the leftovers of interrupted uploads from the store: %s; trying again"
                        " in %.0f s", exc, self._sweep_delay)
            self._sweep_due = trio.current_time() + self._sweep_delay
            self._sweep_delay = min(self._sweep_delay * 2, SWEEP_RETRY_CAP)
        else:
            if removed is None:  # the store calls running did not let it list: not the store's fault
                self._sweep_due = trio.current_time() + SWEEP_RETRY_FIRST
            else:
                self._sweep_delay = SWEEP_RETRY_FIRST
            if removed:
                log.info("removed %d leftovers of interrupted uploads from the store", removed)
        finally:
            self._sweeps_running -= 1
            self.notify()

    def _sweep_wanted_at(self) -> float:
        """The trio time of the next background sweep (math.inf: none wanted)."""
        if self._sweeps_running:
            return math.inf
        if not self.engine.sweep_due:
            self._sweep_due = math.inf
            return math.inf
        if self._sweep_due == math.inf:  # a cleanup failed just now: give the store some time
            self._sweep_due = trio.current_time() + self._sweep_delay
        return self._sweep_due

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Scan and dispatch until cancelled. Nothing but an unusable journal ends it: a job's failure is
        the job's (_attempt), one entry's failure in a scan is that entry's (_isolated), and any other
        failure of a round is logged, counted, and the next round comes after a pause."""
        pause = SCAN_FAILURE_PAUSE
        async with trio.open_nursery() as nursery:
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
        scanned_at = trio.current_time()
        while self._discarded:
            nursery.start_soon(self._guarded, "abort", self._abort_discarded, self._discarded.pop())
        sweep_at = self._sweep_wanted_at()
        if sweep_at <= scanned_at:
            self._sweep_due = math.inf
            nursery.start_soon(self._guarded, "sweep", self._sweep)
            sweep_at = math.inf
        jobs, next_due = self._scan()
        next_due = min(next_due, sweep_at)
        if not await self._dispatch(jobs, nursery, scanned_at):
            with trio.move_on_at(next_due):
                await self._new_work.wait()
        # Coalesce a burst of notifications (thousands of small files closing) into one scan.
        await trio.sleep_until(scanned_at + MIN_SCAN_INTERVAL)

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
            self._failed_unexpectedly(Job(kind, inode.id, ()), exc, entry=inode.path)

    async def _dispatch(self, jobs: list[Job], nursery: trio.Nursery, scanned_at: float) -> bool:
        """Start the jobs of a scan as slots free up, small uploads in batches of up to SMALL_BATCH (one
        upload slot each). True if it stopped early for new work."""
        batch: list[Job] = []
        batch_bytes = 0
        holding = False  # an upload slot for `batch`
        interrupted = False
        try:
            for job in jobs:
                if job.small:
                    if not holding:
                        await self._upload_slots.acquire()
                        holding = True
                    if self._claim(job):
                        batch.append(job)
                        batch_bytes += job.size
                    if len(batch) < SMALL_BATCH and batch_bytes < SMALL_BATCH_BYTES:
                        continue
                if batch:
                    nursery.start_soon(self._run_batch, batch, self._upload_slots)  # it owns the slot now
                    batch, batch_bytes = [], 0
                elif holding:
                    self._upload_slots.release()  # never wait for a slot while holding one
                holding = False
                if not job.small:
                    slots = self._upload_slots if job.kind in ("upload", "spill") else self._other_slots
                    await slots.acquire()
                    if not self._claim(job):
                        slots.release()
                        continue
                    nursery.start_soon(self._run_job, job, slots)
                if self._new_work.is_set() and trio.current_time() - scanned_at > RESCAN_INTERVAL:
                    interrupted = True
                    break
        finally:
            if batch:
                nursery.start_soon(self._run_batch, batch, self._upload_slots)
            elif holding:
                self._upload_slots.release()
        return interrupted

    async def wait_durable(self, paths: list[str] | None) -> None:
        """Return once everything under `paths` (None: everything) that is pending now is durable in the
        store, ignoring upload_delay meanwhile. Files open for writing count as pending. The caller owns
        the timeout (trio.move_on_after); `pending(paths)` then says what is left."""
        items = self._outstanding(paths)
        deletes = {d.id: d.key for d in self.journal.pending_deletes() if _in_scope(d.key, paths)}
        # Jobs that finish while we wait, so that each check looks only at what may have changed; a full
        # check now and then catches what changed without a job (an unlink, a rename).
        finished: set[tuple[str, int]] = set()
        self._flush_waiters.append(finished)
        self._expedite += 1
        self.notify()
        try:
            collected_old_copies = False
            full_check_due = -math.inf
            while True:
                checked_at = trio.current_time()
                if checked_at >= full_check_due:
                    self._drop_durable(items, deletes)
                    full_check_due = checked_at + FULL_CHECK_INTERVAL
                else:
                    self._drop_durable(items, deletes, only=finished)
                finished.clear()
                if not items and not deletes and not self._discarded and not self._discards_running:
                    if collected_old_copies:
                        return
                    # Uploads and moves queue deletes of the copies they replace; wait for those too,
                    # so that the store shows the namespace as it was, not stale names beside it.
                    collected_old_copies = True
                    deletes = {d.id: d.key for d in self.journal.pending_deletes() if _in_scope(d.key, paths)}
                    continue
                with trio.move_on_at(full_check_due):
                    await self._progress.wait()
                await trio.sleep_until(checked_at + FLUSH_POLL)
        finally:
            self._expedite -= 1
            self._flush_waiters.remove(finished)

    def pending(self, paths: list[str] | None) -> list[str]:
        """What under `paths` is not yet durable in the store, now."""
        items = self._outstanding(paths)
        deletes = {d.id: d.key for d in self.journal.pending_deletes() if _in_scope(d.key, paths)}
        self._drop_durable(items, deletes)
        failing = {parked.inode_id: parked.error for parked in self._parked.values() if parked.job != "delete"}
        paths_left = []
        for inode_id in items:
            inode = self.journal.get(inode_id)
            if inode is None or inode.path is None:
                continue
            error = failing.get(inode_id)
            waiting = self.why_marker_waits(inode) if self.is_commit_marker(inode.name) else None
            if error is not None:
                paths_left.append(f"{inode.path} (failing: {error})")
            elif waiting is not None:
                paths_left.append(f"{inode.path} ({waiting})")
            else:
                paths_left.append(inode.path)
        return paths_left + [f"(delete) {key}" for key in deletes.values()]

    def _path_of(self, inode_id: int) -> str | None:
        inode = self.journal.get(inode_id)
        return inode.path if inode is not None else None

    async def flush(self, paths: list[str] | None, deadline: float) -> FlushResult:
        """wait_durable() until the trio time `deadline` (math.inf: no limit), then a sweep of leftovers if
        a cleanup failed: the store then holds nothing of ours but objects. A sweep that fails or cannot run
        does not fail the flush (leftovers cost storage, not data); the drain tries again later."""
        durable = False
        with trio.move_on_at(deadline):
            await self.wait_durable(paths)
            durable = True
        if not durable:
            return FlushResult(False, self.pending(paths))
        if self.engine.sweep_due:
            with trio.move_on_at(min(deadline, trio.current_time() + SWEEP_AT_FLUSH)):
                await self._sweep()
        return FlushResult(True, [])

    # -- scheduling ----------------------------------------------------------------------------------

    def _outstanding(self, paths: list[str] | None) -> dict[int, int]:
        """inode id -> the version that must reach the store, for everything pending under `paths`."""
        items = {}
        for inode in [*self.journal.pending_uploads(), *self.journal.misplaced(), *self.journal.meta_stale(-1)]:
            if _in_scope(inode.path or "", paths):
                items[inode.id] = inode.version
        return items

    def _drop_durable(
        self, items: dict[int, int], deletes: dict[int, str], only: set[tuple[str, int]] | None = None
    ) -> None:
        """Remove from `items`/`deletes` what is durable now; look only at the jobs in `only` if given.
        A flush of thousands of small files calls this every FLUSH_POLL: it reads the journal once per
        batch of ids, not once per file, so that the wait does not take the GIL from the drain it waits on."""
        if only is None:
            inode_ids: Collection[int] = list(items)
            delete_ids: Collection[int] = list(deletes)
        else:
            inode_ids = [ident for kind, ident in only if kind == "inode" and ident in items]
            delete_ids = [ident for kind, ident in only if kind == "delete" and ident in deletes]
        if inode_ids:
            current = self.journal.get_many(inode_ids)
            for inode_id in inode_ids:
                if _durable(current.get(inode_id), items[inode_id]):
                    del items[inode_id]
        if delete_ids:
            still_pending = self.journal.deletes_pending(delete_ids)
            for delete_id in delete_ids:
                if delete_id not in still_pending:
                    del deletes[delete_id]

    def _scan(self) -> tuple[list[Job], float]:
        """Work that may start now, in order, and the trio time at which more becomes due. Reads only
        rows that are due, so thousands of files waiting out upload_delay cost nothing per scan."""
        now_wall = self.clock()
        now = trio.current_time()
        next_due = math.inf
        jobs: list[Job] = []
        cut_off = math.inf if self._expedite else now_wall - self.upload_delay
        small_cut_off = cut_off
        if cut_off != math.inf:
            next_close = self.journal.next_close_after(cut_off)
            if next_close is not None:
                next_due = now + (next_close + self.upload_delay - now_wall)
            burst_ends = self._changed_at + BURST_QUIET
            if self.small_file_wait > 0 and now < burst_ends:
                # In a burst (mount_changed): small files only once they waited small_file_wait too. The
                # scans the burst's own notifications cause, and one when it ends, pick up the rest.
                small_cut_off = cut_off - self.small_file_wait
                next_due = min(next_due, burst_ends)

        def waiting(job_id: tuple[str, int], inode: Inode | None = None) -> bool:
            nonlocal next_due
            if inode is not None and self._parked:
                self._unpark_if_changed(job_id, inode)
            if job_id in self._running:
                return True
            retry_at = self._retry_at.get(job_id)
            if retry_at is not None and retry_at > now:
                next_due = min(next_due, retry_at)
                return True
            return False

        misplaced = self.journal.misplaced(SCAN_LIMIT)
        unmarked = self._unmarked_dirs(misplaced, now)
        for inode, key in _keyed(self.journal.uploads_due(cut_off, SCAN_LIMIT, small=(SMALL_FILE, small_cut_off))):
            if waiting(("upload", inode.id), inode) or ("spill", inode.id) in self._running:
                continue
            with self._isolated("upload", inode):
                if self._marker_blocked(inode) or (unmarked and _below(key, unmarked)):
                    continue
                if self._target_taken(inode, key):
                    continue
                small = (inode.kind == FILE and inode.size <= SMALL_FILE and inode.upload_state is None
                         and not self.is_commit_marker(inode.name))
                jobs.append(Job("upload", inode.id, (key,), small, inode.size))
        if self._pressure or self.early_spills:
            for inode_id in self.journal.open_dirty_files():
                if waiting(("spill", inode_id)) or ("upload", inode_id) in self._running:
                    continue
                if self._spillable(inode_id) >= self.spill_part_size:
                    if unmarked and _below(self._path(inode_id), unmarked):
                        continue
                    jobs.append(Job("spill", inode_id, ()))
                elif not self._pressure:
                    # Writes do not notify the drain (the write path stays free of it): look again soon.
                    next_due = min(next_due, now + EARLY_SPILL_POLL)
        for inode, key in _keyed(misplaced):
            if inode.remote_key is None or waiting(("move", inode.id), inode):
                continue
            with self._isolated("move", inode):
                if self._marker_blocked(inode) or (unmarked and _below(key, unmarked)):
                    continue
                if self._target_taken(inode, key) and not self._breaks_move_cycle(inode, key):
                    continue
                jobs.append(Job("move", inode.id, (inode.remote_key, key)))
        for inode, key in _keyed(self.journal.meta_stale(SCAN_LIMIT)):
            if waiting(("meta", inode.id), inode):
                continue
            jobs.append(Job("meta", inode.id, (key,)))
        for delete in self.journal.pending_deletes(SCAN_LIMIT):
            if waiting(("delete", delete.id)):
                continue
            jobs.append(Job("delete", delete.id, (delete.key,)))
        return jobs, next_due

    def _unmarked_dirs(self, misplaced: list[Inode], now: float) -> set[str]:
        """Paths of the directories whose marker is still to be written at their path (never uploaded, or
        renamed since and among `misplaced`, the inodes still to be moved): nothing below one is written
        before its marker, which SeaweedFS would lose (see _overlaps_a_marker). Left out, so that they
        hold nothing back: a directory whose marker failed and waits for a retry (the files below go on;
        _overlaps_a_marker still keeps the two apart), and one named like a commit marker (it waits for
        earlier work, which may be below it)."""
        dirs = self.journal.dirs_to_upload() + [inode for inode in misplaced if inode.kind == DIR]
        return {
            d.path for d in dirs
            if d.path is not None and not self.is_commit_marker(d.name)
            and not any(self._retry_at.get((kind, d.id), -math.inf) > now for kind in ("upload", "move"))
        }

    def _path(self, inode_id: int) -> str:
        inode = self.journal.get(inode_id)
        return inode.path if inode is not None and inode.path is not None else ""

    def _marker_blocked(self, inode: Inode) -> bool:
        """A commit marker waits for all work that became work before it, earlier markers included (a
        tracker naming a step must not reach the store before that step's own marker). A file still open
        for writing was not closed before the marker, so it does not count. Its completion rescans. With
        cross-node ordering it also waits for the other nodes' work closed before it (`waits_for_nodes`,
        asked every time so that its listing of the other nodes starts while local work still drains)."""
        if not self.is_commit_marker(inode.name):
            return False
        waits_for_nodes = self.waits_for_nodes(inode)
        return waits_for_nodes or bool(self.journal.work_before(inode.seq, 1))

    def _target_taken(self, inode: Inode, key: str) -> bool:
        """Another inode's object still sits at `key`, waiting to be moved away (a rename after upload,
        then a new file under the old name). Writing `key` now would destroy it: wait for the move, unless
        that inode has local data to upload again (then the write goes first; see Journal.release_key)."""
        owner = self.journal.key_owner(key)
        # A directory's marker holds only metadata: its owner writes it again (Journal.release_key).
        return owner is not None and owner.id != inode.id and not owner.has_local_data and owner.kind != DIR

    def _breaks_move_cycle(self, inode: Inode, key: str) -> bool:
        """Misplaced objects that wait for each other's keys (a swap: `mv x t; mv y x; mv t y` on files
        without local data) never move on their own. The one with the lowest id in such a cycle breaks it:
        its move goes to a parking key first (see _move), which frees its old key (`key` is its new one)
        for the next one."""
        lowest = inode.id
        owner = self.journal.key_owner(key)
        for _ in range(MOVE_CYCLE_LIMIT):
            if owner is None or owner.key is None or owner.remote_key == owner.key or not self._target_taken(
                owner, owner.key
            ):
                return False
            if owner.id == inode.id:
                return inode.id == lowest
            lowest = min(lowest, owner.id)
            owner = self.journal.key_owner(owner.key)
        return False

    def _claim(self, job: Job) -> bool:
        job_id = (job.kind, job.ident)
        try:
            if job_id in self._running or any(k in self._busy_keys for k in job.keys) or self._overlaps_a_marker(job):
                return False
        except Exception as exc:
            if journal_unusable(exc):
                raise
            self._failed_unexpectedly(job, exc)
            return False
        self._running.add(job_id)
        self._busy_keys.update(job.keys)
        return True

    def _overlaps_a_marker(self, job: Job) -> bool:
        """The job would write a directory marker while something below it is being written, or write below
        a marker being written. SeaweedFS drops a marker PUT made at the same moment as an object below
        it (the object's implicit folder wins; measured: 6 of 100 concurrent pairs), and the directory then
        lists only as an implicit folder, gone with its last object."""
        if job.kind == "delete":
            return False
        for key in job.keys:
            if key.endswith("/") and any(busy.startswith(key) for busy in self._busy_keys):
                return True
            if any(parent + "/" in self._busy_keys for parent in _parent_dirs(key.rstrip("/"))):
                return True
        return False

    async def _run_job(self, job: Job, slots: trio.Semaphore) -> None:
        try:
            await self._attempt(job)
        finally:
            self._settle([job], slots)

    async def _run_batch(self, jobs: list[Job], slots: trio.Semaphore) -> None:
        try:
            try:
                rest = await self._upload_small(jobs)
            except Exception as exc:
                if journal_unusable(exc):
                    raise
                for job in jobs:
                    self._failed_unexpectedly(job, exc)
                return
            for job in rest:
                await self._attempt(job)
        finally:
            self._settle(jobs, slots)

    async def _attempt(self, job: Job) -> None:
        """Run one job; a failure schedules its retry."""
        try:
            if job.kind == "upload":
                await self._upload(job.ident, job.keys[0])
            elif job.kind == "spill":
                await self._spill(job.ident)
            elif job.kind == "move":
                await self._move(job.ident, (job.keys[0], job.keys[1]))
            elif job.kind == "meta":
                await self._update_meta(job.ident)
            else:
                await self._delete(job.ident)
        except Exception as exc:
            if journal_unusable(exc):
                raise
            self._failed_unexpectedly(job, exc)
        else:
            self._succeeded(job)

    def _succeeded(self, job: Job) -> None:
        job_id = (job.kind, job.ident)
        self._retry_at.pop(job_id, None)
        self._attempts.pop(job_id, None)
        self._unexpected.pop(job_id, None)
        if self._parked.pop(job_id, None) is not None:
            log.info("%s job of inode %d succeeded again; no longer parked", job.kind, job.ident)

    def _failed_unexpectedly(self, job: Job, exc: Exception, *, entry: str | None = None) -> None:
        job_id, op = (job.kind, job.ident), job.kind
        if isinstance(exc, BackendError):
            self._failed(job_id, op, exc)
        elif journal_full(exc):
            # The cache filesystem is full (others filled it): the journal cannot record this job's
            # result now. Nothing is lost: the job is retried as a store error would be.
            self._failed(job_id, op, TransientBackendError(f"the journal cannot grow: {exc}"))
        else:
            # A bug must not take the mount down with it: report it loudly with its entry, keep the work
            # journaled, and retry with backoff like a store error; park it where retrying keeps failing.
            if entry is None:
                entry = self._entry_of(job.kind, job.ident)
            failures = self._unexpected.get(job_id, 0) + 1
            self._unexpected[job_id] = failures
            log.error("unexpected error in the %s job of %s (inode %d, failure %d); it will be retried", op,
                      entry if entry is not None else "an unlinked entry", job.ident, failures, exc_info=exc)
            self.faults.record("drain", f"{op} {entry}: {exc!r}")
            self._failed(job_id, op, TransientBackendError(f"internal error: {exc!r}"), logged=True)
            if failures >= PARK_AFTER:
                if job_id not in self._parked:
                    log.error("parking the %s job of %s after %d unexpected failures: retried every %.0f s,"
                              " named by `ckptfs status`", op, entry, failures, PARKED_RETRY)
                inode = None if job.kind == "delete" else self.journal.get(job.ident)
                self._parked[job_id] = Parked(op, job.ident, repr(exc), time.time(), inode.seq if inode else -1)
                self._retry_at[job_id] = trio.current_time() + PARKED_RETRY

    def _unpark_if_changed(self, job_id: tuple[str, int], inode: Inode) -> None:
        """A parked entry that changed since (closed again, renamed) is tried again now."""
        parked = self._parked.get(job_id)
        if parked is not None and parked.seq != inode.seq:
            del self._parked[job_id]
            self._retry_at.pop(job_id, None)
            self._unexpected.pop(job_id, None)

    def _entry_of(self, kind: str, ident: int) -> str | None:
        """What a job works on, for messages: the inode's path, or the key of a pending delete (None: gone)."""
        if kind == "delete":
            delete = self.journal.get_pending_delete(ident)
            return None if delete is None else f"(delete) {delete.key}"
        return self._path_of(ident)

    def failure_of(self, inode_id: int) -> str | None:
        """Why a job of this inode is parked (None: none is); the xattr user.ckptfs.error shows it."""
        for (kind, ident), parked in self._parked.items():
            if ident == inode_id and kind != "delete":
                return f"{kind}: {parked.error}"
        return None

    def failing(self) -> list[tuple[str, Parked]]:
        """The parked jobs whose entries still exist, with their paths: what `ckptfs status` names."""
        out = []
        for job_id, parked in list(self._parked.items()):
            entry = self._entry_of(*job_id)
            if entry is None:
                del self._parked[job_id]  # removed meanwhile: nothing left to do
                continue
            out.append((entry, parked))
        return out

    def _settle(self, jobs: list[Job], slots: trio.Semaphore) -> None:
        """Jobs ended (done, failed or cancelled): free their keys and slot, wake flushes and the scanner."""
        for job in jobs:
            self._running.discard((job.kind, job.ident))
            self._busy_keys.difference_update(job.keys)
            for finished in self._flush_waiters:
                finished.add(("delete" if job.kind == "delete" else "inode", job.ident))
        slots.release()
        self._progress.set()
        self._progress = trio.Event()
        # Their outcome may be new work (a restart under a new name, a queued delete, an unblocked
        # marker); scans are cheap and rate-limited by the dispatch loop.
        self.notify()

    def _failed(self, job_id: tuple[str, int], op: str, exc: BackendError, *, logged: bool = False) -> None:
        attempts = self._attempts.get(job_id, 0) + 1
        self._attempts[job_id] = attempts
        delays = backoff_delays(base=0.5, cap=60.0 if isinstance(exc, PermanentBackendError) else 30.0)
        delay = 0.0
        for _ in range(attempts):
            delay = next(delays)
        self._retry_at[job_id] = trio.current_time() + max(delay, 0.05)
        self.stats.errors += 1
        self.stats.errors_by_job[op] = self.stats.errors_by_job.get(op, 0) + 1
        self.stats.last_error = f"{op}: {exc}"
        self.stats.last_error_at = time.time()
        if logged:
            pass
        elif isinstance(exc, PermanentBackendError):
            message = str(exc)
            if message not in self._permanent_reported:
                self._permanent_reported.add(message)
                log.error("%s to %s failed and will be retried until it works: %s", op, self.store.url, exc)
        elif attempts in (1, 5) or attempts % 50 == 0:
            log.warning("%s failed (attempt %d), retrying in %.1fs: %s", op, attempts, delay, exc)

    # -- jobs -------------------------------------------------------------------------------------------

    def _meta(self, inode: Inode) -> ObjectMeta:
        return ObjectMeta(mtime_ns=inode.mtime_ns, mode=inode.mode & 0o7777)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A store call that moves no file data (a directory marker, a copy, a delete), via the engine."""
        return await self.engine.call(fn, *args)

    def _priority(self, inode: Inode) -> Priority:
        return Priority.MARKER if self.is_commit_marker(inode.name) else Priority.UPLOAD

    def _changed_since_scan(self, inode: Inode, scanned_keys: tuple[str, ...], keys: tuple[str, ...]) -> bool:
        """A job waits for a slot after the scan that chose it: by the time it runs, its file may have been
        renamed (`.latest.tmp` to `latest` makes it a commit marker) or rewritten (a marker with a newer
        seq). Such a job does nothing; its completion rescans, and the scan decides afresh."""
        return keys != scanned_keys or self._marker_blocked(inode)

    def _still_due(self, inode_id: int, scanned_key: str) -> Inode | None:
        """The inode, if the upload the scan chose is still to be done now: pending, under the key it was
        chosen for, not a blocked marker, and for a file not open for writing."""
        inode = self.journal.get(inode_id)
        if inode is None or inode.key is None or inode.state not in ("dirty", UPLOADING):
            return None
        if self._changed_since_scan(inode, (scanned_key,), (inode.key,)):
            return None
        if inode.kind == FILE and inode.closed_at is None:
            return None
        return inode

    async def _upload(self, inode_id: int, scanned_key: str) -> None:
        inode = self._still_due(inode_id, scanned_key)
        if inode is None:
            return
        key, version = inode.key, inode.version
        assert key is not None  # _still_due checked
        if inode.kind == FILE:
            spill = await self._spill_state(inode)
            if spill is not None and spill.early and not await self._early_spill_holds(inode, spill):
                spill = None
            if spill is not None:
                await self._finish_spill(inode, spill)
                return
            current = self.journal.get(inode_id)
            if current is None or current.version != version or current.closed_at is None:
                return
            entry = self.cache.files.get(inode_id)
            if entry is not None and entry.freed:
                # Part of the file was spilled and its spill is gone: the cache file has holes, and
                # uploading it would put zeros in the store. Never do that; keep it pending and say so.
                raise RuntimeError(f"{current.path}: spilled part of the file is no longer staged")
            inode = current
            with self.journal.transaction():
                self.journal.begin_upload(inode_id)
            started = trio.current_time()
            resume = await self._resumable_state(inode, key)
            priority = self._priority(inode)
            latest: list[UploadState] = []

            def progress(state: UploadState) -> None:
                latest[:] = [state]
                self._save_upload_state(inode_id, state)

            try:
                staged: StagedUpload = await self.engine.stage_upload(
                    key, self.cache.data_path(inode_id), self._meta(inode), resume=resume, progress=progress,
                    # The journal will call the local copy clean: it must survive power loss as it is.
                    priority=priority, sync_source=True,
                )
            except BaseException as exc:
                current = self.journal.get(inode_id)
                removed = current is None or current.path is None
                # Nothing will resume the staged upload if the file was removed while we staged it (removed
                # before the journal had its state, the purge could not hand it to discard_upload), or if
                # the journal never got its state (a full cache filesystem refused the save).
                if latest and (removed or not _journal_holds(current, latest[0])):
                    with trio.move_on_after(30, shield=True):
                        await self.engine.abort_state(latest[0])
                    self._forget_upload_state(inode_id, latest[0])
                with self.journal.transaction():
                    self.journal.abort_upload(inode_id)
                if removed and isinstance(exc, NotFoundBackendError):
                    return  # its cache file went with it: nothing to upload
                raise
            # Re-check after the awaits: abandon the upload if the file changed, moved or went away.
            current = self.journal.get(inode_id)
            if current is None or current.key != key or current.version != version:
                await self.engine.abort_upload(staged)
                if current is not None:
                    with self.journal.transaction():
                        self.journal.abort_upload(inode_id)
                        self.journal.save_upload_state(inode_id, None)
                    log.debug("upload of %s abandoned: changed or renamed during upload", key)
                return
            write_ahead = self._write_ahead(key)
            try:
                await self.engine.commit_upload(staged, priority=priority)
            except BaseException:
                with self.journal.transaction():
                    self.journal.abort_upload(inode_id)
                raise
            self.stats.uploaded_files += 1
            self.stats.uploaded_bytes += staged.size
            self.stats.upload_seconds += trio.current_time() - started
            self._record_upload(inode_id, key, version, staged.checksum, staged.size, write_ahead)
            log.debug("uploaded %s (%d bytes, %s)", key, staged.size, staged.checksum)
        elif inode.kind == DIR:
            write_ahead = self._write_ahead(key)
            await self._call(self.store.put_dir, key, self._meta(inode))
            self._record_upload(inode_id, key, version, None, 0, write_ahead)
        elif inode.kind == SYMLINK:
            assert inode.target is not None
            write_ahead = self._write_ahead(key)
            await self._call(self.store.put_symlink, key, inode.target, self._meta(inode))
            self._record_upload(inode_id, key, version, None, 0, write_ahead)

    async def _upload_small(self, jobs: list[Job]) -> list[Job]:
        """Upload small closed files together (Transfers.put_files): one transaction begins them, one
        worker-thread hop reads them, one transaction re-checks them and queues their write-ahead deletes,
        one hop PUTs them, one transaction records them. Per file the protocol is _upload's: the version
        read is the version recorded, a file renamed or changed before its PUT is not put (a change is
        also caught between the re-check and its PUT), nothing is recorded for a file removed meanwhile.
        Returns the jobs that need _upload (a staged upload or a spill to finish, a file that grew)."""
        chosen: list[tuple[Job, Inode]] = []
        files: list[SmallFile] = []
        rest: list[Job] = []
        size = 0
        for job in jobs:
            inode = self._still_due(job.ident, job.keys[0])
            if inode is None:
                self._succeeded(job)  # nothing to do now, as in _upload
                continue
            key = inode.key
            assert key is not None  # _still_due checked
            entry = self.cache.files.get(inode.id)
            if (inode.kind != FILE or inode.upload_state is not None or entry is None or entry.freed
                    or entry.size > SMALL_FILE):
                rest.append(job)
                continue
            chosen.append((job, inode))
            size += entry.size
            files.append(SmallFile(key, self.cache.data_path(inode.id), self._meta(inode),
                                   _change_detector(self.cache, inode.id, entry)))
        if not chosen:
            return rest
        keys = [file.key for file in files]
        with self.journal.transaction():
            for _, inode in chosen:
                self.journal.begin_upload(inode.id)
        write_aheads: dict[int, int] = {}

        def commit(read: list[int]) -> list[int]:
            """The files read that are still what was chosen, each with its write-ahead delete queued."""
            wanted = []
            with self.journal.transaction():
                rows = self.journal.get_many([chosen[index][1].id for index in read])
                for index in read:
                    _, inode = chosen[index]
                    current = rows.get(inode.id)
                    if current is None or current.key != inode.key or current.version != inode.version:
                        continue  # changed, moved or gone: not put (see _upload)
                    write_aheads[index] = self._queue_write_ahead(keys[index])
                    wanted.append(index)
            return wanted

        started = trio.current_time()
        try:
            outcomes = await self.engine.put_files(files, size=size, commit=commit)
        except BaseException:
            with self.journal.transaction():
                for _, inode in chosen:
                    self.journal.abort_upload(inode.id)
            raise
        done: list[Uploaded] = []
        undone: list[tuple[Inode, int | None]] = []  # not put (changed, renamed, failed): back to dirty
        failed: list[tuple[Job, BaseException]] = []
        for index, ((job, inode), outcome) in enumerate(zip(chosen, outcomes, strict=True)):
            write_ahead = write_aheads.get(index)
            if isinstance(outcome, PutFile):
                assert write_ahead is not None
                done.append(Uploaded(inode.id, keys[index], inode.version, outcome.checksum, outcome.size,
                                     write_ahead))
                self._succeeded(job)
                continue
            current = self.journal.get(inode.id)
            if outcome is None or isinstance(outcome, SourceChangedError):
                undone.append((inode, write_ahead))  # nothing was put: its write-ahead delete goes
                self._succeeded(job)  # changed or renamed: pending again, the next scan takes it
                continue
            undone.append((inode, None))
            if isinstance(outcome, NotFoundBackendError) and (current is None or current.path is None):
                self._succeeded(job)  # its cache file went with it: nothing to upload
            else:
                failed.append((job, outcome))
        if undone:
            with self.journal.transaction():
                for inode, write_ahead in undone:
                    self.journal.abort_upload(inode.id)
                    if write_ahead is not None:
                        self.journal.delete_done(write_ahead)
        self._record_uploads(done)
        uploaded = len(done)
        if uploaded:
            self.stats.uploaded_files += uploaded
            self.stats.uploaded_bytes += sum(u.size for u in done)
            self.stats.upload_seconds += trio.current_time() - started
        for job, exc in failed:
            self._failed_unexpectedly(job, exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
        if log.isEnabledFor(logging.DEBUG):
            for item in done:
                log.debug("uploaded %s (%d bytes, %s)", item.key, item.size, item.checksum)
            log.debug("uploaded %d of %d small files in one batch", uploaded, len(chosen))
        return rest

    # -- spills: the start of a file still being written leaves the cache (see backends/base.py) ----------

    @property
    def spill_room(self) -> int:
        """The cache a file being written needs to go on through spills: its lookahead, the part being
        uploaded and the next one being written."""
        return self.spill_lookahead + 2 * self.spill_part_size

    def _spillable(self, inode_id: int) -> int:
        """Bytes of a file being written that a spill could take now."""
        entry = self.cache.files.get(inode_id)
        if entry is None or (entry.passthrough_writers and self._pressure):
            # A spill under pressure seals what it takes, and nothing could hold back a write the kernel
            # makes to the file itself (FUSE passthrough): such a file is only ever staged early.
            return 0
        return entry.size - self.spill_lookahead - max(entry.sealed, entry.staged)

    async def _spill_state(self, inode: Inode) -> UploadState | None:
        """The spill this file has in progress, if it is still valid; a stale one (the file was truncated
        or rewritten since) is thrown away."""
        state = _journaled_state(inode)
        if state is None or not state.spilled:
            return None
        entry = self.cache.files.get(inode.id)
        # An early spill's parts are not sealed: a truncate below them (cache.resize lowers `staged`) ends it.
        if entry is not None and entry.freed == state.punched and (not state.early or entry.staged == state.size):
            return state
        await self._discard_spill(inode, state, "it was rewritten since")
        return None

    async def _spill(self, inode_id: int) -> None:
        """Upload the written start of a file still open for writing, part by part in order. While the
        cache is full, seal each part first and punch it out of the cache file once the journal has it;
        else (an early spill) leave the parts as they are."""
        inode = self.journal.get(inode_id)
        if inode is None or inode.kind != FILE or inode.path is None:
            return
        state = await self._spill_state(inode)
        if state is not None and state.early and self._pressure:
            # Its parts were never sealed, so they cannot be punched out: start again with one that seals.
            await self._discard_spill(inode, state, "the cache is full")
            state = None
        if state is None:
            earlier = _journaled_state(inode)
            if earlier is not None and not earlier.spilled and inode.upload_state is not None:
                self.discard_upload(inode.upload_state)  # a staged upload of an earlier close
            early = not self._pressure
            state = await self.engine.spill_begin(self.spill_part_size, early=early)
            with self.journal.transaction():
                self.journal.save_upload_state(inode_id, state.to_json())
            entry = self.cache.files.get(inode_id)
            if entry is not None:
                entry.staged = 0  # what an earlier spill staged is another version's (it was completed)
            if early:
                log.debug("uploading the start of %s while it is still being written", inode.path)
            else:
                log.info("cache full: uploading the start of %s while it is still being written", inode.path)
        if state.early:
            await self._spill_early(inode_id, state)
            return
        part = state.part_size
        path = self.cache.data_path(inode_id)
        while self._pressure:
            entry = self.cache.files.get(inode_id)
            if entry is None or entry.freed != state.size or self._spillable(inode_id) < part:
                log.debug("spill of inode %d pauses: freed %s, staged %d, spillable %d", inode_id,
                          entry and entry.freed, state.size, self._spillable(inode_id))
                return
            # Seal the part first: a write into it from now on fails instead of going unnoticed.
            entry.sealed = state.size + part
            state = await self.engine.spill_parts(state, path, state.size + part)
            current = self.journal.get(inode_id)
            if current is None or current.path is None or self.cache.files.get(inode_id) is not entry:
                await self.engine.abort_state(state)  # removed meanwhile: nothing will finish this spill
                self._forget_upload_state(inode_id, state)
                return
            if entry.sealed < state.size:
                # Truncated while the part was uploading: what was staged is no longer the file's start.
                await self._discard_spill(inode, state, "it was truncated")
                return
            # Journaled as punched before the hole is made: after a crash in between, the bytes are still
            # there but never read again (the parts have them).
            state = replace(state, punched=state.size)
            with self.journal.transaction():
                self.journal.save_upload_state(inode_id, state.to_json())
            # In the trio thread, with no await between the check above and the accounting: a truncate
            # and rewrite can never slip in and lose its new bytes to the hole (fallocate is quick).
            self.cache.punch_hole(inode_id, state.size - part, part)
            self.cache.punched(inode_id, state.size - part, part)
            self.stats.spilled_bytes += part
            entry.staged = state.size

    async def _spill_early(self, inode_id: int, state: UploadState) -> None:
        """Stage the parts of a file being written that its writer is done with (all but the last
        spill_lookahead bytes), while the cache has room, a batch at a time, journaling each batch. Nothing
        is sealed: a write into a staged part is found when the file is closed (_early_spill_holds), and the
        file is then uploaded whole."""
        part = state.part_size
        path = self.cache.data_path(inode_id)
        while not self._pressure:
            entry = self.cache.files.get(inode_id)
            if entry is None:
                return
            ready = (entry.size - self.spill_lookahead - state.size) // part * part
            if ready <= 0:
                return
            # All the parts written meanwhile at once, in parallel (a writer can be faster than one part at a
            # time), and the cache file to disk with them: else all of it is written back in the fsync
            # before the file is called clean, seconds after close on a slow disk.
            staged = state.size
            state = await self.engine.spill_parts(state, path, staged + ready, sync_source=True)
            current = self.journal.get(inode_id)
            if current is None or current.path is None or self.cache.files.get(inode_id) is not entry:
                await self.engine.abort_state(state)  # removed meanwhile: nothing will finish this spill
                self._forget_upload_state(inode_id, state)
                return
            if entry.staged != staged:  # truncated meanwhile (cache.resize lowered it)
                await self._discard_spill(current, state, "it was truncated")
                return
            with self.journal.transaction():
                self.journal.save_upload_state(inode_id, state.to_json())
            entry.staged = state.size
            self.stats.spilled_bytes += ready
            if current.closed_at is not None:
                return  # closed: its upload stages the rest, parts in parallel, and need not wait for this

    async def _discard_spill(self, inode: Inode, state: UploadState, why: str) -> None:
        log.info("%s: discarding the part of it uploaded while it was written (%s)", inode.path, why)
        await self.engine.abort_state(state)
        with self.journal.transaction():
            self.journal.save_upload_state(inode.id, None)
        entry = self.cache.files.get(inode.id)
        if entry is not None:
            entry.staged = entry.sealed

    async def _early_spill_holds(self, inode: Inode, state: UploadState) -> bool:
        """An early spill of a closed file can be finished if its staged parts are still the start of the
        file; else it is thrown away and the file is uploaded whole."""
        if await self.engine.spill_matches(state, self.cache.data_path(inode.id)):
            return True
        await self._discard_spill(inode, state, "it changed where it was already uploaded")
        return False

    async def _finish_spill(self, inode: Inode, state: UploadState) -> None:
        """The spilled file was closed: stage the rest of it, then move the whole to its key."""
        inode_id, key, version = inode.id, inode.key, inode.version
        assert key is not None
        with self.journal.transaction():
            self.journal.begin_upload(inode_id)
        started = trio.current_time()
        path = self.cache.data_path(inode_id)
        try:
            entry = self.cache.file(inode_id)
            if not state.early:  # an early spill's file stays writable: a change is caught by its version
                entry.sealed = entry.size
            if state.size < entry.size:
                state = await self.engine.spill_parts(state, path, entry.size, priority=self._priority(inode))
                with self.journal.transaction():
                    self.journal.save_upload_state(inode_id, state.to_json())
            current = self.journal.get(inode_id)
            current_key = current.key if current is not None else None
            if current is None or current.version != version or not current_key:
                # Rewritten (O_TRUNC) or removed: _spill_state discards the spill next time.
                with self.journal.transaction():
                    self.journal.abort_upload(inode_id)
                return
            meta = self._meta(current)
            write_ahead = self._write_ahead(current_key)
            await self.engine.spill_commit(state, current_key, meta)
        except BaseException:
            with self.journal.transaction():
                self.journal.abort_upload(inode_id)
            raise
        self.stats.uploaded_files += 1
        self.stats.uploaded_bytes += state.size
        self.stats.upload_seconds += trio.current_time() - started
        self._record_upload(inode_id, current_key, version, state.checksum, state.size, write_ahead)
        # Early spills are routine (DEBUG, as other uploads); a spill forced by a full cache is worth a line.
        (log.debug if state.early else log.info)("uploaded %s (%d bytes, started while it was written)",
                                                   current_key, state.size)
        if state.punched:
            self.on_spilled(inode_id)

    async def _resumable_state(self, inode: Inode, key: str) -> UploadState | None:
        """The staged upload an earlier attempt (or daemon) left for this file, if it can continue here.
        One for another key is thrown away. The store itself checks that the file is unchanged."""
        if inode.upload_state is None:
            return None
        try:
            state = UploadState.from_json(inode.upload_state)
        except (ValueError, KeyError, TypeError):
            state = None
        if state is not None and state.key == key:
            log.info("resuming upload of %s: %d parts already in the store", key, len(state.parts))
            return state
        if state is not None:
            await self.engine.abort_state(state)
        with self.journal.transaction():
            self.journal.save_upload_state(inode.id, None)
        return None

    def _save_upload_state(self, inode_id: int, state: UploadState) -> None:
        """Journal each step of a staged upload (the engine calls it after every part), so that a crash
        resumes from the last finished part."""
        with self.journal.transaction():
            self.journal.save_upload_state(inode_id, state.to_json())

    def _write_ahead(self, key: str) -> int:
        """Before an object appears at `key`, journal its deletion; its id. If the daemon dies before
        recording which inode owns the object (or the inode is removed meanwhile), that delete removes the
        orphan; the transaction that records the owner drops it (a delete job would drop it too, since an
        inode owns the key, but at the cost of a job per object: a third of the drain's work per small file)."""
        with self.journal.transaction():
            return self._queue_write_ahead(key)

    def _queue_write_ahead(self, key: str) -> int:
        """_write_ahead inside the caller's transaction."""
        delete_id = self.journal.queue_delete(key)
        assert delete_id is not None
        return delete_id

    def _record_upload(
        self, inode_id: int, key: str, version: int, checksum: str | None, size: int, write_ahead: int
    ) -> None:
        self._record_uploads([Uploaded(inode_id, key, version, checksum, size, write_ahead)])

    def _record_uploads(self, done: list[Uploaded]) -> None:
        """The store holds these objects now: record each for its inode, in one transaction."""
        if not done:
            return
        markers = []
        with self.journal.transaction():
            for item in done:
                # One at a time, not get_many: recording one object may change another's row (release_key
                # forgets a copy that lived at this key), and a stale row would delete what was just put.
                current = self.journal.get(item.inode_id)
                if current is None or current.path is None:
                    continue  # removed while the object was committed: the write-ahead delete removes the object
                self.journal.finish_upload(
                    current, key=item.key, version=item.version, checksum=item.checksum, size=item.size,
                    clean=current.version == item.version,
                )
                self.journal.delete_done(item.write_ahead)  # the inode owns the key now
                if self.is_commit_marker(current.name):
                    markers.append(current)
        for current in markers:
            self.on_marker_uploaded(current)

    async def _move(self, inode_id: int, scanned_keys: tuple[str, str]) -> None:
        inode = self.journal.get(inode_id)
        if inode is None or inode.remote_key is None or inode.key is None or inode.remote_key == inode.key:
            return
        if self._changed_since_scan(inode, scanned_keys, (inode.remote_key, inode.key)):
            return
        old, new = inode.remote_key, inode.key
        if self._target_taken(inode, new):
            if not self._breaks_move_cycle(inode, new):
                return  # the owner of `new` moved on meanwhile or not: the next scan decides again
            new = _parking_key(new, inode.id)
        write_ahead = self._write_ahead(new)
        try:
            if inode.kind == DIR:
                await self._call(self.store.put_dir, new, self._meta(inode))
            else:
                await self._call(self.store.copy, old, new)
        except NotFoundBackendError:
            self._lost_remote_copy(inode_id, old)
            return
        current = self.journal.get(inode_id)
        if current is not None and current.path is not None and current.remote_key == old:
            with self.journal.transaction():
                self.journal.finish_move(current, old, new)
                self.journal.delete_done(write_ahead)  # the inode owns the key now
        # Otherwise (removed, or re-uploaded meanwhile) the write-ahead delete of `new` cleans up.
        self.stats.moves += 1
        log.debug("moved %s -> %s", old, new)

    async def _update_meta(self, inode_id: int) -> None:
        """chmod/utime of an uploaded file: rewrite the object's metadata, not its bytes."""
        inode = self.journal.get(inode_id)
        if inode is None or not inode.meta_dirty or inode.key is None or inode.remote_key != inode.key:
            return
        meta = self._meta(inode)
        try:
            await self._call(self.store.set_meta, inode.key, meta)
        except NotFoundBackendError:
            self._lost_remote_copy(inode_id, inode.key)
            return
        # Re-check after the await: clear the flag only if nothing changed the metadata meanwhile.
        current = self.journal.get(inode_id)
        if current is not None and self._meta(current) == meta and current.remote_key == inode.key:
            with self.journal.transaction():
                self.journal.clear_meta_dirty(inode_id)

    def _lost_remote_copy(self, inode_id: int, key: str) -> None:
        current = self.journal.get(inode_id)
        if current is None:
            return
        with self.journal.transaction():
            if current.has_local_data or current.kind != FILE:
                log.warning("object %s vanished from the store; uploading %s again", key, current.path)
                self.journal.forget_remote_copy(inode_id, now=self.clock())
            else:
                log.error("object %s vanished from the store and %s has no local copy; removing it", key, current.path)
                self.journal.detach(current._replace(remote_key=None))

    async def _delete(self, delete_id: int) -> None:
        pending = self.journal.get_pending_delete(delete_id)
        if pending is None:
            return
        verdict = self._delete_verdict(pending)
        if verdict == "drop":
            with self.journal.transaction():
                self.journal.delete_done(delete_id)
            return
        if verdict == "defer":
            self._retry_at[("delete", delete_id)] = trio.current_time() + 1.0
            return
        await self._call(self.store.delete, pending.key)
        with self.journal.transaction():
            self.journal.delete_done(delete_id)
        self.stats.deletes += 1
        log.debug("deleted %s", pending.key)

    def _delete_verdict(self, pending: PendingDelete) -> str:
        """'drop' if an inode owns the key again, 'defer' if one is about to overwrite it (the old object
        stays until the new one replaces it) or, for a directory marker, while objects below it remain."""
        if self.journal.key_owner(pending.key) is not None:
            return "drop"
        if self.journal.key_claimant(pending.key) is not None:
            return "defer"
        if pending.key.endswith("/") and self.journal.keys_under(pending.key):
            return "defer"
        return "run"


def _change_detector(cache: CacheDir, inode_id: int, entry: CacheFile) -> Callable[[], bool]:
    """For a worker thread: has a change of the file begun (or its cache file been replaced) since now?"""
    changes = entry.changes
    return lambda: entry.changes != changes or cache.files.get(inode_id) is not entry


def _parent_dirs(path: str) -> Iterator[str]:
    """The directories `path` lies under, outermost first ("a/b/c": "a", "a/b")."""
    slash = path.find("/")
    while slash != -1:
        yield path[:slash]
        slash = path.find("/", slash + 1)


def _below(path: str, dirs: set[str]) -> bool:
    """`path` (or the store key of a path) lies under one of the directory paths in `dirs`."""
    return any(parent in dirs for parent in _parent_dirs(path.rstrip("/")))


def _keyed(inodes: Iterable[Inode]) -> Iterator[tuple[Inode, str]]:
    """Each inode that has a place in the store now, with its key. The journal's work queries return
    linked inodes only; an unlinked one (an open file or directory removed meanwhile) has no key, and
    the root has none: neither is ever given a job."""
    for inode in inodes:
        key = inode.key
        if key:
            yield inode, key


def _journaled_state(inode: Inode | None) -> UploadState | None:
    """The staged upload the journal remembers for the inode (None: none, or unreadable)."""
    if inode is None or inode.upload_state is None:
        return None
    try:
        return UploadState.from_json(inode.upload_state)
    except (ValueError, KeyError, TypeError):
        return None


def _journaled_upload_id(inode: Inode | None) -> str | None:
    state = _journaled_state(inode)
    return None if state is None else state.upload_id


def _journal_holds(inode: Inode | None, state: UploadState) -> bool:
    """The journal remembers this staged upload (any of its steps) for the inode: a retry resumes it."""
    return _journaled_upload_id(inode) == state.upload_id


def _parking_key(key: str, inode_id: int) -> str:
    """Where a move that breaks a cycle puts its object on the way, next to its final key. A plain key
    (stores refuse to write reserved names): other nodes may list it until the second move deletes it."""
    directory = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    return f"{directory}.ckptfs-moving-{inode_id}"


def _durable(inode: Inode | None, version: int) -> bool:
    """Is `version` of this inode (or a newer one) in the store, under its name, with its metadata?
    An inode that was removed meanwhile counts as done: there is nothing left to make durable."""
    if inode is None or inode.path is None:
        return True
    return inode.uploaded_version >= version and inode.remote_key == inode.key and not inode.meta_dirty


def _in_scope(path: str, paths: list[str] | None) -> bool:
    if not paths:
        return True
    path = path.rstrip("/")
    return any(p == "" or path == p or path.startswith(p + "/") for p in paths)
