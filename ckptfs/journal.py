"""The journal: SQLite (WAL) holding the namespace, every file's state and the pending remote operations.

It is the single source of truth. The FUSE layer changes state only through it, the drain learns its work
only from it, and a restart rebuilds everything from it. All calls are synchronous and must be made from
the trio thread: a run of journal calls between two awaits is therefore atomic with respect to every other
task. It knows nothing about FUSE, trio or object stores; it stores keys as plain strings.

Durability: WAL with synchronous=NORMAL survives a crash or kill -9 of the daemon after every commit;
`sync()` makes everything committed so far survive power loss (fsync() on a file calls it).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, NamedTuple

SCHEMA_VERSION = 2
ROOT_ID = 1

# Content / marker states of an inode (column inodes.state).
DIRTY = "dirty"  # local data or entry is newer than the store's copy (or the store has none)
UPLOADING = "uploading"  # the drain is copying this version to the store right now
CLEAN = "clean"  # the store holds this version at remote_key; local data present
REMOTE = "remote"  # the store holds it; no local data (seen on a fresh node, or fetched never)

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"


def create_tables(db: sqlite3.Connection) -> None:
    """The canonical schema, created in one transaction with the root directory.
    Every column says what it means, its sentinels and who sets it."""
    now = time.time_ns()
    db.executescript(
        """
        BEGIN;
        CREATE TABLE meta (
            -- 'source': the store URL this cache belongs to (set by the daemon at the first mount);
            -- 'owner': a random tag of this cache dir, carried by the uploads it stages (daemon);
            -- 'node_id', 'node_gen': this node's name and start count in cross-node records (nodes.py);
            -- 'synced_at': written by sync() only so that a transaction commits with synchronous=FULL.
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );

        CREATE TABLE inodes (
            -- The FUSE inode number. 1 is the root. AUTOINCREMENT so a number is never reused while
            -- the kernel might still hold it.
            id        INTEGER PRIMARY KEY AUTOINCREMENT,
            -- Containing directory; NULL for the root and for unlinked inodes kept alive by open
            -- handles (purged at the next start). Set by fs.py (create, rename, unlink).
            parent    INTEGER REFERENCES inodes(id),
            -- Entry name in parent (UTF-8, the store's key alphabet); NULL exactly when parent is.
            name      TEXT,
            -- Full path below the mount root without a leading '/' ('' for the root); NULL when
            -- unlinked. Derived from parent/name, stored so the drain finds every renamed object with
            -- one indexed query; rename() rewrites it for a whole subtree in one statement.
            path      TEXT,
            kind      TEXT NOT NULL CHECK (kind IN ('file', 'dir', 'symlink')),
            mode      INTEGER NOT NULL,  -- st_mode including the type bits
            uid       INTEGER NOT NULL,
            gid       INTEGER NOT NULL,
            -- Bytes. For files with local data the cache file is the truth and this is refreshed at
            -- close, fsync and upload; for 'remote' files it is the object's size.
            size      INTEGER NOT NULL DEFAULT 0,
            mtime_ns  INTEGER NOT NULL,  -- as for size: the cache file's mtime is the truth when local
            ctime_ns  INTEGER NOT NULL,
            target    TEXT,              -- symlink target; NULL for other kinds
            state     TEXT NOT NULL CHECK (state IN ('dirty', 'uploading', 'clean', 'remote')),
            -- Content version: bumped (by mark_dirty) before the first byte of every change is
            -- written. An upload records the version it read; it commits only if it is unchanged.
            version   INTEGER NOT NULL DEFAULT 1,
            -- The version the store holds at remote_key (0: the store holds none of this inode's).
            uploaded_version INTEGER NOT NULL DEFAULT 0,
            -- The store key (relative to the prefix; directories end in '/') where a copy of this
            -- inode lives now, NULL if none. Differs from the path's key after a rename until the
            -- drain moves the object. Set only by the drain (and by recovery for imported objects).
            remote_key TEXT,
            -- 'crc32:<8 hex digits>' (zlib's CRC-32, backends.base.crc_text) of the uploaded content, as
            -- the store's metadata carries it; NULL if none (an imported object without one).
            checksum  TEXT,
            -- 1 when mode or mtime changed since the store copy's metadata was written (chmod, utime
            -- of an uploaded file): the drain rewrites the object's metadata. Set by fs.setattr, cleared
            -- when an upload or a metadata update starts from the current values.
            meta_dirty INTEGER NOT NULL DEFAULT 0,
            -- JSON of the store's staged upload in progress (backends.base.UploadState: upload id,
            -- finished parts) so that an upload interrupted by a crash resumes; NULL if none. Set by the
            -- drain as parts finish, cleared when the upload commits or is thrown away.
            upload_state TEXT,
            -- Wall-clock time the last writer closed the file; NULL while a writer has it open.
            -- upload_delay counts from here.
            closed_at REAL,
            -- Journal-wide order in which this inode last became work for the drain (a close after
            -- writing, a rename, a mkdir). Commit markers wait for every inode with a smaller seq.
            seq       INTEGER NOT NULL DEFAULT 0,
            UNIQUE (parent, name)
        );
        CREATE INDEX inodes_path ON inodes(path);
        CREATE INDEX inodes_remote_key ON inodes(remote_key) WHERE remote_key IS NOT NULL;
        CREATE INDEX inodes_pending ON inodes(state) WHERE state IN ('dirty', 'uploading');
        -- Inodes whose object sits under another key than their path: the drain's move queue.
        CREATE INDEX inodes_misplaced ON inodes(id)
            WHERE remote_key IS NOT NULL AND id != 1
              AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END);
        -- Inodes whose object metadata is out of date (the drain's metadata queue): each scan must cost
        -- what is pending, not what the namespace holds (without it a scan of 20,000 inodes read every
        -- inode twice, 7 ms, and the drain scans every 20 ms while it is busy).
        CREATE INDEX inodes_meta_stale ON inodes(seq) WHERE meta_dirty = 1;

        CREATE TABLE pending_deletes (
            id         INTEGER PRIMARY KEY AUTOINCREMENT,  -- order of the deletes
            -- Store key to delete. The drain skips it while an inode still owns that key
            -- (remote_key = key) and defers it while an inode is about to write that key.
            key        TEXT NOT NULL,
            created_at REAL NOT NULL
        );

        -- Lazy listing (recovery.DirLister): when each directory was last listed from the store, so that
        -- a restart within the refresh interval lists nothing again. Rows of inodes gone are pruned when
        -- a DirLister starts.
        CREATE TABLE listed_dirs (
            inode_id  INTEGER PRIMARY KEY,  -- a directory's inode id
            listed_at REAL NOT NULL         -- wall-clock time (time.time()) of its last listing
        );
        """
        f"""
        INSERT INTO inodes (id, parent, name, path, kind, mode, uid, gid, mtime_ns, ctime_ns, state, remote_key)
            VALUES ({ROOT_ID}, NULL, NULL, '', 'dir', {0o40755}, 0, 0, {now}, {now}, 'clean', NULL);
        PRAGMA user_version = {SCHEMA_VERSION};
        COMMIT;
        """
    )


def _to_version_2(db: sqlite3.Connection) -> None:
    """Version 1 journals gained listed_dirs and inodes_meta_stale at open, outside the schema version
    (ckptfs up to 1bdda0c): create them where they are missing."""
    db.execute("CREATE TABLE IF NOT EXISTS listed_dirs (inode_id INTEGER PRIMARY KEY, listed_at REAL NOT NULL)")
    db.execute("CREATE INDEX IF NOT EXISTS inodes_meta_stale ON inodes(seq) WHERE meta_dirty = 1")


# The step from version N to N + 1, in one transaction with the new user_version.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _to_version_2}


def migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a journal of schema `version` up to SCHEMA_VERSION, one version per transaction."""
    while version < SCHEMA_VERSION:
        db.execute("BEGIN IMMEDIATE")
        try:
            _MIGRATIONS[version](db)
            version += 1
            db.execute(f"PRAGMA user_version = {version}")
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise


def _prefix_range(prefix: str) -> tuple[str, str]:
    """(lo, hi) such that `lo <= s < hi` holds exactly for the strings s that start with the non-empty
    `prefix`: a range of an index where `substr(s, 1, n) = prefix` would read every row. SQLite compares
    TEXT by its UTF-8 bytes, whose order is that of code points."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


class JournalError(Exception):
    """The journal cannot do what was asked: a journal of another schema at open, or a statement that
    failed for a reason of neither kind below (a bug)."""


class JournalFull(JournalError):
    """The journal could not grow: its file system (the cache's) is full. Nothing was changed; the same
    write works once there is room."""


class JournalUnusable(JournalError):
    """The journal can no longer record anything: its file cannot be read or written (an I/O error, a
    corrupt page, a cache filesystem remounted read-only) or its connection is closed. Every promise
    rests on it, so this alone may end the daemon; any other failure is one entry's or one task's."""


# Primary SQLite result codes after which the journal cannot be trusted or reached any more.
_UNUSABLE_CODES = frozenset(
    (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CANTOPEN,
     sqlite3.SQLITE_READONLY)
)


def _translated(exc: sqlite3.Error) -> JournalError:
    """What a failed statement means to the journal's callers; the one place that reads SQLite's codes."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL:
        return JournalFull(str(exc))
    if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
        return JournalUnusable(str(exc))
    if isinstance(exc, sqlite3.DatabaseError) and code is not None and code & 0xFF in _UNUSABLE_CODES:
        return JournalUnusable(str(exc))
    return JournalError(str(exc))


def journal_unusable(exc: BaseException) -> bool:
    """Is `exc` a JournalUnusable, or a group raised out of a nursery that holds one?"""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(JournalUnusable) is not None
    return isinstance(exc, JournalUnusable)


def journal_full(exc: BaseException) -> bool:
    """Is `exc` a JournalFull? (For callers that test a caught exception rather than catch JournalFull.)"""
    return isinstance(exc, JournalFull)


class _Cursor(sqlite3.Cursor):
    """A cursor whose statements and rows raise journal errors, never sqlite3's."""

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        try:
            return super().execute(sql, parameters)
        except sqlite3.Error as exc:
            raise _translated(exc) from exc

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.Error as exc:
            raise _translated(exc) from exc

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.Error as exc:
            raise _translated(exc) from exc

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.Error as exc:
            raise _translated(exc) from exc


class _Connection(sqlite3.Connection):
    """The journal's connection: every statement runs on a _Cursor, so no sqlite3 error leaves the journal."""

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        try:
            cursor = self.cursor(_Cursor)
        except sqlite3.Error as exc:  # a closed connection
            raise _translated(exc) from exc
        return cursor.execute(sql, parameters)

    def executescript(self, script: str, /) -> sqlite3.Cursor:
        try:
            return super().executescript(script)
        except sqlite3.Error as exc:
            raise _translated(exc) from exc


def _connect(path: Path) -> _Connection:
    try:
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=_Connection)
    except sqlite3.Error as exc:
        raise _translated(exc) from exc


class Inode(NamedTuple):
    id: int
    parent: int | None
    name: str | None
    path: str | None
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    target: str | None
    state: str
    version: int
    uploaded_version: int
    remote_key: str | None
    checksum: str | None
    meta_dirty: int
    upload_state: str | None
    closed_at: float | None
    seq: int

    @property
    def key(self) -> str | None:
        """The store key this inode belongs at now (None when unlinked; '' for the root, which has none)."""
        if not self.path:
            return self.path
        return self.path + "/" if self.kind == DIR else self.path

    @property
    def has_local_data(self) -> bool:
        return self.kind == FILE and self.state != REMOTE


class PendingDelete(NamedTuple):
    id: int
    key: str
    created_at: float


_COLUMNS = ", ".join(Inode._fields)
# Below SQLite's smallest limit on bound parameters (999 before 3.32).
_IDS_PER_QUERY = 900


def _id_groups(ids: Collection[int]) -> Iterator[tuple[tuple[int, ...], str]]:
    """`ids` in groups small enough for one query each, with each group's placeholders ("?, ?, ...")."""
    items = list(ids)
    for start in range(0, len(items), _IDS_PER_QUERY):
        group = tuple(items[start:start + _IDS_PER_QUERY])
        yield group, ", ".join("?" * len(group))


def _inode_factory(_cursor: sqlite3.Cursor, row: tuple) -> Inode:
    return Inode(*row)


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path
        fresh = not path.exists()
        self.db = _connect(path)
        if fresh:
            path.chmod(0o600)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = NORMAL")
        self.db.execute("PRAGMA foreign_keys = OFF")
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version == 0:
            create_tables(self.db)
            version = SCHEMA_VERSION
        elif version > SCHEMA_VERSION:
            raise JournalError(
                f"journal {path} has schema version {version}, newer than this ckptfs ({SCHEMA_VERSION});"
                " upgrade ckptfs or use another --cache-dir"
            )
        try:
            self.db.execute(f"SELECT {_COLUMNS} FROM inodes LIMIT 0")
        except JournalError as exc:
            raise JournalError(
                f"journal {path} does not match this ckptfs's schema ({exc}): it was made by a development"
                " build; use another --cache-dir"
            ) from None
        migrate(self.db, version)
        self._seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM inodes").fetchone()[0]

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            # A COMMIT that fails (SQLITE_FULL: the cache filesystem is full) leaves the transaction open;
            # roll it back too, or every later BEGIN fails as well.
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

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

    # -- reads --------------------------------------------------------------------------------------

    def _one(self, sql: str, args: tuple = ()) -> Inode | None:
        cur = self.db.execute(sql, args)
        cur.row_factory = _inode_factory
        return cur.fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[Inode]:
        cur = self.db.execute(sql, args)
        cur.row_factory = _inode_factory
        return cur.fetchall()

    def get(self, inode_id: int) -> Inode | None:
        return self._one(f"SELECT {_COLUMNS} FROM inodes WHERE id = ?", (inode_id,))

    def get_many(self, inode_ids: Collection[int]) -> dict[int, Inode]:
        """The inodes among `inode_ids` that exist, by id: one query per _IDS_PER_QUERY ids, not one each."""
        found: dict[int, Inode] = {}
        for chunk, marks in _id_groups(inode_ids):
            for inode in self._all(f"SELECT {_COLUMNS} FROM inodes WHERE id IN ({marks})", chunk):
                found[inode.id] = inode
        return found

    def deletes_pending(self, delete_ids: Collection[int]) -> set[int]:
        """Those of `delete_ids` still waiting in pending_deletes."""
        pending: set[int] = set()
        for chunk, marks in _id_groups(delete_ids):
            rows = self.db.execute(f"SELECT id FROM pending_deletes WHERE id IN ({marks})", chunk)
            pending.update(row[0] for row in rows)
        return pending

    def lookup(self, parent: int, name: str) -> Inode | None:
        return self._one(f"SELECT {_COLUMNS} FROM inodes WHERE parent = ? AND name = ?", (parent, name))

    def by_path(self, path: str) -> Inode | None:
        return self._one(f"SELECT {_COLUMNS} FROM inodes WHERE path = ?", (path,))

    def children(self, parent: int, after_id: int = 0, limit: int = 1000) -> list[Inode]:
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes WHERE parent = ? AND id > ? ORDER BY id LIMIT ?",
            (parent, after_id, limit),
        )

    def all_children(self, parent: int) -> list[Inode]:
        return self._all(f"SELECT {_COLUMNS} FROM inodes WHERE parent = ?", (parent,))

    def descendants(self, path: str) -> list[Inode]:
        """Every linked inode below the directory `path`."""
        return self._all(f"SELECT {_COLUMNS} FROM inodes WHERE path >= ? AND path < ?", _prefix_range(path + "/"))

    def has_children(self, parent: int) -> bool:
        return self.db.execute("SELECT 1 FROM inodes WHERE parent = ? LIMIT 1", (parent,)).fetchone() is not None

    def all_inodes(self) -> list[Inode]:
        return self._all(f"SELECT {_COLUMNS} FROM inodes")

    def is_ancestor(self, ancestor: int, inode_id: int) -> bool:
        """True if `ancestor` is `inode_id` or one of its parent directories."""
        current: int | None = inode_id
        while current is not None:
            if current == ancestor:
                return True
            row = self.db.execute("SELECT parent FROM inodes WHERE id = ?", (current,)).fetchone()
            current = row[0] if row else None
        return False

    # -- namespace changes (called by fs.py inside transaction()) ------------------------------------

    def create_inode(
        self,
        parent: Inode,
        name: str,
        kind: str,
        mode: int,
        uid: int,
        gid: int,
        *,
        target: str | None = None,
        now_ns: int | None = None,
        closed_at: float | None = None,
    ) -> Inode:
        now = now_ns if now_ns is not None else time.time_ns()
        path = f"{parent.path}/{name}" if parent.path else name
        cur = self.db.execute(
            "INSERT INTO inodes (parent, name, path, kind, mode, uid, gid, mtime_ns, ctime_ns, target, state,"
            " closed_at, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'dirty', ?, ?)",
            (parent.id, name, path, kind, mode, uid, gid, now, now, target, closed_at, self.next_seq()),
        )
        self.touch_dir(parent.id, now)
        inode = self.get(cur.lastrowid)  # type: ignore[arg-type]
        assert inode is not None
        return inode

    def import_remote(
        self, parent: Inode, name: str, kind: str, *, size: int, mtime_ns: int, mode: int, key: str | None,
        uid: int, gid: int, now: float, target: str | None = None, checksum: str | None = None,
    ) -> Inode:
        """An inode for an object that exists only in the store (state 'remote'; 'clean' for dirs).
        `key` None: a directory implied by deeper keys, with no marker object of its own."""
        path = f"{parent.path}/{name}" if parent.path else name
        state = REMOTE if kind == FILE else CLEAN
        cur = self.db.execute(
            "INSERT INTO inodes (parent, name, path, kind, mode, uid, gid, size, mtime_ns, ctime_ns, target,"
            " state, version, uploaded_version, remote_key, checksum, closed_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 1, ?, ?, ?)",
            (parent.id, name, path, kind, mode, uid, gid, size, mtime_ns, mtime_ns, target, state, key, checksum,
             now),
        )
        inode = self.get(cur.lastrowid)  # type: ignore[arg-type]
        assert inode is not None
        return inode

    def touch_dir(self, inode_id: int, now_ns: int | None = None) -> None:
        now = now_ns if now_ns is not None else time.time_ns()
        self.db.execute("UPDATE inodes SET mtime_ns = ?, ctime_ns = ? WHERE id = ?", (now, now, inode_id))

    def set_attrs(self, inode_id: int, **columns: object) -> None:
        assert columns and set(columns) <= {"mode", "uid", "gid", "size", "mtime_ns", "ctime_ns"}
        assignments = ", ".join(f"{c} = ?" for c in columns)
        self.db.execute(f"UPDATE inodes SET {assignments} WHERE id = ?", (*columns.values(), inode_id))

    def mark_dirty(self, inode_id: int) -> None:
        """The content is about to change: new version, dirty, not closed (a writer holds it). Setuid and
        setgid go, as a write drops them (the daemon asks the kernel to leave that to it: see fuse_ops)."""
        self.db.execute(
            "UPDATE inodes SET version = version + 1, state = 'dirty', closed_at = NULL, mode = mode & ~3072"
            " WHERE id = ?",
            (inode_id,),
        )

    def mark_open_for_write(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET closed_at = NULL WHERE id = ?", (inode_id,))

    def mark_closed(self, inode_id: int, *, size: int, mtime_ns: int, changed: bool, now: float) -> None:
        """The last writer closed. If it changed the content, the file queues for upload from now."""
        if changed:
            self.db.execute(
                "UPDATE inodes SET size = ?, mtime_ns = ?, closed_at = ?, seq = ? WHERE id = ?",
                (size, mtime_ns, now, self.next_seq(), inode_id),
            )
        else:
            self.db.execute("UPDATE inodes SET closed_at = ? WHERE id = ?", (now, inode_id))

    def queue_delete(self, key: str | None) -> int | None:
        """Queue the deletion of `key` from the store; its id, or None for no key."""
        if key is None or key == "":
            return None
        cur = self.db.execute("INSERT INTO pending_deletes (key, created_at) VALUES (?, ?)", (key, time.time()))
        return cur.lastrowid

    def detach(self, inode: Inode) -> None:
        """Remove the entry of `inode` from the namespace; its store copy (if any) is queued for deletion.
        The row stays (parent NULL) while handles are open; call purge() when the last one goes."""
        self.queue_delete(inode.remote_key)
        self.db.execute(
            "UPDATE inodes SET parent = NULL, name = NULL, path = NULL, remote_key = NULL,"
            " uploaded_version = 0 WHERE id = ?",
            (inode.id,),
        )
        if inode.parent is not None:
            self.touch_dir(inode.parent)

    def forget_folder(self, path: str | None, remote_key: str | None) -> None:
        """A directory leaves `path`. Its marker, if any, goes with its remote_key; but the objects
        uploaded below `path` made a folder there in stores with real or implicit directories (SeaweedFS
        lists an emptied folder until its own key is deleted, marker or not). Deleting `path/` once the
        objects below are gone (see Drain._delete_verdict) removes it; a missing key is no error."""
        if path and remote_key != path + "/":
            self.queue_delete(path + "/")

    def purge(self, inode_id: int) -> None:
        self.db.execute("DELETE FROM inodes WHERE id = ? AND parent IS NULL AND id != ?", (inode_id, ROOT_ID))

    def move(self, inode: Inode, new_parent: Inode, new_name: str) -> None:
        """Re-link `inode` (and, for a directory, its subtree) under a new parent/name."""
        new_path = f"{new_parent.path}/{new_name}" if new_parent.path else new_name
        old_path = inode.path
        assert old_path is not None
        now = time.time_ns()
        if inode.kind == DIR:
            folders = self.db.execute("SELECT path, remote_key FROM inodes WHERE id = ?", (inode.id,)).fetchall()
            folders += self.db.execute(
                "SELECT path, remote_key FROM inodes WHERE path >= ? AND path < ? AND kind = 'dir'",
                _prefix_range(old_path + "/"),
            ).fetchall()
            for path, remote_key in folders:
                self.forget_folder(path, remote_key)
        self.db.execute(
            "UPDATE inodes SET parent = ?, name = ?, path = ?, ctime_ns = ?, seq = ? WHERE id = ?",
            (new_parent.id, new_name, new_path, now, self.next_seq(), inode.id),
        )
        if inode.kind == DIR:
            # The subtree becomes work after everything before the rename, in the order its entries
            # became work before it: a commit marker inside still follows its siblings.
            # A range of the path index, not a walk of every inode: `mv step.tmp step` in a namespace of
            # many retained checkpoints stays cheap (the FUSE loop waits for it).
            prefix = old_path + "/"
            lo, hi = _prefix_range(prefix)
            self.db.execute(
                "UPDATE inodes SET path = ? || substr(path, ?), seq = seq + ? WHERE path >= ? AND path < ?",
                (new_path + "/", len(prefix) + 1, self.next_seq(), lo, hi),
            )
            # Only the subtree's seqs changed: the journal-wide maximum is the old one or among them.
            lo, hi = _prefix_range(new_path + "/")
            moved_max = self.db.execute("SELECT MAX(seq) FROM inodes WHERE path >= ? AND path < ?", (lo, hi))
            self._seq = max(self._seq, moved_max.fetchone()[0] or 0)
        if inode.parent is not None:
            self.touch_dir(inode.parent, now)
        self.touch_dir(new_parent.id, now)

    # -- drain bookkeeping ----------------------------------------------------------------------------

    def uploads_due(
        self, closed_before: float, limit: int, *, small: tuple[int, float] | None = None
    ) -> list[Inode]:
        """Pending uploads that may start now: directories and symlinks, and files closed before
        `closed_before` (the upload_delay cut-off), oldest work first; `small` (size, cut-off): files of at
        most that size only if closed before that cut-off too."""
        max_small, small_closed_before = small if small is not None else (0, closed_before)
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
            " AND (kind != 'file' OR (closed_at <= ? AND (size > ? OR closed_at <= ?))) ORDER BY seq LIMIT ?",
            (closed_before, max_small, small_closed_before, limit),
        )

    def next_close_after(self, cut_off: float) -> float | None:
        """The earliest close time after `cut_off` among pending files: when the next one becomes due."""
        row = self.db.execute(
            "SELECT MIN(closed_at) FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
            " AND kind = 'file' AND closed_at > ?",
            (cut_off,),
        ).fetchone()
        return row[0] if row else None

    def work_before(self, seq: int, limit: int, after: tuple[int, int] = (-1, -1)) -> list[Inode]:
        """Pending uploads of closed files, dirs and symlinks, and pending moves, that became work before
        `seq` (what a commit marker with that seq waits for); a page of them after `after` (seq, id)."""
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes WHERE seq < ? AND (seq, id) > (?, ?) AND path IS NOT NULL"
            " AND id != 1 AND ("
            " (state IN ('dirty', 'uploading') AND (kind != 'file' OR closed_at IS NOT NULL))"
            " OR (state IN ('clean', 'remote') AND remote_key IS NOT NULL"
            "     AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END))"
            ") ORDER BY seq, id LIMIT ?",
            (seq, after[0], after[1], limit),
        )

    def get_pending_delete(self, delete_id: int) -> PendingDelete | None:
        row = self.db.execute("SELECT id, key, created_at FROM pending_deletes WHERE id = ?", (delete_id,)).fetchone()
        return PendingDelete(*row) if row else None

    def longest_path_under(self, path: str) -> int:
        """Length in bytes of the longest path at or below `path`."""
        below = self.db.execute(
            "SELECT MAX(length(CAST(path AS BLOB))) FROM inodes WHERE path >= ? AND path < ?",
            _prefix_range(path + "/"),
        ).fetchone()[0]
        return max(len(path.encode()), int(below or 0))

    def pending_uploads(self, limit: int = -1) -> list[Inode]:
        """Linked inodes whose content or marker the store lacks (dirty or mid-upload), oldest work first."""
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
            " ORDER BY seq LIMIT ?",
            (limit,),
        )

    def has_closed_pending(self) -> bool:
        """Is any upload pending of a directory, a symlink or a file no writer holds open?"""
        return self.db.execute(
            "SELECT 1 FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
            " AND (kind != 'file' OR closed_at IS NOT NULL) LIMIT 1"
        ).fetchone() is not None

    def misplaced(self, limit: int = -1) -> list[Inode]:
        """Inodes whose store copy sits under an old name (renamed after upload), not dirty."""
        return self._all(
            # INDEXED BY: left to itself, the planner walks inodes_remote_key, every uploaded inode.
            f"SELECT {_COLUMNS} FROM inodes INDEXED BY inodes_misplaced WHERE remote_key IS NOT NULL AND id != 1"
            " AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END)"
            " AND state IN ('clean', 'remote') ORDER BY seq LIMIT ?",
            (limit,),
        )

    def dirs_to_upload(self) -> list[Inode]:
        """Linked directories whose marker was never uploaded (or is being uploaded)."""
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND kind = 'dir'"
            " AND path IS NOT NULL"
        )

    def pending_deletes(self, limit: int = -1) -> list[PendingDelete]:
        rows = self.db.execute("SELECT id, key, created_at FROM pending_deletes ORDER BY id LIMIT ?", (limit,))
        return [PendingDelete(*row) for row in rows]

    def pending_delete_keys_under(self, prefix: str) -> set[str]:
        """Keys below the directory key `prefix` ('' for all) that wait to be deleted from the store."""
        if not prefix:
            return {row[0] for row in self.db.execute("SELECT key FROM pending_deletes")}
        rows = self.db.execute("SELECT key FROM pending_deletes WHERE key >= ? AND key < ?", _prefix_range(prefix))
        return {row[0] for row in rows}

    def adopt_marker(self, inode_id: int, key: str) -> None:
        """A directory imported without a marker has one in the store after all (seen when listing it)."""
        self.db.execute("UPDATE inodes SET remote_key = ? WHERE id = ? AND remote_key IS NULL", (key, inode_id))

    # -- lazy listing: when each directory was last listed from the store (recovery.DirLister) --------------

    def prune_listed_dirs(self) -> None:
        """Forget when directories gone since were listed."""
        self.db.execute("DELETE FROM listed_dirs WHERE inode_id NOT IN (SELECT id FROM inodes WHERE path IS NOT NULL)")

    def listed_dirs(self) -> dict[int, float]:
        return dict(self.db.execute("SELECT inode_id, listed_at FROM listed_dirs").fetchall())

    def set_listed(self, inode_id: int, listed_at: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO listed_dirs (inode_id, listed_at) VALUES (?, ?)", (inode_id, listed_at))

    def clear_listed(self) -> None:
        self.db.execute("DELETE FROM listed_dirs")

    def delete_done(self, delete_id: int) -> None:
        self.db.execute("DELETE FROM pending_deletes WHERE id = ?", (delete_id,))

    def key_owner(self, key: str) -> Inode | None:
        """The inode whose store copy is at `key`, if any."""
        return self._one(f"SELECT {_COLUMNS} FROM inodes WHERE remote_key = ?", (key,))

    def key_claimant(self, key: str) -> Inode | None:
        """A linked inode that belongs at `key` but is not there yet (it will overwrite it)."""
        path = key[:-1] if key.endswith("/") else key
        kind_test = "kind = 'dir'" if key.endswith("/") else "kind != 'dir'"
        return self._one(
            f"SELECT {_COLUMNS} FROM inodes WHERE path = ? AND {kind_test} AND remote_key IS NOT ?", (path, key)
        )

    def keys_under(self, prefix: str) -> bool:
        """True if some inode's store copy or a pending delete still has a key below `prefix` (a dir key)."""
        lo, hi = _prefix_range(prefix)
        if self.db.execute(
            "SELECT 1 FROM inodes WHERE remote_key IS NOT NULL AND remote_key > ? AND remote_key < ? LIMIT 1",
            (lo, hi),
        ).fetchone():
            return True
        return (
            self.db.execute("SELECT 1 FROM pending_deletes WHERE key > ? AND key < ? LIMIT 1", (lo, hi)).fetchone()
            is not None
        )

    def begin_upload(self, inode_id: int) -> None:
        """An upload starts from the current row: it carries the current mode and mtime."""
        self.db.execute(
            "UPDATE inodes SET state = 'uploading', meta_dirty = 0 WHERE id = ? AND state = 'dirty'", (inode_id,)
        )

    def save_upload_state(self, inode_id: int, state: str | None) -> None:
        self.db.execute("UPDATE inodes SET upload_state = ? WHERE id = ?", (state, inode_id))

    def upload_states(self) -> list[tuple[int, str]]:
        return list(self.db.execute("SELECT id, upload_state FROM inodes WHERE upload_state IS NOT NULL"))

    def mark_meta_dirty(self, inode_id: int) -> None:
        """Mode or mtime changed. An upload that starts later carries them (and clears this); one in
        flight or done leaves it set, and the drain rewrites the object's metadata."""
        self.db.execute("UPDATE inodes SET meta_dirty = 1 WHERE id = ?", (inode_id,))

    def meta_stale(self, limit: int) -> list[Inode]:
        """Inodes in their right place in the store whose object metadata is out of date."""
        return self._all(
            f"SELECT {_COLUMNS} FROM inodes INDEXED BY inodes_meta_stale WHERE meta_dirty = 1"
            # An unlinked inode (path NULL, remote_key cleared by detach) matches the key test below too:
            # it has no object left to update.
            " AND path IS NOT NULL AND state IN ('clean', 'remote')"
            " AND remote_key IS (CASE kind WHEN 'dir' THEN path || '/' ELSE path END) ORDER BY seq LIMIT ?",
            (limit,),
        )

    def clear_meta_dirty(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET meta_dirty = 0 WHERE id = ?", (inode_id,))

    def abort_upload(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET state = 'dirty' WHERE id = ? AND state = 'uploading'", (inode_id,))

    def finish_upload(
        self, inode: Inode, *, key: str, version: int, checksum: str | None, size: int, clean: bool
    ) -> None:
        """The store now holds `version` of `inode` at `key`. A copy under another key is queued for
        deletion. `clean` is False when the content changed meanwhile (it stays dirty)."""
        if inode.remote_key is not None and inode.remote_key != key:
            self.queue_delete(inode.remote_key)
        self.release_key(key, inode.id)
        self.db.execute(
            "UPDATE inodes SET remote_key = ?, uploaded_version = ?, checksum = ?, size = ?, upload_state = NULL,"
            " state = CASE WHEN ? THEN 'clean' ELSE 'dirty' END WHERE id = ?",
            (key, version, checksum, size, clean, inode.id),
        )

    def finish_move(self, inode: Inode, old_key: str, new_key: str) -> None:
        """The store has a copy at `new_key` now; the one at `old_key` is queued for deletion."""
        self.queue_delete(old_key)
        self.release_key(new_key, inode.id)
        self.db.execute("UPDATE inodes SET remote_key = ? WHERE id = ?", (new_key, inode.id))

    def release_key(self, key: str, keeper: int) -> None:
        """An object was just written at `key` for inode `keeper`: any other inode whose copy lived there
        has lost it (the drain lets that happen only to inodes with local data, which upload again)."""
        for other in self._all(f"SELECT {_COLUMNS} FROM inodes WHERE remote_key = ? AND id != ?", (key, keeper)):
            self.forget_remote_copy(other.id, now=time.time())

    def forget_remote_copy(self, inode_id: int, *, now: float) -> None:
        """The store lost this inode's object: upload it again from local data."""
        self.db.execute(
            "UPDATE inodes SET remote_key = NULL, uploaded_version = 0, state = 'dirty',"
            " closed_at = COALESCE(closed_at, ?) WHERE id = ?",
            (now, inode_id),
        )

    def finish_fetch(self, inode_id: int, *, size: int, mtime_ns: int) -> None:
        self.db.execute(
            "UPDATE inodes SET state = 'clean', size = ?, mtime_ns = ? WHERE id = ? AND state = 'remote'",
            (size, mtime_ns, inode_id),
        )

    def serve_from_store(self, inode_id: int) -> None:
        """The local copy is gone (its cache file vanished): the version the store holds serves it now."""
        self.db.execute("UPDATE inodes SET state = 'remote' WHERE id = ?", (inode_id,))

    def replaced_in_store(self, inode_id: int, *, size: int, mtime_ns: int, checksum: str | None) -> None:
        """Another node replaced the object of this inode: the store's new version (of this size, mtime and
        checksum) serves it from now; the caller drops the local copy."""
        self.db.execute(
            "UPDATE inodes SET state = 'remote', size = ?, mtime_ns = ?, checksum = ? WHERE id = ?",
            (size, mtime_ns, checksum, inode_id),
        )

    # -- eviction (called by evict.py) -----------------------------------------------------------------

    def clean_files(self) -> list[int]:
        """Ids of linked files whose local data is a clean copy of what the store holds: what may be
        evicted (the evictor skips open ones)."""
        return [row[0] for row in self.db.execute(
            "SELECT id FROM inodes WHERE state = 'clean' AND kind = 'file' AND path IS NOT NULL"
        )]

    def open_dirty_files(self) -> list[int]:
        """Ids of linked files being written right now (what a spill may take from)."""
        return [row[0] for row in self.db.execute(
            # The IN term lets the planner use the partial index inodes_pending.
            "SELECT id FROM inodes WHERE state IN ('dirty', 'uploading') AND state = 'dirty' AND kind = 'file'"
            " AND closed_at IS NULL AND path IS NOT NULL"
        )]

    def clean_bytes(self) -> int:
        row = self.db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM inodes WHERE state = 'clean' AND kind = 'file' AND path IS NOT NULL"
        ).fetchone()
        return int(row[0])

    def mark_evicted(self, inode_id: int, *, size: int, mtime_ns: int) -> bool:
        """The local copy of a clean file is about to go: the store's copy serves it from now ('remote').
        False (nothing changed) if the file is no longer clean."""
        cur = self.db.execute(
            "UPDATE inodes SET state = 'remote', size = ?, mtime_ns = ? WHERE id = ? AND state = 'clean'"
            " AND kind = 'file'",
            (size, mtime_ns, inode_id),
        )
        return cur.rowcount == 1

    # -- status ----------------------------------------------------------------------------------------

    def state_summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for state, files, size in self.db.execute(
            "SELECT state, COUNT(*), COALESCE(SUM(size), 0) FROM inodes"
            " WHERE kind = 'file' AND path IS NOT NULL GROUP BY state"
        ):
            out[state] = {"files": files, "bytes": size}
        return out

    def oldest_dirty_closed_at(self) -> float | None:
        row = self.db.execute(
            "SELECT MIN(closed_at) FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
        ).fetchone()
        return row[0] if row else None
