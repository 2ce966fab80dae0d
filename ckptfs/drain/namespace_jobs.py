"""Namespace jobs: the store follows renames, metadata changes and removals of entries already uploaded.

Owns: moving an object whose inode was renamed after upload (a copy to the new key, via a parking key when
a cycle of moves must be broken), rewriting an object's metadata after chmod/utime, deleting the objects
the journal queued for deletion (and when such a delete must wait or is no longer wanted), and what
happens when the store lost an object the journal thought it held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptfs.drain.object_records import ObjectRecords, object_meta
from ckptfs.drain.ordering import breaks_move_cycle, changed_since_scan, parking_key, target_taken
from ckptfs.drain.retries import Retries
from ckptfs.drain.stats import DrainStats
from ckptfs.errors import NotFoundBackendError
from ckptfs.journal import DIR, FILE, Inode, Journal, PendingDelete
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

# A delete that must wait (another object is about to replace the key's, or objects below a directory
# marker remain) is tried again after this long.
DELETE_DEFER = 1.0


class NamespaceJobs:
    def __init__(
        self,
        journal: Journal,
        engine: Transfers,
        records: ObjectRecords,
        retries: Retries,
        stats: DrainStats,
        *,
        clock: Callable[[], float],
        marker_blocked: Callable[[Inode], bool],
    ) -> None:
        self.journal = journal
        self.engine = engine
        self.store = engine.store
        self.records = records
        self.retries = retries
        self.stats = stats
        self.clock = clock
        self.marker_blocked = marker_blocked
        # A name removed here without a FUSE request (its object vanished): the kernel must drop it
        # (fuse_ops.forget_kernel_entry, queued: safe in the trio thread).
        self.forget_kernel_entry: Callable[[int, str], None] = lambda parent_id, name: None

    async def move(self, inode_id: int, scanned_keys: tuple[str, str]) -> None:
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.remote_key is None or inode.key is None or inode.remote_key == inode.key:
            return
        if changed_since_scan(inode, scanned_keys, (inode.remote_key, inode.key), self.marker_blocked):
            return
        old, new = inode.remote_key, inode.key
        if target_taken(inode, self.journal.work.key_owner(new)):
            if not breaks_move_cycle(inode, new, self.journal.work.key_owner):
                return  # the owner of `new` moved on meanwhile or not: the next scan decides again
            new = parking_key(new, inode.id)
        write_ahead = self.records.write_ahead(new)
        try:
            if inode.kind == DIR:
                await self.engine.call(self.store.put_dir, new, object_meta(inode))
            else:
                await self.engine.copies.copy(old, new)
        except NotFoundBackendError:
            self._lost_remote_copy(inode_id, old)
            return
        current = self.journal.names.get(inode_id)
        if current is not None and current.path is not None and current.remote_key == old:
            with self.journal.transaction():
                self.journal.work.finish_move(current, old, new)
                self.journal.deletes.delete_done(write_ahead)  # the inode owns the key now
        # Otherwise (removed, or re-uploaded meanwhile) the write-ahead delete of `new` cleans up.
        self.stats.moves += 1
        log.debug("moved %s -> %s", old, new)

    async def update_meta(self, inode_id: int) -> None:
        """chmod/utime of an uploaded file: rewrite the object's metadata, not its bytes."""
        inode = self.journal.names.get(inode_id)
        if inode is None or not inode.meta_dirty or inode.key is None or inode.remote_key != inode.key:
            return
        meta = object_meta(inode)
        try:
            await self.engine.copies.set_meta(inode.key, meta)
        except NotFoundBackendError:
            self._lost_remote_copy(inode_id, inode.key)
            return
        # Re-check after the await: clear the flag only if nothing changed the metadata meanwhile.
        current = self.journal.names.get(inode_id)
        if current is not None and object_meta(current) == meta and current.remote_key == inode.key:
            with self.journal.transaction():
                self.journal.work.clear_meta_dirty(inode_id)

    def _lost_remote_copy(self, inode_id: int, key: str) -> None:
        current = self.journal.names.get(inode_id)
        if current is None:
            return
        if current.has_local_data or current.kind != FILE:
            log.warning("object %s vanished from the store; uploading %s again", key, current.path)
            with self.journal.transaction():
                self.journal.work.forget_remote_copy(inode_id, now=self.clock())
            return
        log.error("object %s vanished from the store and %s has no local copy; removing it", key, current.path)
        with self.journal.transaction():
            self.journal.names.detach(current._replace(remote_key=None))
        if current.parent is not None and current.name is not None:
            self.forget_kernel_entry(current.parent, current.name)

    async def delete(self, delete_id: int) -> None:
        pending = self.journal.deletes.get_pending_delete(delete_id)
        if pending is None:
            return
        verdict = self._delete_verdict(pending)
        if verdict == "drop":
            with self.journal.transaction():
                self.journal.deletes.delete_done(delete_id)
            return
        if verdict == "defer":
            self.retries.defer(("delete", delete_id), DELETE_DEFER)
            return
        await self.engine.call(self.store.delete, pending.key)
        with self.journal.transaction():
            self.journal.deletes.delete_done(delete_id)
        self.stats.deletes += 1
        log.debug("deleted %s", pending.key)

    def _delete_verdict(self, pending: PendingDelete) -> str:
        """'drop' if an inode owns the key again, 'defer' if one is about to overwrite it (the old object
        stays until the new one replaces it) or, for a directory marker, while objects below it remain."""
        if self.journal.work.key_owner(pending.key) is not None:
            return "drop"
        if self.journal.work.key_claimant(pending.key) is not None:
            return "defer"
        if pending.key.endswith("/") and self.journal.deletes.keys_under(pending.key):
            return "defer"
        return "run"
