"""The types at the edge of the filesystem layer: the values its operations take and return (Attr,
SetAttrs, DirEntry, StatFs, Moved, RoomNeeded), and the protocols of what it is given from outside (the
fetcher's streaming reads, the store lister, the kernel's registry of backing files, the cross-node
announcer)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from ckptfs.journal import Inode


class Attr(NamedTuple):
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


class DirEntry(NamedTuple):
    name: bytes
    attr: Attr
    next_id: int


class StatFs(NamedTuple):
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int


class RoomNeeded(Exception):
    """The cache is over its budget: await Filesystem.wait_for_room(), then repeat the write."""


@dataclass
class SetAttrs:
    """The fields of a setattr request that are to change (None = leave alone)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class Moved(NamedTuple):
    inode_id: int
    path: str
    directory: bool


FetchFn = Callable[[Inode], Awaitable[None]]


class PartialReader(Protocol):
    """One handle's reader of a remote file's partial file (fetch.Reader)."""

    @property
    def path(self) -> str: ...

    @property
    def complete(self) -> bool: ...


R = TypeVar("R", bound=PartialReader)


class ReadStreams(Protocol[R]):
    """Streaming reads of remote files (fetch.Fetcher): partial files filled as reads need them."""

    def open_reader(self, inode: Inode) -> R: ...

    def close_reader(self, reader: R) -> None: ...

    async def wait_readable(self, reader: R, offset: int, size: int) -> None: ...

    def discard(self, inode_id: int) -> None: ...


class BackingFiles(Protocol):
    """The kernel's registry of backing files for FUSE passthrough (mount/adapter.py implements it)."""

    def open(self, fd: int) -> int:
        """Register the open file `fd` with the kernel; its backing id for an open or create reply."""

    def close(self, backing_id: int) -> None: ...


class OtherNodesWork(Protocol):
    """Other nodes' pending work (cross-node records, nodes/peers.py), as a directory's rename sees it."""

    async def wait_for_entry(self, entry: str) -> None:
        """Return once no other node has work pending in the top-level entry `entry`; the caller bounds it."""
        ...

    def pending_in(self, entry: str) -> list[str]:
        """The other nodes still pending in `entry` as of the last listing, one line each."""
        ...


class Lister(Protocol):
    """Reads the store's namespace into the journal, a directory at a time (lister.DirLister)."""

    async def ensure(self, inode_id: int, *, required: bool = False, fresh: bool = False) -> None: ...

    def mark_listed(self, inode_id: int) -> None: ...

    def listed_before(self, inode_id: int) -> bool:
        """The directory was listed from the store, or made here, at some time: the journal holds its
        entries as of then (a directory never listed holds only what this node put in it)."""
        ...

    def fresh_for(self, inode_id: int) -> float:
        """Seconds the directory's listing stays fresh (0: it is listed again at the next access)."""
        ...


class Announcer(Protocol):
    """Makes this node's pending work known to the other nodes before the request returns (nodes.py)."""

    async def cover(self, inode_id: int, path: str, *, directory: bool = False, writer: bool = False) -> None: ...

    def released(self, inode_id: int) -> None: ...
