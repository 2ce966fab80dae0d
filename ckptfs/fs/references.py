"""How long an inode lives: the references the kernel holds (lookup counts, given back by FORGET) and the
open handles; an unlinked inode is purged (its journal row, cache file, staged upload) once neither refers
to it. After a takeover the kernel holds references this daemon never counted: such an inode is purged
only once the kernel forgot it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor
from ckptfs.fs.changes import Changes
from ckptfs.fs.interface import ReadStreams
from ckptfs.fs.open_files import OpenFiles
from ckptfs.journal import FILE, ROOT_ID, Journal

log = logging.getLogger(__name__)


class References:
    def __init__(self, journal: Journal, cache: CacheDir, open_files: OpenFiles, changes: Changes,
                 evictor: Evictor, streams: ReadStreams[Any] | None,
                 discard_upload: Callable[[str], None]) -> None:
        self.journal = journal
        self.cache = cache
        self._open_count = open_files.open_count
        self._changes = changes
        self.evictor = evictor
        self.streams = streams
        # Takes the journaled upload_state of a purged file: its staged upload or spill is to be aborted.
        self._discard_upload = discard_upload
        self._lookup_count: dict[int, int] = {}
        # After a takeover the kernel holds references this daemon never counted: an unlinked inode is
        # purged only once the kernel forgot it (it sends FORGET when it evicts an inode, with its full
        # count), `_counted` holds those.
        self._refs_inherited = False
        self._counted: set[int] = set()

    def inherit(self) -> None:
        """This daemon took the mount over: the kernel holds references it never counted."""
        self._refs_inherited = True

    def remember(self, inode_id: int) -> None:
        """The kernel now holds a reference to this inode (a lookup, create, mkdir, ... or readdirplus
        reported it)."""
        self._lookup_count[inode_id] = self._lookup_count.get(inode_id, 0) + 1

    def remember_many(self, inode_ids: Iterable[int]) -> None:
        """The kernel now holds a reference to each of these inodes (the entries of one readdirplus reply)."""
        counts = self._lookup_count
        known = counts.get
        for inode_id in inode_ids:
            counts[inode_id] = known(inode_id, 0) + 1

    def forget(self, inode_id: int, count: int) -> None:
        self.forget_many([(inode_id, count)])

    def forget_many(self, forgotten: Iterable[tuple[int, int]]) -> None:
        """The kernel gave back references (one FORGET or BATCH_FORGET). An inode it no longer refers to is
        purged if it is unlinked; whether any is, is one journal query for the whole batch: the kernel
        forgets the entries of a big walk by the thousand, nearly all of them linked."""
        unreferenced = []
        for inode_id, count in forgotten:
            left = self._lookup_count.get(inode_id, 0) - count
            if left > 0:
                self._lookup_count[inode_id] = left
            else:
                self._lookup_count.pop(inode_id, None)
                if self._refs_inherited:
                    self._counted.add(inode_id)
                unreferenced.append(inode_id)
        if unreferenced:
            for inode_id in self.journal.names.unlinked_among(unreferenced):
                try:
                    self.maybe_purge(inode_id)
                except Exception:  # one inode's failure must not keep the others of the batch
                    log.exception("purging inode %d failed", inode_id)

    def maybe_purge(self, inode_id: int) -> None:
        """Drop an unlinked inode once neither the kernel nor an open handle refers to it."""
        if self._lookup_count.get(inode_id, 0) or self._open_count.get(inode_id, 0):
            return
        if self._refs_inherited and inode_id not in self._counted:
            return
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.parent is not None or inode_id == ROOT_ID:
            return
        with self.journal.transaction():
            self.journal.names.purge(inode_id)
        self._counted.discard(inode_id)
        if inode.upload_state is not None:
            self._discard_upload(inode.upload_state)
        self._changes.forget(inode_id)
        if inode.kind == FILE:
            self.cache.remove_data(inode_id)
            self.evictor.forget(inode_id)
            if self.streams is not None:
                self.streams.discard(inode_id)
