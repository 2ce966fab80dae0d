"""Retries of failed drain jobs: when a job may run again (backoff), and the parking of jobs that keep
failing unexpectedly.

Owns: the retry time and attempt count of every job that failed, how a failure is counted and logged (a
store error, a full journal, a bug), parking a job after PARK_AFTER unexpected failures in a row (retried
only every PARKED_RETRY seconds, named by `ckptfs status`, `ckptfs flush` and the xattr until it succeeds
or its entry changes). The scheduler (scheduler.py) asks it which jobs wait; the jobs report to it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import trio

from ckptfs.backends.base import backoff_delays
from ckptfs.drain.ordering import Job
from ckptfs.drain.stats import DrainStats
from ckptfs.errors import BackendError, Faults, PermanentBackendError, TransientBackendError
from ckptfs.journal import Inode, Journal, JournalFull

log = logging.getLogger(__name__)

# A job that fails unexpectedly (a bug, not a store error) this many times in a row is parked: retried
# only every PARKED_RETRY seconds, and named by `ckptfs status` and `ckptfs flush` until it succeeds.
PARK_AFTER = 3
PARKED_RETRY = 600.0

JobId = tuple[str, int]  # (kind, ident) of a Job


@dataclass(frozen=True)
class Parked:
    """A job parked after failing unexpectedly PARK_AFTER times in a row (see Retries.failing)."""

    job: str  # "upload", "move", "meta", ...
    inode_id: int  # the pending delete's id for a "delete" job
    error: str
    since: float  # wall-clock time it was parked
    seq: int  # the inode's seq then: once the entry changes (a close, a rename), it is tried again at once


class Retries:
    def __init__(self, journal: Journal, stats: DrainStats, faults: Faults, store_url: str) -> None:
        self.journal = journal
        self.stats = stats
        self.faults = faults
        self.store_url = store_url
        self._retry_at: dict[JobId, float] = {}  # trio time
        self._attempts: dict[JobId, int] = {}
        # Unexpected failures in a row per job, and the jobs parked after PARK_AFTER of them.
        self._unexpected: dict[JobId, int] = {}
        self.parked: dict[JobId, Parked] = {}
        # The last error of each job failing now (cleared by its success): what a preemption report names.
        self._last_error: dict[JobId, str] = {}
        self._permanent_reported: set[str] = set()
        # Jobs whose last run deferred itself (defer): that run ends without an error, but it is no success.
        self._deferred: set[JobId] = set()

    def due_at(self, job_id: JobId) -> float:
        """The trio time before which a failed job must not run again (-inf: it may run now)."""
        return self._retry_at.get(job_id, -math.inf)

    def defer(self, job_id: JobId, delay: float) -> None:
        """Run the job again in `delay` seconds (it found it must wait; not a failure, nor a success: the
        run's end, succeeded(), keeps the time; before, it dropped it and the job ran at every scan)."""
        self._retry_at[job_id] = trio.current_time() + delay
        self._deferred.add(job_id)

    def succeeded(self, job: Job) -> None:
        job_id = (job.kind, job.ident)
        if job_id in self._deferred:
            self._deferred.discard(job_id)
            return
        self._retry_at.pop(job_id, None)
        self._attempts.pop(job_id, None)
        self._unexpected.pop(job_id, None)
        self._last_error.pop(job_id, None)
        if self.parked.pop(job_id, None) is not None:
            log.info("%s job of inode %d succeeded again; no longer parked", job.kind, job.ident)

    def failed_unexpectedly(self, job: Job, exc: Exception, *, entry: str | None = None) -> None:
        job_id, op = (job.kind, job.ident), job.kind
        self._deferred.discard(job_id)
        if isinstance(exc, BackendError):
            self.failed(job_id, op, exc)
        elif isinstance(exc, JournalFull):
            # The cache filesystem is full (others filled it): the journal cannot record this job's
            # result now. Nothing is lost: the job is retried as a store error would be.
            self.failed(job_id, op, TransientBackendError(f"the journal cannot grow: {exc}"))
        else:
            # A bug must not take the mount down with it: report it loudly with its entry, keep the work
            # journaled, and retry with backoff like a store error; park it where retrying keeps failing.
            if entry is None:
                entry = self.entry_of(job.kind, job.ident)
            failures = self._unexpected.get(job_id, 0) + 1
            self._unexpected[job_id] = failures
            log.error("unexpected error in the %s job of %s (inode %d, failure %d); it will be retried", op,
                      entry if entry is not None else "an unlinked entry", job.ident, failures, exc_info=exc)
            self.faults.record("drain", f"{op} {entry}: {exc!r}")
            self.failed(job_id, op, TransientBackendError(f"internal error: {exc!r}"), logged=True)
            if failures >= PARK_AFTER:
                if job_id not in self.parked:
                    log.error("parking the %s job of %s after %d unexpected failures: retried every %.0f s,"
                              " named by `ckptfs status`", op, entry, failures, PARKED_RETRY)
                inode = None if job.kind == "delete" else self.journal.names.get(job.ident)
                self.parked[job_id] = Parked(op, job.ident, repr(exc), time.time(), inode.seq if inode else -1)
                self._retry_at[job_id] = trio.current_time() + PARKED_RETRY

    def failed(self, job_id: JobId, op: str, exc: BackendError, *, logged: bool = False) -> None:
        self._deferred.discard(job_id)
        attempts = self._attempts.get(job_id, 0) + 1
        self._attempts[job_id] = attempts
        self._last_error[job_id] = str(exc)
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
                log.error("%s to %s failed and will be retried until it works: %s", op, self.store_url, exc)
        elif attempts in (1, 5) or attempts % 50 == 0:
            log.warning("%s failed (attempt %d), retrying in %.1fs: %s", op, attempts, delay, exc)

    def unpark_if_changed(self, job_id: JobId, inode: Inode) -> None:
        """A parked entry that changed since (closed again, renamed) is tried again now."""
        parked = self.parked.get(job_id)
        if parked is not None and parked.seq != inode.seq:
            del self.parked[job_id]
            self._retry_at.pop(job_id, None)
            self._unexpected.pop(job_id, None)

    def entry_of(self, kind: str, ident: int) -> str | None:
        """What a job works on, for messages: the inode's path, or the key of a pending delete (None: gone)."""
        if kind == "delete":
            delete = self.journal.deletes.get_pending_delete(ident)
            return None if delete is None else f"(delete) {delete.key}"
        inode = self.journal.names.get(ident)
        return inode.path if inode is not None else None

    def failure_of(self, inode_id: int) -> str | None:
        """Why a job of this inode is parked (None: none is); the xattr user.ckptfs.error shows it."""
        for (kind, ident), parked in self.parked.items():
            if ident == inode_id and kind != "delete":
                return f"{kind}: {parked.error}"
        return None

    def failing_now(self) -> dict[int, str]:
        """inode id -> the last error of its job, for every job (not a delete) whose last attempt failed:
        parked ones and those waiting for a retry after a store error."""
        failing = {ident: error for (kind, ident), error in self._last_error.items() if kind != "delete"}
        failing.update({p.inode_id: p.error for p in self.parked.values() if p.job != "delete"})
        return failing

    def failing(self) -> list[tuple[str, Parked]]:
        """The parked jobs whose entries still exist, with their paths: what `ckptfs status` names."""
        out = []
        for job_id, parked in list(self.parked.items()):
            entry = self.entry_of(*job_id)
            if entry is None:
                del self.parked[job_id]  # removed meanwhile: nothing left to do
                continue
            out.append((entry, parked))
        return out
