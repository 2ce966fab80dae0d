"""The drain yields to a writer (drain/small_lane.py): while FUSE requests arrive back to back, a batch of
small uploads waits for a lull, at most YIELD_LIMIT, and one that gave up waiting is small; a flush and
cache pressure never wait for it. The FUSE layer's side is one timestamp (metrics.OpStats.last_at)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
from fsharness import Stack, check_consistency, make_stack
from waiting import until

from ckptfs.control.metrics import OpStats
from ckptfs.drain import SMALL_BATCH, SMALL_FILE, small_lane
from ckptfs.drain.ordering import Job


def streaming(stack: Stack) -> None:
    """Requests keep arriving: the last one always ended just now."""
    stack.drain.foreground_at = time.perf_counter


def stopped(stack: Stack) -> None:
    """The requests stopped now."""
    ended = time.perf_counter()
    stack.drain.foreground_at = lambda: ended


async def wait_for_store(stack: Stack, names: set[str]) -> None:
    await until(lambda: set(stack.store_files()), done=lambda seen: seen == names, seconds=20,
                what=f"exactly {sorted(names)} in the store")


async def test_small_uploads_wait_while_requests_stream_in_then_go_once_they_stop(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before: with upload_delay and small_file_wait 0 the small file went at once, beside the
    writer's requests. A large file does not wait."""
    monkeypatch.setattr(small_lane, "YIELD_LIMIT", 60.0)
    stack = make_stack(tmp_path)
    streaming(stack)
    await nursery.start(stack.drain.run)
    stack.write_file("small.bin", b"s" * 1000)
    big = b"B" * (SMALL_FILE + 1)
    stack.write_file("big.bin", big)
    await until(lambda: "big.bin" in stack.store_files(), what="big.bin in the store")
    # Before the negative assertion: small.bin was claimed and the lane holds it (not started), waiting for a lull.
    await until(lambda: stack.drain.lane.waiting, what="small.bin held in the small lane")
    assert set(stack.store_files()) == {"big.bin"}, "a small file was uploaded while requests streamed in"
    stopped(stack)
    await wait_for_store(stack, {"big.bin", "small.bin"})
    assert stack.store_files()["small.bin"] == b"s" * 1000
    check_consistency(stack)


async def test_a_flush_does_not_wait_for_a_lull(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(small_lane, "YIELD_LIMIT", 3600.0)
    stack = make_stack(tmp_path)
    streaming(stack)
    await nursery.start(stack.drain.run)
    names = {f"f{i}" for i in range(5)}
    for name in names:
        stack.write_file(name, name.encode())
    await until(lambda: stack.drain.lane.waiting, done=lambda n: n == len(names),
                what="the small files held in the small lane")
    assert not stack.store_files()
    await stack.flush()  # fails after 20 s
    assert set(stack.store_files()) == names
    check_consistency(stack)


async def test_cache_pressure_does_not_wait_for_a_lull(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The evictor needs clean files to make room: the drain must not yield then (a write waiting for room
    would wait for a lull it prevents)."""
    monkeypatch.setattr(small_lane, "YIELD_LIMIT", 3600.0)
    stack = make_stack(tmp_path)
    streaming(stack)
    await nursery.start(stack.drain.run)
    stack.write_file("a", b"a")
    await until(lambda: stack.drain.lane.waiting, what="a held in the small lane")
    assert not stack.store_files()
    stack.drain.set_pressure(True)
    await wait_for_store(stack, {"a"})
    check_consistency(stack)


async def test_a_steady_writer_still_gets_its_files_uploaded_in_small_batches(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that never pause: every YIELD_LIMIT a batch gives up waiting and goes, of at most
    YIELDED_BATCH files (before: all of them in one batch at once)."""
    monkeypatch.setattr(small_lane, "YIELD_LIMIT", 0.2)
    stack = make_stack(tmp_path)
    streaming(stack)
    await nursery.start(stack.drain.run)
    names = {f"f{i:02d}" for i in range(3 * small_lane.YIELDED_BATCH)}
    for name in sorted(names):
        stack.write_file(name, name.encode())
    await wait_for_store(stack, names)
    batches = stack.drain.engine.batches  # type: ignore[attr-defined]
    assert sorted(key for batch in batches for key in batch) == sorted(names)
    assert len(batches) >= 3 and max(len(batch) for batch in batches) <= small_lane.YIELDED_BATCH
    check_consistency(stack)


async def test_batches_started_in_a_lull_are_spaced_by_it(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the requests stop, batches are full again, but start FOREGROUND_LULL apart rather than all in
    the same instant (a writer that resumes meets one batch, not every upload slot's)."""
    monkeypatch.setattr(small_lane, "YIELD_LIMIT", 3600.0)
    monkeypatch.setattr(small_lane, "FOREGROUND_LULL", 0.3)
    stack = make_stack(tmp_path)
    started: list[float] = []
    upload_small = stack.drain.uploads.upload_small

    async def timed(jobs: list[Job]) -> list[Job]:
        started.append(trio.current_time())
        return await upload_small(jobs)

    monkeypatch.setattr(stack.drain.uploads, "upload_small", timed)
    stopped(stack)
    names = {f"f{i:03d}" for i in range(2 * SMALL_BATCH)}
    for name in sorted(names):
        stack.write_file(name, name.encode())
    await nursery.start(stack.drain.run)
    await wait_for_store(stack, names)
    assert len(started) == 2 and started[1] - started[0] >= 0.3 * 0.9, started
    check_consistency(stack)


def test_the_fuse_request_counters_keep_when_the_last_request_ended() -> None:
    stats = OpStats()
    before = time.perf_counter()
    stats.record("lookup", before - 0.01, False)
    assert before <= stats.last_at <= time.perf_counter()
    assert stats.calls == {"lookup": 1} and stats.seconds["lookup"] >= 0.01
