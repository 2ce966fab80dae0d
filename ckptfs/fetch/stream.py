"""A Stream: one version of one remote inode, partly present in a partial file of the cache, and the
trio-thread record of which chunks are present, in flight or failed. A Reader: one open handle's position
in a Stream and how far ahead it is worth fetching for it."""

from __future__ import annotations

import os

import trio

from ckptfs.errors import FsError
from ckptfs.journal import Inode


class Stream:
    """One version of one remote inode, partly in the cache. Trio thread only."""

    def __init__(self, inode: Inode, path: str, fd: int, chunk_size: int) -> None:
        assert inode.remote_key is not None
        self.inode_id = inode.id
        self.key = inode.remote_key
        self.size = inode.size
        self.expected_checksum = inode.checksum
        # What the journal said when the Stream began: if it says otherwise later, the namespace has
        # moved on (rewritten, truncated, replaced): the Stream serves its readers and is never adopted.
        self.identity = identity_of(inode)
        self.path = path
        self.fd = fd
        self.chunk_size = chunk_size
        self.count = max(1, -(-self.size // chunk_size))
        self.etag: str | None = None
        self.meta_checksum: str | None = None
        self.pinned = False  # the first answer fixed the version (etag) of every later range
        self.pinning = False  # that first answer is being fetched now
        self.pin_attempt = trio.Event()  # set when an attempt to pin ends (either way)
        self.present: set[int] = set()
        self.crcs: dict[int, int] = {}  # chunk index -> CRC32 of its bytes (kept when punched: same version)
        self.inflight: dict[int, trio.Event] = {}
        self.errors: dict[int, FsError] = {}  # the last attempt's failure per chunk
        self.failure: FsError | None = None  # sticky: the whole Stream is unusable
        self.readers: set[Reader] = set()
        self.whole_waiters = 0  # fetch() callers: every chunk is wanted, none may be punched
        self.charged = 0  # bytes reserved in the cache for present and in-flight chunks
        self.complete = False  # adopted: the data file is a clean cached copy
        self.detached = False  # no longer the Stream new opens use
        self.dropped = False  # the partial file is gone
        self.changed = trio.Event()  # set (and replaced) whenever a chunk arrives or fails

    def chunk_range(self, index: int) -> tuple[int, int]:
        offset = index * self.chunk_size
        return offset, max(0, min(self.chunk_size, self.size - offset))

    def chunks(self, offset: int, size: int) -> range:
        if self.size == 0:
            return range(1)
        end = min(offset + size, self.size)
        if end <= offset:
            return range(0)
        return range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def idle(self) -> bool:
        return not self.readers and not self.whole_waiters and not self.inflight


class Reader:
    """One open handle's view of a Stream: where it reads, and how far ahead it is worth fetching."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.next_offset = 0
        self.window = 0  # read-ahead chunks; 0 until the reader proves sequential
        self.position = 0  # chunk index of its last read

    @property
    def path(self) -> str:
        """Where the handle opens its descriptor: the partial file, renamed into data/ once adopted
        (an open descriptor follows the rename)."""
        return self.stream.path

    @property
    def complete(self) -> bool:
        return self.stream.complete


def identity_of(inode: Inode) -> tuple[object, ...]:
    return (inode.state, inode.remote_key, inode.size, inode.checksum, inode.uploaded_version)


def close_stream(stream: Stream) -> None:
    if stream.fd >= 0:
        os.close(stream.fd)
        stream.fd = -1
