"""How the kernel caches each handle's data, and when those caches go stale: FUSE passthrough (the kernel
reads and writes the cache file itself; one backing file per inode, shared by its handles), direct I/O
for write-only handles (no page cache), or the kernel's page cache of the mount's file, which an open
drops when a handle that bypassed it changed the file meanwhile (caching)."""

from __future__ import annotations

import errno
import logging
import os

from ckptfs.cache.directory import CacheDir, CacheFile
from ckptfs.fs.interface import BackingFiles
from ckptfs.fs.open_files import OpenFile

log = logging.getLogger(__name__)

# A handle that can write gets passthrough only while the cache budget has at least this much room, and
# PASSTHROUGH_ROOM_SHARE of the budget: its writes no longer wait for room (see KernelCache.choose).
PASSTHROUGH_ROOM = 1 << 30
PASSTHROUGH_ROOM_SHARE = 0.1


def probe_passthrough(mode: str, backing: BackingFiles | None, granted: bool, probe_path: str
                      ) -> tuple[BackingFiles | None, str]:
    """FUSE passthrough where the option (`mode`), the FUSE binding, the kernel and this process's
    privileges allow it: the backing files to use (None: the mount works as without it), and why. Never a
    failure. `backing`: the binding's registry of backing files (None: a binding without passthrough, such
    as the stock pyfuse3); `granted`: the kernel granted FUSE_PASSTHROUGH at INIT; `probe_path`: a scratch
    file on the cache filesystem, removed again."""
    if mode == "off":
        return None, "off: passthrough = off"
    if backing is None:
        return None, ("off: this pyfuse3 is the stock build, without passthrough support (scripts/install.sh"
                      " builds one against libfuse >= 3.17; elsewhere `pip install` the pyfuse3 wheel that"
                      " scripts/build-wheels.sh makes: docs/INSTALL.md)")
    if not granted:
        return None, ("off: the kernel did not grant FUSE passthrough (it needs Linux >= 6.9"
                      " with CONFIG_FUSE_PASSTHROUGH)")
    try:
        fd = os.open(probe_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            backing.close(backing.open(fd))
        finally:
            os.close(fd)
            os.unlink(probe_path)
    except OSError as exc:
        need = " (it needs CAP_SYS_ADMIN: run the daemon as root)" if exc.errno == errno.EPERM else ""
        return None, f"off: the kernel refused a backing file: {exc.strerror}{need}"
    return backing, "on: the kernel reads and writes the cache files of open files itself"


class KernelCache:
    def __init__(self, cache: CacheDir, handles: dict[int, OpenFile]) -> None:
        self.cache = cache
        self._handles = handles
        # Inodes written through page-cache-bypassing handles since the kernel's cached pages were dropped.
        self._uncached_writes: set[int] = set()
        # FUSE passthrough (None: off). All passthrough handles of an inode share one backing id, the
        # kernel's rule, registered at the first and closed after the last: inode -> [backing id, handles].
        self.backing: BackingFiles | None = None
        self._backing_ids: dict[int, list[int]] = {}
        # Handles per inode that go through the kernel's page cache of the FUSE file (neither direct nor
        # passthrough): while there are any, the kernel refuses passthrough opens of the inode (ETXTBSY).
        self._cached_opens: dict[int, int] = {}
        self.passthrough_opens = 0  # handles opened with passthrough since start
        self.passthrough_errors = 0  # registrations the kernel refused (the open then goes through us)

    def choose(self, inode_id: int, fd: int, local: CacheFile, writable: bool) -> int:
        """The backing id for a new handle of a file whose bytes are in the cache, or 0 (reads and writes
        then come to the daemon). Passthrough is for files whose bytes are all local (none spilled), and
        for a handle that can write only while the budget has room: its writes no longer wait for it.
        Every handle of an inode that has a backing file gets it too (the kernel allows one backing file
        per inode, and no cached handle beside it), and none while cached handles of the inode are open."""
        if self.backing is None:
            return 0
        held = self._backing_ids.get(inode_id)
        if held is not None:
            held[1] += 1
            self.passthrough_opens += 1
            return held[0]
        if self._cached_opens.get(inode_id) or local.freed or local.sealed:
            return 0
        if writable:
            room = self.cache.limit - self.cache.used
            if room < PASSTHROUGH_ROOM or room < self.cache.limit * PASSTHROUGH_ROOM_SHARE:
                return 0
        try:
            # The kernel takes the file, not the descriptor, and opens it anew with each handle's own flags
            # (so a read-only first handle serves later writers too).
            backing_id = self.backing.open(fd)
        except OSError as exc:
            self.passthrough_errors += 1
            log.debug("no passthrough for inode %d: %s", inode_id, exc)
            return 0
        self._backing_ids[inode_id] = [backing_id, 1]
        self.passthrough_opens += 1
        return backing_id

    def opened(self, inode_id: int, backing: int, writable: bool, direct: bool, dirtied: bool) -> None:
        """A new handle of the inode, with what choose() gave it."""
        if backing:
            if writable:
                # Its writes bypass the daemon: the accounting follows the file (its size as it grows, for
                # the budget and for spills).
                self.cache.passthrough_opened(inode_id)
                self._uncached_writes.add(inode_id)  # see caching(): cached pages go stale behind the kernel
        elif not direct:
            self._cached_opens[inode_id] = self._cached_opens.get(inode_id, 0) + 1
        if direct and dirtied:
            self._uncached_writes.add(inode_id)

    def restored(self, inode_id: int, backing: int, writable: bool, direct: bool) -> None:
        """A handle a daemon before this one handed out, with the backing id it had (the kernel kept it)."""
        if backing:
            held = self._backing_ids.setdefault(inode_id, [backing, 0])
            held[1] += 1
            if writable:
                self.cache.passthrough_opened(inode_id)
        elif not direct:
            self._cached_opens[inode_id] = self._cached_opens.get(inode_id, 0) + 1
        if writable and (direct or backing):
            self._uncached_writes.add(inode_id)

    def bypassed(self, inode_id: int) -> None:
        """A handle that bypasses the kernel's page cache wrote to the inode: its cached pages are stale."""
        self._uncached_writes.add(inode_id)

    def released(self, handle: OpenFile) -> None:
        inode_id = handle.inode_id
        if handle.backing:
            self._release_backing(handle)
            if handle.writable:
                self.cache.passthrough_closed(inode_id)
        elif not handle.direct:
            cached = self._cached_opens[inode_id] - 1
            if cached:
                self._cached_opens[inode_id] = cached
            else:
                del self._cached_opens[inode_id]

    def caching(self, fh: int) -> tuple[bool, bool]:
        """(direct_io, keep_cache) for a new handle. Write-only handles bypass the kernel's page cache:
        their data reaches the cache file with one copy less (checkpoint writers are write-only). A handle
        that can read keeps the kernel's cached pages unless a write-only handle changed the file since
        they were last dropped; then this open drops them, so that no kernel, old or new, serves stale
        pages after a direct write."""
        handle = self._handles[fh]
        if handle.direct:
            return True, False
        if handle.backing:
            return False, False  # the kernel serves it from the cache file's own pages (no keep_cache)
        inode_id = handle.inode_id
        if inode_id not in self._uncached_writes:
            return False, True
        if not any((h.direct or (h.backing and h.writable)) and h.inode_id == inode_id
                   for h in self._handles.values()):
            self._uncached_writes.discard(inode_id)
        return False, False

    def passthrough_files(self) -> int:
        """Files open with passthrough now."""
        return len(self._backing_ids)

    def backing_of(self, fh: int) -> int:
        """The backing id the open or create reply of a new handle names (0: no passthrough)."""
        return self._handles[fh].backing

    def _release_backing(self, handle: OpenFile) -> None:
        held = self._backing_ids[handle.inode_id]
        held[1] -= 1
        if held[1]:
            return
        del self._backing_ids[handle.inode_id]
        if self.backing is None:
            return  # the FUSE connection is gone (close_all after unmount), and its backing files with it
        try:
            self.backing.close(held[0])
        except OSError as exc:  # the kernel keeps what open files hold; nothing of ours is lost
            log.warning("cannot release the passthrough backing file %d of inode %d: %s",
                        held[0], handle.inode_id, exc)
