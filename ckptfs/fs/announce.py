"""Cross-node ordering, this node's side: an open for writing, a new directory or symlink and a rename are
made known to the other nodes (the announcer, nodes.py) before the request returns."""

from __future__ import annotations

from ckptfs.fs.interface import Announcer
from ckptfs.fs.open_files import OpenFile
from ckptfs.journal import DIR, Journal


class Announcements:
    def __init__(self, journal: Journal, handles: dict[int, OpenFile]) -> None:
        self.journal = journal
        self._handles = handles
        # None: cross-node ordering is off.
        self.announcer: Announcer | None = None
        # handle -> path of a writer to announce (announce_writer)
        self._to_announce: dict[int, str] = {}

    def writer_opened(self, fh: int, path: str | None) -> None:
        """create or open of a handle for writing: its path, kept for announce_writer."""
        if self.announcer is not None and path is not None:
            self._to_announce[fh] = path

    async def announce_writer(self, fh: int) -> None:
        """An open for writing: with cross-node ordering, announced before open() returns, so that the
        file's close() is covered (the job's barrier after it orders it before another node's marker)
        without a request of its own. RELEASE, which records the close, ends the writer. create and
        open left the path here (no journal read per file)."""
        path = self._to_announce.pop(fh, None)
        if self.announcer is not None and path is not None:
            await self.announcer.cover(self._handles[fh].inode_id, path, writer=True)

    async def announce(self, inode_id: int | None, path: str | None = None, directory: bool = False) -> None:
        """A new directory or symlink, or a renamed entry: announced before the request returns."""
        if self.announcer is None or inode_id is None:
            return
        if path is None:
            inode = self.journal.names.get(inode_id)
            if inode is None or inode.path is None:
                return
            path, directory = inode.path, inode.kind == DIR
        await self.announcer.cover(inode_id, path, directory=directory)

    def forget(self, fh: int) -> None:
        """The handle is released (before it was announced, if it never was)."""
        self._to_announce.pop(fh, None)

    def writer_released(self, inode_id: int) -> None:
        if self.announcer is not None:
            self.announcer.released(inode_id)
