"""When a file's content changes, as the journal learns it: a change is recorded before its first byte
(the file becomes dirty, a new version), and when the last writer closes the file its size is recorded
and, if it changed, it is queued for the drain. A close a full cache filesystem kept out of the journal
is retried by run() until it can be recorded."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import trio

from ckptfs.cache.directory import CacheDir
from ckptfs.fs.open_files import OpenFiles
from ckptfs.journal import Journal, JournalFull

log = logging.getLogger(__name__)

CLOSE_RETRY_INTERVAL = 1.0  # seconds between attempts to record closes a full journal refused


class Changes:
    def __init__(self, journal: Journal, cache: CacheDir, notify_drain: Callable[[], None],
                 open_files: OpenFiles) -> None:
        self.journal = journal
        self.cache = cache
        self._notify_drain = notify_drain
        self._writer_count = open_files.writer_count
        # Inodes written since their last close by any handle: their close queues an upload.
        self._changed: set[int] = set()
        # Closes the journal could not record (the cache filesystem was full), with whether the content
        # changed; retried by run() until it can. Meanwhile the drain takes such a file for one still open.
        self._unrecorded_closes: dict[int, bool] = {}
        self._close_retry = trio.Event()

    def mark_changed(self, inode_id: int) -> None:
        """The content is changing (already recorded in the journal): the file's close queues an upload."""
        self._changed.add(inode_id)

    def forget(self, inode_id: int) -> None:
        """The inode was purged."""
        self._changed.discard(inode_id)

    def begin_change(self, inode_id: int, *, emptied_remote: bool = False) -> None:
        """Record, before the first byte changes, that the content is changing (a new version).
        `emptied_remote`: the file was only in the store and now has an empty cache file; that is recorded
        in the same transaction, since an empty file journaled as a clean copy of the object on its own
        would outlive a kill before the change was recorded (found by the crash harness: the mount then
        showed the file empty and the store kept the old bytes)."""
        if inode_id not in self._changed:
            with self.journal.transaction():
                if emptied_remote:
                    self.journal.copies.finish_fetch(inode_id, size=0, mtime_ns=time.time_ns())
                self.journal.names.mark_dirty(inode_id)
            self._changed.add(inode_id)
            local = self.cache.files.get(inode_id)
            if local is not None:
                local.changes += 1
            # A file being written may grow large enough to be uploaded while it is written: the drain
            # watches files open for writing from now on (writes themselves never notify it).
            self._notify_drain()

    def end_change_if_unopened(self, inode_id: int) -> None:
        if not self._writer_count.get(inode_id):
            self.closed(inode_id)

    def closed(self, inode_id: int) -> None:
        """No writer has the file open any more: record its size, and queue it if it changed."""
        changed = inode_id in self._changed
        self._changed.discard(inode_id)
        try:
            self._record_close(inode_id, changed)
        except JournalFull:
            # The kernel never repeats a release: unrecorded, the file would look open for writing for
            # as long as the daemon runs, never uploaded, and a flush would wait for it for ever.
            self._unrecorded_closes[inode_id] = self._unrecorded_closes.get(inode_id, False) or changed
            self._close_retry.set()
            raise

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Record the closes a full cache filesystem kept out of the journal, once it has room again."""
        task_status.started()
        while True:
            await self._close_retry.wait()
            await trio.sleep(CLOSE_RETRY_INTERVAL)
            try:
                self._record_unrecorded_closes()
            except Exception:
                log.exception("cannot record the close of files; retrying")

    def _record_unrecorded_closes(self) -> None:
        recorded = 0
        for inode_id, changed in list(self._unrecorded_closes.items()):
            if self._writer_count.get(inode_id):
                if changed:  # opened for writing again: its next close records the change
                    self._changed.add(inode_id)
            else:
                try:
                    self._record_close(inode_id, changed)
                except JournalFull:
                    return  # still full
                recorded += 1
            del self._unrecorded_closes[inode_id]
        self._close_retry = trio.Event()
        if recorded:
            log.info("the journal has room again: recorded the close of %d file(s)", recorded)

    def _record_close(self, inode_id: int, changed: bool) -> None:
        # Only a file with local data has a cache file; mark_closed checks the rest without a read first.
        try:
            st = os.stat(self.cache.data_path(inode_id))
        except FileNotFoundError:
            return
        self.cache.observe(inode_id, st)
        # One statement, which commits on its own: no transaction around it.
        recorded = self.journal.names.mark_closed(
            inode_id, size=st.st_size, mtime_ns=st.st_mtime_ns, changed=changed, now=time.time()
        )
        if changed and recorded:
            self._notify_drain()
