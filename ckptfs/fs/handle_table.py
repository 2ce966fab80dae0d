"""The open file handles the kernel holds, kept where a daemon that takes the mount over finds them.

When a daemon dies and another takes over its FUSE connection (keepmount/holder.py), the kernel still refers to the
handles the dead one handed out: reads, writes, fsyncs and releases name them. This table is what the new
daemon rebuilds them from: for each handle, the inode, how it was opened (flags), whether it had dirtied
the file, whether it bypassed the page cache, and its passthrough backing id (the kernel keeps that file
open; a new handle of the same inode must name the same id).

It is a file of fixed-size slots mapped into memory: slot `fh - 1` describes handle `fh` (fs/open_files.py hands
out the lowest free handle numbers, so the table stays as small as the most files ever open at once). A
slot is written when the open or create reply naming its handle goes out (with that request's id: see
fs/takeover.py, handed_out and unanswered) and zeroed when the handle is released: a store into memory, no
system call, no journal transaction on the open path. It survives the daemon's death, not the machine's: pages of
a shared mapping stay in the page cache when the process dies, and after a reboot the kernel's handles are
gone too, so nothing is lost by not syncing it.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

# fh, inode, open flags, backing id, state bits (below), the id of the kernel's open or create request that
# the handle answered; 40 bytes a slot
SLOT = struct.Struct("<QQIiI4xQ")
IN_USE = 1
DIRTIED = 2
DIRECT = 4
STREAM = 8  # a read-only open of a remote file, served from a partial download
INITIAL_SLOTS = 1024


class OpenHandle(NamedTuple):
    """One handle the kernel may still hold, as the table recorded it."""

    fh: int
    inode_id: int
    flags: int
    backing: int
    dirtied: bool
    direct: bool
    stream: bool
    request: int  # the kernel's id of the open or create this handle answered (0: unknown)

    @property
    def writable(self) -> bool:
        return (self.flags & os.O_ACCMODE) != os.O_RDONLY


class HandleTable:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._slots = 0

    def open(self, *, keep: bool) -> list[OpenHandle]:
        """Map the table. `keep`: this daemon takes over a live connection, so the handles recorded by the
        one before are returned (and stay recorded); otherwise the kernel holds no handle of ours yet and
        the table starts empty."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if keep else os.O_TRUNC)
        self._fd = os.open(self.path, flags, 0o600)
        size = os.fstat(self._fd).st_size
        slots = max(INITIAL_SLOTS, size // SLOT.size)
        os.ftruncate(self._fd, slots * SLOT.size)
        self._map = mmap.mmap(self._fd, slots * SLOT.size)
        self._slots = slots
        return self._records() if keep else []

    def _records(self) -> list[OpenHandle]:
        assert self._map is not None
        found = []
        for fh, inode_id, flags, backing, state, request in SLOT.iter_unpack(self._map):
            if state & IN_USE:
                found.append(OpenHandle(fh, inode_id, flags, backing, bool(state & DIRTIED), bool(state & DIRECT),
                                        bool(state & STREAM), request))
        return found

    def put(self, fh: int, inode_id: int, flags: int, backing: int, *, dirtied: bool, direct: bool,
            stream: bool, request: int = 0) -> None:
        if self._map is None:
            return
        if fh > self._slots:
            self._grow(fh)
        state = IN_USE | (DIRTIED if dirtied else 0) | (DIRECT if direct else 0) | (STREAM if stream else 0)
        SLOT.pack_into(self._map, (fh - 1) * SLOT.size, fh, inode_id, flags & 0xFFFFFFFF, backing, state, request)

    def dirtied(self, fh: int) -> None:
        """The handle wrote for the first time (its inode's change began)."""
        if self._map is None or fh > self._slots:
            return
        offset = (fh - 1) * SLOT.size
        fields = list(SLOT.unpack_from(self._map, offset))
        if fields[4] & IN_USE:
            fields[4] |= DIRTIED
            SLOT.pack_into(self._map, offset, *fields)

    def drop(self, fh: int) -> None:
        if self._map is None or fh > self._slots:
            return
        SLOT.pack_into(self._map, (fh - 1) * SLOT.size, 0, 0, 0, 0, 0, 0)

    def _grow(self, fh: int) -> None:
        assert self._map is not None
        slots = self._slots
        while slots < fh:
            slots *= 2
        os.ftruncate(self._fd, slots * SLOT.size)
        self._map.resize(slots * SLOT.size)
        self._slots = slots

    def clear(self) -> None:
        """Every handle was released (a clean unmount): nothing for a later daemon to take over."""
        if self._map is not None:
            self._map[:] = bytes(len(self._map))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
