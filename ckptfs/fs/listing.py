"""Directories as the store lists them: before a lookup, a readdir, a rename or an rmdir the store's
entries of the directories involved are in the journal (the lister reads them, a directory at a time,
and decides how fresh a listing must be); and readdir itself, from the journal."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import trio

from ckptfs.cache.directory import CacheDir
from ckptfs.errors import BackendError, FsError, errno_for_backend_error
from ckptfs.fs.inodes import directory, journal_attr, local_attr
from ckptfs.fs.interface import Attr, DirEntry, Lister, OtherNodesWork
from ckptfs.fs.namespace import Namespace, RenameEntries
from ckptfs.journal import DIR, FILE, REMOTE, Inode, Journal

log = logging.getLogger(__name__)


class NothingToList:
    """The lister of a filesystem without a store to list (tests of the semantics alone)."""

    async def ensure(self, inode_id: int, *, required: bool = False, fresh: bool = False) -> None:
        return None

    def mark_listed(self, inode_id: int) -> None:
        return None

    def listed_before(self, inode_id: int) -> bool:
        return True

    def fresh_for(self, inode_id: int) -> float:
        return float("inf")  # nothing but this filesystem changes the journal


class Listing:
    def __init__(self, journal: Journal, cache: CacheDir, lister: Lister, namespace: Namespace) -> None:
        self.journal = journal
        self.cache = cache
        self.lister = lister
        self._namespace = namespace
        # Cross-node ordering (None: off): a directory renamed or removed here first waits, for at most
        # `rename_wait` seconds, until the other nodes' work pending in its checkpoint is durable.
        self.other_nodes: OtherNodesWork | None = None
        self.rename_wait = 30.0
        self.on_straggler: Callable[[str], None] = lambda message: None

    async def _wait_for_other_nodes(self, inode: Inode, doing: str) -> None:
        """Before a rename or rmdir of the directory `inode`: the files other nodes closed in it before now
        are in the store, so that its listing brings them (Orbax's hosts close their shards, meet at a
        barrier, and the primary renames the tmp dir). Their records name the top-level entry their work is
        in; the wait is for those records to go. Past `rename_wait` the operation goes on, and what those
        nodes upload later lands under the old name: said once in the log and in `ckptfs status`. A store
        that cannot be asked (its errors outlast the transfer engine's retries) is such a bound too: the
        rename is served locally, as the mount promises, and what the others may have pending there is
        named the same way."""
        if self.other_nodes is None or not inode.path:
            return
        entry = inode.path.split("/", 1)[0]
        with trio.move_on_after(self.rename_wait):
            try:
                await self.other_nodes.wait_for_entry(entry)
            except BackendError as exc:
                self._straggler(f"{doing} {inode.path} without knowing what other nodes have pending in {entry}:"
                                f" their records cannot be read ({exc}); what they upload there later lands"
                                " under the old name")
            return
        left = self.other_nodes.pending_in(entry)
        if left:
            self._straggler(f"{doing} {inode.path} while other nodes still have work pending in {entry} after"
                            f" {self.rename_wait:.0f} s (rename_wait): {'; '.join(left)}; what they upload there"
                            " later lands under the old name")

    def _straggler(self, message: str) -> None:
        log.warning("%s", message)
        self.on_straggler(message)

    async def _list_fresh(self, inode: Inode, doing: str) -> None:
        """A directory listed from the store now, before its rename or rmdir, for what other nodes wrote in
        it. One the journal has held the entries of (made here, or listed before) is renamed or removed
        with those if the store cannot be listed now, and what the store has beyond them is named as left
        behind; one it never had must be listed: a store that refuses fails the request."""
        if not await self._list_required(inode.id, fresh=True):
            self._straggler(f"{doing} {inode.path} as this node knows it: the store cannot list it now;"
                            " what other nodes wrote there stays under the old name")

    async def ensure_listed(self, inode_id: int) -> None:
        """Before a lookup in or a readdir of a directory: the store's entries of it are in the journal."""
        await self.lister.ensure(inode_id)

    async def _list_required(self, inode_id: int, *, fresh: bool = False) -> bool:
        """The directory's entries are in the journal before a rename or rmdir needs them all: listed now
        (`fresh`) or recently. False if the store could not list it but the journal holds its entries as of
        an earlier listing (or it was made here): the request goes on with those, as a lookup does. A
        directory never listed fails the request with the store's errno."""
        try:
            await self.lister.ensure(inode_id, required=True, fresh=fresh)
        except BackendError as exc:
            if self.lister.listed_before(inode_id):
                return False
            raise FsError(errno_for_backend_error(exc), f"cannot list the store: {exc}") from None
        return True

    async def _list_tree(self, inode_id: int) -> None:
        """Every directory at and below `inode_id` is listed from the store now, so the journal knows the
        whole subtree, other nodes' files in it included: a directory this node made counts as listed here,
        but another node may have written into it since (Orbax's multi-host save: every host writes into one
        tmp dir, then one host renames it). Re-read after each await: entries may come and go meanwhile."""
        pending = [inode_id]
        while pending:
            folder = self.journal.names.get(pending.pop())
            if folder is None:
                continue
            await self._list_fresh(folder, "renaming")
            pending.extend(c.id for c in self.journal.names.all_children(folder.id) if c.kind == DIR)

    async def prepare_rename(self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes
                             ) -> RenameEntries | None:
        """Before rename(): the journal knows everything the rename moves or replaces. Listing is lazy, so a
        directory this node never looked into has no entries here yet; renamed as it is, its objects would
        stay at the old keys and the new name would be empty (a rename in the store is a move of every
        object, each journaled). So its whole subtree is listed first, and a directory it replaces is
        listed too (rename over a non-empty directory is ENOTEMPTY). A big remote tree makes the rename
        slower, never wrong; a store that cannot be listed fails the rename instead of losing entries.
        Returns what the rename reads (Namespace.rename_entries) when nothing was listed after reading it,
        so that the rename need not read it again; None if the rename must (or fails: it says why)."""
        await self._list_required(old_parent_id)
        await self._list_required(new_parent_id)
        try:
            entries = self._namespace.rename_entries(old_parent_id, raw_old, new_parent_id, raw_new)
        except FsError:
            # rename() reports it, but a directory to move is listed all the same, if there is one.
            source = self._maybe_child(old_parent_id, raw_old)
            if source is not None and source.kind == DIR:
                await self._list_tree(source.id)
            return None
        if entries.source.kind == DIR or (entries.target is not None and entries.target.kind == DIR):
            if entries.source.kind == DIR:
                await self._wait_for_other_nodes(entries.source, "renaming")
                await self._list_tree(entries.source.id)
            target = self._maybe_child(new_parent_id, raw_new)
            if target is not None and target.kind == DIR:
                await self._list_required(target.id)
            return None
        return entries

    async def prepare_rmdir(self, parent_id: int, raw_name: bytes) -> None:
        """Before rmdir(): the directory is listed now, so one with objects only in the store (another node's
        files in a directory this node made, too) is ENOTEMPTY."""
        await self._list_required(parent_id)
        inode = self._maybe_child(parent_id, raw_name)
        if inode is not None and inode.kind == DIR:
            await self._wait_for_other_nodes(inode, "removing")
            await self._list_fresh(inode, "removing")

    def _maybe_child(self, parent_id: int, raw_name: bytes) -> Inode | None:
        try:
            return self._namespace.existing_child_of(parent_id, raw_name)
        except FsError:
            return None  # rename()/rmdir() report it

    def opendir(self, inode_id: int) -> int:
        directory(self.journal, inode_id)
        return inode_id

    def readdir(self, inode_id: int, after_id: int, limit: int = 1000) -> Iterator[DirEntry]:
        """From the journal's rows as they are, read `limit` at a time and turned into entries as the caller
        takes them: a walk of a big tree reads every entry here, and the kernel's buffer may take fewer
        than the rows read. A file with local data takes its size and times from its cache file, as
        getattr does; a file only in the store (all of a fresh node's walk) is its row as it is."""
        for ino, name, kind, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, target, state in (
            self.journal.names.entry_rows(inode_id, after_id, limit)
        ):
            if kind == FILE:
                if state == REMOTE:
                    atime = mtime_ns if atime_ns is None else atime_ns
                    attr = _new_tuple(Attr, (ino, mode, 1, uid, gid, size, (size + 511) // 512, atime, mtime_ns,
                                             ctime_ns))
                else:
                    attr = local_attr(self.cache, ino, mode, uid, gid, ctime_ns)
            else:
                subdirectories = self.journal.names.subdirectory_count(ino) if kind == DIR else 0
                attr = journal_attr(ino, kind, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, target,
                                    subdirectories=subdirectories)
            yield _new_tuple(DirEntry, (name.encode(), attr, ino))


_new_tuple = tuple.__new__
