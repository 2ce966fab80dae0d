"""Durability: the waiters of `ckptfs flush` and `ckptfs.wait_durable()`.

Owns: what was pending under a flush's paths when it started (uploads, moves, metadata rewrites, deletes,
and the deletes of the old copies these queue), when each of those is durable in the store, what is left
when a flush times out (with why: a parked job's error, a commit marker waiting for other nodes), and the
sweep of leftovers that ends a flush. While a flush waits, the scheduler ignores upload_delay (`waiting`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import trio

from ckptfs.drain.cleanup import Cleanup
from ckptfs.drain.ordering import CommitMarkers, Job, durable, held_by, in_scope
from ckptfs.drain.retries import Retries
from ckptfs.journal import Inode, Journal

# A flush re-checks the items whose jobs finished at most this often, and all of its items this often.
FLUSH_POLL = 0.05
FULL_CHECK_INTERVAL = 1.0
# A flush ends with a sweep if a cleanup failed (so that it leaves nothing of ours but objects behind), for
# at most this long; a store that refuses it is asked again until then (Leftovers.sweep_in_background).
SWEEP_AT_FLUSH = 60.0


@dataclass
class FlushResult:
    ok: bool
    remaining: list[str]


class Durability:
    def __init__(
        self,
        journal: Journal,
        cleanup: Cleanup,
        retries: Retries,
        markers: CommitMarkers,
        *,
        notify: Callable[[], None],
        why_marker_waits: Callable[[Inode], str | None],
        note_open_changes: Callable[[list[int]], None] = lambda inode_ids: None,
    ) -> None:
        self.journal = journal
        self.cleanup = cleanup
        self.retries = retries
        self.markers = markers
        self.notify = notify
        self.why_marker_waits = why_marker_waits
        # Gateway mode: files open for writing that changed since the store's copy get a new content
        # version before a flush takes what is pending, so that it waits for their content as it is.
        self.note_open_changes = note_open_changes
        self.waiting = 0  # flushes waiting now
        self._progress = trio.Event()
        # Per waiting flush: the jobs that finished since it last looked (("inode" | "delete", id)).
        self._finished: list[set[tuple[str, int]]] = []

    def progressed(self) -> None:
        """Something a flush may wait for ended (a job, an abort): wake the waiters."""
        self._progress.set()
        self._progress = trio.Event()

    def jobs_ended(self, jobs: list[Job]) -> None:
        for job in jobs:
            for finished in self._finished:
                finished.add(("delete" if job.kind == "delete" else "inode", job.ident))
        self.progressed()

    async def wait_durable(self, paths: list[str] | None) -> None:
        """Return once everything under `paths` (None: everything) that is pending now is durable in the
        store, ignoring upload_delay meanwhile. Files open for writing count as pending (in gateway mode:
        until their content as it is now is in the store). The caller owns the timeout
        (trio.move_on_after); `pending(paths)` then says what is left."""
        self.note_open_changes(self.journal.copies.open_pending_files())
        items = self._outstanding(paths)
        deletes = {d.id: d.key for d in self.journal.deletes.pending_deletes() if in_scope(d.key, paths)}
        # Jobs that finish while we wait, so that each check looks only at what may have changed; a full
        # check now and then catches what changed without a job (an unlink, a rename).
        finished: set[tuple[str, int]] = set()
        self._finished.append(finished)
        self.waiting += 1
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
                if not items and not deletes and self.cleanup.idle:
                    if collected_old_copies:
                        return
                    # Uploads and moves queue deletes of the copies they replace; wait for those too,
                    # so that the store shows the namespace as it was, not stale names beside it.
                    collected_old_copies = True
                    deletes = {d.id: d.key for d in self.journal.deletes.pending_deletes() if in_scope(d.key, paths)}
                    continue
                with trio.move_on_at(full_check_due):
                    await self._progress.wait()
                await trio.sleep_until(checked_at + FLUSH_POLL)
        finally:
            self.waiting -= 1
            self._finished.remove(finished)

    def pending(self, paths: list[str] | None) -> list[str]:
        """What under `paths` is not yet durable in the store, now."""
        items = self._outstanding(paths)
        deletes = {d.id: d.key for d in self.journal.deletes.pending_deletes() if in_scope(d.key, paths)}
        self._drop_durable(items, deletes)
        failing = {parked.inode_id: parked.error for parked in self.retries.parked.values() if parked.job != "delete"}
        failing_inodes = list(self.journal.names.get_many(list(failing)).values()) if failing else []
        paths_left = []
        for inode_id in items:
            inode = self.journal.names.get(inode_id)
            if inode is None or inode.path is None:
                continue
            error = failing.get(inode_id)
            marker = self.markers.match(inode.name)
            waiting = self.why_marker_waits(inode) if marker else None
            held = held_by(inode, failing_inodes) if marker and failing_inodes else None
            if error is not None:
                paths_left.append(f"{inode.path} (failing: {error})")
            elif held is not None:
                paths_left.append(f"{inode.path} (commit marker held back: {held} is failing)")
            elif waiting is not None:
                paths_left.append(f"{inode.path} ({waiting})")
            else:
                paths_left.append(inode.path)
        return paths_left + [f"(delete) {key}" for key in deletes.values()]

    async def flush(self, paths: list[str] | None, deadline: float) -> FlushResult:
        """wait_durable() until the trio time `deadline` (math.inf: no limit), then the start-up sweep of
        the last run's leftovers if it still runs, then a sweep of leftovers if a cleanup failed: the store
        then holds nothing of ours but objects. A sweep that fails or cannot run does not fail the flush
        (leftovers cost storage, not data); the drain tries again later."""
        durable_now = False
        with trio.move_on_at(deadline):
            await self.wait_durable(paths)
            durable_now = True
        if not durable_now:
            return FlushResult(False, self.pending(paths))
        leftovers = self.cleanup.engine.leftovers
        with trio.move_on_at(deadline):
            # It runs in the background while the mount serves, and may take long on a throttling store:
            # waited for until the deadline (SWEEP_AT_FLUSH bounds only the flush's own sweep below).
            await leftovers.wait_start_sweep()
        if leftovers.due:
            bound = min(deadline, trio.current_time() + SWEEP_AT_FLUSH)
            with trio.move_on_at(bound):
                await self.cleanup.sweep(refused_retry_until=bound)
        return FlushResult(True, [])

    def _outstanding(self, paths: list[str] | None) -> dict[int, int]:
        """inode id -> the version that must reach the store, for everything pending under `paths`."""
        items = {}
        work = self.journal.work
        for inode in [*work.pending_uploads(), *work.misplaced(), *work.meta_stale(-1)]:
            if in_scope(inode.path or "", paths):
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
            current = self.journal.names.get_many(inode_ids)
            for inode_id in inode_ids:
                if durable(current.get(inode_id), items[inode_id]):
                    del items[inode_id]
        if delete_ids:
            still_pending = self.journal.deletes.deletes_pending(delete_ids)
            for delete_id in delete_ids:
                if delete_id not in still_pending:
                    del deletes[delete_id]
