"""Preemption (issue 44, parts 1 and 5), kernel-free (fsharness): under a notice the drain uploads the newest
complete step first, its shards then its markers, cutting short what it was uploading of older steps; steps
still being written and deletes wait; a file that cannot upload holds its step's markers back and is named
by the report, flush and status. The FUSE and CLI side: test_preempt_fuse.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
from fsharness import Stack, make_stack

from ckptfs.drain import PARK_AFTER, Drain, retries
from ckptfs.drain.ordering import Job
from ckptfs.drain.preemption import choose
from ckptfs.journal import ROOT_ID, Inode
from ckptfs.notices.preempter import REPORT_NAME, Preempter
from ckptfs.notices.watchers import Notice, seconds_left

MiB = 1 << 20
SHARD = 2 * MiB  # above SMALL_FILE: each shard is an upload job of its own
RATE = 2 * MiB  # the store "throttled to a known rate": the upload cap, kept under the notice
STEP_SECONDS = 2 * SHARD / RATE  # one step of two shards at the cap


def write_step(stack: Stack, name: str, shards: int = 2, *, marker: bool = True) -> None:
    stack.fs.mkdir(ROOT_ID, name.encode(), 0o755, 0, 0)
    for i in range(shards):
        stack.write_file(f"{name}/shard{i}", bytes([i + 1]) * SHARD)
    if marker:
        stack.write_file(f"{name}/.metadata", f"{name} done".encode())


def capped_stack(tmp_path: Path) -> Stack:
    stack = make_stack(tmp_path, upload_delay=0.0)
    stack.drain.engine.bandwidth.direction("upload").set_runtime(RATE)
    return stack


async def wait_for(condition, seconds: float = 30, *, poke: Drain | None = None) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.02)
            if poke is not None:
                poke.notify()  # a failure met while choosing a job is retried at the next scan


async def test_a_notice_makes_the_newest_complete_step_durable_first_cutting_older_uploads_short(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = capped_stack(tmp_path)
    await nursery.start(stack.drain.run)
    write_step(stack, "step_100")
    # step_100 is being uploaded (at the cap) when the next steps are saved and the notice comes.
    await wait_for(lambda: stack.drain.stats.uploaded_bytes > 0 or stack.drain.in_flight() > 0)
    write_step(stack, "step_200")
    write_step(stack, "step_300")
    preempter = Preempter(stack.drain, stack.drain.engine, stack.cache.root)
    await nursery.start(preempter.run)
    # Room for one step and most of the next: the newest must be the one that made it.
    preempter.begin(STEP_SECONDS * 1.75, reason="test", lift_limits=False)
    report = await preempter.wait_report()
    files = stack.store_files()
    # The newest step is durable and published (its marker) while the oldest, started first, is not.
    assert files["step_300/.metadata"] == b"step_300 done"
    assert {"step_300/shard0", "step_300/shard1"} <= set(files)
    assert "step_100/.metadata" not in files
    assert report["newest_complete_step"] == "step_300"
    assert report["durable"] == ["step_300"] and not report["deadline_met"]
    by_step = {row["step"]: row for row in report["steps"]}
    assert by_step["step_300"]["published"] and by_step["step_300"]["why"] is None
    # Each other step is not durable yet, with what it lacks; the whole report is on disk too.
    assert not by_step["step_100"]["durable"] and "bytes left" in by_step["step_100"]["why"]
    assert [row["step"] for row in report["steps"]] == ["step_300", "step_200", "step_100"]
    assert json.loads((stack.cache.root / REPORT_NAME).read_text())["durable"] == report["durable"]
    # Then the next newest, and so on: everything is uploaded, step_200's marker before step_100's.
    await stack.flush(60)
    order = [key for key, _ in stack.store.committed]
    assert order.index("step_300/.metadata") < order.index("step_200/.metadata") < order.index("step_100/.metadata")


async def test_steps_being_written_and_deletes_wait_under_a_notice(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, upload_delay=0.0)
    await nursery.start(stack.drain.run)
    stack.write_file("old.pt", b"old checkpoint")
    await stack.flush()
    stack.drain.engine.bandwidth.direction("upload").set_runtime(RATE)
    upload_delay_was = stack.drain.upload_delay
    stack.drain.upload_delay = 3600.0  # nothing goes before the notice: it alone decides the order
    write_step(stack, "step_300")
    stack.fs.mkdir(ROOT_ID, b"step_400", 0o755, 0, 0)
    stack.write_file("step_400/shard0", b"closed shard")
    fh, _ = stack.fs.create(stack.resolve_dir("step_400"), b"shard1", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
    stack.fs.write(fh, 0, b"still being written")
    preempter = Preempter(stack.drain, stack.drain.engine, stack.cache.root)
    await nursery.start(preempter.run)
    preempter.begin(60, reason="test", lift_limits=False)
    # A delete (retention's would be the same), made under the notice: before it, a delete is due at once
    # and may be done before the notice comes (upload_delay holds back uploads only).
    stack.fs.unlink(ROOT_ID, b"old.pt")
    report = await preempter.wait_report()
    by_step = {row["step"]: row for row in report["steps"]}
    assert by_step["step_300"]["published"]
    assert not by_step["step_400"]["complete"]
    assert by_step["step_400"]["why"] == "files still open for writing: step_400/shard1"
    # They went after the complete step: the delete, and the closed shard of the step still written.
    await wait_for(lambda: "step_400/shard0" in stack.store_files() and "old.pt" not in stack.store_files())
    calls = stack.store.calls
    published = calls.index(("commit", "step_300/.metadata"))
    assert published < calls.index(("delete", "old.pt")) and published < calls.index(("commit", "step_400/shard0"))
    stack.drain.upload_delay = upload_delay_was
    stack.fs.release(fh)
    await stack.flush()


def _failing_upload(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload of the file called `name` raises (a bug met by that file alone): it is parked."""
    original = Drain._target_taken

    def target_taken(self: Drain, inode: Inode, key: str) -> bool:
        if inode.name == name:
            raise RuntimeError(f"cannot upload {inode.name}")
        return original(self, inode, key)

    monkeypatch.setattr(Drain, "_target_taken", target_taken)


async def test_a_parked_file_holds_its_steps_marker_back_and_is_named_by_the_report_and_flush(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retries, "PARKED_RETRY", 3600.0)
    monkeypatch.setattr(retries, "backoff_delays", lambda base, cap: iter([0.01] * 100))
    _failing_upload("bad", monkeypatch)
    stack = make_stack(tmp_path, upload_delay=0.0)
    await nursery.start(stack.drain.run)
    write_step(stack, "step_200")
    stack.fs.mkdir(ROOT_ID, b"step_300", 0o755, 0, 0)
    stack.write_file("step_300/shard0", b"good shard")
    stack.write_file("step_300/bad", b"a shard that cannot upload")
    stack.write_file("step_300/.metadata", b"step_300 done")
    await wait_for(lambda: len(stack.drain.failing()) == 1 and "step_200/.metadata" in stack.store_files(),
                   poke=stack.drain)
    assert stack.drain.failing()[0][0] == "step_300/bad"
    # Never published over the hole: the marker waits for the parked shard, with and without a notice.
    assert "step_300/.metadata" not in stack.store_files()
    result = await stack.drain.flush(["step_300"], trio.current_time() + 0.5)
    assert not result.ok and any(r.startswith("step_300/bad (failing: ") for r in result.remaining)
    assert "step_300/.metadata (commit marker held back: step_300/bad is failing)" in result.remaining
    assert stack.drain.markers_held() == [("step_300/.metadata", "step_300/bad")]
    preempter = Preempter(stack.drain, stack.drain.engine, stack.cache.root)
    await nursery.start(preempter.run)
    preempter.begin(2, reason="test")
    report = await preempter.wait_report()
    assert "step_300/.metadata" not in stack.store_files()
    by_step = {row["step"]: row for row in report["steps"]}
    assert by_step["step_300"]["failing"][0]["path"] == "step_300/bad"
    assert by_step["step_300"]["why"].startswith("failing: step_300/bad (")
    assert by_step["step_300"]["markers_left"] == ["step_300/.metadata"]
    assert len(stack.drain.failing()) == 1 and stack.drain.faults.counts["drain"] == PARK_AFTER


def test_a_notice_that_names_its_end_shortens_the_deadline() -> None:
    assert seconds_left(Notice("gcp", None, ""), 25.0, 1000.0) == 25.0
    assert seconds_left(Notice("aws", 1120.0, ""), 25.0, 1000.0) == 25.0
    assert seconds_left(Notice("azure", 1020.0, ""), 25.0, 1000.0) == 15.0
    assert seconds_left(Notice("azure", 990.0, ""), 25.0, 1000.0) == 1.0


def test_the_order_under_a_notice_holds_back_only_bandwidth_and_deletes() -> None:
    """choose(): uploads of the first rank only (a running one of a later rank is cut short), moves of any
    rank (an upload may wait for one to free its key: seed 1209 of the crash harness waited forever when a
    move of a step still being written was held back), deletes once no complete step has work left."""
    ranks = {("upload", 1): 0, ("upload", 2): 1, ("move", 3): 3, ("meta", 4): 2, ("upload", 5): 1,
             ("upload", 6): None}
    jobs = [Job("upload", 2, ("s2/a",)), Job("delete", 9, ("old/",)), Job("move", 3, ("x", "w/x")),
            Job("upload", 1, ("s1/a",)), Job("meta", 4, ("t",))]
    chosen, cut = choose(jobs, {("upload", 5), ("upload", 6)}, lambda kind, ident: ranks[(kind, ident)], 2)
    assert [(j.kind, j.ident) for j in chosen] == [("upload", 1), ("meta", 4), ("move", 3)]
    assert sorted(cut) == [("upload", 5), ("upload", 6)]
    # No complete step's work left (ranks 0 and 1 of other_rank 2): deletes go, after the rest.
    later = [Job("move", 3, ("x", "w/x")), Job("delete", 9, ("old/",))]
    chosen, cut = choose(later, set(), lambda kind, ident: ranks[(kind, ident)], 2)
    assert [(j.kind, j.ident) for j in chosen] == [("move", 3), ("delete", 9)] and not cut


async def test_a_step_whose_files_close_after_the_notice_goes_first_once_they_do(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The kernel releases a file after close() returns: a SIGTERM right after a save found the newest step's
    files still open, ranked it behind the older steps and kept it there until the next timed replan (the
    older step went first). A close replans at once."""
    stack = capped_stack(tmp_path)
    stack.drain.upload_delay = 3600.0
    await nursery.start(stack.drain.run)
    write_step(stack, "step_100")
    write_step(stack, "step_200")
    stack.fs.mkdir(ROOT_ID, b"step_300", 0o755, 0, 0)
    handles = []
    for name, data in ((b"shard0", b"\x07" * SHARD), (b"shard1", b"\x08" * SHARD), (b".metadata", b"done")):
        fh, _ = stack.fs.create(stack.resolve_dir("step_300"), name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)
        stack.fs.write(fh, 0, data)
        handles.append(fh)
    preempter = Preempter(stack.drain, stack.drain.engine, stack.cache.root)
    await nursery.start(preempter.run)
    preempter.begin(STEP_SECONDS * 1.75, reason="test", lift_limits=False)
    await trio.sleep(0.1)
    for fh in handles:
        stack.fs.release(fh)
    report = await preempter.wait_report()
    assert report["durable"] == ["step_300"], report["not_durable"]
    assert stack.store_files()["step_300/.metadata"] == b"done"
