"""The drain's running jobs: the upload and other slots, a scan's jobs started as slots free up (small uploads
claimed in batches for the small lane), each job's keys claimed and freed, and the cancel scopes a
preemption notice cuts jobs short by.

Owns what runs now (`running`, the busy keys) and a job's end (keys and slot freed, flushes and the scanner
woken); a job's failure is the job's (retried by retries.py). What to run, and in what order, is the
scheduler's choice; what a job does is uploads.py's, spills.py's and namespace.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import trio

from ckptfs.drain import ordering
from ckptfs.drain.durability import Durability
from ckptfs.drain.namespace_jobs import NamespaceJobs
from ckptfs.drain.ordering import Job
from ckptfs.drain.retries import Retries
from ckptfs.drain.small_lane import SmallLane
from ckptfs.drain.spill_jobs import SpillJobs
from ckptfs.drain.uploads import SMALL_BATCH, SMALL_BATCH_BYTES, Uploads
from ckptfs.journal import journal_unusable

# While new work keeps arriving, rescan at most this often (a scan reads up to SCAN_LIMIT rows).
RESCAN_INTERVAL = 0.2


class Dispatcher:
    def __init__(
        self, transfers: int, uploads: Uploads, spills: SpillJobs, namespace: NamespaceJobs, retries: Retries,
        durability: Durability, *, notify: Callable[[], None], pressed: Callable[[], bool],
    ) -> None:
        self.uploads = uploads
        self.spills = spills
        self.namespace = namespace
        self.retries = retries
        self.durability = durability
        self.notify = notify  # the scheduler's: a job's end may be new work
        self.upload_slots = trio.Semaphore(transfers)
        self.other_slots = trio.Semaphore(transfers * 2)
        self.running: set[tuple[str, int]] = set()
        # Under a preemption notice, running jobs of a later rank are cut short by their scope (a job
        # claimed but not started yet, a small one waiting in the lane, when it starts).
        self._scopes: dict[tuple[str, int], trio.CancelScope] = {}
        self._cut_at_start: set[tuple[str, int]] = set()
        self._busy_keys: set[str] = set()
        # Batches of small uploads, started when the writer's requests let them.
        self.lane = SmallLane(self.upload_slots, self._run_batch, pressed=pressed)

    def cut(self, job_ids: Iterable[tuple[str, int]]) -> None:
        """A preemption notice left these jobs out: cut them short now (they resume from their saved
        parts), or as they start."""
        for job_id in job_ids:
            scope = self._scopes.get(job_id)
            if scope is not None:
                scope.cancel()
            else:
                self._cut_at_start.add(job_id)

    async def dispatch(self, jobs: list[Job], nursery: trio.Nursery, scanned_at: float, new_work: trio.Event) -> bool:
        """Start the jobs of a scan (made at trio time `scanned_at`) as slots free up; small uploads are
        claimed in batches of up to SMALL_BATCH and queued for the small lane (small_lane.py), which starts
        them (one upload slot each) when the writer lets it. True if it stopped early for new work (the
        scheduler's `new_work` set, RESCAN_INTERVAL after the scan)."""
        batch: list[Job] = []
        batch_bytes = 0
        interrupted = False
        try:
            for job in jobs:
                if job.small:
                    if self._claim(job):
                        batch.append(job)
                        batch_bytes += job.size
                    if len(batch) < SMALL_BATCH and batch_bytes < SMALL_BATCH_BYTES:
                        continue
                if batch:
                    self.lane.queue(batch)
                    batch, batch_bytes = [], 0
                if not job.small:
                    slots = self.upload_slots if job.kind in ("upload", "spill") else self.other_slots
                    await slots.acquire()
                    if not self._claim(job):
                        slots.release()
                        continue
                    nursery.start_soon(self._run_job, job, slots)
                if new_work.is_set() and trio.current_time() - scanned_at > RESCAN_INTERVAL:
                    interrupted = True
                    break
        finally:
            if batch:
                self.lane.queue(batch)
        return interrupted

    def _claim(self, job: Job) -> bool:
        try:
            if ordering.busy(job, self.running, self._busy_keys):
                return False
        except Exception as exc:
            if journal_unusable(exc):
                raise
            self.retries.failed_unexpectedly(job, exc)
            return False
        self.running.add((job.kind, job.ident))
        self._busy_keys.update(job.keys)
        return True

    @contextmanager
    def _cuttable(self, jobs: list[Job]) -> Iterator[None]:
        """The jobs run in a scope that a preemption notice may cancel (cut)."""
        job_ids = [(job.kind, job.ident) for job in jobs]
        scope = trio.CancelScope()
        if any(job_id in self._cut_at_start for job_id in job_ids):
            scope.cancel()
        for job_id in job_ids:
            self._scopes[job_id] = scope
        try:
            with scope:
                yield
        finally:
            for job_id in job_ids:
                self._scopes.pop(job_id, None)
                self._cut_at_start.discard(job_id)

    async def _run_job(self, job: Job, slots: trio.Semaphore) -> None:
        try:
            with self._cuttable([job]):
                await self._attempt(job)
        finally:
            self._settle([job], slots)

    async def _run_batch(self, jobs: list[Job], slots: trio.Semaphore) -> None:
        try:
            with self._cuttable(jobs):
                try:
                    rest = await self.uploads.upload_small(jobs)
                except Exception as exc:
                    if journal_unusable(exc):
                        raise
                    for job in jobs:
                        self.retries.failed_unexpectedly(job, exc)
                    return
                for job in rest:
                    await self._attempt(job)
        finally:
            self._settle(jobs, slots)

    async def _attempt(self, job: Job) -> None:
        """Run one job; a failure schedules its retry."""
        try:
            if job.kind == "upload":
                await self.uploads.upload(job.ident, job.keys[0])
            elif job.kind == "spill":
                await self.spills.spill(job.ident)
            elif job.kind == "move":
                await self.namespace.move(job.ident, (job.keys[0], job.keys[1]))
            elif job.kind == "meta":
                await self.namespace.update_meta(job.ident)
            else:
                await self.namespace.delete(job.ident)
        except Exception as exc:
            if journal_unusable(exc):
                raise
            self.retries.failed_unexpectedly(job, exc)
        else:
            self.retries.succeeded(job)

    def _settle(self, jobs: list[Job], slots: trio.Semaphore) -> None:
        """Jobs ended (done, failed or cancelled): free their keys and slot, wake flushes and the scanner."""
        for job in jobs:
            self.running.discard((job.kind, job.ident))
            self._busy_keys.difference_update(job.keys)
        slots.release()
        self.durability.jobs_ended(jobs)
        # Their outcome may be new work (a restart under a new name, a queued delete, an unblocked
        # marker); scans are cheap and rate-limited by the dispatch loop.
        self.notify()
