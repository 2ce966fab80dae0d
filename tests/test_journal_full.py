"""A cache filesystem so full that the journal cannot grow: the request fails with ENOSPC, what was
committed stays, and the journal works again once there is room (found by the crash harness, full-cache
rounds: a failed COMMIT left its transaction open, and every later request failed with EIO)."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

import pytest

from ckptfs.fuse_ops import _fuse_error
from ckptfs.journal import Journal


def _fill(journal: Journal) -> None:
    """Let the database grow no further, as a full filesystem would."""
    pages = journal.db.execute("PRAGMA page_count").fetchone()[0]
    journal.db.execute(f"PRAGMA max_page_count = {pages}")


def test_a_commit_that_cannot_grow_the_journal_rolls_back_and_the_journal_still_works(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        journal.set_meta("kept", "yes")
    _fill(journal)
    with pytest.raises(sqlite3.OperationalError) as caught, journal.transaction():
        for i in range(2000):
            journal.set_meta(f"key-{i}", "x" * 1000)
    assert caught.value.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert not journal.db.in_transaction
    journal.db.execute("PRAGMA max_page_count = 1073741823")  # room again
    with journal.transaction():
        journal.set_meta("after", "yes")
    assert journal.get_meta("kept") == "yes" and journal.get_meta("after") == "yes"
    assert journal.get_meta("key-0") is None


def test_a_full_journal_answers_enospc_not_eio() -> None:
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = sqlite3.SQLITE_FULL  # type: ignore[attr-defined]
    assert _fuse_error(full, "mkdir").errno == errno.ENOSPC
    assert _fuse_error(sqlite3.OperationalError("no such table: x"), "mkdir").errno == errno.EIO
