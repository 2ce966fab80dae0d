"""Every partial file in the cache: the Stream new opens of a remote inode use, the detached ones still
read or written, and giving their room back: dropping idle ones and punching out chunks no reader is near.
`PartialFiles` is the evictor's hook (evict.PartialFiles)."""

from __future__ import annotations

import errno
import itertools
import logging
import os
from typing import Protocol

from ckptfs.cache.directory import CacheDir, punch_hole_fd
from ckptfs.errors import FsError
from ckptfs.fetch.stream import Stream, close_stream, identity_of
from ckptfs.journal import Inode

log = logging.getLogger(__name__)

# Chunks this far behind a reader's position are not punched: a reader that re-reads a little is common.
KEEP_BEHIND_CHUNKS = 1


class PunchCounter(Protocol):
    chunks_punched: int


class PartialFiles:
    def __init__(self, cache: CacheDir, stats: PunchCounter) -> None:
        self.cache = cache
        self.stats = stats
        self.streams: dict[int, Stream] = {}  # remote inode id -> the Stream new opens use
        self.all: set[Stream] = set()  # every Stream with a partial file, detached ones too
        self._serial = itertools.count(1)

    def stream_for(self, inode: Inode, chunk_size: int) -> Stream:
        """The Stream new opens of `inode` use: the current one unless it failed or the journal says the
        inode changed since it began, else a new one on a new sparse partial file."""
        stream = self.streams.get(inode.id)
        if stream is not None and (stream.failure is not None or stream.identity != identity_of(inode)):
            self.detach(stream)
            stream = None
        if stream is None:
            path = self.cache.partial_path(inode.id, next(self._serial))
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise FsError(exc.errno or errno.EIO, f"cannot create a partial file: {exc.strerror}") from None
            try:
                os.ftruncate(fd, inode.size)  # sparse: reads of what has not arrived must wait, not see zeros
            except OSError as exc:
                os.close(fd)
                os.unlink(path)
                raise FsError(exc.errno or errno.EIO, f"cannot size a partial file: {exc.strerror}") from None
            stream = Stream(inode, path, fd, chunk_size)
            self.streams[inode.id] = stream
            self.all.add(stream)
            log.debug("streaming %s (%d bytes, %d chunks)", stream.key, stream.size, stream.count)
        return stream

    def detach(self, stream: Stream) -> None:
        """New opens must not use this Stream; its partial file goes once its readers are done."""
        if self.streams.get(stream.inode_id) is stream:
            del self.streams[stream.inode_id]
        stream.detached = True
        if stream.idle():
            self.drop_stream(stream)

    def adopted(self, stream: Stream) -> None:
        """The Stream's file became the inode's clean data file: it is no partial file any more."""
        self.cache.unreserve(stream.charged)
        stream.charged = 0
        self.all.discard(stream)
        if self.streams.get(stream.inode_id) is stream:
            del self.streams[stream.inode_id]
        stream.detached = True

    def drop_stream(self, stream: Stream) -> int:
        """Remove a partial file and its charge; its descriptor closes once no chunk writes into it."""
        if self.streams.get(stream.inode_id) is stream:
            del self.streams[stream.inode_id]
        stream.detached = True
        if stream.dropped:
            return 0
        stream.dropped = True
        if not stream.complete:
            try:
                os.unlink(stream.path)
            except FileNotFoundError:
                pass
        stream.present.clear()
        freed = stream.charged
        self.cache.unreserve(stream.charged)
        stream.charged = 0
        self.all.discard(stream)
        if not stream.inflight:
            close_stream(stream)
        stream.notify()
        return freed

    def bytes_charged(self) -> int:
        return sum(stream.charged for stream in self.all)

    # -- the evictor's hooks (evict.PartialFiles) -----------------------------------------------------

    def droppable(self) -> list[int]:
        """Inodes whose partial file no handle has open and no fetch writes into."""
        return [inode_id for inode_id, stream in self.streams.items() if stream.idle()]

    def drop(self, inode_id: int) -> int:
        stream = self.streams.get(inode_id)
        if stream is None or not stream.idle():
            return 0
        return self.drop_stream(stream)

    def punch(self, wanted: int, *, keep_read_ahead: bool = False) -> int:
        """Free present chunks of open partial files that no reader is near, until `wanted` bytes are
        freed; return the bytes freed. The chunks are fetched again if read later. First chunks outside
        every reader's read-ahead window; then, unless `keep_read_ahead`, read-ahead chunks too (a
        reader blocked on its own chunk comes before read-ahead), never a reader's current chunk."""
        freed = self._punch(wanted, windows=True)
        if freed < wanted and not keep_read_ahead:
            freed += self._punch(wanted - freed, windows=False)
        return freed

    def _punch(self, wanted: int, *, windows: bool) -> int:
        freed = 0
        for stream in list(self.all):
            if freed >= wanted:
                break
            if stream.whole_waiters or stream.complete or stream.dropped:
                continue
            keep: set[int] = set()
            for reader in stream.readers:
                ahead = reader.window if windows else 1
                keep.update(range(reader.position - KEEP_BEHIND_CHUNKS, reader.position + 1 + ahead))
            # Farthest behind the readers first: a sequential reader will not come back to them.
            for index in sorted(stream.present - keep):
                if freed >= wanted:
                    break
                offset, length = stream.chunk_range(index)
                try:
                    punch_hole_fd(stream.fd, offset, length)
                except OSError as exc:
                    log.warning("cannot free a chunk of %s: %s", stream.key, exc.strerror)
                    return freed
                stream.present.discard(index)
                stream.charged -= length
                self.cache.unreserve(length)
                self.stats.chunks_punched += 1
                freed += length
        return freed
