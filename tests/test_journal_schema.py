"""The journal's schema: whole in create_tables, and journals of an older schema version migrated at open
with their data intact (existing cache dirs keep working)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ckptfs.journal import CLEAN, REMOTE, ROOT_ID, SCHEMA_VERSION, Journal

# Schema version 1 as ckptfs up to 1bdda0c created it (create_tables, less its comments) ...
V1_SCHEMA = """
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    CREATE TABLE inodes (
        id        INTEGER PRIMARY KEY AUTOINCREMENT,
        parent    INTEGER REFERENCES inodes(id),
        name      TEXT,
        path      TEXT,
        kind      TEXT NOT NULL CHECK (kind IN ('file', 'dir', 'symlink')),
        mode      INTEGER NOT NULL,
        uid       INTEGER NOT NULL,
        gid       INTEGER NOT NULL,
        size      INTEGER NOT NULL DEFAULT 0,
        mtime_ns  INTEGER NOT NULL,
        ctime_ns  INTEGER NOT NULL,
        target    TEXT,
        state     TEXT NOT NULL CHECK (state IN ('dirty', 'uploading', 'clean', 'remote')),
        version   INTEGER NOT NULL DEFAULT 1,
        uploaded_version INTEGER NOT NULL DEFAULT 0,
        remote_key TEXT,
        checksum  TEXT,
        meta_dirty INTEGER NOT NULL DEFAULT 0,
        upload_state TEXT,
        closed_at REAL,
        seq       INTEGER NOT NULL DEFAULT 0,
        UNIQUE (parent, name)
    );
    CREATE INDEX inodes_path ON inodes(path);
    CREATE INDEX inodes_remote_key ON inodes(remote_key) WHERE remote_key IS NOT NULL;
    CREATE INDEX inodes_pending ON inodes(state) WHERE state IN ('dirty', 'uploading');
    CREATE INDEX inodes_misplaced ON inodes(id)
        WHERE remote_key IS NOT NULL AND id != 1
          AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END);
    CREATE TABLE pending_deletes (
        id         INTEGER PRIMARY KEY AUTOINCREMENT,
        key        TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    INSERT INTO inodes (id, parent, name, path, kind, mode, uid, gid, mtime_ns, ctime_ns, state, remote_key)
        VALUES (1, NULL, NULL, '', 'dir', 16877, 0, 0, 1000, 1000, 'clean', NULL);
    PRAGMA user_version = 1;
"""
# ... and what its Journal added at every open and DirLister start, outside the version.
V1_ADDED_AT_OPEN = """
    CREATE TABLE IF NOT EXISTS listed_dirs (inode_id INTEGER PRIMARY KEY, listed_at REAL NOT NULL);
    CREATE INDEX IF NOT EXISTS inodes_meta_stale ON inodes(seq) WHERE meta_dirty = 1;
"""


def _v1_journal(path: Path, *, opened: bool) -> None:
    """A version 1 journal with a directory, a clean file, a remote file, a pending delete and a meta row;
    `opened`: as a mount by ckptfs up to 1bdda0c left it (with a listing of the directory)."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode = WAL")
    db.executescript(V1_SCHEMA)
    db.executescript(
        """
        INSERT INTO inodes (id, parent, name, path, kind, mode, uid, gid, size, mtime_ns, ctime_ns, state, version,
                            uploaded_version, remote_key, checksum, closed_at, seq)
        VALUES (2, 1, 'step_1', 'step_1', 'dir', 16877, 1000, 1000, 0, 5, 5, 'clean', 1, 1, 'step_1/', NULL, 1.5, 1),
               (3, 2, 'model.pt', 'step_1/model.pt', 'file', 33188, 1000, 1000, 7, 6, 6, 'clean', 2, 2,
                'step_1/model.pt', 'crc32:0a1b2c3d', 2.5, 2),
               (4, 2, 'optim.pt', 'step_1/optim.pt', 'file', 33188, 1000, 1000, 9, 7, 7, 'remote', 1, 1,
                'step_1/optim.pt', NULL, 3.5, 3);
        INSERT INTO pending_deletes (key, created_at) VALUES ('old/model.pt', 4.5);
        INSERT INTO meta (key, value) VALUES ('source', 'file:///store');
        """
    )
    if opened:
        db.executescript(V1_ADDED_AT_OPEN)
        db.execute("INSERT INTO listed_dirs (inode_id, listed_at) VALUES (2, 8.5)")
    db.close()


def _schema(db: sqlite3.Connection) -> dict[str, object]:
    """Every table's columns and every index's definition (comments apart)."""
    schema: dict[str, object] = {}
    for kind, name in db.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"):
        if kind == "table":
            schema[name] = db.execute(f"PRAGMA table_info({name})").fetchall()
        else:
            schema[name] = db.execute(f"PRAGMA index_xinfo({name})").fetchall()
    return schema


@pytest.mark.parametrize("opened", [False, True], ids=["created", "mounted"])
def test_a_version_1_journal_is_migrated_with_its_data_intact(tmp_path: Path, opened: bool) -> None:
    _v1_journal(tmp_path / "journal.db", opened=opened)
    journal = Journal(tmp_path / "journal.db")
    assert journal.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    fresh = Journal(tmp_path / "fresh.db")
    assert _schema(journal.db) == _schema(fresh.db)
    model, optim = journal.names.by_path("step_1/model.pt"), journal.names.by_path("step_1/optim.pt")
    assert model is not None and optim is not None
    assert (model.state, model.size, model.version, model.remote_key, model.checksum, model.seq) == (
        CLEAN, 7, 2, "step_1/model.pt", "crc32:0a1b2c3d", 2
    )
    assert (optim.state, optim.size, optim.closed_at) == (REMOTE, 9, 3.5)
    assert model.atime_ns is None and optim.atime_ns is None  # version 4: never set, reads as the mtime
    assert [c.name for c in journal.names.all_children(2)] == ["model.pt", "optim.pt"]
    assert [(d.key, d.created_at) for d in journal.deletes.pending_deletes()] == [("old/model.pt", 4.5)]
    assert journal.get_meta("source") == "file:///store"
    assert journal.names.listed_dirs() == ({2: 8.5} if opened else {})
    # New work continues the old order.
    root = journal.names.get(ROOT_ID)
    assert root is not None
    with journal.transaction():
        created = journal.names.create_inode(root, "step_2", "dir", 0o40755, 0, 0)
    assert created.seq == 4
    with journal.transaction():
        journal.work.mark_meta_dirty(model.id)
    assert [i.id for i in journal.work.meta_stale(10)] == [model.id]
    journal.close()
    again = Journal(tmp_path / "journal.db")  # a migrated journal opens as it is
    assert again.names.by_path("step_2") is not None and again.names.listed_dirs() == ({2: 8.5} if opened else {})


def test_a_fresh_journal_has_the_whole_schema(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    names = {row[0] for row in journal.db.execute("SELECT name FROM sqlite_master")}
    assert {"meta", "inodes", "pending_deletes", "listed_dirs", "inodes_meta_stale"} <= names
    assert journal.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
