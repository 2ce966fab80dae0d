"""The journal's core: the one connection (opened with its schema created or migrated), its transactions,
durability, the sequence of work, the meta table and the row cache; and JournalTable, what each of the
journal's tables (names, work, deletes, copies) is built on: the core as a collaborator, never a base class."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TypeVar

from ckptfs.journal.connection import JournalConnection, connect, from_sqlite, translate_public_methods, translating
from ckptfs.journal.rowcache import RowCache
from ckptfs.journal.rows import Inode
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


def fetch_inode(db: sqlite3.Connection, sql: str, args: tuple = ()) -> Inode | None:
    """The one row of `sql` (which selects INODE_COLUMNS), as an Inode."""
    cur = db.execute(sql, args)
    cur.row_factory = _inode_factory
    return cur.fetchone()


def fetch_inodes(db: sqlite3.Connection, sql: str, args: tuple = ()) -> list[Inode]:
    """Every row of `sql` (which selects INODE_COLUMNS), as Inodes."""
    cur = db.execute(sql, args)
    cur.row_factory = _inode_factory
    return cur.fetchall()


class JournalCore:
    """One connection to the journal at `path`, opened with its schema current, and what every table shares
    on it: transactions, the sequence of work (next_seq) and the row cache. Its entry points translate
    SQLite's errors (translating); next_seq and committed_alone run no statement."""

    @translating
    def __init__(self, path: Path) -> None:
        self.path = path
        self.commits = 0  # transactions committed since open (the daemon checkpoints only after new ones)
        self._checkpointer: sqlite3.Connection | None = None
        # Rows and directory entries read or written (rowcache.py): every mutator keeps it exact.
        self.cache = RowCache()
        fresh = not path.exists()
        self.db: JournalConnection = connect(path)
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

    @translating
    def close(self) -> None:
        self.cache.clear()  # a read after close fails as the connection's would, not from memory
        if self._checkpointer is not None:
            self._checkpointer.close()
        self.db.close()

    @translating
    def checkpoints_elsewhere(self) -> None:
        """From now on checkpoint() copies the WAL into the database file, called from a worker thread;
        commits no longer do (up to WAL_BACKSTOP_PAGES). A checkpoint syncs the WAL and the database file:
        on a busy disk the FUSE request whose commit ran it waited tens of milliseconds (SQLite runs one
        every 1000 pages: every few hundred small files)."""
        self.db.execute(f"PRAGMA wal_autocheckpoint = {WAL_BACKSTOP_PAGES}")

    @translating
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

    @translating
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
        """The next number of the sequence of work (inodes.seq): the order in which entries became work."""
        self._seq += 1
        return self._seq

    def seq_at_least(self, seq: int) -> None:
        """Rows were given seqs up to `seq` by a statement of their own (a directory's rename): the sequence
        goes on after them."""
        self._seq = max(self._seq, seq)

    # -- meta ---------------------------------------------------------------------------------------

    @translating
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    @translating
    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


class JournalTable:
    """What one table of the journal (its rows and the calls on them) is built on: the shared core, and its
    connection and row cache at hand. Every public method of a table translates SQLite's errors once, at
    the call (connection.translating); a table calls another only through that one's public methods."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        translate_public_methods(cls)

    def __init__(self, core: JournalCore) -> None:
        self.core = core
        self.db = core.db
        self.cache = core.cache
