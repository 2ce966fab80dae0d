"""The journal's schema: every table, column and index in create_tables(), with what each column means;
the version of the schema a journal has, and the migrations that bring an older journal up to it."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from ckptfs.journal.connection import JournalError
from ckptfs.journal.rows import INODE_COLUMNS, ROOT_ID

SCHEMA_VERSION = 4


def create_tables(db: sqlite3.Connection) -> None:
    """The canonical schema, created in one transaction with the root directory.
    Every column says what it means, its sentinels and who sets it."""
    now = time.time_ns()
    # The mount's root belongs to whoever runs the daemon: a user mounting their own FUSE filesystem (no
    # root) can then create files in it, as the kernel checks the root's owner and mode for them.
    uid, gid = os.getuid(), os.getgid()
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
            -- handles (purged at the next start). Set by the fs package (create, rename, unlink).
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
            -- Access time set by utimens of an inode without local data (a directory, a symlink, a file
            -- only in the store); NULL until then, read as mtime_ns. A file with local data keeps its atime
            -- on its cache file instead. Never sent to the store (it keeps no atime). Set by fs.setattr.
            -- Last in the table: version 4 added it (ALTER TABLE appends).
            atime_ns  INTEGER,
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
        -- A directory's subdirectories, counted for its link count (2 + subdirectories, as POSIX tools
        -- expect: find and fts read it): a count costs the subdirectories, not every file beside them.
        CREATE INDEX inodes_subdirs ON inodes(parent) WHERE kind = 'dir';

        CREATE TABLE pending_deletes (
            id         INTEGER PRIMARY KEY AUTOINCREMENT,  -- order of the deletes
            -- Store key to delete. The drain skips it while an inode still owns that key
            -- (remote_key = key) and defers it while an inode is about to write that key.
            key        TEXT NOT NULL,
            created_at REAL NOT NULL
        );

        -- Lazy listing (lister.DirLister): when each directory was last listed from the store, so that
        -- a restart within the refresh interval lists nothing again. Rows of inodes gone are pruned when
        -- a DirLister starts.
        CREATE TABLE listed_dirs (
            inode_id  INTEGER PRIMARY KEY,  -- a directory's inode id
            listed_at REAL NOT NULL         -- wall-clock time (time.time()) of its last listing
        );
        """
        f"""
        INSERT INTO inodes (id, parent, name, path, kind, mode, uid, gid, mtime_ns, ctime_ns, state, remote_key)
            VALUES ({ROOT_ID}, NULL, NULL, '', 'dir', {0o40755}, {uid}, {gid}, {now}, {now}, 'clean', NULL);
        PRAGMA user_version = {SCHEMA_VERSION};
        COMMIT;
        """
    )


def _to_version_2(db: sqlite3.Connection) -> None:
    """Version 1 journals gained listed_dirs and inodes_meta_stale at open, outside the schema version
    (ckptfs up to 1bdda0c): create them where they are missing."""
    db.execute("CREATE TABLE IF NOT EXISTS listed_dirs (inode_id INTEGER PRIMARY KEY, listed_at REAL NOT NULL)")
    db.execute("CREATE INDEX IF NOT EXISTS inodes_meta_stale ON inodes(seq) WHERE meta_dirty = 1")
    db.execute("PRAGMA user_version = 2")


def _to_version_3(db: sqlite3.Connection) -> None:
    """Version 3 counts a directory's subdirectories for its link count: the index that makes it cheap."""
    db.execute("CREATE INDEX IF NOT EXISTS inodes_subdirs ON inodes(parent) WHERE kind = 'dir'")
    db.execute("PRAGMA user_version = 3")


def _to_version_4(db: sqlite3.Connection) -> None:
    """Version 4 keeps the atime that utimens sets on a directory, a symlink or a file only in the store."""
    db.execute("ALTER TABLE inodes ADD COLUMN atime_ns INTEGER")
    db.execute("PRAGMA user_version = 4")


# The step from each version to the next; each sets the version it reaches.
_MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _to_version_2, 2: _to_version_3, 3: _to_version_4}


# The inode columns each version added (ALTER TABLE): a journal of an older version lacks them until migrated.
_ADDED_COLUMNS: dict[int, tuple[str, ...]] = {4: ("atime_ns",)}


def check_version(db: sqlite3.Connection, path: Path, version: int) -> None:
    """Refuse a journal this ckptfs cannot use, before anything touches it: one of a newer schema, or one
    whose inodes lack columns its version has."""
    if version > SCHEMA_VERSION:
        raise JournalError(
            f"journal {path} has schema version {version}, newer than this ckptfs ({SCHEMA_VERSION});"
            " upgrade ckptfs or use another --cache-dir"
        )
    later = {column for v, columns in _ADDED_COLUMNS.items() if v > version for column in columns}
    try:
        db.execute(f"SELECT {', '.join(c for c in INODE_COLUMNS.split(', ') if c not in later)} FROM inodes LIMIT 0")
    except sqlite3.Error as exc:
        raise JournalError(
            f"journal {path} does not match this ckptfs's schema ({exc}): it was made by a development"
            " build; use another --cache-dir"
        ) from None


def migrations(version: int) -> list[Callable[[sqlite3.Connection], None]]:
    """The steps that bring a journal of schema `version` to SCHEMA_VERSION, in order, each to run in a
    transaction of its own."""
    return [_MIGRATIONS[v] for v in range(version, SCHEMA_VERSION)]
