"""The drain's work and its results: what is due (uploads, moves, metadata updates, and what a commit
marker waits for), which inode owns or claims a store key, and the bookkeeping of an upload or a move from
its start to the store holding it."""

from __future__ import annotations

import time
from collections.abc import Collection

from ckptfs.journal.core import JournalCore, JournalTable, fetch_inode, fetch_inodes, id_groups, prefix_range
from ckptfs.journal.deletes import PendingDeletes
from ckptfs.journal.rows import INODE_COLUMNS, Inode


class DrainWork(JournalTable):
    """What the drain has to do, and what it did (journal.work); a copy replaced under another key queues
    its delete (in `deletes`)."""

    def __init__(self, core: JournalCore, deletes: PendingDeletes) -> None:
        super().__init__(core)
        self.deletes = deletes

    def uploads_due(
        self, closed_before: float, limit: int, *, small: tuple[int, float] | None = None
    ) -> list[Inode]:
        """Pending uploads that may start now: directories and symlinks, and files closed before
        `closed_before` (the upload_delay cut-off), oldest work first; `small` (size, cut-off): files of at
        most that size only if closed before that cut-off too."""
        max_small, small_closed_before = small if small is not None else (0, closed_before)
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
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
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE seq < ? AND (seq, id) > (?, ?) AND path IS NOT NULL"
            " AND id != 1 AND ("
            " (state IN ('dirty', 'uploading') AND (kind != 'file' OR closed_at IS NOT NULL))"
            " OR (state IN ('clean', 'remote') AND remote_key IS NOT NULL"
            "     AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END))"
            ") ORDER BY seq, id LIMIT ?",
            (seq, after[0], after[1], limit),
        )

    def work_before_under(self, seq: int, directory: str, limit: int) -> list[Inode]:
        """work_before, of the work below the directory path `directory` only (a preemption: a step's
        marker waits for its own step's files, not for older steps'; drain/preemption.py)."""
        low, high = prefix_range(directory + "/")
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE seq < ? AND path >= ? AND path < ? AND id != 1 AND ("
            " (state IN ('dirty', 'uploading') AND (kind != 'file' OR closed_at IS NOT NULL))"
            " OR (state IN ('clean', 'remote') AND remote_key IS NOT NULL"
            "     AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END))"
            ") ORDER BY seq, id LIMIT ?",
            (seq, low, high, limit),
        )

    def closed_pending_after(self, seq: int, limit: int = 1000) -> list[Inode]:
        """Closed files not yet uploaded that became work after `seq` (gateway mode: a marker's check of
        files the server closed after the marker was written)."""
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
            " AND kind = 'file' AND closed_at IS NOT NULL AND seq > ? ORDER BY seq LIMIT ?",
            (seq, limit),
        )

    def new_content_version(self, inode_id: int) -> None:
        """A file open for writing changed since the content version the store holds (gateway mode): the
        content it has now is a new version, which an upload still staging the old one must not record."""
        self.db.execute(
            "UPDATE inodes SET version = version + 1 WHERE id = ? AND state IN ('dirty', 'uploading')", (inode_id,)
        )
        self.cache.drop(inode_id)

    def pending_uploads(self, limit: int = -1) -> list[Inode]:
        """Linked inodes whose content or marker the store lacks (dirty or mid-upload), oldest work first."""
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
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
        return fetch_inodes(
            self.db,
            # INDEXED BY: left to itself, the planner walks inodes_remote_key, every uploaded inode.
            f"SELECT {INODE_COLUMNS} FROM inodes INDEXED BY inodes_misplaced WHERE remote_key IS NOT NULL AND id != 1"
            " AND remote_key IS NOT (CASE kind WHEN 'dir' THEN path || '/' ELSE path END)"
            " AND state IN ('clean', 'remote') ORDER BY seq LIMIT ?",
            (limit,),
        )

    def dirs_to_upload(self) -> list[Inode]:
        """Linked directories whose marker was never uploaded (or is being uploaded)."""
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE state IN ('dirty', 'uploading') AND kind = 'dir'"
            " AND path IS NOT NULL"
        )

    def meta_stale(self, limit: int) -> list[Inode]:
        """Inodes in their right place in the store whose object metadata is out of date."""
        return fetch_inodes(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes INDEXED BY inodes_meta_stale WHERE meta_dirty = 1"
            # An unlinked inode (path NULL, remote_key cleared by detach) matches the key test below too:
            # it has no object left to update.
            " AND path IS NOT NULL AND state IN ('clean', 'remote')"
            " AND remote_key IS (CASE kind WHEN 'dir' THEN path || '/' ELSE path END) ORDER BY seq LIMIT ?",
            (limit,),
        )

    def oldest_dirty_closed_at(self) -> float | None:
        row = self.db.execute(
            "SELECT MIN(closed_at) FROM inodes WHERE state IN ('dirty', 'uploading') AND path IS NOT NULL"
        ).fetchone()
        return row[0] if row else None

    # -- store keys -----------------------------------------------------------------------------------

    def key_owner(self, key: str) -> Inode | None:
        """The inode whose store copy is at `key`, if any."""
        return fetch_inode(self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE remote_key = ?", (key,))

    def owned_keys(self, keys: Collection[str], *, under: str = "") -> set[str]:
        """The keys among `keys` whose store copy an inode holds (key_owner for many keys: one query per
        _IDS_PER_QUERY keys). `under`: a directory key that every one of `keys` is below; where no inode
        holds a key below it (a directory a fresh node lists for the first time) one probe of the index
        answers for all of them, instead of a probe per key."""
        owned: set[str] = set()
        if under and not self.db.execute(
            "SELECT 1 FROM inodes WHERE remote_key > ? AND remote_key < ? LIMIT 1", prefix_range(under)
        ).fetchone():
            return owned
        for chunk, marks in id_groups(keys):
            rows = self.db.execute(f"SELECT remote_key FROM inodes WHERE remote_key IN ({marks})", chunk)
            owned.update(row[0] for row in rows)
        return owned

    def key_claimant(self, key: str) -> Inode | None:
        """A linked inode that belongs at `key` but is not there yet (it will overwrite it)."""
        path = key[:-1] if key.endswith("/") else key
        kind_test = "kind = 'dir'" if key.endswith("/") else "kind != 'dir'"
        return fetch_inode(
            self.db,
            f"SELECT {INODE_COLUMNS} FROM inodes WHERE path = ? AND {kind_test} AND remote_key IS NOT ?", (path, key)
        )

    def adopt_marker(self, inode_id: int, key: str) -> None:
        """A directory imported without a marker has one in the store after all (seen when listing it)."""
        self.db.execute("UPDATE inodes SET remote_key = ? WHERE id = ? AND remote_key IS NULL", (key, inode_id))
        self.cache.drop(inode_id)

    def release_key(self, key: str, keeper: int) -> None:
        """An object was just written at `key` for inode `keeper`: any other inode whose copy lived there
        has lost it (the drain lets that happen only to inodes with local data, which upload again)."""
        others = fetch_inodes(
            self.db, f"SELECT {INODE_COLUMNS} FROM inodes WHERE remote_key = ? AND id != ?", (key, keeper)
        )
        for other in others:
            self.forget_remote_copy(other.id, now=time.time())

    def forget_remote_copy(self, inode_id: int, *, now: float) -> None:
        """The store lost this inode's object: upload it again from local data."""
        self.db.execute(
            "UPDATE inodes SET remote_key = NULL, uploaded_version = 0, state = 'dirty',"
            " closed_at = COALESCE(closed_at, ?) WHERE id = ?",
            (now, inode_id),
        )
        self.cache.drop(inode_id)

    # -- an upload, a move, a metadata update ---------------------------------------------------------

    def begin_upload(self, inode_id: int) -> None:
        """An upload starts from the current row: it carries the current mode and mtime."""
        self.db.execute(
            "UPDATE inodes SET state = 'uploading', meta_dirty = 0 WHERE id = ? AND state = 'dirty'", (inode_id,)
        )
        self.cache.drop(inode_id)

    def save_upload_state(self, inode_id: int, state: str | None) -> None:
        self.db.execute("UPDATE inodes SET upload_state = ? WHERE id = ?", (state, inode_id))
        self.cache.update(inode_id, upload_state=state)

    def upload_states(self) -> list[tuple[int, str]]:
        return list(self.db.execute("SELECT id, upload_state FROM inodes WHERE upload_state IS NOT NULL"))

    def abort_upload(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET state = 'dirty' WHERE id = ? AND state = 'uploading'", (inode_id,))
        self.cache.drop(inode_id)

    def finish_upload(
        self, inode: Inode, *, key: str, version: int, checksum: str | None, size: int, clean: bool
    ) -> None:
        """The store now holds `version` of `inode` at `key`. A copy under another key is queued for
        deletion. `clean` is False when the content changed meanwhile (it stays dirty)."""
        if inode.remote_key is not None and inode.remote_key != key:
            self.deletes.queue_delete(inode.remote_key)
        self.release_key(key, inode.id)
        self.db.execute(
            "UPDATE inodes SET remote_key = ?, uploaded_version = ?, checksum = ?, size = ?, upload_state = NULL,"
            " state = CASE WHEN ? THEN 'clean' ELSE 'dirty' END WHERE id = ?",
            (key, version, checksum, size, clean, inode.id),
        )
        self.cache.drop(inode.id)

    def finish_move(self, inode: Inode, old_key: str, new_key: str) -> None:
        """The store has a copy at `new_key` now; the one at `old_key` is queued for deletion."""
        self.deletes.queue_delete(old_key)
        self.release_key(new_key, inode.id)
        self.db.execute("UPDATE inodes SET remote_key = ? WHERE id = ?", (new_key, inode.id))
        self.cache.drop(inode.id)

    def mark_meta_dirty(self, inode_id: int) -> None:
        """Mode or mtime changed. An upload that starts later carries them (and clears this); one in
        flight or done leaves it set, and the drain rewrites the object's metadata."""
        self.db.execute("UPDATE inodes SET meta_dirty = 1 WHERE id = ?", (inode_id,))
        self.cache.update(inode_id, meta_dirty=1)

    def clear_meta_dirty(self, inode_id: int) -> None:
        self.db.execute("UPDATE inodes SET meta_dirty = 0 WHERE id = ?", (inode_id,))
        self.cache.update(inode_id, meta_dirty=0)
