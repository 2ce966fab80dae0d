"""Lazy listing of the store's namespace while mounted (`DirLister`): the store is read one directory at a
time, when the mount first looks into it and again after refresh_interval (or `ckptfs refresh`), importing
what other nodes wrote and dropping what they deleted (`apply_dir_listing`), and telling the kernel what
changed behind its back. Journal work runs in the trio thread; store calls in worker threads.
"""


import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from itertools import repeat
from typing import Any

import trio

from ckptfs.backends.base import SYMLINK as STORE_SYMLINK
from ckptfs.backends.base import DirListing, ObjectInfo, ObjectStore
from ckptfs.cache.directory import CacheDir
from ckptfs.errors import BackendError
from ckptfs.journal import CLEAN, DIR, FILE, REMOTE, ROOT_ID, SYMLINK, Inode, Journal, ListedEntry
from ckptfs.journal.connection import JournalFull

log = logging.getLogger(__name__)

MAX_PATH_BYTES = 1000
# Directories waiting to be listed ahead of walks (DirLister.run); more are dropped, not waited for.
AHEAD_QUEUE = 64


def _valid_path(key: str) -> str | None:
    """The mount path for a store key, or None if the key cannot be a path inside the mount."""
    path = key[:-1] if key.endswith("/") else key  # one '/': 'a//' is the key of an empty name in a/
    try:
        key.encode()
    except UnicodeEncodeError:
        return None  # a file:// name that is not UTF-8 (os.fsdecode's surrogate escapes)
    if not path or key.startswith("/") or "\0" in key or len(path.encode()) > MAX_PATH_BYTES:
        return None
    parts = path.split("/")
    if any(p in ("", ".", "..") or len(p.encode()) > 255 for p in parts):
        return None
    return path


class DirLister:
    """Lazy listing: the store is read one directory at a time, the first time the mount looks into it
    and again once its listing is older than `refresh_interval` (or after invalidate_all(): `ckptfs
    refresh`). Concurrent requests for one directory share one listing. Listings run in worker threads;
    their results are applied in the trio thread by apply_dir_listing(). When each directory was last
    listed is kept in the journal (wall-clock time), so a restart within refresh_interval lists nothing
    again. The two forget_kernel_* hooks (set by the daemon, which owns the FUSE session) drop what the
    kernel cached of entries a listing replaced or removed, so that a refresh is seen at once. A walk is
    listed one directory ahead (run)."""

    def __init__(
        self, journal: Journal, cache: CacheDir, store: ObjectStore, *, refresh_interval: float = 30.0,
        vanished: Callable[[Inode], None] | None = None, call: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.store = store
        # How a listing runs: the engine's Transfers.call (a worker thread, retried: a store call makes one
        # attempt), or one plain attempt in a worker thread.
        self._call = call if call is not None else trio.to_thread.run_sync
        self.refresh_interval = refresh_interval
        self.vanished = vanished if vanished is not None else _drop_entry(journal, cache)
        journal.names.prune_listed_dirs()
        self._listed: dict[int, float] = journal.names.listed_dirs()  # dir inode id -> time.time() of its listing
        self._in_flight: dict[int, trio.Event] = {}
        # Listing ahead (run): its queue while it runs; what it listed that no request has asked for yet.
        self._ahead: trio.MemorySendChannel[int] | None = None
        self._listed_ahead: set[int] = set()
        self._warned: set[str] = set()
        self.listings = 0
        # Called in a worker thread: the kernel may wait for a request on the same inode to finish.
        self.forget_kernel_data: Callable[[int], None] = lambda inode_id: None
        # Queues the invalidation (pyfuse3.invalidate_entry_async): safe inside a request handler.
        self.forget_kernel_entry: Callable[[int, str], None] = lambda parent_id, name: None
        # Returns once the kernel dropped the name: called in a worker thread (forget_kernel_entry_now of
        # mount/adapter.py).
        self.forget_kernel_entry_now: Callable[[int, str], None] = lambda parent_id, name: None

    def mark_listed(self, inode_id: int) -> None:
        """A directory created here: the store has nothing below it yet."""
        self._set_listed(inode_id, time.time())

    def _set_listed(self, inode_id: int, at: float) -> None:
        self._listed[inode_id] = at
        self.journal.names.set_listed(inode_id, at)

    def listed_before(self, inode_id: int) -> bool:
        return inode_id in self._listed

    def fresh_for(self, inode_id: int) -> float:
        """Seconds until the directory's listing is stale (0 if it is, or was never listed): the kernel
        keeps the directory's names that long (mount/adapter.py), so a name is looked up, and its directory
        listed again, when it would be without the kernel's cache."""
        listed = self._listed.get(inode_id)
        if listed is None:
            return 0.0
        age = time.time() - listed
        return self.refresh_interval - age if 0 <= age < self.refresh_interval else 0.0

    def invalidate_all(self) -> None:
        self._listed.clear()
        self.journal.names.clear_listed()

    async def refresh(self) -> None:
        """`ckptfs refresh`: every listing stale, the root listed again at once, and what the kernel keeps
        of the mount dropped: the names at the top (a directory's name takes the unused names below it
        along, the whole tree of them) and the root's listing and attributes. So the next access of any
        path asks the daemon, which lists its directories again, whatever the kernel held."""
        self.invalidate_all()
        names = [c.name for c in self.journal.names.all_children(ROOT_ID) if c.name is not None]

        def forget() -> None:
            for name in names:
                self.forget_kernel_entry_now(ROOT_ID, name)
            self.forget_kernel_data(ROOT_ID)

        await trio.to_thread.run_sync(forget)
        await self.ensure(ROOT_ID)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List ahead of walks (_list_ahead), a directory at a time. Without this task nothing is."""
        send, receive = trio.open_memory_channel[int](AHEAD_QUEUE)
        self._ahead = send
        task_status.started()
        try:
            async for inode_id in receive:
                try:
                    await self.ensure(inode_id, ahead=True)
                except JournalFull:
                    pass  # the cache filesystem is full: the request that needs this listing hears it (ENOSPC)
        finally:
            self._ahead = None

    def _list_ahead(self, inode_id: int, parent_id: int | None) -> None:
        """A request needed the listing of `inode_id`. A walk (find, du, os.walk) goes through a directory's
        subdirectories in readdir's order: the next one is listed while the walker reads this one, so that
        the store's latency overlaps the walk's work. One ahead, not the tree: a request for a single
        directory costs one listing more."""
        if self._ahead is None or parent_id is None:
            return
        following = self.journal.names.next_subdirectory(parent_id, after_id=inode_id)
        if following is None or following in self._in_flight or following in self._listed:
            return
        with contextlib.suppress(trio.WouldBlock):
            self._ahead.send_nowait(following)

    async def ensure(self, inode_id: int, *, required: bool = False, fresh: bool = False, ahead: bool = False) -> None:
        """List the directory unless its listing is recent. A store failure is logged once and the journal
        served as it is, unless `required` (a rename or rmdir that must know every entry): then it raises.
        `fresh`: list it now whatever its age (retention deletes a tree: other nodes may have written below
        a directory that this node made, which it counts as listed). `ahead`: no request asked for it
        (run); one that does later counts as the request that needed its listing."""
        listed = self._listed.get(inode_id)
        # A listing "from the future" (the clock was set back) counts as stale.
        if not fresh and listed is not None and 0 <= time.time() - listed < self.refresh_interval:
            if not ahead and inode_id in self._listed_ahead:
                self._listed_ahead.discard(inode_id)
                inode = self.journal.names.get(inode_id)
                if inode is not None:
                    self._list_ahead(inode_id, inode.parent)
            return
        event = self._in_flight.get(inode_id)
        if event is not None:
            await event.wait()
            if required and inode_id not in self._listed:
                await self.ensure(inode_id, required=True, fresh=fresh)  # that one failed: once more, ourselves
            elif not ahead and inode_id in self._listed_ahead:
                await self.ensure(inode_id)  # a listing ahead that a request waited for: it lists the next
            return
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.kind != DIR or inode.path is None:
            return
        event = self._in_flight[inode_id] = trio.Event()
        moved = False
        try:
            started = time.time()
            prefix = inode.key or ""
            stored_before = stored_versions(self.journal, inode_id)
            deleting_before = frozenset(self.journal.deletes.pending_delete_keys_under(prefix))
            try:
                listing = await self._call(self.store.list_dir, prefix)
            except BackendError as exc:
                if required:
                    raise
                # Serve what the journal knows; the next access tries again.
                if prefix not in self._warned:
                    self._warned.add(prefix)
                    log.warning("cannot list %s/%s: %s; showing what this node knows", self.store.url, prefix, exc)
                return
            self.listings += 1
            current = self.journal.names.get(inode_id)
            if current is None or current.path is None or current.key != inode.key:
                # Moved or removed while listed: list it again at its new place on next access (at once
                # if the caller needs the listing, after this one is no longer in flight).
                moved = current is not None and current.path is not None
                return
            replaced: list[int] = []
            changed_dirs: set[int] = set()  # whose entries went: the kernel's listing of them must go too

            def vanished(inode: Inode) -> None:
                self._vanished(inode)
                if inode.parent is not None:
                    changed_dirs.add(inode.parent)

            imported = apply_dir_listing(
                self.journal, current, listing, now=time.time(), exact_mtimes=self.store.listing_has_metadata,
                vanished=vanished, warned=self._warned, cache=self.cache, replaced=replaced.append,
                stored_before=stored_before, listed_at=started, deleting_before=deleting_before,
            )
            self._listed[inode_id] = started
            if ahead:
                self._listed_ahead.add(inode_id)
            else:
                self._listed_ahead.discard(inode_id)
                self._list_ahead(inode_id, current.parent)
            if imported:
                changed_dirs.add(inode_id)
            # The directories' attributes (mtime, link count) and the listings the kernel keeps of them
            # (FOPEN_CACHE_DIR) go with the files' pages and attributes.
            for changed_id in [*replaced, *changed_dirs]:
                await trio.to_thread.run_sync(self.forget_kernel_data, changed_id)
        finally:
            del self._in_flight[inode_id]
            event.set()
            if moved and required:
                # Only after the plain return above (never while an exception propagates).
                await self.ensure(inode_id, required=True, fresh=fresh)


    def _vanished(self, inode: Inode) -> None:
        self.vanished(inode)
        if inode.parent is not None and inode.name is not None:
            self.forget_kernel_entry(inode.parent, inode.name)


def _drop_entry(journal: Journal, cache: CacheDir) -> Callable[[Inode], None]:
    def drop(inode: Inode) -> None:
        with journal.transaction():
            journal.names.detach(inode._replace(remote_key=None))
            journal.names.purge(inode.id)
        if inode.kind == FILE:
            cache.remove_data(inode.id)

    return drop


def apply_dir_listing(
    journal: Journal, directory: Inode, listing: DirListing, *, now: float, exact_mtimes: bool,
    vanished: Callable[[Inode], None], warned: set[str], cache: CacheDir,
    replaced: Callable[[int], None] = lambda inode_id: None, stored_before: dict[int, int] | None = None,
    listed_at: float | None = None, deleting_before: frozenset[str] = frozenset(),
) -> int:
    """Bring one directory of the journal up to date with the store's listing of it; return how many
    entries were imported. New objects appear (state 'remote'; subdirectories without a marker too),
    objects another node replaced are served anew, and entries whose objects someone deleted go (the
    namespace is shared: the delete wins), unless they hold local work. Imported entries belong to the
    daemon's user (object stores keep no owner). `listed_at`: the directory counts as listed at that time
    (Names.set_listed), in the same transaction.

    One transaction, and a number of journal statements that does not grow with the listing (the new
    entries go in by two statements: Names.import_listed), except for subdirectories and entries that
    already exist: a fresh node's first walk of a big tree is mostly this.

    `stored_before`: inode id -> uploaded_version of the entries the store held before the listing began
    (`stored_versions`). Only those can be judged by it: an upload that committed while the listing ran is
    missing from it or shows its previous version, and was taken for a delete (the file vanished from
    the mount) or a replacement (the journal took the old object's size) by another node.

    `deleting_before`: the keys under the directory whose deletes were pending when the listing began. A
    delete that completed while the listing ran is no longer pending, yet the listing may show its object:
    taken for a new one, it came back as a remote file (an rmdir right after `shutil.rmtree`'s unlinks then
    failed with ENOTEMPTY). Another node's new object at such a key shows at the next listing."""
    uid, gid = os.getuid(), os.getgid()
    children = {c.name: c for c in journal.names.all_children(directory.id)}
    prefix = directory.key or ""
    deleting = journal.deletes.pending_delete_keys_under(prefix) | deleting_before
    infos = listing.entries
    keys = [info.key for info in infos]
    plain = _plain_names(keys, prefix)
    names = [_listed_name(key, prefix, warned) for key in keys] if plain is None else list[str | None](plain)
    unknown = [info.key for info, name in zip(infos, names, strict=True) if name is not None and name not in children]
    owned = journal.work.owned_keys(unknown, under=prefix)
    present: set[str] = set()
    new: list[ListedEntry] = []
    with journal.transaction():
        if listing.marker and prefix and directory.remote_key is None and directory.state == CLEAN:
            journal.work.adopt_marker(directory.id, prefix)  # the root ('' key) has no marker
        if plain is not None and not children and not deleting and not owned:
            # A directory this node lists for the first time (a fresh node's walk is mostly these): every
            # entry is new; the same entries as below, without the tests per entry that cannot apply.
            present.update(plain)
            new = _new_entries(infos, plain)
            infos = []
        for info, name in zip(infos, names, strict=False):  # (infos emptied above: all imported)
            if name is None:
                continue
            present.add(name)
            existing = children.get(name)
            if existing is not None:
                if _listed_before(existing, stored_before) and existing.remote_key == info.key and _refresh_clean(
                    journal, cache, existing, info, exact_mtimes=exact_mtimes
                ):
                    replaced(existing.id)
                continue
            if info.key in deleting or info.key in owned:
                continue  # we removed it (delete pending), or an old copy of a renamed file (a move pending)
            new.extend(_new_entries([info], [name]))
        for name in listing.subdirs:
            key = f"{prefix}{name}/"
            if _listed_name(key, prefix, warned, subdir=True) is None:
                continue
            if name in present:
                # Both an object `x` and objects below `x/` (possible in a bucket, not in a file system):
                # the file wins, as it does against a directory of this node.
                if key not in warned:
                    warned.add(key)
                    log.warning("skipping store directory %r: %r is also a file in the store", key, key[:-1])
                continue
            present.add(name)
            existing = children.get(name)
            if existing is not None:
                if existing.kind != DIR and key not in warned:
                    warned.add(key)
                    log.warning("skipping store directory %r: %s is a file here", key, existing.path)
                continue
            if key in deleting or journal.work.key_owner(key) is not None or journal.deletes.keys_under(key):
                # Renamed or removed here, and the drain has not moved or deleted all of it yet.
                continue
            new.append(ListedEntry(name, DIR, 0, directory.mtime_ns, stat.S_IFDIR | 0o755, None))
        journal.names.import_listed(directory, new, uid=uid, gid=gid, now=now)
        if listed_at is not None:
            journal.names.set_listed(directory.id, listed_at)
    for name, child in children.items():
        if (name not in present and child.state in (CLEAN, REMOTE) and _came_from_store(child)
                and _listed_before(child, stored_before)):
            _vanish(journal, child, vanished, now)
    return len(new)


def _new_entries(infos: list[ObjectInfo], names: list[str]) -> list[ListedEntry]:
    """The entry to import of every listed object, in one comprehension (100,000 of them in a big tree's first
    walk)."""
    return [
        _new_tuple(ListedEntry, (name, SYMLINK, size, mtime_ns, stat.S_IFLNK | (mode & 0o7777), key, target, checksum))
        if kind == STORE_SYMLINK else
        _new_tuple(ListedEntry, (name, FILE, size, mtime_ns, stat.S_IFREG | (mode & 0o7777), key, target, checksum))
        for (key, kind, size, mtime_ns, mode, target, checksum, _etag), name in zip(infos, names, strict=True)
    ]


_new_tuple = tuple.__new__


def stored_versions(journal: Journal, directory_id: int) -> dict[int, int]:
    """What a listing of the directory about to start can judge: its entries the store holds now."""
    return {c.id: c.uploaded_version for c in journal.names.all_children(directory_id)
            if c.remote_key is not None or c.uploaded_version > 0}


def _listed_before(inode: Inode, stored_before: dict[int, int] | None) -> bool:
    """Was this version of the entry in the store before the listing began?"""
    return stored_before is None or stored_before.get(inode.id, -1) == inode.uploaded_version


def _came_from_store(inode: Inode) -> bool:
    """The store had this entry under its current name (uploaded or imported): if a listing no longer
    shows it, someone removed it there. (A directory imported without a marker has no remote_key.)"""
    if inode.kind == DIR and inode.remote_key is None:
        return inode.uploaded_version > 0
    return inode.remote_key is not None and inode.remote_key == inode.key


def _vanish(journal: Journal, inode: Inode, vanished: Callable[[Inode], None], now: float) -> None:
    if inode.kind == DIR:
        # Its contents went with it, except what holds local work here: that stays, under its marker.
        for child in sorted(journal.names.descendants(inode.path or ""), key=lambda i: -(i.path or "").count("/")):
            if child.state in (CLEAN, REMOTE) and (child.kind != DIR or not journal.names.has_children(child.id)):
                vanished(child)
        if journal.names.has_children(inode.id):
            with journal.transaction():
                journal.work.forget_remote_copy(inode.id, now=now)
            return
    log.info("%s was deleted from the store by someone else; removing it here too", inode.path)
    vanished(inode)


def _plain_names(keys: list[str], prefix: str) -> list[str] | None:
    """The names of files listed below the directory key `prefix` if every one is ASCII without '/' or
    NUL, not '.' or '..', and short enough (a big listing nearly always is), checked over the whole list at
    once; else None, and _listed_name judges each key (key by key, that was most of an import's Python)."""
    start = len(prefix)
    names = [key[start:] for key in keys]
    joined = "/".join(names)
    if not (names and joined.isascii() and "\0" not in joined and joined.count("/") == len(names) - 1
            and all(map(str.startswith, keys, repeat(prefix))) and "." not in names and ".." not in names):
        return None
    longest = max(map(len, names))
    if min(map(len, names)) > 0 and longest <= 255 and len(prefix.encode()) + longest <= MAX_PATH_BYTES:
        return names
    return None


def _listed_name(key: str, prefix: str, warned: set[str], *, subdir: bool = False) -> str | None:
    """The entry name of a key listed below the directory key `prefix` (`subdir`: the key of a directory,
    ending in '/'), or None (with one warning per key) if it cannot be a path. What _valid_path checks of
    the whole path, checked of the name alone: the directory's own path is valid already (per entry of a
    big listing this is most of the Python work)."""
    end = len(key) - 1 if subdir else len(key)
    name = key[len(prefix):end]
    try:
        size = len(name.encode())
        total = len(key.encode()) - subdir
    except UnicodeEncodeError:  # a file:// name that is not UTF-8 (os.fsdecode's surrogate escapes)
        size = total = MAX_PATH_BYTES + 1
    if (0 < size <= 255 and total <= MAX_PATH_BYTES and key.startswith(prefix) and "/" not in name
            and "\0" not in name and name not in (".", "..") and (not subdir or key.endswith("/"))):
        return name
    if key not in warned:
        warned.add(key)
        log.warning("skipping store key %r: it cannot be a path inside the mount", key)
    return None


def _refresh_clean(
    journal: Journal, cache: CacheDir, inode: Inode, info: ObjectInfo, *, exact_mtimes: bool
) -> bool:
    """Another node replaced an object we hold clean: drop our copy, serve theirs (last upload wins).
    Where listings carry no metadata (object stores: mtime is the upload time) only the size tells."""
    if inode.kind != FILE or inode.state not in (CLEAN, REMOTE) or inode.remote_key != info.key:
        return False
    if info.size == inode.size and (info.mtime_ns == inode.mtime_ns or not exact_mtimes):
        return False
    journal.copies.replaced_in_store(inode.id, size=info.size, mtime_ns=info.mtime_ns, checksum=info.checksum)
    cache.remove_data(inode.id)
    return True
