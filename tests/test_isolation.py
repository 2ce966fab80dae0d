"""One odd entry never ends the drain (issue 33): a bug met while choosing or running one entry's job is
that entry's failure, logged with it, counted, retried, parked when it keeps failing, and named by
flush and the xattr; everything else goes on. Kernel-free (fsharness)."""

from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

import pytest
import trio
from fsharness import Stack, check_consistency, make_stack
from waiting import until

from ckptfs.drain import PARK_AFTER, Drain, retries, scheduler
from ckptfs.drain.ordering import Job
from ckptfs.errors import FsError
from ckptfs.fs import ERROR_XATTR, STATE_XATTR, SetAttrs
from ckptfs.journal import ROOT_ID, Inode, Journal, JournalError, JournalFull, JournalUnusable, journal_unusable
from ckptfs.journal.connection import from_sqlite


class Bug(Exception):
    pass


def _buggy_for(name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make choosing an upload job raise for the entry called `name` (as a bug in a rule would)."""
    calls: list[int] = []
    original = Drain._target_taken

    def target_taken(self: Drain, inode: Inode, key: str) -> bool:
        if inode.name == name:
            calls.append(inode.id)
            raise Bug(f"odd entry {inode.name}")
        return original(self, inode, key)

    monkeypatch.setattr(Drain, "_target_taken", target_taken)
    return calls


async def test_a_bug_met_by_one_entry_parks_it_and_the_rest_is_uploaded(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(retries, "PARKED_RETRY", 3600.0)
    calls = _buggy_for("odd", monkeypatch)
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    odd = stack.write_file("odd", b"odd bytes")
    stack.write_file("good", b"good bytes")
    with caplog.at_level(logging.ERROR, logger="ckptfs.drain"):
        with trio.move_on_after(10):
            while len(calls) < PARK_AFTER or not stack.drain.failing():
                await trio.sleep(0.05)
                stack.drain.notify()
        assert stack.store_files() == {"good": b"good bytes"}
        assert len(calls) == PARK_AFTER  # parked: not tried again within PARKED_RETRY
        [(path, parked)] = stack.drain.failing()
        assert path == "odd" and parked.job == "upload" and "odd entry" in parked.error
    assert any("odd" in r.getMessage() and r.exc_info for r in caplog.records), "the error names its entry"
    assert stack.drain.faults.counts["drain"] == PARK_AFTER
    assert "odd entry" in (stack.drain.faults.last or "")
    # Visible where an operator looks: the xattr, and what a flush leaves.
    assert stack.fs.getxattr(odd, STATE_XATTR) == b"dirty"
    assert b"odd entry" in stack.fs.getxattr(odd, ERROR_XATTR)
    assert ERROR_XATTR in stack.fs.listxattr(odd)
    result = await stack.drain.flush(None, trio.current_time() + 1)
    assert not result.ok and len(result.remaining) == 1 and result.remaining[0].startswith("odd (failing: ")
    # Once the bug is gone (here: the entry renamed away from it), the retry succeeds and the park ends.
    stack.fs.rename(ROOT_ID, b"odd", ROOT_ID, b"fine", 0)
    await stack.flush()
    assert stack.store_files() == {"good": b"good bytes", "fine": b"odd bytes"}
    assert not stack.drain.failing()
    with pytest.raises(FsError) as raised:
        stack.fs.getxattr(odd, ERROR_XATTR)
    assert raised.value.errno == errno.ENODATA
    check_consistency(stack)


async def test_an_entry_whose_job_could_not_be_chosen_is_retried_without_another_wake_up(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug met while choosing one entry's job set that entry's retry time, but the scan did not count it in
    when it said when to look again: with nothing else written, the drain slept until the next change of the
    mount, and the file stayed dirty (a flush would have woken it)."""
    calls: list[int] = []
    original = Drain._target_taken

    def target_taken(self: Drain, inode: Inode, key: str) -> bool:
        if inode.name == "odd" and not calls:
            calls.append(inode.id)
            raise Bug("odd entry, once")
        return original(self, inode, key)

    monkeypatch.setattr(Drain, "_target_taken", target_taken)
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    stack.write_file("odd", b"odd bytes")
    # No notify(), no flush: only the drain's own schedule.
    await until(lambda: stack.store_files() == {"odd": b"odd bytes"}, what="the odd file uploaded", seconds=10)
    assert len(calls) == 1
    check_consistency(stack)


async def test_a_scan_that_fails_unexpectedly_is_retried_not_fatal(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduler, "SCAN_FAILURE_PAUSE", 0.05)
    stack = make_stack(tmp_path)
    failures = [Bug("scan broke"), Bug("scan broke again")]
    original = Drain._scan

    def scan(self: Drain) -> tuple[list[Job], float]:
        if failures:
            raise failures.pop(0)
        return original(self)

    monkeypatch.setattr(Drain, "_scan", scan)
    with caplog.at_level(logging.ERROR, logger="ckptfs.drain"):
        await nursery.start(stack.drain.run)
        stack.write_file("a", b"a")
        await stack.flush()
    assert stack.store_files() == {"a": b"a"}
    assert stack.drain.faults.counts["drain"] == 2
    assert sum("scan failed unexpectedly" in r.getMessage() for r in caplog.records) == 2


async def test_an_unusable_journal_ends_the_drain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = make_stack(tmp_path)

    def scan(self: Drain) -> tuple[list[Job], float]:
        raise JournalUnusable("disk I/O error")

    monkeypatch.setattr(Drain, "_scan", scan)
    with pytest.raises(BaseException) as raised:
        async with trio.open_nursery() as nursery:
            await nursery.start(stack.drain.run)
    assert journal_unusable(raised.value)


def test_what_counts_as_an_unusable_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with pytest.raises(JournalError) as bug, journal.transaction():
        journal.db.execute("SELECT * FROM x")  # SQLite's error, translated once by the transaction
    assert not journal_unusable(bug.value)  # one statement's failure, not the journal's
    pages = journal.db.execute("PRAGMA page_count").fetchone()[0]
    journal.db.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(JournalFull) as full, journal.transaction():
        for i in range(2000):
            journal.set_meta(f"key-{i}", "x" * 1000)
    assert not journal_unusable(full.value)  # a full cache filesystem: retried, not the end
    journal.close()
    with pytest.raises(JournalUnusable) as closed:
        journal.names.get(ROOT_ID)
    assert journal_unusable(closed.value)
    assert journal_unusable(ExceptionGroup("nursery", [ValueError(), closed.value]))
    assert not journal_unusable(Bug())
    (tmp_path / "corrupt.db").write_bytes(b"not a database, " * 512)
    with pytest.raises(JournalUnusable):
        Journal(tmp_path / "corrupt.db")
    # What cannot be made to happen here, as SQLite reports it: an I/O error (an extended code).
    io_error = sqlite3.OperationalError("disk I/O error")
    io_error.sqlite_errorcode = sqlite3.SQLITE_IOERR_WRITE  # type: ignore[attr-defined]
    assert isinstance(from_sqlite(io_error), JournalUnusable)


async def test_a_sparse_extension_is_not_charged_and_filled_holes_are(tmp_path: Path) -> None:
    stack: Stack = make_stack(tmp_path, cache_size=64 << 20, dirty_wait=0.5)
    ino = stack.write_file("sparse", b"")
    await stack.fs.setattr(ino, SetAttrs(size=100 << 30), None)
    assert stack.cache.used < 1 << 20
    fh = await stack.fs.open(ino, 0o2)  # O_RDWR
    assert stack.fs.write(fh, 40 << 30, b"x" * 4096) == 4096
    assert stack.cache.used < 1 << 20
    for offset in range(0, 8 << 20, 1 << 20):  # writes into the hole: charged at the next remeasure
        stack.fs.write(fh, offset, b"y" * (1 << 20))
    stack.cache.remeasure_all()
    assert 8 << 20 <= stack.cache.used < 9 << 20
    stack.fs.release(fh)
    await stack.fs.setattr(ino, SetAttrs(size=4 << 20), None)
    assert 4 << 20 <= stack.cache.used < 5 << 20
    assert stack.cache.measured == set()
    check_consistency(stack)
