"""A cache filesystem so full that the journal cannot grow: the request fails with ENOSPC, what was
committed stays, and the journal works again once there is room (found by the crash harness, full-cache
rounds: a failed COMMIT left its transaction open, and every later request failed with EIO)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio
import trio.testing
from fsharness import GID, UID, check_consistency, make_stack

from ckptfs.daemon import services
from ckptfs.daemon.services import checkpoint_journal
from ckptfs.errors import Faults
from ckptfs.journal import CLEAN, REMOTE, ROOT_ID, Journal, JournalError, JournalFull
from ckptfs.mount.adapter import _fuse_error


def _full() -> JournalFull:
    """What the journal raises when its file cannot grow (a full filesystem)."""
    return JournalFull("database or disk is full")


def _not_expected(exc: BaseException) -> None:
    raise AssertionError(f"a full journal is not an unusable one: {exc!r}")


def _refuse(*args: object, **kwargs: object) -> None:
    """A journal write the full cache filesystem refuses."""
    raise _full()


def _fill(journal: Journal) -> None:
    """Let the database grow no further, as a full filesystem would."""
    pages = journal.db.execute("PRAGMA page_count").fetchone()[0]
    journal.db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_commit_that_cannot_grow_the_journal_rolls_back_and_the_journal_still_works(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        journal.set_meta("kept", "yes")
    _fill(journal)
    with pytest.raises(JournalFull), journal.transaction():
        for i in range(2000):
            journal.set_meta(f"key-{i}", "x" * 1000)
    assert not journal.db.in_transaction
    journal.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    with journal.transaction():
        journal.set_meta("after", "yes")
    assert journal.get_meta("kept") == "yes" and journal.get_meta("after") == "yes"
    assert journal.get_meta("key-0") is None


async def test_a_request_the_full_journal_refuses_answers_enospc_and_changes_nothing(tmp_path: Path) -> None:
    """SQLite's SQLITE_FULL reaches the FUSE layer as the journal's JournalFull, through fs.py."""
    stack = make_stack(tmp_path)
    _fill(stack.journal)
    with pytest.raises(JournalFull) as caught:
        for i in range(2000):
            stack.fs.mkdir(ROOT_ID, f"dir-{i:04d}-{'x' * 200}".encode(), 0o755, UID, GID)
    assert _fuse_error(caught.value, "mkdir", Faults(), _not_expected).errno == errno.ENOSPC
    made = len(stack.journal.names.all_children(ROOT_ID))
    assert stack.journal.names.lookup(ROOT_ID, f"dir-{made:04d}-{'x' * 200}") is None
    stack.journal.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    stack.fs.mkdir(ROOT_ID, b"after", 0o755, UID, GID)
    assert stack.journal.names.lookup(ROOT_ID, "after") is not None


def test_a_full_journal_answers_enospc_not_eio() -> None:
    faults = Faults()
    assert _fuse_error(_full(), "mkdir", faults, _not_expected).errno == errno.ENOSPC
    assert _fuse_error(JournalError("no such table: x"), "mkdir", faults, _not_expected).errno == errno.EIO
    assert faults.counts == {"fuse": 1}


async def test_a_close_the_full_journal_refused_is_recorded_once_there_is_room(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The kernel never repeats a release. When the journal could not record one (cache filesystem full),
    the file stayed 'open for writing' for good: never uploaded, and every flush timed out on it (crash
    harness, full cache, seed 8400 round 0: "not durable after 300.0s: .model.pt.tmp")."""
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.run)
    fh, attr = stack.fs.create(ROOT_ID, b"model.pt", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    stack.fs.write(fh, 0, b"weights")
    record_close = stack.journal.names.mark_closed
    stack.journal.names.mark_closed = _refuse  # type: ignore[method-assign]
    with pytest.raises(JournalFull):
        stack.fs.release(fh)
    assert not stack.fs.in_use(attr.ino)  # the handle is gone all the same
    stack.journal.names.mark_closed = record_close  # type: ignore[method-assign]  # room again
    await stack.flush(seconds=15)
    assert stack.store_files() == {"model.pt": b"weights"}
    check_consistency(stack)


async def test_a_staged_upload_the_full_journal_could_not_remember_is_aborted(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The drain journals a staged upload once it is opened, to resume it after a crash. When the journal
    could not take that (cache filesystem full), the attempt failed, the retry started another upload, and
    the first one's parts stayed in the store until the next start-up (crash harness, full cache, seed
    8400 round 5: a temp object in the file:// store after flush)."""
    stack = make_stack(tmp_path)
    stack.drain.engine.part_size = 1 << 20
    save_upload_state = stack.journal.work.save_upload_state
    refused = []

    def cannot_grow_once(inode_id: int, state: str | None) -> None:
        if state is not None and not refused:
            refused.append(state)
            raise _full()
        save_upload_state(inode_id, state)

    stack.journal.work.save_upload_state = cannot_grow_once  # type: ignore[method-assign]
    await nursery.start(stack.drain.run)
    data = os.urandom(12 << 20)
    stack.write_file("big.bin", data)
    await stack.flush(seconds=30)
    assert refused, "the journal never refused an upload state"
    leftovers = [str(p.relative_to(tmp_path)) for p in (tmp_path / "store").rglob("*") if not p.is_dir()]
    assert leftovers == ["store/big.bin"] and stack.store_files() == {"big.bin": data}
    check_consistency(stack)


async def test_an_eviction_the_full_journal_refuses_leaves_the_file_and_the_daemon_running(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The evictor's round raised the journal's JournalFull (SQLITE_FULL) out of its task and took the daemon down, so
    the mount was gone for every process (crash harness, full cache, seed 8500 round 1)."""
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    ino = stack.write_file("old.bin", b"o" * 100_000)
    await stack.flush()
    mark_evicted = stack.journal.copies.mark_evicted
    stack.journal.copies.mark_evicted = _refuse  # type: ignore[method-assign]
    assert stack.fs.evictor.evict(1 << 40) == 0
    stack.fs.evictor.evict_if_clean(ino)
    assert stack.cache.has_data(ino) and stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    stack.journal.copies.mark_evicted = mark_evicted  # type: ignore[method-assign]  # room again
    assert stack.fs.evictor.evict(1 << 40) == 100_000
    assert stack.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]
    check_consistency(stack)


async def test_a_fetched_file_the_full_journal_cannot_adopt_stays_remote_and_reads_whole(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A read of a remote file fetches it whole, then the journal records it as local: when the journal
    cannot (cache filesystem full), the read is still answered, the file stays remote with no cache file,
    and the fetcher keeps serving (before, the error ended the fetcher's task and the daemon)."""
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fetcher.run)
    content = os.urandom(300_000)
    ino = stack.write_file("model.pt", content)
    await stack.flush()
    stack.fs.evictor.evict(1 << 40)
    finish_fetch = stack.journal.copies.finish_fetch
    stack.journal.copies.finish_fetch = _refuse  # type: ignore[method-assign]
    fh = await stack.fs.open(ino, os.O_RDONLY)
    with trio.fail_after(20):
        got = b"".join([await stack.fs.read(fh, offset, 65536) for offset in range(0, len(content), 65536)])
    stack.fs.release(fh)
    assert got == content
    assert stack.journal.names.get(ino).state == REMOTE and not stack.cache.has_data(ino)  # type: ignore[union-attr]
    stack.journal.copies.finish_fetch = finish_fetch  # type: ignore[method-assign]  # room again
    fh = await stack.fs.open(ino, os.O_RDONLY)
    with trio.fail_after(20):
        got = b"".join([await stack.fs.read(fh, offset, 65536) for offset in range(0, len(content), 65536)])
    stack.fs.release(fh)
    assert got == content and stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    check_consistency(stack)


class _CheckpointsRefusedOnce:
    """A journal whose first checkpoint the full cache filesystem refuses, as the crash harness met it."""

    def __init__(self) -> None:
        self.commits = 0
        self.checkpoints: list[bool] = []  # one entry per attempt: did it get through
        self.tried_twice = trio.Event()

    def checkpoint(self) -> None:  # in a worker thread, as Journal.checkpoint
        refused = not self.checkpoints
        self.checkpoints.append(not refused)
        if len(self.checkpoints) == 2:
            trio.from_thread.run_sync(self.tried_twice.set)
        if refused:
            raise _full()


async def test_a_checkpoint_the_full_cache_filesystem_refuses_is_tried_again_later(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the crash harness (full-cache rounds): the background checkpoint's JournalFull ended the
    task with a traceback; it waits for room instead, and the next checkpoint copies the WAL.

    On the real clock: the checkpoint runs in a worker thread, and an autojump clock skips ahead while a
    thread works (this test once ran out its 60 virtual seconds during the first checkpoint in CI)."""
    monkeypatch.setattr(services, "JOURNAL_CHECKPOINT_INTERVAL", 0.01)
    journal = _CheckpointsRefusedOnce()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(checkpoint_journal, journal)  # type: ignore[arg-type]
            await trio.testing.wait_all_tasks_blocked()  # the task has seen the journal as it was
            journal.commits = 10  # then quiet: the quiet rule checkpoints, and tries again after the refusal
            await journal.tried_twice.wait()
            nursery.cancel_scope.cancel()
    assert journal.checkpoints[:2] == [False, True]
    assert [r.levelname for r in caplog.records if "checkpoint" in r.getMessage()] == ["WARNING"]
