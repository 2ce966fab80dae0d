"""The names (journal.names): inodes by id, looking entries up and walking the tree, the changes the fs
package makes inside transaction() (create, attributes, open and close for writing, unlink, rename), the
entries recovery imports from the store, and when each directory was last listed from the store
(lister.DirLister)."""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Collection
from itertools import chain

from ckptfs.journal.core import JournalCore, JournalTable, fetch_inode, fetch_inodes, id_groups, prefix_range
from ckptfs.journal.deletes import PendingDeletes
from ckptfs.journal.rows import CLEAN, DIR, DIRTY, FILE, INODE_COLUMNS, REMOTE, ROOT_ID, EntryRow, Inode, ListedEntry

_LISTED_COLUMNS = ("INSERT INTO inodes (parent, name, path, kind, mode, uid, gid, size, mtime_ns, ctime_ns, target,"
                   " state, version, uploaded_version, remote_key, checksum, closed_at) VALUES ")
_LISTED_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 1, ?, ?, ?)"
_LISTED_PARAMETERS = 15
# Rows of a listing per INSERT: a directory of 1,000 files in one statement where SQLite takes 15,000
# parameters (32,766 since SQLite 3.32), 64 where it takes 999. Measured on 100,000 rows: one a statement
# 2.5 s of CPU, 64 a statement 1.2 s, 1,000 a statement 0.93 s.
_LISTED_PER_INSERT_MAX = 1000
_LISTED_FEW = 64  # rows per INSERT of what is left of a listing after the largest INSERTs
_INSERT_LISTED = _LISTED_COLUMNS + _LISTED_ROW


def listed_per_insert(db: sqlite3.Connection) -> int:
    """How many rows of a listing one INSERT takes on this connection (its limit of parameters)."""
    return max(1, min(_LISTED_PER_INSERT_MAX, db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // _LISTED_PARAMETERS))


@functools.lru_cache(maxsize=4)
def _insert_listed_many(rows: int) -> str:
    return _LISTED_COLUMNS + ", ".join([_LISTED_ROW] * rows)


class Names(JournalTable):
    """The tree of entries and its changes; an entry removed or moved queues its store keys' deletes (in
    `deletes`)."""

    def __init__(self, core: JournalCore, deletes: PendingDeletes) -> None:
        super().__init__(core)
        self.deletes = deletes

    # -- inodes by id -------------------------------------------------------------------------------

    def get(self, inode_id: int) -> Inode | None:
        inode = self.cache.rows.get(inode_id)
        if inode is None:
            inode = fetch_inode(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE id = ?", (inode_id,))
            if inode is not None:
                self.cache.keep(inode)
        return inode

    def get_many(self, inode_ids: Collection[int]) -> dict[int, Inode]:
        """The inodes among `inode_ids` that exist, by id: one query per group of ids (id_groups), not one each."""
        found: dict[int, Inode] = {}
        for chunk, marks in id_groups(inode_ids):
            for inode in fetch_inodes(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE id IN ({marks})", chunk):
                found[inode.id] = inode
        return found

    def stale_cache_entries(self) -> list[str]:
        """What the row cache holds that the inodes table does not (nothing, unless a mutator forgot to keep
        it exact): for tests, which check it after every step."""
        stale = []
        for inode_id, cached in list(self.cache.rows.items()):
            row = fetch_inode(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE id = ?", (inode_id,))
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

    # -- lookups and walks --------------------------------------------------------------------------

    def lookup(self, parent: int, name: str) -> Inode | None:
        cache = self.cache
        if (parent, name) in cache.entries:
            inode_id = cache.entries[(parent, name)]
            if inode_id is None:
                return None
            inode = self.get(inode_id)
            # An entry is checked against its row: one whose row moved or went is read again below.
            if inode is not None and inode.parent == parent and inode.name == name:
                return inode
            cache.distrust_entry(parent, name)
        elif parent in cache.complete:
            return None
        inode = fetch_inode(
            self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE parent = ? AND name = ?", (parent, name)
        )
        if inode is None:
            cache.keep_entry(parent, name, None)
        else:
            cache.keep(inode)
            cache.keep_entry(parent, name, inode.id)
        return inode

    def dir_and_child(self, parent: int, name: str) -> tuple[Inode | None, Inode | None]:
        """The inode `parent` and its entry `name` (each None if there is none): from the cache, else in one
        statement: a lookup, create or rename needs both, and read one after the other they were half of a
        small file's reads."""
        cache = self.cache
        parent_row = cache.rows.get(parent)
        if parent_row is not None:
            return parent_row, self.lookup(parent, name)
        child = None
        for inode in fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE id = ?1"
            f" UNION ALL SELECT {INODE_COLUMNS} FROM inodes WHERE parent = ?1 AND name = ?2",
            (parent, name),
        ):
            cache.keep(inode)
            if inode.id == parent:
                parent_row = inode
            else:
                child = inode
        if parent_row is not None:
            cache.keep_entry(parent, name, None if child is None else child.id)
        return parent_row, child

    def by_path(self, path: str) -> Inode | None:
        return fetch_inode(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE path = ?", (path,))

    def children(self, parent: int, after_id: int = 0, limit: int = 1000) -> list[Inode]:
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE parent = ? AND id > ? ORDER BY id LIMIT ?",
            (parent, after_id, limit),
        )

    def entry_rows(self, parent: int, after_id: int, limit: int) -> list[EntryRow]:
        """What readdir answers of a directory's entries, in `children`'s order: plain rows of the few
        columns it needs, not an Inode of every column each (a walk reads every entry of the tree). The ids
        first, from the (parent, name) index alone, then their rows by id in id order: sorting whole rows
        (SQLite's plan for the plain query) made a directory's read a third dearer."""
        return self.db.execute(
            "SELECT id, name, kind, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, target, state FROM inodes"
            " WHERE id IN (SELECT id FROM inodes WHERE parent = ?1 AND id > ?2 ORDER BY id LIMIT ?3) ORDER BY id",
            (parent, after_id, limit),
        ).fetchall()

    def all_children(self, parent: int) -> list[Inode]:
        return fetch_inodes(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE parent = ?", (parent,))

    def descendants(self, path: str) -> list[Inode]:
        """Every linked inode below the directory `path`."""
        return fetch_inodes(
            self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE path >= ? AND path < ?", prefix_range(path + "/")
        )

    def unlinked_among(self, inode_ids: Collection[int]) -> list[int]:
        """The inodes among `inode_ids` that are unlinked (kept by open handles or kernel references)."""
        found: list[int] = []
        for chunk, marks in id_groups(inode_ids):
            rows = self.db.execute(f"SELECT id FROM inodes WHERE id IN ({marks}) AND parent IS NULL", chunk)
            found.extend(row[0] for row in rows)
        return found

    def subdirectory_count(self, parent: int) -> int:
        row = self.db.execute("SELECT COUNT(*) FROM inodes WHERE parent = ? AND kind = 'dir'", (parent,)).fetchone()
        return int(row[0])

    def next_subdirectory(self, parent: int, after_id: int) -> int | None:
        """The first subdirectory of `parent` after `after_id` in readdir's order (by id)."""
        row = self.db.execute(
            "SELECT id FROM inodes WHERE parent = ? AND kind = 'dir' AND id > ? ORDER BY id LIMIT 1", (parent, after_id)
        ).fetchone()
        return row[0] if row else None

    def has_children(self, parent: int) -> bool:
        return self.db.execute("SELECT 1 FROM inodes WHERE parent = ? LIMIT 1", (parent,)).fetchone() is not None

    def all_inodes(self) -> list[Inode]:
        return fetch_inodes(self.db, f"SELECT {INODE_COLUMNS} FROM inodes")

    def is_ancestor(self, ancestor: int, inode_id: int) -> bool:
        """True if `ancestor` is `inode_id` or one of its parent directories."""
        current: int | None = inode_id
        while current is not None:
            if current == ancestor:
                return True
            row = self.db.execute("SELECT parent FROM inodes WHERE id = ?", (current,)).fetchone()
            current = row[0] if row else None
        return False

    def longest_path_under(self, path: str) -> int:
        """Length in bytes of the longest path at or below `path`."""
        below = self.db.execute(
            "SELECT MAX(length(CAST(path AS BLOB))) FROM inodes WHERE path >= ? AND path < ?",
            prefix_range(path + "/"),
        ).fetchone()[0]
        return max(len(path.encode()), int(below or 0))

    # -- changes (called by the fs package inside transaction()) -----------------------------------------------

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
        seq = self.core.next_seq()
        cur = self.db.execute(
            "INSERT INTO inodes (parent, name, path, kind, mode, uid, gid, mtime_ns, ctime_ns, target, state,"
            " closed_at, seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'dirty', ?, ?)",
            (parent.id, name, path, kind, mode, uid, gid, now, now, target, closed_at, seq),
        )
        # The row as inserted, with the schema's defaults, without reading it back (one query less per create).
        assert cur.lastrowid is not None
        inode = Inode(cur.lastrowid, parent.id, name, path, kind, mode, uid, gid, size=0, mtime_ns=now, ctime_ns=now,
                      target=target, state=DIRTY, version=1, uploaded_version=0, remote_key=None, checksum=None,
                      meta_dirty=0, upload_state=None, closed_at=closed_at, seq=seq)
        self.cache.keep(inode)
        self.cache.keep_entry(parent.id, name, inode.id)
        if kind == DIR:
            self.cache.new_directory(inode.id)
        self.touch_dir(parent.id, now)
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
        self.cache.keep_entry(parent.id, name, inode.id)
        return inode

    def import_listed(self, parent: Inode, entries: list[ListedEntry], *, uid: int, gid: int, now: float) -> None:
        """Many imports at once (a directory's listing), as import_remote makes each: three statements at
        most for all of them, not a round trip per entry, and no rows read back (a listing of 1,000 files
        took 3,000 statements and most of a first walk's time). The rows go in as many to an INSERT as the
        connection takes (listed_per_insert: a directory of 1,000 files is one INSERT): SQLite's work per
        statement run (its AUTOINCREMENT bookkeeping among it) was half the cost of an import of one row
        per run."""
        base = f"{parent.path}/" if parent.path else ""
        parent_id = parent.id
        rows = [(parent_id, name, base + name, kind, mode, uid, gid, size, mtime_ns, mtime_ns, target,
                 REMOTE if kind == FILE else CLEAN, key, checksum, now)
                for name, kind, size, mtime_ns, mode, key, target, checksum in entries]
        # These names exist from now on: what the cache knew of them (that they did not) goes first, so
        # that no statement below can leave it behind.
        self.cache.names_arrived(parent_id, [entry.name for entry in entries])
        start = 0
        # Whole INSERTs of as many rows as the connection takes, then of 64, then one by one: three
        # statements at most, each compiled once (SQLite's statement cache keeps them).
        for per_insert in (listed_per_insert(self.db), _LISTED_FEW):
            whole = start + (len(rows) - start) // per_insert * per_insert
            self.db.executemany(_insert_listed_many(per_insert), [
                list(chain.from_iterable(rows[at:at + per_insert])) for at in range(start, whole, per_insert)
            ])
            start = whole
        self.db.executemany(_INSERT_LISTED, rows[start:])

    def touch_dir(self, inode_id: int, now_ns: int | None = None) -> None:
        now = now_ns if now_ns is not None else time.time_ns()
        self.db.execute("UPDATE inodes SET mtime_ns = ?, ctime_ns = ? WHERE id = ?", (now, now, inode_id))
        self.cache.update(inode_id, mtime_ns=now, ctime_ns=now)

    def set_attrs(self, inode_id: int, **columns: object) -> None:
        assert columns and set(columns) <= {"mode", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns"}
        assignments = ", ".join(f"{c} = ?" for c in columns)
        self.db.execute(f"UPDATE inodes SET {assignments} WHERE id = ?", (*columns.values(), inode_id))
        self.cache.update(inode_id, **columns)

    def mark_dirty(self, inode_id: int) -> None:
        """The content is about to change: new version, dirty, not closed (a writer holds it). Setuid and
        setgid go, as a write drops them (the daemon asks the kernel to leave that to it: see mount/adapter.py)."""
        self.db.execute(
            "UPDATE inodes SET version = version + 1, state = 'dirty', closed_at = NULL, mode = mode & ~3072"
            " WHERE id = ?",
            (inode_id,),
        )
        self.cache.drop(inode_id)

    def mark_open_for_write(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET closed_at = NULL WHERE id = ?", (inode_id,))
        self.cache.update(inode_id, closed_at=None)

    def mark_closed(self, inode_id: int, *, size: int, mtime_ns: int, changed: bool, now: float) -> bool:
        """The last writer closed. If it changed the content, the file queues for upload from now. Only a
        file with local data has a close to record: False (nothing changed) for any other inode, which the
        caller need not read first. One statement: called outside transaction() it commits on its own."""
        if changed:
            seq = self.core.next_seq()
            cur = self.db.execute(
                "UPDATE inodes SET size = ?, mtime_ns = ?, closed_at = ?, seq = ? WHERE id = ? AND kind = 'file'"
                " AND state != 'remote'",
                (size, mtime_ns, now, seq, inode_id),
            )
            if cur.rowcount > 0:
                self.cache.update(inode_id, size=size, mtime_ns=mtime_ns, closed_at=now, seq=seq)
        else:
            cur = self.db.execute(
                "UPDATE inodes SET closed_at = ? WHERE id = ? AND kind = 'file' AND state != 'remote'", (now, inode_id)
            )
            if cur.rowcount > 0:
                self.cache.update(inode_id, closed_at=now)
        self.core.committed_alone()
        return cur.rowcount > 0

    def detach(self, inode: Inode) -> None:
        """Remove the entry of `inode` from the namespace; its store copy (if any) is queued for deletion.
        The row stays (parent NULL) while handles are open; call purge() when the last one goes."""
        self.deletes.queue_delete(inode.remote_key)
        self.db.execute(
            "UPDATE inodes SET parent = NULL, name = NULL, path = NULL, remote_key = NULL,"
            " uploaded_version = 0 WHERE id = ?",
            (inode.id,),
        )
        self.cache.drop(inode.id)
        self.cache.drop_entry(inode.parent, inode.name)
        if inode.parent is not None:
            self.touch_dir(inode.parent)

    def forget_folder(self, path: str | None, remote_key: str | None) -> None:
        """A directory leaves `path`. Its marker, if any, goes with its remote_key; but the objects
        uploaded below `path` made a folder there in stores with real or implicit directories (SeaweedFS
        lists an emptied folder until its own key is deleted, marker or not). Deleting `path/` once the
        objects below are gone (see Drain._delete_verdict) removes it; a missing key is no error."""
        if path and remote_key != path + "/":
            self.deletes.queue_delete(path + "/")

    def purge(self, inode_id: int) -> None:
        self.db.execute("DELETE FROM inodes WHERE id = ? AND parent IS NULL AND id != ?", (inode_id, ROOT_ID))
        self.cache.drop(inode_id)

    def move(self, inode: Inode, new_parent: Inode, new_name: str) -> None:
        """Re-link `inode` (and, for a directory, its subtree) under a new parent/name. A file or a symlink
        moves in one statement (with its directories' times): called outside transaction() it commits on
        its own."""
        new_path = f"{new_parent.path}/{new_name}" if new_parent.path else new_name
        old_path = inode.path
        assert old_path is not None and inode.parent is not None and inode.name is not None
        now = time.time_ns()
        if inode.kind != DIR:
            self._move_entry(inode, new_parent, new_name, new_path, now)
            return
        folders = self.db.execute("SELECT path, remote_key FROM inodes WHERE id = ?", (inode.id,)).fetchall()
        folders += self.db.execute(
            "SELECT path, remote_key FROM inodes WHERE path >= ? AND path < ? AND kind = 'dir'",
            prefix_range(old_path + "/"),
        ).fetchall()
        for path, remote_key in folders:
            self.forget_folder(path, remote_key)
        self.db.execute(
            "UPDATE inodes SET parent = ?, name = ?, path = ?, ctime_ns = ?, seq = ? WHERE id = ?",
            (new_parent.id, new_name, new_path, now, self.core.next_seq(), inode.id),
        )
        # The subtree becomes work after everything before the rename, in the order its entries
        # became work before it: a commit marker inside still follows its siblings.
        # A range of the path index, not a walk of every inode: `mv step.tmp step` in a namespace of
        # many retained checkpoints stays cheap (the FUSE loop waits for it).
        prefix = old_path + "/"
        lo, hi = prefix_range(prefix)
        self.db.execute(
            "UPDATE inodes SET path = ? || substr(path, ?), seq = seq + ? WHERE path >= ? AND path < ?",
            (new_path + "/", len(prefix) + 1, self.core.next_seq(), lo, hi),
        )
        # Only the subtree's seqs changed: the journal-wide maximum is the old one or among them.
        lo, hi = prefix_range(new_path + "/")
        moved_max = self.db.execute("SELECT MAX(seq) FROM inodes WHERE path >= ? AND path < ?", (lo, hi))
        self.core.seq_at_least(moved_max.fetchone()[0] or 0)
        if inode.parent != new_parent.id:
            self.touch_dir(inode.parent, now)
        self.touch_dir(new_parent.id, now)
        # Every row below changed its path and seq: the cache cannot tell which it holds without a scan of
        # all of it, and a directory's rename is rare next to the requests the cache serves.
        self.cache.clear()

    def _move_entry(self, inode: Inode, new_parent: Inode, new_name: str, new_path: str, now: int) -> None:
        """move() of a file or a symlink: its row and the times of its old and new directory in one UPDATE
        (a rename of a small file was BEGIN, three UPDATEs and COMMIT)."""
        seq = self.core.next_seq()
        old_parent = inode.parent
        self.db.execute(
            "UPDATE inodes SET parent = CASE id WHEN ?1 THEN ?2 ELSE parent END,"
            " name = CASE id WHEN ?1 THEN ?3 ELSE name END, path = CASE id WHEN ?1 THEN ?4 ELSE path END,"
            " seq = CASE id WHEN ?1 THEN ?5 ELSE seq END, mtime_ns = CASE id WHEN ?1 THEN mtime_ns ELSE ?6 END,"
            " ctime_ns = ?6 WHERE id IN (?1, ?2, ?7)",
            (inode.id, new_parent.id, new_name, new_path, seq, now, old_parent),
        )
        cache = self.cache
        cache.update(inode.id, parent=new_parent.id, name=new_name, path=new_path, seq=seq, ctime_ns=now)
        cache.update(new_parent.id, mtime_ns=now, ctime_ns=now)
        cache.update(old_parent, mtime_ns=now, ctime_ns=now)  # type: ignore[arg-type]
        cache.drop_entry(old_parent, inode.name)
        cache.keep_entry(new_parent.id, new_name, inode.id)
        self.core.committed_alone()

    # -- lazy listing: when each directory was last listed from the store (lister.DirLister) ----------

    def prune_listed_dirs(self) -> None:
        """Forget when directories gone since were listed."""
        self.db.execute("DELETE FROM listed_dirs WHERE inode_id NOT IN (SELECT id FROM inodes WHERE path IS NOT NULL)")

    def listed_dirs(self) -> dict[int, float]:
        return dict(self.db.execute("SELECT inode_id, listed_at FROM listed_dirs").fetchall())

    def set_listed(self, inode_id: int, listed_at: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO listed_dirs (inode_id, listed_at) VALUES (?, ?)", (inode_id, listed_at))

    def clear_listed(self) -> None:
        self.db.execute("DELETE FROM listed_dirs")
