"""The drain's order under a preemption notice (issue 44): the newest complete step first, then the next.

A step is a top-level directory of the mount that holds a commit marker (the way retention and the nodes'
records see a checkpoint: nodes.names.top_entry), or, without commit markers configured, any top-level
directory. It is complete when nothing below it is open for writing (and, with commit markers configured,
it holds one). Under a notice:

- the jobs of complete steps go newest first (by the step number in the name, like retention, else by
  the directory's mtime), one step at a time: a step's uploads get every slot and the bandwidth until none
  is left to start, then the next step's; running uploads of later ranks are cut short (they resume from
  their uploaded parts when their turn comes: uploads.py saves each part in the journal);
- a step's commit markers wait only for the work before them in their own step (not for older steps'
  files, which may never leave before the node goes); top-level markers keep the plain rule;
- work outside any step (top-level files) goes after the complete steps, then what is closed of the steps
  still being written: neither takes bandwidth while a complete step has uploads left. Moves and metadata
  updates (no file's bytes) go in rank order without waiting; deletes (retention's, old copies) wait until
  no complete step has work left.

Owns: the plan (which step ranks where, which wait and why), replanned at most every REPLAN_INTERVAL
while a notice lasts, and the per-step account of what is left (`steps_left`) that the report is made of.
No store I/O; the scheduler asks `choose` (with `rank_of`) which of the jobs it could start go.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from ckptfs.drain.ordering import CommitMarkers, Job
from ckptfs.journal import DIR, FILE, Inode, Journal
from ckptfs.retention.rules import step_of

# While a notice lasts, which steps are complete is looked at again after every change of the mount (a
# file closed, a marker written: `stale`), and at least this often (trio seconds).
REPLAN_INTERVAL = 0.5
# A replan reads every pending entry: during a burst of closes (a save of thousands of small files going on
# under the notice), at most this often.
STALE_REPLAN_INTERVAL = 0.1
OPEN_NAMED = 5  # files still open that the report names per step


def top_of(path: str) -> str:
    """The top-level entry a path lies in (itself at the top)."""
    return path.partition("/")[0]


@dataclass
class StepLeft:
    """What one step still lacks in the store, for the report."""

    name: str
    complete: bool
    why_waiting: str | None  # an incomplete step: why its work waits
    files_left: int = 0
    bytes_left: int = 0
    markers_left: list[str] = field(default_factory=list)
    markers: int = 0  # commit markers below it (published once none is left)
    failing: list[tuple[str, str]] = field(default_factory=list)  # (path, error) of its jobs failing now


class Preemption:
    def __init__(self, journal: Journal, markers: CommitMarkers) -> None:
        self.journal = journal
        self.markers = markers
        self.active = False
        self._rank: dict[str, int] = {}  # complete step -> its rank (0: the newest)
        self._waiting: dict[str, str] = {}  # incomplete step -> why its work waits
        self._planned_at = -math.inf
        self.stale = False  # the mount changed since the last plan
        self.steps_seen: set[str] = set()  # every step with work pending since the notice (the report's rows)
        # Steps found complete since the notice, with the key they rank by (they stay so once durable).
        self._complete_seen: dict[str, tuple[int, int]] = {}

    def begin(self, now: float) -> None:
        self.active = True
        self.replan(now)

    @property
    def other_rank(self) -> int:
        """The rank of work outside any step (after every complete step)."""
        return len(self._rank)

    def rank_of(self, path: str | None) -> int | None:
        """Where a job on `path` goes in the order (lower first); None: an unlinked entry's, which waits."""
        if path is None:
            return None
        top = top_of(path)
        if top in self._waiting:
            return len(self._rank) + 1
        return self._rank.get(top, self.other_rank)

    def step_dir(self, inode: Inode) -> str | None:
        """The step a commit marker completes (its top-level directory; None: a marker at the top)."""
        path = inode.path
        if path is None or "/" not in path:
            return None
        return top_of(path)

    def replan_if_due(self, now: float) -> None:
        since = now - self._planned_at
        if since >= REPLAN_INTERVAL or (self.stale and since >= STALE_REPLAN_INTERVAL):
            self.replan(now)

    def replan(self, now: float) -> None:
        self._planned_at = now
        self.stale = False
        ranked: list[tuple[str, Inode]] = []
        self._waiting = {}
        for name, (top, _below, open_paths, markers) in self._pending_steps().items():
            self.steps_seen.add(name)
            if open_paths:
                self._waiting[name] = "files still open for writing: " + ", ".join(open_paths[:OPEN_NAMED]) + (
                    f" and {len(open_paths) - OPEN_NAMED} more" if len(open_paths) > OPEN_NAMED else "")
            elif self.markers.globs and not markers:
                self._waiting[name] = "no commit marker written yet"
            else:
                ranked.append((name, top))
        by_number = all(step_of(name) is not None for name in [*self._complete_seen, *(n for n, _ in ranked)])
        for name, top in ranked:
            self._complete_seen[name] = (step_of(name) or 0, top.mtime_ns) if by_number else (top.mtime_ns, 0)
        ranked.sort(key=lambda item: self._complete_seen[item[0]], reverse=True)
        self._rank = {name: rank for rank, (name, _) in enumerate(ranked)}

    def steps_left(self, failing: dict[int, str]) -> list[StepLeft]:
        """Every step seen since the notice, newest first as ranked, with what it still lacks (nothing: it
        is durable and, if it has markers, published). `failing`: inode id -> error of jobs failing now."""
        pending = self._pending_by_top()
        rows = []
        for name in self.steps_seen:
            top = self.journal.names.by_path(name)
            below = self.journal.names.descendants(name) if top is not None else []
            markers = [i for i in below if i.kind == FILE and self.markers.match(i.name)]
            row = StepLeft(name, name in self._complete_seen and name not in self._waiting,
                           self._waiting.get(name), markers=len(markers))
            for inode in pending.get(name, []):
                row.files_left += 1
                if inode.state in ("dirty", "uploading") and inode.kind == FILE:
                    row.bytes_left += inode.size
                if self.markers.match(inode.name) and inode.kind == FILE:
                    row.markers_left.append(inode.path or "")
                if inode.id in failing:
                    row.failing.append((inode.path or "", failing[inode.id]))
            rows.append(row)
        # Newest complete step first, as ranked; then the steps still being written.
        complete = sorted((r for r in rows if r.complete), key=lambda r: self._complete_seen[r.name], reverse=True)
        return complete + sorted((r for r in rows if not r.complete), key=lambda r: r.name)

    def complete_steps_pending(self) -> bool:
        """Work is left in a complete step (what a notice is for; the rest waits or goes after)."""
        pending = self._pending_by_top()
        return any(name in pending for name in self._rank)

    # -- reading the journal -----------------------------------------------------------------------------

    def _pending(self) -> Iterable[Inode]:
        return [*self.journal.work.pending_uploads(), *self.journal.work.misplaced(), *self.journal.work.meta_stale(-1)]

    def _pending_by_top(self) -> dict[str, list[Inode]]:
        by_top: dict[str, list[Inode]] = {}
        for inode in self._pending():
            if inode.path is None or inode.id == 1:
                continue
            if "/" in inode.path or inode.kind == DIR:
                by_top.setdefault(top_of(inode.path), []).append(inode)
        return by_top

    def _pending_steps(self) -> dict[str, tuple[Inode, list[Inode], list[str], list[Inode]]]:
        """Top-level directories with pending work: (the directory, its entries, the paths of its files
        open for writing, its commit markers)."""
        open_ids = set(self.journal.copies.open_dirty_files())
        steps = {}
        for name in self._pending_by_top():
            top = self.journal.names.by_path(name)
            if top is None or top.kind != DIR:
                continue
            below = self.journal.names.descendants(name)
            open_paths = sorted(i.path or "" for i in below if i.id in open_ids)
            markers = [i for i in below if i.kind == FILE and self.markers.match(i.name)]
            steps[name] = (top, below, open_paths, markers)
        return steps


def choose(
    jobs: list[Job], running: Collection[tuple[str, int]], rank: Callable[[str, int], int | None], other_rank: int,
) -> tuple[list[Job], list[tuple[str, int]]]:
    """Under a notice, the jobs of a scan that may start, in rank order, and the running jobs to cut short.
    Uploads and spills (the bandwidth): of the first rank with any, ready or running, only; running ones of a
    later rank are cut. Moves and metadata updates, which move no file's bytes, all, in rank order (an upload
    may wait for a move of another rank to free its key: holding those back would hold it forever). Deletes
    once no step's work is left. `rank(kind, id)` is None for an entry gone meanwhile (it waits)."""
    heavy = ("upload", "spill")
    ranked = [(job, rank(job.kind, job.ident)) for job in jobs if job.kind != "delete"]
    running_ranks = {job_id: rank(*job_id) for job_id in running if job_id[0] != "delete"}
    heavy_ranks = [r for job, r in ranked if job.kind in heavy] + [
        r for job_id, r in running_ranks.items() if job_id[0] in heavy]
    first = min((r for r in heavy_ranks if r is not None), default=None)
    cut = [job_id for job_id, r in running_ranks.items()
           if job_id[0] in heavy and (r is None or first is None or r > first)]
    chosen = sorted(((job, r) for job, r in ranked if r is not None and (job.kind not in heavy or r == first)),
                    key=lambda item: item[1])
    step_work_left = any(r is not None and r < other_rank for r in [*(r for _, r in ranked), *running_ranks.values()])
    deletes = [] if step_work_left else [job for job in jobs if job.kind == "delete"]
    return [job for job, _ in chosen] + deletes, cut


