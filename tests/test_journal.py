"""The journal's queries that run on every drain scan cost what is pending, not what the namespace holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfs.journal import ROOT_ID, Journal

# What the drain's scan (and a flush's check) asks on every round, every 20 ms while it is busy.
SCAN_QUERIES: dict[str, Callable[[Journal], object]] = {
    "uploads_due": lambda j: j.uploads_due(time.time(), 2000),
    "next_close_after": lambda j: j.next_close_after(0.0),
    "misplaced": lambda j: j.misplaced(2000),
    "dirs_to_upload": lambda j: j.dirs_to_upload(),
    "meta_stale": lambda j: j.meta_stale(2000),
    "pending_deletes": lambda j: j.pending_deletes(2000),
    "open_dirty_files": lambda j: j.open_dirty_files(),
}


def _uploaded_namespace(journal: Journal, files: int) -> None:
    """`files` files that are all in the store at their own keys: nothing for the drain to do."""
    root = journal.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        for i in range(files):
            inode = journal.create_inode(root, f"f{i:05d}", "file", 0o100644, 0, 0)
            journal.finish_upload(inode, key=inode.path, version=inode.version, checksum=None, size=0, clean=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("query", sorted(SCAN_QUERIES))
def test_a_scan_query_walks_only_what_is_pending(tmp_path: Path, query: str) -> None:
    """Found measuring the small-file path: misplaced walked the index of every uploaded inode and
    meta_stale and open_dirty_files the whole table, 7 ms per scan for 20,000 files."""
    journal = Journal(tmp_path / "journal.db")
    _uploaded_namespace(journal, 300)
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    try:
        SCAN_QUERIES[query](journal)
    finally:
        journal.db.set_trace_callback(None)
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert selects
    partial = {
        name for name, sql in journal.db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index'")
        if sql is not None and " WHERE " in sql
    }
    for sql in selects:
        plan = [row[-1] for row in journal.db.execute("EXPLAIN QUERY PLAN " + sql)]
        for step in plan:
            if step.startswith("SCAN inodes"):
                # A walk is allowed only of a partial index: one that holds only what is pending.
                assert any(f"INDEX {name}" in step for name in partial), (query, plan)
            assert "remote_key>" not in step, (query, plan)  # every uploaded inode
