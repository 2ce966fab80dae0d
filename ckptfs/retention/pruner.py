"""Retention carried out: reads the mount's top level, asks retention/rules.py which checkpoints go, and deletes
them through the mount's namespace (an `rm -r` through the fs package), so that the journal and the drain take the
deletes to the store like any other. Runs after each completed checkpoint (keep_last) and for `ckptfs prune`.

retention/rules.py holds the rules and stays pure; this module owns only what applying them touches: the
listing of the top level and of what is deleted, the pointer files' text, and the other nodes' pending work.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from ckptfs.errors import Faults
from ckptfs.fetch.lister import DirLister
from ckptfs.fs import Filesystem
from ckptfs.journal import DIR, FILE, ROOT_ID, Inode, Journal, journal_unusable
from ckptfs.nodes import TOP_FILES, PeerRecords
from ckptfs.retention.rules import Checkpoint, Plan, pinned_by_pointers, plan

log = logging.getLogger(__name__)

POINTER_READ = 4096  # a pointer file (`latest`, a commit marker) is read whole up to this size


class Pruner:
    """Deletes all but the newest checkpoints of one mount. `is_commit_marker` names the marker files
    (pointers, never candidates); `peers`, with cross-node ordering, tells what other nodes still write."""

    def __init__(
        self, journal: Journal, fs: Filesystem, lister: DirLister, *, is_commit_marker: Callable[[str | None], bool],
        peers: PeerRecords | None, faults: Faults,
    ) -> None:
        self.journal = journal
        self.fs = fs
        self.lister = lister
        self.is_commit_marker = is_commit_marker
        self.peers = peers
        self.faults = faults
        self._wanted = trio.Event()
        # True while a preemption notice lasts: retention's deletes wait (the daemon wires it; notices/preempter.py).
        self.held: Callable[[], bool] = lambda: False
        # Retention deletes behind the kernel's back (no FUSE request): what it held of a deleted checkpoint
        # goes with these (mount/adapter.py: forget_kernel_entry_now and forget_kernel_data), called in a worker thread.
        self.forget_kernel_entry_now: Callable[[int, str], None] = lambda parent_id, name: None
        self.forget_kernel_data: Callable[[int], None] = lambda inode_id: None

    def checkpoint_completed(self) -> None:
        """A commit marker reached the store: `run` prunes next."""
        self._wanted.set()

    async def run(self, keep_last: int, keep_globs: tuple[str, ...], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply keep_last after each completed checkpoint; a failure waits for the next one."""
        task_status.started()
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            if self.held():
                log.info("retention waits: a preemption notice is being carried out")
                continue
            try:
                result = await self.prune(keep_last, keep_globs, dry_run=False)
            except Exception as exc:
                if journal_unusable(exc):
                    raise
                log.exception("retention failed; it runs again after the next checkpoint")
                self.faults.record("retention", repr(exc))
                continue
            if result.delete:
                log.info("retention (keep_last %d): deleted %s", keep_last, ", ".join(result.delete))

    async def prune(self, keep_last: int, keep_globs: tuple[str, ...], *, dry_run: bool) -> Plan:
        """Delete all but the newest `keep_last` top-level checkpoints (see retention/rules.py) through the
        namespace, so that the drain removes them from the store too."""
        await self.lister.ensure(ROOT_ID)
        top = [c for c in self.journal.names.all_children(ROOT_ID) if c.name and not c.name.startswith(".")]
        pointers = [c for c in top if c.kind == FILE and (self.is_commit_marker(c.name) or c.name == "latest")]
        texts = {}
        for pointer in pointers:
            if pointer.size <= POINTER_READ:
                texts[pointer.name or ""] = (await self._read_small(pointer)).decode("utf-8", "replace")
        candidates = [c for c in top if c not in pointers]
        # What other nodes still have pending work in is not complete, however it looks from here.
        elsewhere: set[str] = set()
        if self.peers is not None:
            await self.peers.refresh(entries=True)
            elsewhere = self.peers.pending_entries()
        checkpoints = [Checkpoint(c.name or "", c.mtime_ns, self._complete(c) and c.name not in elsewhere
                                  and not (c.kind != DIR and TOP_FILES in elsewhere))
                       for c in candidates]
        result = plan(checkpoints, keep_last=keep_last, keep_globs=keep_globs,
                      pinned=pinned_by_pointers(texts, [c.name for c in checkpoints]))
        if not dry_run:
            for name in result.delete:
                await self._remove_tree(name)
            if result.delete:
                await trio.to_thread.run_sync(self._forget_in_kernel, result.delete)
        return result

    def _forget_in_kernel(self, names: list[str]) -> None:
        """The kernel keeps names for as long as the root's listing is fresh: the deleted checkpoints' names
        (with every unused name below them) and the root's cached listing and link count go now."""
        for name in names:
            self.forget_kernel_entry_now(ROOT_ID, name)
        self.forget_kernel_data(ROOT_ID)

    def _complete(self, inode: Inode) -> bool:
        for entry in [inode, *self.journal.names.descendants(inode.path or "")]:
            if entry.state in ("dirty", "uploading") or (entry.kind == FILE and entry.closed_at is None):
                return False
        return True

    async def _read_small(self, inode: Inode) -> bytes:
        fh = await self.fs.open(inode.id, os.O_RDONLY)
        try:
            return await self.fs.read(fh, 0, POINTER_READ)
        finally:
            self.fs.release(fh)

    async def _remove_tree(self, name: str) -> None:
        """rm -r of a top-level entry, through the fs (its store listing is read first: objects nobody
        here has listed must be deleted too)."""
        entry = self.journal.names.lookup(ROOT_ID, name)
        if entry is None:
            return
        if entry.kind == DIR:
            await self._list_subtree(entry.id)
            for child in sorted(self.journal.names.descendants(entry.path or ""),
                                key=lambda i: -(i.path or "").count("/")):
                parent = child.parent
                if parent is None or child.name is None:
                    continue
                if child.kind == DIR:
                    self.fs.rmdir(parent, child.name.encode())
                else:
                    self.fs.unlink(parent, child.name.encode())
            self.fs.rmdir(ROOT_ID, name.encode())
        else:
            self.fs.unlink(ROOT_ID, name.encode())

    async def _list_subtree(self, inode_id: int) -> None:
        await self.lister.ensure(inode_id, required=True, fresh=True)
        for child in self.journal.names.all_children(inode_id):
            if child.kind == DIR:
                await self._list_subtree(child.id)
