"""The drain's ordering rules (ckptfs/drain/ordering.py) on plain data: no trio, no journal, no FUSE. The
journal's answers are modelled by dicts and lambdas, as the scheduler passes them in."""

from __future__ import annotations

import ast
from pathlib import Path

from ckptfs.drain import ordering
from ckptfs.drain.ordering import (
    CommitMarkers,
    Job,
    below,
    breaks_move_cycle,
    busy,
    changed_since_scan,
    durable,
    in_scope,
    keyed,
    marker_blocked,
    overlaps_a_marker,
    parent_dirs,
    parking_key,
    target_taken,
    unmarked_dirs,
)
from ckptfs.journal import DIR, FILE, REMOTE, Inode

MARKERS = CommitMarkers(("latest", "*.done"))


def inode(
    ident: int, path: str | None, *, kind: str = FILE, state: str = "dirty", seq: int = 0, version: int = 1,
    uploaded_version: int = 0, remote_key: str | None = None, meta_dirty: int = 0, closed_at: float | None = 1.0,
) -> Inode:
    name = None if path is None else path.rsplit("/", 1)[-1]
    return Inode(ident, 1, name, path, kind, 0o644, 0, 0, 0, 0, 0, None, state, version, uploaded_version,
                 remote_key, None, meta_dirty, None, closed_at, seq)


def test_commit_markers_match_their_globs_only() -> None:
    assert MARKERS.match("latest") and MARKERS.match("step_100.done")
    assert not MARKERS.match("latest.tmp") and not MARKERS.match("model.pt") and not MARKERS.match(None)
    assert not CommitMarkers(()).match("latest")


def test_a_marker_waits_for_the_files_closed_before_it() -> None:
    # The journal's pending work, by seq: a file closed before the marker, and one closed after it.
    pending_seqs = {5: "shard-0.pt"}
    asked: list[int] = []

    def work_before(seq: int) -> bool:
        asked.append(seq)
        return any(other < seq for other in pending_seqs)

    def never(node: Inode) -> bool:
        return False

    marker = inode(9, "step_1/latest", seq=7)
    assert marker_blocked(marker, MARKERS, never, work_before)
    assert asked == [7], "asked for the work before the marker's own seq"
    # Once the earlier file is uploaded, only work closed after the marker is left: it goes.
    pending_seqs = {8: "shard-1.pt"}
    assert not marker_blocked(marker, MARKERS, never, work_before)


def test_other_entries_never_wait_for_earlier_work() -> None:
    def always(seq: int) -> bool:
        raise AssertionError("not a marker: the journal is not asked")

    assert not marker_blocked(inode(3, "shard-0.pt", seq=9), MARKERS, lambda node: True, always)


def test_a_marker_waits_for_other_nodes_and_asks_them_first() -> None:
    asked: list[str] = []

    def waits_for_nodes(node: Inode) -> bool:
        asked.append("nodes")
        return True

    def work_before(seq: int) -> bool:
        asked.append("journal")
        return False

    assert marker_blocked(inode(4, "latest", seq=2), MARKERS, waits_for_nodes, work_before)
    assert asked == ["nodes"]


def test_a_key_taken_by_an_object_waiting_to_move_away() -> None:
    new = inode(2, "a")
    moved_away = inode(1, "b", state=REMOTE, remote_key="a")  # renamed after upload, no local data
    assert target_taken(new, moved_away)
    assert not target_taken(new, None)
    assert not target_taken(new, new._replace(remote_key="a")), "its own object"
    assert not target_taken(new, moved_away._replace(state="clean")), "has local data: uploaded again"
    assert not target_taken(new, inode(1, "d", kind=DIR, state=REMOTE, remote_key="a")), "a marker: rewritten"


def _owners(*nodes: Inode) -> dict[str, Inode]:
    return {node.remote_key: node for node in nodes if node.remote_key is not None}


def test_a_cycle_of_moves_is_broken_by_its_lowest_id_only() -> None:
    # `mv x t; mv y x; mv t y` on files without local data: each waits for the other's key.
    first = inode(3, "y", state=REMOTE, remote_key="x")
    second = inode(5, "x", state=REMOTE, remote_key="y")
    owners = _owners(first, second)
    assert breaks_move_cycle(first, "y", owners.get)
    assert not breaks_move_cycle(second, "x", owners.get)
    # Three in a ring: still exactly one breaks it.
    ring = [inode(7, "b", state=REMOTE, remote_key="a"), inode(4, "c", state=REMOTE, remote_key="b"),
            inode(9, "a", state=REMOTE, remote_key="c")]
    owners = _owners(*ring)
    assert [breaks_move_cycle(node, node.path or "", owners.get) for node in ring] == [False, True, False]


def test_a_chain_of_moves_without_a_cycle_is_not_broken() -> None:
    # y waits for x's key, x waits for a key that is free: x moves first, nothing needs parking.
    first = inode(3, "y", state=REMOTE, remote_key="x")
    second = inode(5, "z", state=REMOTE, remote_key="y")
    owners = _owners(first, second)
    assert not breaks_move_cycle(first, "y", owners.get)
    assert not breaks_move_cycle(second, "x", owners.get)
    # A partner with local data is uploaded again rather than moved: not a cycle either.
    with_data = inode(5, "x", state="clean", remote_key="y")
    assert not breaks_move_cycle(first, "y", _owners(first, with_data).get)


def test_a_parking_key_lies_next_to_the_final_key() -> None:
    assert parking_key("ckpt/step_1/x", 12) == "ckpt/step_1/.ckptfs-moving-12"
    assert parking_key("x", 12) == ".ckptfs-moving-12"


def test_one_job_per_key_at_a_time() -> None:
    upload = Job("upload", 1, ("a/b",))
    assert busy(upload, set(), {"a/b"}), "another job holds its key"
    assert busy(upload, {("upload", 1)}, set()), "it runs already"
    assert not busy(upload, {("upload", 2)}, {"a/c"})
    move = Job("move", 3, ("old", "a/b"))
    assert busy(move, set(), {"a/b"}), "a move holds both its keys"
    assert not busy(move, set(), {"other"})


def test_a_directory_marker_and_what_lies_below_it_are_never_written_together() -> None:
    assert overlaps_a_marker(Job("upload", 1, ("a/",)), {"a/b/c"}), "the marker while below it is written"
    assert overlaps_a_marker(Job("upload", 2, ("a/b/c",)), {"a/"}), "below a marker being written"
    assert not overlaps_a_marker(Job("upload", 2, ("ab/c",)), {"a/"}), "a sibling that shares a prefix"
    assert not overlaps_a_marker(Job("delete", 3, ("a/b/c",)), {"a/"}), "deletes are exempt"
    assert busy(Job("upload", 2, ("a/b/c",)), set(), {"a/"})


def test_parents_go_before_their_children() -> None:
    assert list(parent_dirs("a/b/c")) == ["a", "a/b"]
    assert list(parent_dirs("top")) == []
    dirs = [inode(2, "a", kind=DIR), inode(3, "a/b", kind=DIR), inode(4, "x.done", kind=DIR),
            inode(5, "retried", kind=DIR), inode(6, None, kind=DIR)]
    unmarked = unmarked_dirs(dirs, MARKERS, retrying=lambda inode_id: inode_id == 5)
    assert unmarked == {"a", "a/b"}, "a marker-named dir and one waiting for a retry hold nothing back"
    assert below("a/b/file", unmarked) and below("a/b/c/", unmarked)
    assert not below("a/", unmarked), "a directory's own marker is not below itself"
    assert not below("ab/file", unmarked) and not below("retried/file", unmarked)


def test_only_linked_entries_get_a_key() -> None:
    nodes = [inode(1, ""), inode(2, None), inode(3, "f"), inode(4, "d", kind=DIR)]
    assert [(node.id, key) for node, key in keyed(nodes)] == [(3, "f"), (4, "d/")]


def test_scope_of_a_flush() -> None:
    assert in_scope("anything/at/all", None) and in_scope("x", [])
    assert in_scope("step_1", ["step_1"]) and in_scope("step_1/shard", ["step_1"])
    assert in_scope("step_1/", ["step_1"]), "a directory's key"
    assert not in_scope("step_10/shard", ["step_1"]) and not in_scope("other", ["step_1", "step_2"])
    assert in_scope("other", [""]), "the mount's root"


def test_durable_means_this_version_at_its_key_with_its_metadata() -> None:
    done = inode(1, "f", state="clean", version=3, uploaded_version=3, remote_key="f")
    assert durable(done, 3) and durable(done._replace(uploaded_version=4), 3)
    assert not durable(done._replace(uploaded_version=2), 3)
    assert not durable(done._replace(remote_key="old"), 3), "renamed, not moved yet"
    assert not durable(done._replace(meta_dirty=1), 3)
    assert durable(None, 3) and durable(done._replace(path=None), 3), "removed: nothing left to do"


def test_a_job_whose_entry_changed_since_its_scan_does_nothing() -> None:
    node = inode(1, "f")
    assert not changed_since_scan(node, ("f",), ("f",), lambda n: False)
    assert changed_since_scan(node, ("f.tmp",), ("f",), lambda n: False), "renamed meanwhile"
    assert changed_since_scan(node, ("f",), ("f",), lambda n: True), "a marker that must wait now"


def test_the_rules_need_neither_trio_nor_io() -> None:
    tree = ast.parse(Path(ordering.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert imported <= {"__future__", "fnmatch", "re", "collections.abc", "dataclasses", "ckptfs.journal"}, imported
