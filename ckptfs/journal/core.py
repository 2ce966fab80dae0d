"""The journal's core: opening it (schema created or migrated), transactions, durability, the sequence of
work, the meta table, and reading inodes by id. The concerns of the Journal class build on it."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TypeVar

from ckptfs.journal.connection import connect, from_sqlite, translate_public_methods
from ckptfs.journal.rowcache import RowCache
from ckptfs.journal.rows import INODE_COLUMNS, Inode
from ckptfs.journal.schema import check_version, create_tables, migrations

T = TypeVar("T")

# Below SQLite's smallest limit on bound parameters (999 before 3.32).
_IDS_PER_QUERY = 900
# With checkpoints_elsewhere(), a commit still checkpoints the WAL itself once it holds this many pages
# (64 MiB of 4 KiB pages; SQLite's default is 1000): the backstop for writes that never pause long enough
# for the background checkpoints to catch up (the WAL starts over only once all of it is checkpointed).
WAL_BACKSTOP_PAGES = 16384


def prefix_range(prefix: str) -> tuple[str, str]:
    """(lo, hi) such that `lo <= s < hi` holds exactly for the strings s that start with the non-empty
    `prefix`: a range of an index where `substr(s, 1, n) = prefix` would read every row. SQLite compares
    TEXT by its UTF-8 bytes, whose order is that of code points."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


def id_groups(ids: Collection[T]) -> Iterator[tuple[tuple[T, ...], str]]:
    """`ids` (or keys) in groups small enough for one query each, with each group's placeholders ("?, ?, ...")."""
    items = list(ids)
    for start in range(0, len(items), _IDS_PER_QUERY):
        group = tuple(items[start:start + _IDS_PER_QUERY])
        yield group, ", ".join("?" * len(group))


def _inode_factory(_cursor: sqlite3.Cursor, row: tuple) -> Inode:
    # The row is the Inode's fields in order (INODE_COLUMNS): tuple.__new__ takes it as it is, without
    # the keyword parsing of Inode(*row) (a walk of a big tree reads every row).
    return _new_tuple(Inode, row)


_new_tuple = tuple.__new__


class JournalBase:
    """One connection to the journal at `path`, opened with its schema current."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        translate_public_methods(cls)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits = 0  # transactions committed since open (the daemon checkpoints only after new ones)
        self._checkpointer: sqlite3.Connection | None = None
        # Rows and directory entries read or written (rowcache.py): every mutator keeps it exact.
        self.cache = RowCache()
        fresh = not path.exists()
        self.db = connect(path)
        if fresh:
            path.chmod(0o600)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA foreign_keys = OFF")
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            create_tables(self.db)
        else:
            check_version(self.db, path, version)
            for migration in migrations(version):
                with self.transaction():
                    migration(self.db)
        self._seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM inodes").fetchone()[0]

    def close(self) -> None:
        self.cache.clear()  # a read after close fails as the connection's would, not from memory
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.db.close()

    def checkpoints_elsewhere(self) -> None:
        """From now on checkpoint() copies the WAL into the database file, called from a worker thread;
        commits no longer do (up to WAL_BACKSTOP_PAGES). A checkpoint syncs the WAL and the database file:
        on a busy disk the FUSE request whose commit ran it waited tens of milliseconds (SQLite runs one
        every 1000 pages: every few hundred small files)."""
        self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_BACKSTOP_PAGES}")

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database file (PASSIVE: it never waits for the writer, who never
        waits for it). The one call that may, and should, run outside the trio thread: it uses a
        connection of its own, made at its first call."""
        if self._checkpointer is None:
            self._checkpointer = connect(self.path)
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT around the body; a rollback if it fails. SQLite's errors of any of it
        (the body's statements included) leave as the journal's, translated here once."""
        db = self.db
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc
        try:
            yield
            # A COMMIT that fails (SQLITE_FULL: the cache filesystem is full) leaves the transaction open;
            # roll it back too, or every later BEGIN fails as well.
            db.execute("COMMIT")
            self.commits += 1
        except BaseException as exc:
            # What this transaction read or wrote into the cache may never have been.
            self.cache.clear()
            try:
                if db.in_transaction:
                    db.execute("ROLLBACK")
            except sqlite3.Error as failed:
                raise from_sqlite(failed) from exc
            if isinstance(exc, sqlite3.Error):
                raise from_sqlite(exc) from exc
            raise

    def committed_alone(self) -> None:
        """A mutator of one statement ran: outside transaction() SQLite committed it on its own (atomic and
        durable as any transaction, without the BEGIN and COMMIT around it); count that commit."""
        if not self.db.in_transaction:
            self.commits += 1

    def sync(self) -> None:
        """Make every committed transaction survive power loss (fsync the WAL): a write transaction
        committed with synchronous=FULL syncs the WAL, and with it every transaction before it."""
        self.db.execute("PRAGMA synchronous = FULL")
        try:
            with self.transaction():
                self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('synced_at', ?)", (str(time.time()),))
        finally:
            self.db.execute("PRAGMA synchronous = NORMAL")

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- meta ---------------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- reading inodes -----------------------------------------------------------------------------

    def _one(self, sql: str, args: tuple = ()) -> Inode | None:
        cur = self.db.execute(sql, args)
        cur.row_factory = _inode_factory
        return cur.fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[Inode]:
        cur = self.db.execute(sql, args)
        cur.row_factory = _inode_factory
        return cur.fetchall()

    def get(self, inode_id: int) -> Inode | None:
        inode = self.cache.rows.get(inode_id)
        if inode is None:
            inode = self._one(f"SELECT {INODE_COLUMNS} FROM inodes WHERE id = ?", (inode_id,))
            if inode is not None:
                self.cache.keep(inode)
        return inode

    def stale_cache_entries(self) -> list[str]:
        """What the cache holds that the journal's tables do not (nothing, unless a mutator forgot to keep
        it exact): for tests, which check it after every step."""
        stale = []
        for inode_id, cached in list(self.cache.rows.items()):
            row = self._one(f"SELECT {INODE_COLUMNS} FROM inodes WHERE id = ?", (inode_id,))
            if row != cached:
                stale.append(f"row {inode_id}: cached {cached}, journal {row}")
        for (parent, name), entry in list(self.cache.entries.items()):
            found = self.db.execute("SELECT id FROM inodes WHERE parent = ? AND name = ?", (parent, name)).fetchone()
            if entry is None and found is not None:
                stale.append(f"entry {name!r} of {parent}: cached as missing, journal {found[0]}")
        for directory in list(self.cache.complete):
            names = {row[0] for row in self.db.execute("SELECT name FROM inodes WHERE parent = ?", (directory,))}
            known = {name for (parent, name), entry in self.cache.entries.items()
                     if parent == directory and entry is not None}
            if not names <= known:
                stale.append(f"directory {directory} cached as complete lacks {sorted(names - known)}")
        return stale

    def get_many(self, inode_ids: Collection[int]) -> dict[int, Inode]:
        """The inodes among `inode_ids` that exist, by id: one query per _IDS_PER_QUERY ids, not one each."""
        found: dict[int, Inode] = {}
        for chunk, marks in id_groups(inode_ids):
            for inode in self._all(f"SELECT {INODE_COLUMNS} FROM inodes WHERE id IN ({marks})", chunk):
                found[inode.id] = inode
        return found


translate_public_methods(JournalBase)
