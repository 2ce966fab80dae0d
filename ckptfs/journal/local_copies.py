"""Local copies: a fetched file becomes local, an evicted one remote, one whose cache file vanished or
whose object another node replaced is served from the store again; one whose cache file a writer the kernel
kept changed behind the daemon is dirty again; what may be evicted, and the counts status reports."""

from __future__ import annotations

import json
import os

from ckptfs.journal.core import JournalTable
from ckptfs.journal.rows import Inode

# meta key: the files a writer may still change behind the daemon (see stale_writers).
STALE_WRITERS = "stale_writers"


def rewritten(inode: Inode, st: os.stat_result) -> bool:
    """The cache file of a file with local data no longer has the size and mtime the journal recorded for
    it: something wrote it without the daemon (the daemon records both at every change it makes)."""
    return st.st_size != inode.size or st.st_mtime_ns != inode.mtime_ns


class LocalCopies(JournalTable):
    """Whether a file's bytes are in the cache dir (clean) or only in the store (remote): journal.copies."""

    def finish_fetch(self, inode_id: int, *, size: int, mtime_ns: int) -> None:
        self.db.execute(
            "UPDATE inodes SET state = 'clean', size = ?, mtime_ns = ? WHERE id = ? AND state = 'remote'",
            (size, mtime_ns, inode_id),
        )
        self.cache.drop(inode_id)

    def serve_from_store(self, inode_id: int) -> None:
        """The local copy is gone (its cache file vanished): the version the store holds serves it now."""
        self.db.execute("UPDATE inodes SET state = 'remote' WHERE id = ?", (inode_id,))
        self.cache.drop(inode_id)

    def replaced_in_store(self, inode_id: int, *, size: int, mtime_ns: int, checksum: str | None) -> None:
        """Another node replaced the object of this inode: the store's new version (of this size, mtime and
        checksum) serves it from now; the caller drops the local copy."""
        self.db.execute(
            "UPDATE inodes SET state = 'remote', size = ?, mtime_ns = ?, checksum = ? WHERE id = ?",
            (size, mtime_ns, checksum, inode_id),
        )
        self.cache.drop(inode_id)

    def rewritten_behind(self, inode_id: int, *, size: int, mtime_ns: int, now: float) -> None:
        """The cache file changed without the daemon (a handle the kernel kept open for writing after an
        earlier daemon died without a takeover): a new content version, closed now with the cache file's
        size and mtime, queued for upload. Setuid and setgid go, as mark_dirty drops them for a write."""
        self.db.execute(
            "UPDATE inodes SET version = version + 1, state = 'dirty', size = ?, mtime_ns = ?, closed_at = ?,"
            " seq = ?, mode = mode & ~3072 WHERE id = ? AND kind = 'file'",
            (size, mtime_ns, now, self.core.next_seq(), inode_id),
        )
        self.cache.drop(inode_id)

    def stale_writers(self) -> dict[int, float]:
        """Files that were open for writing when a daemon died without a takeover, which the kernel may
        still write through the handles it kept: inode id -> since when (time.time()) the cache file has
        been seen unchanged. Kept by drain/recovery.py and the evictor, which watch them."""
        text = self.core.get_meta(STALE_WRITERS)
        if not text:
            return {}
        try:
            return {int(k): float(v) for k, v in json.loads(text).items()}
        except (ValueError, AttributeError):
            return {}

    def set_stale_writers(self, watched: dict[int, float]) -> None:
        self.core.set_meta(STALE_WRITERS, json.dumps({str(k): v for k, v in sorted(watched.items())}))

    # -- eviction (called by cache/evictor.py) ----------------------------------------------------------------

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

    def open_pending_files(self) -> list[int]:
        """Ids of linked files open for writing not yet in the store as the journal says (dirty, or being
        uploaded while open in gateway mode)."""
        return [row[0] for row in self.db.execute(
            "SELECT id FROM inodes WHERE state IN ('dirty', 'uploading') AND kind = 'file'"
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
        self.cache.drop(inode_id)
        return cur.rowcount == 1

    # -- status ---------------------------------------------------------------------------------------

    def state_summary(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for state, files, size in self.db.execute(
            "SELECT state, COUNT(*), COALESCE(SUM(size), 0) FROM inodes"
            " WHERE kind = 'file' AND path IS NOT NULL GROUP BY state"
        ):
            out[state] = {"files": files, "bytes": size}
        return out
