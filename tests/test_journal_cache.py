"""The journal's read-through cache of rows and directory entries (journal/rowcache.py) never answers with
what the tables do not hold: after every mutator, after a rollback, after a directory's rename, and for
names that appear (a create, an import, a listing, a rename onto them) after the cache learnt they were
missing. A stale entry would be a file served with another's attributes, or a name said not to exist."""

from __future__ import annotations

import ast
import inspect
import random
import time
from pathlib import Path

import pytest

from ckptfs import journal as journal_package
from ckptfs.journal import (
    CLEAN,
    DIR,
    FILE,
    REMOTE,
    ROOT_ID,
    Inode,
    Journal,
    JournalFull,
    ListedEntry,
    core,
    deletes,
    local_copies,
    tree,
    work,
)
from ckptfs.journal.core import fetch_inode

# SQL that changes a row or an entry of the inodes table.
_WRITES_INODES = ("UPDATE inodes", "INSERT INTO inodes", "DELETE FROM inodes", "_INSERT_LISTED", "_insert_listed_many")


def _root(journal: Journal) -> Inode:
    root = journal.names.get(ROOT_ID)
    assert root is not None
    return root


def _fresh(journal: Journal, inode_id: int) -> Inode | None:
    """The row as the table holds it, past the cache."""
    return fetch_inode(journal.db, f"SELECT {', '.join(Inode._fields)} FROM inodes WHERE id = ?", (inode_id,))


def test_every_function_that_writes_inodes_keeps_the_cache() -> None:
    """A mutator added without a word to the cache would leave it stale: each function of the journal whose
    SQL changes inodes names the cache (updates or drops what it changed), or calls one that does."""
    missing = []
    for module in (core, tree, work, deletes, local_copies):
        parsed = ast.parse(inspect.getsource(module))
        for node in ast.walk(parsed):
            if not isinstance(node, ast.FunctionDef) or not node.args.args or node.args.args[0].arg != "self":
                continue  # a method of the journal, not a helper that builds SQL text
            text = ast.unparse(node)
            if any(marker in text for marker in _WRITES_INODES) and "self.cache" not in text:
                missing.append(f"{module.__name__}.{node.name}")
    assert missing == []


def test_the_cache_answers_reads_it_has_seen_without_sql(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "a", FILE, 0o100644, 0, 0)
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    assert journal.names.lookup(ROOT_ID, "a") == made
    assert journal.names.dir_and_child(ROOT_ID, "a") == (_root(journal), made)
    assert journal.names.get(made.id) == made
    assert journal.names.lookup(ROOT_ID, "b") is None  # read once: the directory has no such entry
    assert journal.names.lookup(ROOT_ID, "b") is None
    assert len(statements) == 1, statements


def test_a_rollback_drops_what_the_transaction_cached(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        kept = journal.names.create_inode(_root(journal), "kept", FILE, 0o100644, 0, 0)
    assert journal.names.lookup(ROOT_ID, "gone") is None  # a negative entry, then a create that is rolled back
    made: list[Inode] = []
    with pytest.raises(RuntimeError), journal.transaction():
        made.append(journal.names.create_inode(_root(journal), "gone", FILE, 0o100644, 0, 0))
        journal.names.set_attrs(kept.id, mode=0o100600)
        journal.names.move(kept, _root(journal), "moved")
        assert journal.names.lookup(ROOT_ID, "gone") == made[0]  # inside, the transaction's own rows
        raise RuntimeError("the request failed after its changes")
    assert journal.names.lookup(ROOT_ID, "gone") is None
    assert journal.names.get(made[0].id) is None
    assert journal.names.lookup(ROOT_ID, "moved") is None
    assert journal.names.lookup(ROOT_ID, "kept") == _fresh(journal, kept.id)
    assert journal.names.get(kept.id) == kept
    assert journal.names.stale_cache_entries() == []


def test_names_that_appear_replace_a_negative_entry(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    root = _root(journal)
    for name in ("created", "imported", "listed", "renamed"):
        assert journal.names.lookup(ROOT_ID, name) is None
    with journal.transaction():
        created = journal.names.create_inode(root, "created", FILE, 0o100644, 0, 0)
        imported = journal.names.import_remote(root, "imported", FILE, size=3, mtime_ns=1, mode=0o100644,
                                               key="imported", uid=0, gid=0, now=time.time())
        journal.names.import_listed(_root(journal), [ListedEntry("listed", FILE, 5, 1, 0o100644, "listed")],
                                    uid=0, gid=0, now=time.time())
        source = journal.names.create_inode(_root(journal), "source", FILE, 0o100644, 0, 0)
    journal.names.move(source, _root(journal), "renamed")
    assert journal.names.lookup(ROOT_ID, "created") == created
    assert journal.names.lookup(ROOT_ID, "imported") == imported
    listed = journal.names.lookup(ROOT_ID, "listed")
    assert listed is not None and listed.size == 5 and listed.state == REMOTE
    renamed = journal.names.lookup(ROOT_ID, "renamed")
    assert renamed is not None and renamed.id == source.id and renamed.path == "renamed"
    assert journal.names.lookup(ROOT_ID, "source") is None
    assert journal.names.stale_cache_entries() == []


def test_a_directory_rename_moves_the_cached_rows_below_it(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        step = journal.names.create_inode(_root(journal), "step.tmp", DIR, 0o40755, 0, 0)
        inner = journal.names.create_inode(step, "inner", DIR, 0o40755, 0, 0)
        leaf = journal.names.create_inode(inner, "leaf", FILE, 0o100644, 0, 0)
    assert journal.names.lookup(inner.id, "leaf") == leaf  # cached with its old path
    with journal.transaction():
        journal.names.move(step, _root(journal), "step")
    cached = journal.names.lookup(inner.id, "leaf")
    assert cached is not None and cached.path == "step/inner/leaf"
    got = journal.names.get(leaf.id)
    assert got is not None and got.path == "step/inner/leaf" and got.seq == _fresh(journal, leaf.id).seq  # type: ignore[union-attr]
    assert journal.names.stale_cache_entries() == []


def test_an_unlink_and_a_purge_leave_no_entry_behind(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "f", FILE, 0o100644, 0, 0)
    with journal.transaction():
        journal.names.detach(made)
    assert journal.names.lookup(ROOT_ID, "f") is None
    held = journal.names.get(made.id)
    assert held is not None and held.parent is None and held.path is None
    with journal.transaction():
        journal.names.purge(made.id)
    assert journal.names.get(made.id) is None
    assert journal.names.stale_cache_entries() == []


def test_an_entry_read_before_its_row_moved_is_checked_against_the_row(tmp_path: Path) -> None:
    """detach() and move() drop the entry of the row they are given; a row given as it was before (the
    caller read it, then it moved) leaves the current entry pointing at a row elsewhere: it is checked
    at its use and read again."""
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "a", FILE, 0o100644, 0, 0)
    journal.names.move(made, _root(journal), "b")
    assert journal.names.lookup(ROOT_ID, "b") is not None
    journal.cache.entries[(ROOT_ID, "a")] = made.id  # as a stale entry would be
    assert journal.names.lookup(ROOT_ID, "a") is None


def test_state_changes_that_stat_shows_are_seen(tmp_path: Path) -> None:
    """Eviction, fetch, upload and a replacement by another node change what stat answers for a file."""
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "f", FILE, 0o100644, 0, 0)
    journal.names.mark_closed(made.id, size=10, mtime_ns=5, changed=True, now=time.time())
    assert journal.names.get(made.id) == _fresh(journal, made.id)
    with journal.transaction():
        journal.work.begin_upload(made.id)
    assert journal.names.get(made.id) == _fresh(journal, made.id)
    current = journal.names.get(made.id)
    assert current is not None
    with journal.transaction():
        journal.work.finish_upload(current, key="f", version=current.version, checksum="crc32:00000000", size=10,
                              clean=True)
    assert journal.names.get(made.id).state == CLEAN  # type: ignore[union-attr]
    assert journal.copies.mark_evicted(made.id, size=10, mtime_ns=5)
    assert journal.names.get(made.id).state == REMOTE  # type: ignore[union-attr]
    journal.copies.finish_fetch(made.id, size=10, mtime_ns=6)
    assert journal.names.get(made.id) == _fresh(journal, made.id)
    journal.copies.replaced_in_store(made.id, size=20, mtime_ns=7, checksum=None)
    assert journal.names.get(made.id).size == 20  # type: ignore[union-attr]
    assert journal.names.stale_cache_entries() == []


def _random_step(journal: Journal, rng: random.Random, names: list[str]) -> None:
    linked = [i for i in journal.names.all_inodes() if i.parent is not None]
    dirs = [_root(journal)] + [i for i in linked if i.kind == DIR]
    parent = rng.choice(dirs)
    name = rng.choice(names)
    journal.names.lookup(parent.id, name)  # the cache learns of the name either way
    action = rng.randrange(9)
    existing = journal.names.lookup(parent.id, name)
    if action <= 2 and existing is None:
        with journal.transaction():
            journal.names.create_inode(parent, name, rng.choice((FILE, DIR)), 0o100644, 0, 0, closed_at=time.time())
    elif action == 3 and existing is not None and not journal.names.has_children(existing.id):
        with journal.transaction():
            journal.names.detach(existing)
    elif action == 4 and existing is not None:
        target_parent = rng.choice(dirs)
        new_name = rng.choice(names)
        if (journal.names.lookup(target_parent.id, new_name) is None
                and not (existing.kind == DIR and journal.names.is_ancestor(existing.id, target_parent.id))):
            if existing.kind == DIR:
                with journal.transaction():
                    journal.names.move(existing, target_parent, new_name)
            else:
                journal.names.move(existing, target_parent, new_name)
    elif action == 5 and existing is not None:
        with journal.transaction():
            journal.names.set_attrs(existing.id, mode=0o100600, mtime_ns=rng.randrange(1 << 40))
    elif action == 6 and existing is not None and existing.kind == FILE:
        journal.names.mark_closed(existing.id, size=rng.randrange(100), mtime_ns=1, changed=True, now=time.time())
    elif action == 7:
        fresh = [n for n in names if journal.names.lookup(parent.id, n) is None]
        with journal.transaction():
            journal.names.import_listed(journal.names.get(parent.id), [ListedEntry(n, FILE, 1, 1, 0o100644, n)  # type: ignore[arg-type]
                                                           for n in fresh[:2]], uid=0, gid=0, now=time.time())
    elif action == 8 and existing is not None:
        with pytest.raises(RuntimeError), journal.transaction():
            journal.names.set_attrs(existing.id, size=12345)
            raise RuntimeError("rolled back")


@pytest.mark.parametrize("seed", range(5))
def test_random_changes_leave_the_cache_exact(tmp_path: Path, seed: int) -> None:
    journal = Journal(tmp_path / "journal.db")
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(6)]
    for _ in range(300):
        _random_step(journal, rng, names)
        assert journal.names.stale_cache_entries() == []
        for directory in [i for i in journal.names.all_inodes() if i.kind == DIR and (i.parent or i.id == ROOT_ID)]:
            for name in names:
                assert journal.names.lookup(directory.id, name) == fetch_inode(
                    journal.db,
                    f"SELECT {', '.join(Inode._fields)} FROM inodes WHERE parent = ? AND name = ?", (directory.id, name)
                )
        for inode in journal.names.all_inodes():
            assert journal.names.get(inode.id) == inode
            if inode.parent is not None and inode.name is not None:
                assert journal.names.lookup(inode.parent, inode.name) == inode


def test_a_directory_made_here_answers_missing_names_without_sql_until_a_listing_arrives(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "d", DIR, 0o40755, 0, 0)
        journal.names.create_inode(made, "a", FILE, 0o100644, 0, 0)
    statements: list[str] = []
    journal.db.set_trace_callback(statements.append)
    assert journal.names.lookup(made.id, "never") is None
    assert journal.names.lookup(made.id, "a") is not None
    assert statements == []
    with journal.transaction():
        journal.names.import_listed(made, [ListedEntry("other", FILE, 1, 1, 0o100644, "d/other")], uid=0, gid=0,
                              now=time.time())
    other = journal.names.lookup(made.id, "other")  # not known one by one: read
    assert other is not None and other.path == "d/other"
    assert journal.names.lookup(made.id, "never") is None
    assert journal.names.stale_cache_entries() == []


def test_a_change_of_its_own_that_fails_raises_the_journals_error_and_leaves_the_cache_exact(tmp_path: Path) -> None:
    """Outside transaction() a mutator's statement commits on its own; SQLite's error of it leaves as the
    journal's (translated at the call, not per statement), and the cache learnt nothing of it."""
    journal = Journal(tmp_path / "journal.db")
    with journal.transaction():
        made = journal.names.create_inode(_root(journal), "d", DIR, 0o40755, 0, 0)
    assert journal.names.lookup(made.id, "x0") is None
    pages = journal.db.execute("PRAGMA page_count").fetchone()[0]
    journal.db.execute(f"PRAGMA max_page_count = {pages}")
    listing = [ListedEntry(f"x{i}", FILE, 1, 1, 0o100644, f"d/x{i}" + "y" * 200) for i in range(2000)]
    with pytest.raises(JournalFull):
        journal.names.import_listed(made, listing, uid=0, gid=0, now=time.time())
    assert journal.names.stale_cache_entries() == []
    journal.db.execute("PRAGMA max_page_count = 1073741823")
    journal.names.import_listed(made, listing, uid=0, gid=0, now=time.time())
    assert journal.names.lookup(made.id, "x0") is not None
    assert journal.names.stale_cache_entries() == []


def test_the_package_names_the_cache() -> None:
    assert "rowcache" in (journal_package.__doc__ or "")
