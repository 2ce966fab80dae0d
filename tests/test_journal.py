"""The journal's queries that run on every drain scan cost what is pending, not what the namespace holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptfs.journal import ROOT_ID, Journal, JournalUnusable
from ckptfs.journal.deletes import PendingDeletes
from ckptfs.journal.local_copies import LocalCopies
from ckptfs.journal.tree import Names
from ckptfs.journal.work import DrainWork

# What the drain's scan (and a flush's check) asks on every round, every 20 ms while it is busy.
SCAN_QUERIES: dict[str, Callable[[Journal], object]] = {
    "uploads_due": lambda j: j.work.uploads_due(time.time(), 2000),
    "uploads_due in a burst": lambda j: j.work.uploads_due(time.time(), 2000, small=(1 << 20, time.time() - 10)),
    "next_close_after": lambda j: j.work.next_close_after(0.0),
    "misplaced": lambda j: j.work.misplaced(2000),
    "dirs_to_upload": lambda j: j.work.dirs_to_upload(),
    "meta_stale": lambda j: j.work.meta_stale(2000),
    "pending_deletes": lambda j: j.deletes.pending_deletes(2000),
    "open_dirty_files": lambda j: j.copies.open_dirty_files(),
}


def _uploaded_namespace(journal: Journal, files: int) -> None:
    """`files` files that are all in the store at their own keys: nothing for the drain to do."""
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        for i in range(files):
            inode = journal.names.create_inode(root, f"f{i:05d}", "file", 0o100644, 0, 0)
            journal.work.finish_upload(inode, key=inode.path, version=inode.version, checksum=None, size=0, clean=True)  # type: ignore[arg-type]


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


def _checkpoints(journal: Journal, steps: int, files: int) -> None:
    """`steps` directories of `files` uploaded files each: a namespace of retained checkpoints."""
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        for step in range(steps):
            directory = journal.names.create_inode(root, f"step_{step:04d}", "dir", 0o40755, 0, 0)
            journal.work.finish_upload(directory, key=f"{directory.path}/", version=directory.version, checksum=None,  # type: ignore[arg-type]
                                  size=0, clean=True)
            sub = journal.names.create_inode(directory, "sub", "dir", 0o40755, 0, 0)
            for i in range(files):
                inode = journal.names.create_inode(sub if i % 2 else directory, f"f{i:03d}", "file", 0o100644, 0, 0)
                journal.work.finish_upload(inode, key=inode.path, version=inode.version, checksum=None, size=0,  # type: ignore[arg-type]
                                      clean=True)


def _plans(journal: Journal, run: Callable[[], object]) -> list[list[str]]:
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    try:
        run()
    finally:
        journal.db.set_trace_callback(None)
    return [[row[-1] for row in journal.db.execute("EXPLAIN QUERY PLAN " + sql)]
            for sql in statements if sql.lstrip().upper().startswith(("SELECT", "UPDATE"))]


def test_renaming_a_directory_reads_its_subtree_not_the_namespace(tmp_path: Path) -> None:
    """`mv step.tmp step` runs in the FUSE loop: its journal work walked every inode (a prefix test by
    substr() and MAX(seq) over the whole table), 4 scans of the namespace per directory rename."""
    journal = Journal(tmp_path / "journal.db")
    _checkpoints(journal, steps=20, files=10)
    root = journal.names.get(ROOT_ID)
    source = journal.names.lookup(ROOT_ID, "step_0007")
    assert root is not None and source is not None and source.path is not None
    before = {i.path: i.id for i in journal.names.descendants(source.path)}
    seq_before = journal.core.next_seq()

    def rename() -> None:
        assert journal.names.longest_path_under(source.path) == len("step_0007/sub/f009")  # type: ignore[arg-type]
        with journal.transaction():
            journal.names.move(source, root, "step_final")
        assert journal.deletes.keys_under("step_0007/")

    for plan in _plans(journal, rename):
        assert not any(step.startswith("SCAN inodes") for step in plan), plan
    after = {i.path: i.id for i in journal.names.descendants("step_final")}
    assert after == {p.replace("step_0007/", "step_final/", 1): i for p, i in before.items()}
    assert len(after) == 11 and journal.names.descendants("step_0007") == []
    assert journal.names.descendants("step_00") == []  # a prefix of a name is not a parent
    # New work after the rename comes after the moved subtree's.
    moved_seqs = [i.seq for i in journal.names.descendants("step_final")]
    assert journal.core.next_seq() > max(moved_seqs) > seq_before
    # The folder of its subdirectory (no marker of its own) goes from the store; its marker moves.
    assert journal.deletes.pending_delete_keys_under("step_0007/") == {"step_0007/sub/"}
    assert journal.deletes.pending_delete_keys_under("") == {"step_0007/sub/"}
    assert journal.deletes.pending_delete_keys_under("step_0007/sub/x") == set()


def test_many_inodes_and_deletes_are_read_a_batch_at_a_time(tmp_path: Path) -> None:
    """A flush waiting on 2,000 small files read the journal once per file every 50 ms (Durability._drop_durable),
    taking the GIL from the uploads it waited on. get_many and deletes_pending answer for any number of ids
    in a few queries, and leave out what is gone."""
    journal = Journal(tmp_path / "journal.db")
    _uploaded_namespace(journal, 2000)
    ids = [row[0] for row in journal.db.execute("SELECT id FROM inodes WHERE id != ? ORDER BY id", (ROOT_ID,))]
    with journal.transaction():
        gone = journal.names.get(ids[1500])
        assert gone is not None
        journal.names.detach(gone)
        journal.names.purge(gone.id)
        deletes = [journal.deletes.queue_delete(f"gone/{i}") for i in range(1200)]
        for delete_id in deletes[::3]:
            journal.deletes.delete_done(delete_id)
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    try:
        found = journal.names.get_many([*ids, 10**9])
        pending = journal.deletes.deletes_pending(deletes)
    finally:
        journal.db.set_trace_callback(None)
    assert len(statements) <= 6, statements
    assert set(found) == set(ids) - {ids[1500]}
    assert all(found[i] == journal.names.get(i) for i in ids[::97] if i != ids[1500])
    assert pending == set(deletes) - set(deletes[::3])


def test_with_checkpoints_elsewhere_commits_leave_the_wal_to_checkpoint(tmp_path: Path) -> None:
    """After checkpoints_elsewhere() no commit copies the WAL into the database file (SQLite's own
    checkpoint, every 1000 pages, synced two files inside the commit of a FUSE request); checkpoint(), from
    another thread, does, and what it copied reads back after a reopen."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    journal.checkpoints_elsewhere()
    root = journal.names.get(ROOT_ID)
    assert root is not None
    before = path.stat().st_size
    for i in range(600):  # about 2,000 WAL pages
        with journal.transaction():
            journal.names.create_inode(root, f"f{i}", "file", 0o100644, 0, 0)
    assert path.stat().st_size == before
    worker = threading.Thread(target=journal.checkpoint)
    worker.start()
    worker.join()
    assert path.stat().st_size > before
    journal.close()
    reopened = Journal(path)
    assert len(reopened.names.all_children(ROOT_ID)) == 600
    reopened.close()


def test_create_inode_returns_the_row_as_stored(tmp_path: Path) -> None:
    """create_inode builds its Inode without reading the row back: it must be what a read gives."""
    journal = Journal(tmp_path / "journal.db")
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        folder = journal.names.create_inode(root, "d", "dir", 0o40755, 1, 2, closed_at=5.0)
        assert journal.names.get(folder.id) == folder
        made = journal.names.create_inode(folder, "f", "file", 0o100644, 3, 4)
        assert journal.names.get(made.id) == made
        link = journal.names.create_inode(folder, "l", "symlink", 0o120777, 3, 4, target="f", closed_at=6.0)
        assert journal.names.get(link.id) == link
    journal.close()


def test_owned_keys_below_a_directory_with_none_is_one_probe(tmp_path: Path) -> None:
    """A fresh node's listing asks which of a directory's listed keys an inode already holds (an old copy of
    a renamed file): one probe of the index when nothing below the directory is held, the keys' own query
    otherwise, with the same answer as without `under`."""
    journal = Journal(tmp_path / "journal.db")
    _checkpoints(journal, steps=3, files=4)
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        journal.names.create_inode(root, "fresh", "dir", 0o40755, 0, 0)
    held = ["step_0001/f000", "step_0001/f002", "step_0001/sub/f001"]
    asked = [*held, "step_0001/f999", "step_0001/sub"]
    assert journal.work.owned_keys(asked, under="step_0001/") == journal.work.owned_keys(asked) == set(held)
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    fresh = [f"fresh/f{i:04d}" for i in range(2000)]
    assert journal.work.owned_keys(fresh, under="fresh/") == set()
    journal.db.set_trace_callback(None)
    assert len(statements) == 1, statements
    assert journal.work.owned_keys(["step_0002/f000"], under="step_0002/") == {"step_0002/f000"}


def test_the_tables_share_one_connection_and_its_transactions(tmp_path: Path) -> None:
    """The tables are objects of their own on one connection: a transaction spans them (an unlink queues
    its store key's delete in another table, and a rollback undoes both), and a sequence number given by
    one table (a rename's) is not given again by another (a file rewritten behind the daemon)."""
    journal = Journal(tmp_path / "journal.db")
    tables = (journal.names, journal.work, journal.deletes, journal.copies)
    assert len({id(table) for table in tables}) == 4
    assert all(table.db is journal.db and table.cache is journal.cache for table in tables)
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        made = journal.names.create_inode(root, "f", "file", 0o100644, 0, 0)
        journal.work.finish_upload(made, key="f", version=1, checksum=None, size=0, clean=True)
    uploaded = journal.names.get(made.id)
    assert uploaded is not None
    with pytest.raises(RuntimeError), journal.transaction():
        journal.names.detach(uploaded)
        assert [d.key for d in journal.deletes.pending_deletes()] == ["f"]
        raise RuntimeError("rolled back")
    assert journal.deletes.pending_deletes() == []
    assert journal.names.lookup(ROOT_ID, "f") == uploaded
    with journal.transaction():
        folder = journal.names.create_inode(root, "d", "dir", 0o40755, 0, 0)
        inner = journal.names.create_inode(folder, "g", "file", 0o100644, 0, 0)
        journal.names.move(folder, root, "e")  # the subtree's seqs: a statement of their own
    moved = journal.names.get(inner.id)
    assert moved is not None
    journal.copies.rewritten_behind(made.id, size=1, mtime_ns=1, now=time.time())
    rewritten = journal.names.get(made.id)
    assert rewritten is not None and rewritten.seq > moved.seq
    journal.close()


def test_every_table_raises_the_journals_errors(tmp_path: Path) -> None:
    """SQLite's errors leave each table (and the journal's own calls) as the journal's, translated at the
    call: after close, each says the journal is unusable, not sqlite3's ProgrammingError."""
    journal = Journal(tmp_path / "journal.db")
    journal.close()
    calls: list[Callable[[], object]] = [
        lambda: journal.names.get(ROOT_ID), lambda: journal.names.lookup(ROOT_ID, "x"),
        lambda: journal.work.pending_uploads(), lambda: journal.deletes.pending_deletes(),
        lambda: journal.copies.clean_files(), lambda: journal.get_meta("x"), journal.sync,
    ]
    for call in calls:
        with pytest.raises(JournalUnusable):
            call()


def test_each_method_belongs_to_one_table_and_the_journal_keeps_few() -> None:
    """A caller finds a call in one place: no name is a method of two tables, and the Journal itself has
    only the calls that span the tables."""
    owners: dict[str, list[str]] = {}
    for table in (Names, DrainWork, PendingDeletes, LocalCopies):
        for name in vars(table):
            if not name.startswith("_"):
                owners.setdefault(name, []).append(table.__name__)
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
    own = {name for name in vars(Journal) if not name.startswith("_")}
    assert own == {"commits", "transaction", "sync", "checkpoints_elsewhere", "checkpoint", "get_meta", "set_meta",
                   "close"}
