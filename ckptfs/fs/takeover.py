"""Open handles across a takeover of the mount (keep-mount): each handle is recorded in the handle table
(fs/handle_table.py) when the reply naming it goes to the kernel (handed_out); a daemon that takes the connection
over restores them (restore_handles), and answers an open or create the kernel sends again, because the
daemon before died before its reply went out, with the handle made for it (unanswered)."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from ckptfs.cache.directory import CacheDir, CacheFile
from ckptfs.fs.changes import Changes
from ckptfs.fs.handle_table import OpenHandle
from ckptfs.fs.interface import PartialReader, ReadStreams
from ckptfs.fs.kernel_cache import KernelCache
from ckptfs.fs.open_files import OpenFile, OpenFiles
from ckptfs.fs.references import References
from ckptfs.journal import CLEAN, FILE, REMOTE, Journal

log = logging.getLogger(__name__)

# FUSE_UNIQUE_RESEND: the high bit of a request id marks a request the kernel sent again after a takeover
RESENT = 1 << 63


class Takeover:
    def __init__(self, journal: Journal, cache: CacheDir, streams: ReadStreams[Any] | None, open_files: OpenFiles,
                 kernel_cache: KernelCache, changes: Changes, references: References) -> None:
        self.journal = journal
        self.cache = cache
        self.streams = streams
        self._open_files = open_files
        self._kernel_cache = kernel_cache
        self._changes = changes
        self._references = references
        # Restored handles by the id of the open or create request they answered (see unanswered)
        self._unanswered: dict[int, int] = {}

    def handed_out(self, fh: int, request: int = 0) -> None:
        """The reply of the kernel's open or create `request` (its id) naming `fh` goes to the kernel now:
        record the handle for a daemon that takes the mount over. Not earlier: a daemon that dies before its
        reply leaves no record of a handle the kernel never got (the kernel sends that open again, and it
        gets a handle of its own). A daemon killed between the record and the reply is what `unanswered` is
        for."""
        table = self._open_files.handle_table
        if table is not None:
            handle = self._open_files.handles[fh]
            table.put(fh, handle.inode_id, os.O_RDWR if handle.writable else os.O_RDONLY,
                      handle.backing, dirtied=handle.dirtied, direct=handle.direct,
                      stream=handle.reader is not None, request=request & ~RESENT)

    def unanswered(self, request: int) -> int | None:
        """The handle a daemon before this one made for the kernel's open or create `request` and died before
        its reply went out: the kernel sent the request again (it never got the handle), and it gets that
        handle now instead of a second one that would keep the file open for ever."""
        fh = self._unanswered.pop(request & ~RESENT, None)
        return fh if fh is not None and fh in self._open_files.handles else None

    def released(self, fh: int) -> None:
        if self._unanswered:  # (after a takeover) the number goes back to the pool: no longer that handle
            self._unanswered = {request: kept for request, kept in self._unanswered.items() if kept != fh}

    def restore_handles(self, records: list[OpenHandle]) -> int:
        """Take over the handles a daemon before this one handed to the kernel (the handle table of a
        connection this daemon took over): each gets its descriptor on the cache file (or a new reader of
        a remote file) and counts as open, for writing as it was. A record whose file is gone is dropped
        (the kernel's later requests on it get EBADF). Returns how many were restored."""
        self._references.inherit()
        restored = 0
        for record in records:
            if self._restore_handle(record):
                restored += 1
                if record.request:
                    self._unanswered[record.request] = record.fh
            elif self._open_files.handle_table is not None:
                self._open_files.handle_table.drop(record.fh)
        self._open_files.renumber()
        return restored

    def _restore_handle(self, record: OpenHandle) -> bool:
        inode_id = record.inode_id
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.kind != FILE:
            log.warning("an open handle of inode %d could not be taken over: the file is gone", inode_id)
            return False
        reader: PartialReader | None = None
        try:
            if inode.state == REMOTE:
                if record.writable or self.streams is None:
                    raise FileNotFoundError(errno.ENOENT, "no local copy")
                reader = self.streams.open_reader(inode)
                fd = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
            else:
                fd = os.open(self.cache.data_path(inode_id),
                             (os.O_RDWR if record.writable else os.O_RDONLY) | os.O_CLOEXEC)
        except OSError as exc:
            if reader is not None and self.streams is not None:
                self.streams.close_reader(reader)
            log.warning("an open handle of %s could not be taken over: %s", inode.path, exc.strerror)
            return False
        local = self.cache.file(inode_id) if reader is None else CacheFile(inode_id, 0)
        backing = record.backing if reader is None else 0
        self._open_files.handles[record.fh] = OpenFile(inode_id, fd, local, record.writable, record.dirtied,
                                                       record.direct, reader, backing)
        self._open_files.count_open(inode_id)
        self._kernel_cache.restored(inode_id, backing, record.writable, record.direct)
        if record.writable:
            self._open_files.count_writer(inode_id)
            if record.dirtied or inode.state != CLEAN:
                # (dirty in the journal: the daemon before may have died between the two records)
                self._changes.mark_changed(inode_id)
        return True

    def restored_writers(self) -> list[tuple[int, str]]:
        """(inode, path) of the files open for writing, for the cross-node records of a takeover."""
        writers = []
        for inode_id in self._open_files.writer_count:
            inode = self.journal.names.get(inode_id)
            if inode is not None and inode.path is not None:
                writers.append((inode_id, inode.path))
        return writers
