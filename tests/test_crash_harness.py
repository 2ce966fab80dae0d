"""The crash-and-fault harness (tests/crash_harness.py) in CI: a short run of about 31 rounds over file://,
SeaweedFS, SeaweedFS behind the fault proxy, a full cache filesystem, two nodes on one store (also with Orbax
steps: a tmp dir every node writes into, renamed by one), kills that the holder's next daemon takes over
(--keep-mount), and gateway mode (files uploaded while held open); and the
regression tests of the product bugs the harness found (xfail(strict=True) while they are open, each with
its reason; plain regression tests once fixed)."""

from __future__ import annotations

import errno
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount, file_store_objects
from crash_harness import (
    EIO_ANSWERED,
    KNOWN_TRACEBACKS,
    MARKER_PREFIX,
    SPILL_CACHE_SIZE,
    CrossNodeCheck,
    Model,
    NodeState,
    Op,
    PlanBuilder,
    RoundConfig,
    RoundFailed,
    Tree,
    check_kill_point,
    check_step_markers,
    digest,
    first_difference,
    known_traceback,
    moved_path,
    parse_args,
    phase_builder,
    run,
    tracebacks,
)

# Fixed seeds: CI replays the same rounds; a failure prints the command that replays it alone.
RUNS = [
    ("file", ["--store", "file", "--seed", "1201"], 8),
    ("seaweedfs", ["--store", "seaweedfs", "--seed", "1202"], 4),
    ("seaweedfs-faults", ["--store", "seaweedfs", "--faults", "--seed", "1203"], 4),
    ("full-cache", ["--store", "file", "--full-cache", "--seed", "1204"], 4),
    ("two-nodes", ["--store", "file", "--nodes", "2", "--seed", "1205"], 4),
    # Orbax's multi-host save: every node writes into a step's tmp dir, node 0 renames it after the barrier
    # (kills while the rename waits for the other node's records and right after it)
    ("two-nodes-orbax", ["--store", "file", "--nodes", "2", "--orbax", "--seed", "1208"], 2),
    # keep_mount: kills the holder's next daemon takes over, the workload going on (one round killed
    # mid-workload, one with a fresh node mid-fetch, one mid-drain)
    ("keep-mount", ["--store", "file", "--keep-mount", "--seed", "1338"], 3),
    # gateway mode: files held open after their last write are uploaded while open (issue 32)
    ("gateway", ["--store", "file", "--gateway", "--seed", "1206"], 2),
    # a preemption notice at a random moment before the kill (issue 44): steps with markers of their own
    ("preempt", ["--store", "file", "--preempt", "--seed", "1209"], 2),
]
# Each run in tests of at most two rounds (--round, --rounds): the same rounds as one test per run, since a
# round's choices depend only on the seed and its index, but the suite's workers share a run's rounds (one
# test of 8 rounds took 3.5 minutes under load, the suite's longest).
ROUNDS_PER_TEST = 2
CI_RUNS = [
    pytest.param([*argv, "--round", str(first), "--rounds", str(min(ROUNDS_PER_TEST, rounds - first))],
                 id=f"{name}-{first}")
    for name, argv, rounds in RUNS
    for first in range(0, rounds, ROUNDS_PER_TEST)
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", CI_RUNS)
def test_crash_rounds_lose_nothing(argv: list[str], tmp_path: Path) -> None:
    lines: list[str] = []
    results = run(parse_args([*argv, "--workdir", str(tmp_path)]), emit=lines.append)
    report = "\n".join(lines)
    # A round that hit an open bug with its own xfail test below counts as known, not as a new failure.
    assert results and all(r.ok or r.known for r in results), report


def test_keep_mount_refuses_the_modes_whose_writers_expect_errors() -> None:
    assert parse_args(["--keep-mount", "--store", "seaweedfs", "--faults"]).keep_mount
    for other in (["--nodes", "2"], ["--full-cache"]):
        with pytest.raises(SystemExit):
            parse_args(["--keep-mount", *other])


def test_the_checks_catch_what_they_claim() -> None:
    """The invariants fail on the states they are meant to reject (a test that cannot fail is not one)."""
    model = Model()
    model.apply({"op": "mkdir", "path": "s"})
    for op in ({"op": "open", "path": "s/a", "trunc": True},
               {"op": "write_bytes", "path": "s/a", "offset": 0, "hex": b"data".hex()},
               {"op": "close", "path": "s/a"},
               {"op": "open", "path": "latest", "trunc": True},
               {"op": "write_bytes", "path": "latest", "offset": 0, "hex": b"ckpt-marker s x:1\n".hex()},
               {"op": "close", "path": "latest"}):
        model.apply(op)
    good = Tree({"s/a": b"data", "latest": b"ckpt-marker s x:1\n"}, {"s"})
    check_kill_point(good, model, None)
    assert first_difference(good, model.files, model.dirs, "t") is None  # type: ignore[arg-type]
    with pytest.raises(Exception, match="s/a, closed before it"):
        check_kill_point(Tree({"latest": good.files["latest"]}, set()), model, None)
    with pytest.raises(Exception, match="torn or stale"):
        check_kill_point(Tree({"s/a": b"da"}, set()), model, None)
    assert "differs" in (first_difference(Tree({"s/a": b"dat4", "latest": good.files["latest"]}, {"s"}),
                                          model.files, model.dirs, "t") or "")  # type: ignore[arg-type]
    assert "should not exist" in (first_difference(Tree(good.files, {"s", "old"}), model.files, model.dirs,
                                                   "t") or "")  # type: ignore[arg-type]


def test_the_step_marker_check_catches_a_step_published_over_a_hole() -> None:
    """--preempt: a step's own marker in the store without a file its step closed before it fails the round;
    the same file changed after the marker, or a step's marker written under a name renamed since, does not."""
    model = Model()
    model.apply({"op": "mkdir", "path": "step_1"})
    marker = b"ckpt-marker step_1 x:1 step\n"
    for path, data in (("step_1/shard", b"data"), ("step_1/COMMITTED", marker)):
        for op in _write(path, data):
            model.apply(op)
    check_step_markers(Tree({"step_1/shard": b"data", "step_1/COMMITTED": marker}, {"step_1"}), model, None)
    with pytest.raises(RoundFailed, match=r"step_1/shard, closed before it .* published over a hole"):
        check_step_markers(Tree({"step_1/COMMITTED": marker}, {"step_1"}), model, None)
    with pytest.raises(RoundFailed, match="holds other bytes"):
        check_step_markers(Tree({"step_1/shard": b"dat4", "step_1/COMMITTED": marker}, {"step_1"}), model, None)
    changed_after = model.copy()
    for op in _write("step_1/shard", b"new data"):
        changed_after.apply(op)
    check_step_markers(Tree({"step_1/COMMITTED": marker}, {"step_1"}), changed_after, None)
    assert parse_args(["--preempt"]).preempt
    with pytest.raises(SystemExit):
        parse_args(["--preempt", "--keep-mount"])


class _Store:
    """A store the cross-node check reads: path -> bytes (the token is the bytes themselves)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def listing(self) -> dict[str, bytes]:
        return dict(self.files)

    def fetch(self, path: str) -> tuple[bytes, bytes] | None:
        return (self.files[path], self.files[path]) if path in self.files else None


def _node(index: int, ops: list[Op]) -> NodeState:
    ns = NodeState(index, Model())
    for op in ops:
        ns.model.apply(op)
    return ns


def _write(path: str, data: bytes) -> list[Op]:
    return [{"op": "open", "path": path, "trunc": True},
            {"op": "write_bytes", "path": path, "offset": 0, "hex": data.hex()},
            {"op": "close", "path": path}]


def test_the_cross_node_check_catches_a_marker_ahead_of_another_nodes_file() -> None:
    """--nodes: node 1 closed its shard before the barrier; node 0's marker in the store without that shard,
    or with other bytes in it, is reported; once node 1 replaced the shard after the barrier, it is not."""
    marker = MARKER_PREFIX + b"step_00001 t:0 step_00001/.metadata\n"
    check = CrossNodeCheck({digest(marker): 0})
    node0 = _node(0, [{"op": "mkdir", "path": "step_00001"}, *_write("step_00001/shard_0_0", b"zero")])
    node1 = _node(1, [{"op": "mkdir", "path": "step_00001"}, *_write("step_00001/shard_1_0", b"one")])
    nodes = [node0, node1]
    for ns in nodes:  # both arrive at the barrier of step 0 (as the harness records it from their logs)
        ns.arrived[0] = len(ns.model.applied)
        ns.closed_at_arrival[0] = {p: digest(d) for p, d in ns.model.files.items()}
    check.open_barrier(0, nodes)
    for op in _write("step_00001/.metadata", marker):
        node0.model.apply(op)
    complete = {"step_00001/shard_0_0": b"zero", "step_00001/shard_1_0": b"one", "step_00001/.metadata": marker}
    check.check(_Store(complete), nodes, lambda: None, full=True)
    check.check(_Store({k: v for k, v in complete.items() if k != "step_00001/.metadata"}), nodes, lambda: None)
    ahead = {k: v for k, v in complete.items() if k != "step_00001/shard_1_0"}
    with pytest.raises(RoundFailed, match="shard_1_0, closed on node 1 before the barrier of step_00001, is not"):
        check.check(_Store(ahead), nodes, lambda: None)
    with pytest.raises(RoundFailed, match="shard_1_0 holds other bytes"):
        check.check(_Store(dict(complete, **{"step_00001/shard_1_0": b"on"})), nodes, lambda: None)
    with pytest.raises(RoundFailed, match="torn or stale"):
        check.check(_Store({"step_00001/shard_0_0": b"zer"}), nodes, lambda: None, full=True)
    # An operation in flight on node 1 (a temp renamed over the shard) may have changed it: not required now.
    node1.run = None
    node1.in_flight = [{"op": "rename", "src": "step_00001/.shard_1_0.tmp", "dst": "step_00001/shard_1_0"}]
    check.check(_Store(ahead), nodes, lambda: None)
    # Once the writer logged it, it is an operation after the barrier that replaced the file: not required.
    rename = node1.in_flight.pop()
    for op in [*_write("step_00001/.shard_1_0.tmp", b"one again"), rename]:
        node1.model.apply(op)
    check.check(_Store(ahead), nodes, lambda: None)
    # A marker no barrier let anyone write yet.
    with pytest.raises(RoundFailed, match="before the barrier of its step"):
        CrossNodeCheck({digest(marker): 0}).check(_Store(complete), nodes, lambda: None)


def test_the_cross_node_check_wants_an_orbax_steps_shards_at_the_final_name() -> None:
    """--orbax: every node wrote into the tmp dir, node 0 renamed it after the barrier and wrote the marker.
    A marker in the store with a shard still under the tmp name (another node's, or node 0's own: its rename
    is no change after the barrier that excuses it) is reported."""
    tmp, final = "step_00001.orbax-checkpoint-tmp-t", "step_00001"
    marker = MARKER_PREFIX + b"step_00001 t:0 step_00001/commit_success.txt\n"
    check = CrossNodeCheck({digest(marker): 0})
    node0 = _node(0, [{"op": "mkdir", "path": tmp}, *_write(f"{tmp}/shard_0_0", b"zero")])
    node1 = _node(1, _write(f"{tmp}/shard_1_0", b"one"))
    nodes = [node0, node1]
    for ns in nodes:
        ns.arrived[0] = len(ns.model.applied)
        ns.closed_at_arrival[0] = {p: digest(d) for p, d in ns.model.files.items()}
    check.open_barrier(0, nodes, lambda p: moved_path(p, tmp, final))
    node0.model.apply({"op": "rename", "src": tmp, "dst": final, "orbax": 0})
    node1.model._rename(tmp, final)  # as MultiNodeRound.sync_renames does once node 0 logged the rename
    for op in _write(f"{final}/commit_success.txt", marker):
        node0.model.apply(op)
    complete = {f"{final}/shard_0_0": b"zero", f"{final}/shard_1_0": b"one", f"{final}/commit_success.txt": marker}
    check.check(_Store(complete), nodes, lambda: None, full=True)
    for path in ("shard_1_0", "shard_0_0"):
        left = {(f"{tmp}/{path}" if k == f"{final}/{path}" else k): v for k, v in complete.items()}
        wanted = f"{final}/{path}, closed on node .* before the barrier of {final}, is not"
        with pytest.raises(RoundFailed, match=wanted):
            check.check(_Store(left), nodes, lambda: None)


def test_an_eio_at_the_kill_is_in_flight_only_when_the_daemon_did_not_answer_it(tmp_path: Path) -> None:
    """Linux answers EIO to a write the killed daemon never answered (seed 6100 round 5): that write is in
    flight, possibly applied in part; an EIO earlier in the log, or one the daemon answered, is a failure."""
    write = {"op": "write_bytes", "path": "a", "offset": 0, "hex": b"data".hex()}
    plan = [{"op": "open", "path": "a", "trunc": True}, write, {"op": "close", "path": "a"}]
    log = tmp_path / "log.jsonl"
    log.write_text('{"i": 0}\n{"i": 1, "err": 5, "upto": 0}\n')
    in_flight, failures = Model().apply_log(plan, log, eio_at_kill=True)
    assert (in_flight, failures) == (write, [])
    in_flight, failures = Model().apply_log(plan, log)
    assert in_flight == plan[2] and failures and "EIO" in failures[0]
    # close(2) sends nothing the daemon must answer (no FUSE flush): it returns 0 on a dead mount too
    # (seed 61 round 23), so an EIO followed only by closes is still the one in flight.
    log.write_text('{"i": 0}\n{"i": 1, "err": 5, "upto": 0}\n{"i": 2}\n')
    assert Model().apply_log(plan, log, eio_at_kill=True) == (write, [])
    plan += [{"op": "open", "path": "a", "trunc": False}]
    log.write_text('{"i": 0}\n{"i": 1, "err": 5, "upto": 0}\n{"i": 2}\n{"i": 3}\n')
    assert Model().apply_log(plan, log, eio_at_kill=True)[1], "an EIO before other answered calls is a failure"
    assert EIO_ANSWERED.search("2026-11-23 DEBUG ckptfs.mount.adapter: write failed: [EIO] cache file gone")
    assert not EIO_ANSWERED.search("2026-11-23 DEBUG ckptfs.mount.adapter: lookup failed: [ENOENT] no entry 'a'")


# -- product bugs found by the harness --------------------------------------------------------------------


def _fresh_node_on(mount_factory, writer: Mount, name: str) -> Mount:  # type: ignore[no-untyped-def]
    reader: Mount = mount_factory(name, start=False)
    reader.store.rmdir()
    reader.store.symlink_to(writer.store)
    reader.start()
    return reader


def _store_dirs(m: Mount) -> set[str]:
    root = m.store.resolve()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir()}


def test_fresh_node_rmdir_of_a_never_listed_directory_deletes_it_in_the_store(mount_factory) -> None:  # type: ignore[no-untyped-def]
    writer: Mount = mount_factory("writer")
    (writer.mnt / "step_1" / "optim").mkdir(parents=True)
    (writer.mnt / "step_1" / "shard").write_bytes(b"x")
    assert writer.umount().returncode == 0
    reader = _fresh_node_on(mount_factory, writer, "reader")
    (reader.mnt / "step_1" / "shard").unlink()  # step_1 is listed by this lookup; optim is not
    os.rmdir(reader.mnt / "step_1" / "optim")
    os.rmdir(reader.mnt / "step_1")
    reader.flush()
    assert _store_dirs(reader) == set()


def test_fresh_node_rename_of_a_never_listed_directory_keeps_its_files(mount_factory) -> None:  # type: ignore[no-untyped-def]
    writer: Mount = mount_factory("writer")
    (writer.mnt / "step_2" / "optim").mkdir(parents=True)
    (writer.mnt / "step_2" / "optim" / "shard").write_bytes(b"optimizer state")
    (writer.mnt / "step_2" / "model").write_bytes(b"weights")
    assert writer.umount().returncode == 0
    reader = _fresh_node_on(mount_factory, writer, "reader")
    (reader.mnt / "archive").mkdir()
    os.rename(reader.mnt / "step_2", reader.mnt / "archive" / "step_2")  # neither step_2 nor optim listed yet
    reader.flush()
    assert reader.umount().returncode == 0
    reader.start()
    assert (reader.mnt / "archive" / "step_2" / "model").read_bytes() == b"weights"
    assert (reader.mnt / "archive" / "step_2" / "optim" / "shard").read_bytes() == b"optimizer state"
    assert not (reader.store.resolve() / "step_2").exists()


def test_fresh_node_rmdir_of_a_never_listed_non_empty_directory_is_enotempty(mount_factory) -> None:  # type: ignore[no-untyped-def]
    writer: Mount = mount_factory("writer")
    (writer.mnt / "a" / "b").mkdir(parents=True)
    (writer.mnt / "a" / "b" / "f").write_bytes(b"x")
    assert writer.umount().returncode == 0
    reader = _fresh_node_on(mount_factory, writer, "reader")
    with pytest.raises(OSError) as raised:
        os.rmdir(reader.mnt / "a" / "b")  # a is listed by this lookup; b is not
    assert raised.value.errno == errno.ENOTEMPTY


def test_a_mount_starts_where_only_the_holder_socket_path_is_too_long(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Found by the CI run of the harness (every round failed at its fresh node, under pytest's long tmp_path):
    <runtime>/<hash>.sock fits in an AF_UNIX address (107 characters) and <runtime>/<hash>.holder does not.
    Such a mount worked before keep_mount; with --no-keep-mount it must still. (Fixed: the holder's socket
    is <hash>.hold, as long as <hash>.sock.)"""
    m: Mount = mount_factory("m", start=False, extra_args=("--no-keep-mount",))
    base = str(tmp_path / "r")
    m.runtime = Path(base + "x" * (84 - len(base)))  # + "/" + 16 hex + ".sock" = 106, ".holder" = 108
    m.env["CKPTFS_RUNTIME_DIR"] = str(m.runtime)
    m.start()
    (m.mnt / "a").write_bytes(b"a")
    m.flush()
    assert m.store_files() == {"a": b"a"}


def _in_journal(m: Mount, path: str) -> bool:
    db = sqlite3.connect(f"file:{m.cache / 'journal.db'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute("SELECT 1 FROM inodes WHERE path = ?", (path,)).fetchone() is not None
    finally:
        db.close()


@pytest.mark.parametrize("call", ["mkdir", "create", "rename", "unlink"])
def test_a_request_done_but_not_answered_at_the_kill_is_not_done_twice(mount_factory, call: str) -> None:  # type: ignore[no-untyped-def]
    """--keep-mount, --seed 4242 --store file, rounds 10 (`open step_00004/shard-0.bin failed: EEXIST`), 26 and
    27 (`mkdir step_00003 failed: EEXIST`); --seed 1207 round 1 (`rename step_00002.tmp-1b -> step_00002
    failed: ENOENT`): the daemon is killed after it recorded the change in its journal and before its answer
    reached the kernel; the kernel sends the request again to the daemon that takes the mount over, which
    finds the name taken (or gone). Here strace holds every answer of the daemon on /dev/fuse for 2 s, and the
    kill comes once the journal has the change. Each call must succeed (and a created file be like any other:
    written, closed, uploaded). (Fixed: the request id pyfuse3 now passes marks a request sent again, and the
    new daemon answers it from what the daemon before did; a create's handle it recorded is handed over.)"""
    m: Mount = mount_factory()
    m.allowed_log_words += ["died; the mount stays"]
    if call in ("rename", "unlink"):
        (m.mnt / "made").write_bytes(b"data")
    assert m.proc is not None
    tracer = subprocess.Popen(["strace", "-f", "-qq", "-o", "/dev/null", "-p", str(m.proc.pid), "-P", "/dev/fuse",
                               "-e", "trace=writev", "-e", "inject=writev:delay_enter=2000000"],
                              stderr=subprocess.DEVNULL)
    time.sleep(1.5)  # attached to every thread
    outcome: list[object] = []

    def job() -> None:
        try:
            if call == "mkdir":
                os.mkdir(m.mnt / "made")
            elif call == "create":
                fd = os.open(m.mnt / "made", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, b"data")
                os.close(fd)
            elif call == "rename":
                os.rename(m.mnt / "made", m.mnt / "moved")
            else:
                os.unlink(m.mnt / "made")
            outcome.append("ok")
        except OSError as exc:
            outcome.append(exc)

    def done() -> bool:
        return _in_journal(m, "moved") if call == "rename" else _in_journal(m, "made") == (call != "unlink")

    thread = threading.Thread(target=job)
    thread.start()
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, "the daemon never recorded the change"
        time.sleep(0.01)
    m.proc.kill()  # its answer is held back by strace: the kernel has not got it
    m.proc.wait()
    m.proc = None
    tracer.wait(timeout=30)
    thread.join(timeout=60)
    if outcome != ["ok"]:
        # (the daemon that took over keeps the create's handle, which the kernel never got, open for writing:
        # its drain would wait for it; the teardown's umount would wait a minute)
        pid = m.status()["pid"]
        m.kill_holder()
        os.kill(pid, signal.SIGKILL)
    assert outcome == ["ok"], outcome
    # The daemon that took the mount over answered the request sent again; its control socket may come a
    # moment later, and the flush waits for it (client.SOCKET_WAIT_SECONDS: it failed with NoDaemonError).
    m.flush()
    assert m.store_files() == {"create": {"made": b"data"}, "rename": {"moved": b"data"}}.get(call, {})


def test_local_store_copy_redone_leaves_no_temp(tmp_path: Path) -> None:
    from ckptfs.backends.local import LocalStore

    store = LocalStore(tmp_path)
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "shard").write_bytes(b"weights")
    store.copy("step_1/shard", "archive/shard")
    store.copy("step_1/shard", "archive/shard")  # the drain redoes the move after the restart
    assert sorted(p.name for p in (tmp_path / "archive").iterdir()) == ["shard"]


def test_a_daemon_traceback_of_an_open_bug_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """A traceback with the exact signature of an open bug (KNOWN_TRACEBACKS, none today) is reported KNOWN."""
    monkeypatch.setitem(KNOWN_TRACEBACKS, r"in tidy\n\s+del self\._records\[record\.gen\][\s\S]*\nKeyError: \d+$",
                        "test_concurrent_tidies_of_the_node_records_delete_a_record_once")
    log = """2026-11-26 20:13:16,047 ERROR ckptfs.daemon: node records failed unexpectedly; starting it again in 1 s
Traceback (most recent call last):
  File "/work/main/ckptfs/daemon.py", line 309, in _supervised
    await service(task_status=status)
  File "/work/main/ckptfs/nodes.py", line 242, in run
    await self.tidy()
  File "/work/main/ckptfs/nodes.py", line 327, in tidy
    del self._records[record.gen]
        ~~~~~~~~~~~~~^^^^^^^^^^^^
KeyError: 1
2026-11-26 20:13:16,050 DEBUG pyfuse3: Calling fuse_session_unmount
"""
    [(head, block)] = tracebacks(log)
    assert "node records failed" in head and block.endswith("KeyError: 1")
    assert known_traceback(block) == "test_concurrent_tidies_of_the_node_records_delete_a_record_once"
    assert known_traceback(block.replace("KeyError: 1", "ValueError: x")) is None


def test_a_live_file_store_is_read_while_its_staging_directory_comes_and_goes(tmp_path: Path) -> None:
    """conftest.file_store_objects, which the mounts' tests poll while the drain uploads: the store's staging
    directory is made and removed with every upload; Path.rglob raised FileNotFoundError when it went between
    the listing of the root and its own (test_gateway_fuse failed so in CI)."""
    (tmp_path / "step_1.pt").write_bytes(b"one")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "step_2.pt").write_bytes(b"two")
    stop = threading.Event()

    def churn() -> None:
        staging = tmp_path / ".ckptfs-tmp.staging"
        while not stop.is_set():
            (staging / "part").mkdir(parents=True)
            (staging / "part" / "0").write_bytes(b"x")
            (tmp_path / "sub" / ".ckptfs-tmp.up").write_bytes(b"y")
            (staging / "part" / "0").unlink()
            (staging / "part").rmdir()
            staging.rmdir()
            (tmp_path / "sub" / ".ckptfs-tmp.up").unlink()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert file_store_objects(tmp_path) == {"step_1.pt": b"one", "sub/step_2.pt": b"two"}
    finally:
        stop.set()
        churner.join()


def test_a_spill_rounds_plan_never_needs_a_file_larger_than_the_cache_in_the_cache() -> None:
    """Seed 9415 round 2 (seaweedfs, faults, keep-mount) appended to the 39 MB file it had spilled, which
    the mount's 24 MiB cache cannot fetch whole: EFBIG, as documented, taken for a lost write. A spill
    round's plan renames such a file where it would append to, overwrite or truncate it."""
    for seed in range(200):
        builder = PlanBuilder(random.Random(seed), "t", {"big.bin": SPILL_CACHE_SIZE + 1}, set())
        builder.cache_budget = SPILL_CACHE_SIZE
        for _ in range(4):  # renamed or removed, never written to (the only file: nothing renamed over it)
            builder.mutate()
        assert all(op["op"] in ("rename", "unlink") for op in builder.ops), (seed, builder.ops)


@pytest.mark.parametrize("phase", ["a", "b"])
def test_both_phases_of_a_spill_round_plan_for_its_small_cache(phase: str) -> None:
    """Seed 4701 round 3 (seaweedfs, faults): the earlier life's plan truncated the 30 MB shard it had spilled
    through the spill round's 24 MiB cache: EFBIG, as documented, taken for a lost write. Each phase's plan
    now knows the cache (phase_builder)."""
    cfg = RoundConfig(kill="spill", upload_delay=1.0, prephase="fresh-cache", kill_at=0, kill_sleep=0.0, faults=[],
                      full_cache=False, filler_mib=0)
    for seed in range(50):
        builder = phase_builder(cfg, random.Random(seed), f"0{phase}", {"big.bin": SPILL_CACHE_SIZE + 1}, set(),
                                "small", gateway=False)
        for _ in range(4):
            builder.mutate()
        assert all(op["op"] in ("rename", "unlink") for op in builder.ops), (seed, builder.ops)
