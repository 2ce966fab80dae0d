"""Cross-node ordering of commit markers (nodes.py, issue 28), kernel-free: two stacks wired like two
daemons on one file:// store. A marker on node A waits for what node B closed before it; records made
after the marker's snapshot do not hold it; a node given up on holds the markers that waited for it;
records of an earlier run go once nothing is pending; a store that refuses the record does not block a
close for longer than ANNOUNCE_WAIT."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import trio
from fsharness import GID, UID, Stack, make_stack
from waiting import drain_had_its_chance, until

from ckptfs.errors import BackendError, TransientBackendError
from ckptfs.journal import ROOT_ID
from ckptfs.nodes import PENDING, TOP_FILES, NodeRecords, PeerRecords, own, peers


class Node:
    """One stack and its records, as daemon.py wires them."""

    def __init__(self, root: Path, store: Path, name: str) -> None:
        self.stack: Stack = make_stack(root / name, store_dir=store)
        self.name = name
        self.records = NodeRecords(self.stack.journal, self.stack.drain.engine, name, host=f"host-{name}")
        self.peers = PeerRecords(self.stack.drain.engine, name)
        self.peers.on_change = self.stack.drain.notify
        self.stack.drain.waits_for_nodes = self.peers.blocks
        self.stack.fs.announcer = self.records

    async def start(self, nursery: trio.Nursery, *, drain: bool = True) -> None:
        await nursery.start(self.records.run)
        await nursery.start(self.peers.run)
        if drain:
            await nursery.start(self.stack.drain.run)

    def mkdir(self, path: str) -> int:
        parent = self.stack.resolve_dir(path.rsplit("/", 1)[0]) if "/" in path else ROOT_ID
        return self.stack.fs.mkdir(parent, path.rsplit("/", 1)[-1].encode(), 0o755, UID, GID).ino

    async def close_file(self, path: str, data: bytes) -> int:
        """create (which announces the writer), write, close() and RELEASE: what the kernel sends."""
        parent = self.stack.resolve_dir(path.rsplit("/", 1)[0]) if "/" in path else ROOT_ID
        fh, attr = self.stack.fs.create(parent, path.rsplit("/", 1)[-1].encode(), 0o644,
                                        os.O_WRONLY | os.O_CREAT, UID, GID)
        await self.stack.fs.announce_writer(fh)
        self.stack.fs.write(fh, 0, data)
        self.stack.fs.release(fh)
        return attr.ino

    def pending_records(self) -> list[str]:
        return self.stack.store.inner.list_notes(f"{PENDING}{self.name}/")


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(own, "LINGER", 0.0)
    monkeypatch.setattr(own, "CHECK_INTERVAL", 0.05)
    monkeypatch.setattr(own, "CHECK_MAX", 0.2)
    monkeypatch.setattr(peers, "POLL_FIRST", 0.05)
    monkeypatch.setattr(peers, "POLL_MAX", 0.2)


async def test_a_marker_waits_for_the_files_another_node_closed_before_it(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery, drain=False)  # node B's uploads are held back
    a.mkdir("step_1")
    b.mkdir("step_1")
    await b.close_file("step_1/shard_b", b"b" * 1000)
    assert b.pending_records(), "the record is in the store before open() returns"
    # The barrier; then node A writes its shard and the marker.
    await a.close_file("step_1/shard_a", b"a" * 1000)
    since = time.time()
    await a.close_file("step_1/.metadata", b"meta")
    await until(lambda: "step_1/shard_a" in a.stack.store_files())
    await drain_had_its_chance(a.stack.drain, since=since, what="upload the marker before node B's shard")
    # The marker's listing of the other nodes' records runs in a worker thread: until it is done the marker
    # waits with no node named yet (CI met that once).
    await until(lambda: [w for w in a.peers.waiting_markers() if w["nodes"]],
                what="the marker's listing of the other nodes' records")
    assert "step_1/.metadata" not in a.stack.store_files()
    [waiting] = a.peers.waiting_markers()
    assert waiting["path"] == "step_1/.metadata" and waiting["nodes"] == ["node-b"]
    assert "host-node-b" in waiting["waits_for"][0] and "step_1" in waiting["waits_for"][0]
    # Node B drains: its shard lands, its record goes, then the marker lands.
    await nursery.start(b.stack.drain.run)
    await until(lambda: "step_1/.metadata" in a.stack.store_files())
    assert "step_1/shard_b" in a.stack.store_files()
    await until(lambda: not a.pending_records() and not b.pending_records())
    assert a.peers.waiting_markers() == []


async def test_work_closed_after_the_marker_does_not_hold_it(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery, drain=False)
    # Node A's shard upload is held, so its marker waits for it locally, with its snapshot already taken.
    gate = threading.Event()
    a.stack.store.key_gates["shard_a"] = gate
    await a.close_file("shard_a", b"a")
    await a.close_file("latest", b"step_1")
    await until(lambda: bool(a.peers._snapshots))
    # Node B closes a file after that (the next checkpoint): it does not hold node A's marker.
    await b.close_file("next_b", b"b")
    assert b.pending_records()
    gate.set()
    await until(lambda: "latest" in a.stack.store_files())
    assert b.pending_records() and "next_b" not in a.stack.store_files()


async def test_a_busy_node_announces_once_per_checkpoint_entry(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    b = Node(tmp_path, tmp_path / "store", "node-b")
    await b.start(nursery, drain=False)
    b.mkdir("step_1")
    for i in range(10):
        await b.close_file(f"step_1/shard_{i}", b"z")
    assert b.records.records_written == 1
    b.mkdir("step_2")
    await b.close_file("step_2/shard_0", b"z")
    assert b.records.records_written == 2  # the same record, now naming step_2 too
    [name] = b.pending_records()
    assert sorted(b.peers.nodes() or []) == []  # nothing listed yet
    await b.peers.refresh()
    assert b.peers.nodes()[0]["entries"] == ["step_1", "step_2"] and name.startswith(f"{PENDING}node-b/")


async def test_a_forgotten_node_holds_the_markers_that_waited_for_it(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery, drain=False)
    await b.close_file("step_1.shard_b", b"b")
    await a.close_file("latest", b"step_1")
    await until(lambda: bool(a.peers.waiting_markers()) and bool(a.peers.waiting_markers()[0]["nodes"]))
    since = time.time()
    assert await a.peers.forget("node-b") == 1
    await drain_had_its_chance(a.stack.drain, since=since, what="upload the marker the forgotten node held")
    assert "latest" not in a.stack.store_files()
    [held] = a.peers.waiting_markers()
    assert held["held_by"] == ["node-b"]
    assert a.peers.pending_entries() == {TOP_FILES}  # retention counts top-level files incomplete
    # The job writes the marker again: a new snapshot leaves the forgotten node out.
    fh = await a.stack.fs.open(a.stack.journal.names.by_path("latest").id, os.O_WRONLY | os.O_TRUNC)  # type: ignore[union-attr]
    await a.stack.fs.announce_writer(fh)
    a.stack.fs.write(fh, 0, b"step_2")
    a.stack.fs.release(fh)
    await until(lambda: a.stack.store_files().get("latest") == b"step_2")


async def test_a_forgotten_node_that_comes_back_and_drains_lets_the_held_marker_land(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery, drain=False)
    await b.close_file("shard_b", b"b")
    await a.close_file("latest", b"step_1")
    await until(lambda: bool(a.peers.waiting_markers()) and bool(a.peers.waiting_markers()[0]["nodes"]))
    await a.peers.forget("node-b")
    await nursery.start(b.stack.drain.run)
    await until(lambda: "latest" in a.stack.store_files())
    assert "shard_b" in a.stack.store_files()


async def test_records_of_an_earlier_run_go_once_nothing_is_pending(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    b = Node(tmp_path, tmp_path / "store", "node-b")
    await nursery.start(b.records.run)
    await b.close_file("shard", b"b")
    [left] = b.pending_records()
    # A restart (kill -9): a new NodeRecords on the same journal finds the record and keeps it while the
    # journal has anything pending.
    again = NodeRecords(b.stack.journal, b.stack.drain.engine, "node-b")
    b.stack.fs.announcer = again
    await nursery.start(again.run)
    await until(lambda: bool(again.status()["records"]))
    assert again.status()["records"][0]["from_before"]
    await trio.sleep(0.3)
    assert b.pending_records() == [left]
    await nursery.start(b.stack.drain.run)
    await b.stack.flush()
    await until(lambda: not b.pending_records())


async def test_a_record_written_while_the_earlier_runs_are_listed_is_not_taken_for_one_of_them(
    tmp_path: Path, nursery: trio.Nursery, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a CI failure of the test above it: the first open of a run does not wait for the listing of
    the node's records from before, which then listed the record that open wrote and kept it as one from
    before: such a record waits for every pending file of the node, so a log held open kept it, and every
    other node's marker that waited for it, until the log closed."""
    monkeypatch.setattr(own, "ROTATE_AFTER", 0.3)
    b = Node(tmp_path, tmp_path / "store", "node-b")
    listing = threading.Event()
    inner_list = b.stack.store.list_notes

    def slow_list(prefix: str = "") -> list[str]:
        if prefix == f"{PENDING}node-b/":
            listing.wait(30)  # the store answers the start's listing after the first open wrote its record
        return inner_list(prefix)

    monkeypatch.setattr(b.stack.store, "list_notes", slow_list)
    await b.start(nursery)
    log_fh, _ = b.stack.fs.create(ROOT_ID, b"train.log", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    await b.stack.fs.announce_writer(log_fh)
    [first] = b.pending_records()
    listing.set()
    await b.close_file("shard_b", b"b")
    await until(lambda: "shard_b" in b.stack.store_files())
    assert not any(record["from_before"] for record in b.records.status()["records"])
    # The log's successor record takes it over; the first record goes, though the log is still open.
    await until(lambda: first not in b.pending_records(), seconds=10)
    assert b.pending_records()
    b.stack.fs.release(log_fh)


@pytest.mark.serial  # five closes within 0.5 s
async def test_a_store_refusing_the_record_delays_a_close_at_most_announce_wait(
    tmp_path: Path, nursery: trio.Nursery, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(own, "ANNOUNCE_WAIT", 0.5)
    b = Node(tmp_path, tmp_path / "store", "node-b")
    b.stack.drain.engine.attempts = 1
    await nursery.start(b.records.run)
    b.stack.store.failures = [TransientBackendError("503 Slow Down")] * 3
    started = trio.current_time()
    await b.close_file("shard", b"b")
    assert trio.current_time() - started < 2
    assert b.records.unannounced is not None
    # While the store refuses records, further opens do not wait for them at all.
    b.mkdir("step_2")
    started = trio.current_time()
    for i in range(5):
        await b.close_file(f"step_2/shard_{i}", b"b")
    assert trio.current_time() - started < 0.5
    # The checker writes it once the store takes it.
    await until(lambda: bool(b.pending_records()))
    await until(lambda: b.records.unannounced is None)


async def test_a_marker_waits_for_a_directory_renamed_into_place_on_another_node(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery, drain=False)
    b.mkdir("tmp_b")
    await b.close_file("tmp_b/shard", b"b")
    moved = b.stack.fs.rename(ROOT_ID, b"tmp_b", ROOT_ID, b"step_1_b", 0)
    assert moved is not None
    await b.stack.fs.announce(*moved)
    since = time.time()
    await a.close_file("latest", b"step_1")
    await drain_had_its_chance(a.stack.drain, since=since, what="upload the marker before the renamed directory")
    assert "latest" not in a.stack.store_files()
    await nursery.start(b.stack.drain.run)
    await until(lambda: "latest" in a.stack.store_files())
    assert "step_1_b/shard" in a.stack.store_files()


async def test_a_flush_and_the_checker_tidy_at_the_same_time(
    tmp_path: Path, nursery: trio.Nursery, quick: None
) -> None:
    """Found by test_frameworks' FSDP save: a flush's tidy and the checker's deleted the same record, and
    the second one's KeyError failed the flush ("bad request: 1")."""
    b = Node(tmp_path, tmp_path / "store", "node-b")
    await nursery.start(b.stack.drain.run)  # no checker of its own: the two calls below are the only ones
    await b.close_file("shard", b"b")
    await b.stack.flush()
    assert b.pending_records()
    async with trio.open_nursery() as both:
        both.start_soon(b.records.tidy)
        both.start_soon(lambda: b.records.tidy(final=True))
    assert not b.pending_records() and b.records.status()["records"] == []


async def test_a_file_held_open_for_writing_does_not_keep_an_old_record(
    tmp_path: Path, nursery: trio.Nursery, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log held open for writing keeps the current record; after ROTATE_AFTER a successor takes it over,
    so the record another node's marker waits for goes once the work closed under it is durable."""
    monkeypatch.setattr(own, "ROTATE_AFTER", 0.3)
    store = tmp_path / "store"
    a, b = Node(tmp_path, store, "node-a"), Node(tmp_path, store, "node-b")
    await a.start(nursery)
    await b.start(nursery)
    log_fh, _ = b.stack.fs.create(ROOT_ID, b"train.log", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    await b.stack.fs.announce_writer(log_fh)
    b.stack.fs.write(log_fh, 0, b"step 1\n")
    await b.close_file("shard_b", b"b")
    await a.close_file("latest", b"step_1")
    await until(lambda: "latest" in a.stack.store_files())
    assert "shard_b" in a.stack.store_files()
    assert b.pending_records(), "the log's writer is still covered"
    b.stack.fs.release(log_fh)
    await until(lambda: not b.pending_records())


@pytest.mark.serial  # five opens within 1 s
async def test_a_store_that_does_not_answer_delays_one_open_not_every_open(
    tmp_path: Path, nursery: trio.Nursery, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that hangs (network down): the first open waits ANNOUNCE_WAIT for its record, later opens
    do not wait at all; the record is written once the store answers."""
    monkeypatch.setattr(own, "ANNOUNCE_WAIT", 0.3)
    b = Node(tmp_path, tmp_path / "store", "node-b")
    await nursery.start(b.records.run)
    answering = threading.Event()
    inner_put = b.stack.store.put_note

    def hanging_put(name: str, data: bytes) -> None:
        answering.wait(30)
        inner_put(name, data)

    monkeypatch.setattr(b.stack.store, "put_note", hanging_put)
    started = trio.current_time()
    for i in range(5):
        b.mkdir(f"step_{i}")  # a new checkpoint directory each: a record rewrite each
        await b.close_file(f"step_{i}/shard", b"b")
    assert trio.current_time() - started < 1.0, "every open waited for the hanging store"
    assert b.records.unannounced is not None
    answering.set()
    await until(lambda: bool(b.pending_records()) and b.records.unannounced is None)


async def test_a_store_that_keeps_refusing_records_is_asked_again_with_backoff_not_in_a_loop(
    tmp_path: Path, nursery: trio.Nursery, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that refuses every record write (or delete) for good: the checker asks it again after a pause
    that doubles, not at once. It asked again at once, thousands of times a second (a daemon whose file://
    store directory was deleted under it spun at 60% CPU)."""
    monkeypatch.setattr(own, "ANNOUNCE_WAIT", 0.2)
    b = Node(tmp_path, tmp_path / "store", "node-b")
    b.stack.drain.engine.attempts = 1
    await nursery.start(b.records.run)
    refusals = 100_000
    b.stack.store.failures = [BackendError("403 Forbidden")] * refusals
    await b.close_file("shard", b"b")
    await trio.sleep(2)
    asked = refusals - len(b.stack.store.failures)
    assert 1 <= asked < 40, asked
    b.stack.store.failures = []
    await until(lambda: bool(b.pending_records()) or b.records.unannounced is None)
