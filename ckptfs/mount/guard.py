"""A read-only guard over a mountpoint that ckptfs does not serve.

Why: once a ckptfs mount is gone (a clean unmount, SIGTERM, an external `umount`), its mountpoint is a
plain directory on the disk below. A training job that keeps saving would then write its checkpoints there,
silently: onto the root disk, never uploaded, and hidden under the next mount. The guard turns that into a
loud failure: a tiny read-only tmpfs mounted over the directory (source `ckptfs-guard`), so that every
write fails with EROFS ("Read-only file system"). It holds one file, CKPTFS-NOT-MOUNTED, that says why and
how to clear it. `ckptfs mount` removes it by itself; `ckptfs unguard MNT` or `umount MNT` by hand.

Which mount is ours is decided from /proc/self/mountinfo only (fstype tmpfs, source ckptfs-guard, exactly
at the mountpoint, and topmost there): nothing here stats or opens a path under a mountpoint before that,
because a path under a hung FUSE mount would hang the caller, and no other mount is ever unmounted.

The calls are mount(2) and umount2(2) through ctypes: no dependency on util-linux, and errno values to
explain a failure. Both need root (CAP_SYS_ADMIN). place() and remove() never raise into a caller that
does not ask for it (the daemon's unmount path must go on): they log one WARNING naming why and return
False; with strict=True they raise CkptfsError instead (the CLI prints it).

This module must not import trio or pyfuse3: the CLI and the test fixtures use it without an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ckptfs.control.client import canonical_mountpoint
from ckptfs.errors import CkptfsError

log = logging.getLogger(__name__)

SOURCE = "ckptfs-guard"
FSTYPE = "tmpfs"
README = "CKPTFS-NOT-MOUNTED"
# One page for the README and a few inodes: nothing else is ever written (the guard is read-only anyway).
OPTIONS = "size=16k,nr_inodes=16,mode=0555"

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MNT_DETACH = 2
UMOUNT_NOFOLLOW = 8
_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC

MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo, as much of it as deciding "is this ours" needs."""

    mount_id: int
    parent_id: int
    mountpoint: str
    fstype: str
    source: str

    @property
    def is_guard(self) -> bool:
        return self.fstype == FSTYPE and self.source == SOURCE

    def describe(self) -> str:
        return f"{self.fstype} from {self.source}"


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    if "\\" not in field:
        return field
    out = bytearray()
    raw = field.encode("utf-8", "surrogateescape")
    i = 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 4 <= len(raw) and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def read_mountinfo(text: str | None = None) -> list[MountEntry]:
    """Every mount this process sees, in /proc/self/mountinfo's order. Reading it never touches a mount."""
    if text is None:
        with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    entries = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        entries.append(MountEntry(int(fields[0]), int(fields[1]), _unescape(fields[4]), tail[0], _unescape(tail[1])))
    return entries


def _path(mountpoint: str | os.PathLike[str]) -> Path:
    """The mountpoint as mountinfo spells it: absolute, symlinks in its parents resolved, without touching
    the mountpoint itself (it may be a hung FUSE mount)."""
    return canonical_mountpoint(mountpoint)


def mounted_at(mountpoint: str | os.PathLike[str], entries: list[MountEntry] | None = None) -> MountEntry | None:
    """The topmost mount exactly at `mountpoint` (what a path lookup there reaches), or None if none is."""
    where = str(_path(mountpoint))
    here = [e for e in (read_mountinfo() if entries is None else entries) if e.mountpoint == where]
    # Mounts stacked on one directory: each one's parent is the one below it. The top is nobody's parent.
    parents = {e.parent_id for e in here}
    tops = [e for e in here if e.mount_id not in parents]
    candidates = tops or here
    return candidates[-1] if candidates else None


def is_guarded(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether the topmost mount at `mountpoint` is a guard."""
    try:
        top = mounted_at(mountpoint)
    except OSError:
        return False
    return top is not None and top.is_guard


def guarded_mountpoints(under: str | os.PathLike[str] = "/") -> list[Path]:
    """Every directory at or below `under` whose topmost mount is a guard (for tests and tidy-ups)."""
    base = str(_path(under)).rstrip("/") + "/"
    entries = read_mountinfo()
    found = []
    for where in dict.fromkeys(e.mountpoint for e in entries if e.is_guard):
        if (where + "/").startswith(base):
            top = mounted_at(where, entries)
            if top is not None and top.is_guard:
                found.append(Path(where))
    return found


def availability(configured: bool) -> tuple[bool, str]:
    """Whether a daemon places the guard when its mount ends, and why (or why not), for its log and status."""
    if not configured:
        return False, f"off: guard_mountpoint = false; {_UNGUARDED}"
    if os.geteuid() != 0:
        return False, f"off: the daemon is not root, and the guard is a mount (it needs CAP_SYS_ADMIN); {_UNGUARDED}"
    return True, ("on: when the mount ends, a read-only guard covers the bare mountpoint"
                  " (`ckptfs unguard MOUNTPOINT` lifts it)")


_UNGUARDED = "when the mount ends, writes into the bare mountpoint land on the disk below"


def readme_text(mountpoint: Path) -> str:
    return f"""ckptfs does not serve this directory ({mountpoint}) right now.

What is mounted here is a read-only guard (a tiny tmpfs, source "{SOURCE}") that ckptfs placed over
the bare mountpoint after its mount ended, or that `ckptfs guard` placed before the first mount.
Writing here fails with EROFS ("Read-only file system") on purpose: without the guard, a job that
keeps saving checkpoints would write them onto the disk below the mountpoint, where they are never
uploaded and are hidden by the next mount.

While it is there, {mountpoint} is a mount point: `rm -rf` of a directory above it fails with
EBUSY ("Device or resource busy"), and so does rmdir of {mountpoint} itself.

To clear it:
  ckptfs mount SOURCE {mountpoint}   (or systemctl start ckptfs@NAME): replaces the guard by itself
  ckptfs unguard {mountpoint}        or  umount {mountpoint}: removes it, leaving the bare directory
"""


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def _check(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _why(exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        return f"{exc.strerror} (mounting needs root, CAP_SYS_ADMIN)"
    return str(exc.strerror or exc)


def _place(where: Path) -> bool:
    """Mount the guard on `where`; False if one is there already. Raises CkptfsError saying why not."""
    top = mounted_at(where)
    if top is not None:
        if top.is_guard:
            return False
        raise CkptfsError(f"{where} is a mount point ({top.describe()}): not guarding over a mount")
    libc = _libc()
    target = os.fsencode(where)
    try:
        _check(libc.mount(SOURCE.encode(), target, FSTYPE.encode(), _FLAGS, OPTIONS.encode()))
    except OSError as exc:
        raise CkptfsError(f"cannot mount a guard on {where}: {_why(exc)}") from None
    try:
        # Our own fresh tmpfs: writing into it cannot hang. Root may write into a 0555 directory.
        fd = os.open(where / README, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
        with os.fdopen(fd, "w") as f:
            f.write(readme_text(where))
        _check(libc.mount(SOURCE.encode(), target, None, MS_REMOUNT | MS_RDONLY | _FLAGS, None))
    except OSError as exc:
        # A writable guard would take writes silently (into memory, until it is full): take it away again.
        with contextlib.suppress(OSError):
            _check(libc.umount2(target, MNT_DETACH | UMOUNT_NOFOLLOW))
        raise CkptfsError(f"cannot make the guard on {where} read-only: {_why(exc)}") from None
    return True


def place(mountpoint: str | os.PathLike[str], *, strict: bool = False) -> bool:
    """Mount a read-only guard over `mountpoint`, so that writes into the bare directory fail with EROFS
    instead of landing on the disk below. True if the mountpoint is guarded afterwards (also if it was
    already). Refuses (False) if anything else is mounted there: a live or stale FUSE mount of ckptfs, or any
    other filesystem. Without `strict`, a failure is one WARNING and False; with it, CkptfsError."""
    where = _path(mountpoint)
    try:
        if _place(where):
            log.info("guarded %s: writes into it fail with EROFS until ckptfs mounts it again", where)
        return True
    except (CkptfsError, OSError) as exc:
        if strict:
            raise CkptfsError(str(exc)) from None
        log.warning("cannot guard the bare mountpoint (%s): writes into it land on the disk below", exc)
        return False


def remove(mountpoint: str | os.PathLike[str], *, strict: bool = False) -> bool:
    """Unmount the guard on `mountpoint` (every one, should several be stacked). True if one was removed;
    False if the topmost mount there is no guard (nothing is unmounted then: not ours) or on a failure
    (one WARNING; with `strict`, CkptfsError)."""
    where = _path(mountpoint)
    removed = False
    try:
        while True:
            top = mounted_at(where)
            if top is None or not top.is_guard:
                return removed
            # Lazily: a shell whose working directory is in the guard must not keep a mount from starting.
            _check(_libc().umount2(os.fsencode(where), MNT_DETACH | UMOUNT_NOFOLLOW))
            removed = True
            log.info("removed the guard on %s", where)
    except OSError as exc:
        message = f"cannot remove the guard on {where}: {_why(exc)}"
        if strict:
            raise CkptfsError(message) from None
        log.warning("%s", message)
        return False
