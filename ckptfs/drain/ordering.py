"""The drain's ordering rules, as pure functions: which job may run now, and which must wait for which.

Owns: the job and the store keys it holds (one job per key at a time), commit markers (a marker waits for
the work that became work before it), keys still taken by an object waiting to be moved away, breaking a
cycle of such moves, directory markers before what lies below them, and the predicates of scope (a flush's
paths) and durability. No trio, no I/O: the journal's answers come in as plain values or lookups (a
`key_owner` callable), so that each rule can be tested on its own (tests/test_ordering.py). The scheduler
(scheduler.py) asks these rules with what the journal says now.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

from ckptfs.journal import DIR, Inode

# How far breaks_move_cycle follows a chain of moves waiting for each other.
MOVE_CYCLE_LIMIT = 1000


@dataclass(frozen=True)
class Job:
    kind: str  # "upload", "spill", "move", "meta" or "delete"
    ident: int  # inode id, or pending delete id
    keys: tuple[str, ...]  # store keys this job must hold exclusively
    small: bool = False  # an upload of a small closed file: it may go in a batch (Uploads.upload_small)
    size: int = 0  # of a small file


class CommitMarkers:
    """The names (globs of the `commit_markers` setting) whose upload completes a checkpoint."""

    def __init__(self, globs: tuple[str, ...]) -> None:
        self.globs = globs
        self._pattern = re.compile("|".join(fnmatch.translate(glob) for glob in globs)) if globs else None

    def match(self, name: str | None) -> bool:
        return name is not None and self._pattern is not None and self._pattern.match(name) is not None


def marker_blocked(
    inode: Inode, markers: CommitMarkers, waits_for_nodes: Callable[[Inode], bool], work_before: Callable[[int], bool]
) -> bool:
    """A commit marker waits for all work that became work before it (`work_before(seq)`: the journal's
    pending work with a lower seq, earlier markers included; a file still open for writing was not closed
    before the marker, so it does not count). With cross-node ordering it also waits for the other nodes'
    work closed before it: `waits_for_nodes` is asked every time, first, so that its listing of the other
    nodes starts while local work still drains. Anything else never waits here."""
    if not markers.match(inode.name):
        return False
    return waits_for_nodes(inode) or work_before(inode.seq)


def held_by(marker: Inode, failing: Iterable[Inode]) -> str | None:
    """The path of a failing (parked) entry that holds this commit marker back (None: none does): one in
    the marker's step (its top-level directory) that became work before it, or any earlier one for a marker
    at the top. A step is never published over such a hole (marker_blocked); this names why."""
    path = marker.path or ""
    step = path.partition("/")[0] if "/" in path else None
    for entry in failing:
        if entry.path is None or entry.seq >= marker.seq or entry.id == marker.id:
            continue
        if step is None or entry.path.startswith(step + "/"):
            return entry.path
    return None


def changed_since_scan(
    inode: Inode, scanned_keys: tuple[str, ...], keys: tuple[str, ...], marker_blocked: Callable[[Inode], bool]
) -> bool:
    """A job waits for a slot after the scan that chose it: by the time it runs, its file may have been
    renamed (`.latest.tmp` to `latest` makes it a commit marker) or rewritten (a marker with a newer seq):
    its keys now are not those it was chosen with, or it is a marker that must wait now. Such a job does
    nothing; its completion rescans, and the scan decides afresh."""
    return keys != scanned_keys or marker_blocked(inode)


def target_taken(inode: Inode, owner: Inode | None) -> bool:
    """Another inode's object (`owner`, the journal's owner of the key) still sits at the key `inode` is to
    be written at, waiting to be moved away (a rename after upload, then a new file under the old name).
    Writing the key now would destroy it: wait for the move, unless that inode has local data to upload
    again (then the write goes first; see DrainWork.release_key). A directory's marker holds only metadata:
    its owner writes it again."""
    return owner is not None and owner.id != inode.id and not owner.has_local_data and owner.kind != DIR


def breaks_move_cycle(inode: Inode, key: str, key_owner: Callable[[str], Inode | None]) -> bool:
    """Misplaced objects that wait for each other's keys (a swap: `mv x t; mv y x; mv t y` on files without
    local data) never move on their own. The one with the lowest id in such a cycle breaks it: its move goes
    to a parking key first (parking_key), which frees its old key (`key` is its new one) for the next one."""
    lowest = inode.id
    owner = key_owner(key)
    for _ in range(MOVE_CYCLE_LIMIT):
        if owner is None or owner.key is None or owner.remote_key == owner.key:
            return False
        next_owner = key_owner(owner.key)  # who holds the key `owner` waits for
        if not target_taken(owner, next_owner):
            return False
        if owner.id == inode.id:
            return inode.id == lowest
        lowest = min(lowest, owner.id)
        owner = next_owner
    return False


def parking_key(key: str, inode_id: int) -> str:
    """Where a move that breaks a cycle puts its object on the way, next to its final key. A plain key
    (stores refuse to write reserved names): other nodes may list it until the second move deletes it."""
    directory = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
    return f"{directory}.ckptfs-moving-{inode_id}"


def busy(job: Job, running: Collection[tuple[str, int]], busy_keys: Collection[str]) -> bool:
    """The job runs already, or another job holds one of its keys: two operations on one key could finish
    in the wrong order. A job that writes a directory marker, or writes below one, also waits for the other
    (overlaps_a_marker)."""
    return (job.kind, job.ident) in running or any(k in busy_keys for k in job.keys) or overlaps_a_marker(
        job, busy_keys)


def overlaps_a_marker(job: Job, busy_keys: Collection[str]) -> bool:
    """The job would write a directory marker while something below it is being written, or write below a
    marker being written. SeaweedFS drops a marker PUT made at the same moment as an object below it (the
    object's implicit folder wins; measured: 6 of 100 concurrent pairs), and the directory then lists only
    as an implicit folder, gone with its last object."""
    if job.kind == "delete":
        return False
    for key in job.keys:
        if key.endswith("/") and any(held.startswith(key) for held in busy_keys):
            return True
        if any(parent + "/" in busy_keys for parent in parent_dirs(key.rstrip("/"))):
            return True
    return False


def unmarked_dirs(dirs: Iterable[Inode], markers: CommitMarkers, retrying: Callable[[int], bool]) -> set[str]:
    """Paths of the directories (`dirs`: those whose marker is still to be written at their path) that hold
    back what lies below them: nothing below one is written before its marker, which SeaweedFS would lose
    (see overlaps_a_marker). Left out, so that they hold nothing back: a directory whose marker failed and
    waits for a retry (`retrying(id)`; the files below go on, overlaps_a_marker still keeps the two apart),
    and one named like a commit marker (it waits for earlier work, which may be below it)."""
    return {
        d.path for d in dirs
        if d.path is not None and not markers.match(d.name) and not retrying(d.id)
    }


def parent_dirs(path: str) -> Iterator[str]:
    """The directories `path` lies under, outermost first ("a/b/c": "a", "a/b")."""
    slash = path.find("/")
    while slash != -1:
        yield path[:slash]
        slash = path.find("/", slash + 1)


def below(path: str, dirs: Collection[str]) -> bool:
    """`path` (or the store key of a path) lies under one of the directory paths in `dirs`."""
    return any(parent in dirs for parent in parent_dirs(path.rstrip("/")))


def keyed(inodes: Iterable[Inode]) -> Iterator[tuple[Inode, str]]:
    """Each inode that has a place in the store now, with its key. The journal's work queries return
    linked inodes only; an unlinked one (an open file or directory removed meanwhile) has no key, and
    the root has none: neither is ever given a job."""
    for inode in inodes:
        key = inode.key
        if key:
            yield inode, key


def durable(inode: Inode | None, version: int) -> bool:
    """Is `version` of this inode (or a newer one) in the store, under its name, with its metadata?
    An inode that was removed meanwhile counts as done: there is nothing left to make durable."""
    if inode is None or inode.path is None:
        return True
    return inode.uploaded_version >= version and inode.remote_key == inode.key and not inode.meta_dirty


def in_scope(path: str, paths: list[str] | None) -> bool:
    """`path` is one of `paths` or below one (None or []: everything is in scope)."""
    if not paths:
        return True
    path = path.rstrip("/")
    return any(p == "" or path == p or path.startswith(p + "/") for p in paths)
