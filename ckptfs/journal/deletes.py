"""Pending deletes: store keys queued for deletion (by unlink, rename, overwrite), in order, until the
drain has deleted them."""

from __future__ import annotations

import time
from collections.abc import Collection

from ckptfs.journal.core import JournalTable, id_groups, prefix_range
from ckptfs.journal.rows import PendingDelete


class PendingDeletes(JournalTable):
    """Store keys waiting to be deleted (journal.deletes); the names and the drain's work queue them."""

    def queue_delete(self, key: str | None) -> int | None:
        """Queue the deletion of `key` from the store; its id, or None for no key."""
        if key is None or key == "":
            return None
        cur = self.db.execute("INSERT INTO pending_deletes (key, created_at) VALUES (?, ?)", (key, time.time()))
        return cur.lastrowid

    def get_pending_delete(self, delete_id: int) -> PendingDelete | None:
        row = self.db.execute("SELECT id, key, created_at FROM pending_deletes WHERE id = ?", (delete_id,)).fetchone()
        return PendingDelete(*row) if row else None

    def pending_deletes(self, limit: int = -1) -> list[PendingDelete]:
        rows = self.db.execute("SELECT id, key, created_at FROM pending_deletes ORDER BY id LIMIT ?", (limit,))
        return [PendingDelete(*row) for row in rows]

    def deletes_pending(self, delete_ids: Collection[int]) -> set[int]:
        """Those of `delete_ids` still waiting in pending_deletes."""
        pending: set[int] = set()
        for chunk, marks in id_groups(delete_ids):
            rows = self.db.execute(f"SELECT id FROM pending_deletes WHERE id IN ({marks})", chunk)
            pending.update(row[0] for row in rows)
        return pending

    def pending_delete_keys_under(self, prefix: str) -> set[str]:
        """Keys below the directory key `prefix` ('' for all) that wait to be deleted from the store."""
        if not prefix:
            return {row[0] for row in self.db.execute("SELECT key FROM pending_deletes")}
        rows = self.db.execute("SELECT key FROM pending_deletes WHERE key >= ? AND key < ?", prefix_range(prefix))
        return {row[0] for row in rows}

    def keys_under(self, prefix: str) -> bool:
        """True if some inode's store copy or a pending delete still has a key below `prefix` (a dir key)."""
        lo, hi = prefix_range(prefix)
        if self.db.execute(
            "SELECT 1 FROM inodes WHERE remote_key IS NOT NULL AND remote_key > ? AND remote_key < ? LIMIT 1",
            (lo, hi),
        ).fetchone():
            return True
        return (
            self.db.execute("SELECT 1 FROM pending_deletes WHERE key > ? AND key < ? LIMIT 1", (lo, hi)).fetchone()
            is not None
        )

    def delete_done(self, delete_id: int) -> None:
        self.db.execute("DELETE FROM pending_deletes WHERE id = ?", (delete_id,))
