"""The mountpoint as the kernel and the disk under it see it: whether it can be mounted on (a stale
FUSE mount detached, a guard removed), when a new mount is up, the read-ahead of a live mount, and the
unmount of a connection libfuse did not mount itself (one taken over). No FUSE session here: only the
mountpoint's path and device.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import trio

from ckptfs.control.client import holder_path
from ckptfs.errors import CkptfsError
from ckptfs.mount import guard

log = logging.getLogger(__name__)

STALE_MOUNT_STAT_WAIT = 5.0  # how long the start waits on a stat of a FUSE mount already on the mountpoint


def check_mountpoint(mountpoint: Path) -> bool:
    """Whether `mountpoint` can be mounted on (CkptfsError naming why not). Returns whether a guard was
    removed from it: a guard (mount/guard.py) kept writes off the bare directory while nothing served it, and
    mounting replaces it."""
    removed = guard.remove(mountpoint)
    try:
        st = _stat_of_a_mountpoint(mountpoint)
    except FileNotFoundError:
        raise CkptfsError(f"mountpoint {mountpoint} does not exist; create it with: mkdir -p {mountpoint}") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            # A FUSE mount whose daemon died (kill -9, OOM): detach it so this daemon can take over.
            log.warning("mountpoint %s is a stale FUSE mount (its daemon died); detaching it", mountpoint)
            _fusermount_unmount(mountpoint)
            return check_mountpoint(mountpoint) or removed
        raise CkptfsError(f"mountpoint {mountpoint} cannot be used: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CkptfsError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise CkptfsError(f"mountpoint {mountpoint} is already a mount point; unmount it first")
    if any(os.scandir(mountpoint)):
        raise CkptfsError(f"mountpoint {mountpoint} is not empty; mount on an empty directory")
    return removed


def _stat_of_a_mountpoint(mountpoint: Path) -> os.stat_result:
    """os.stat, bounded where a FUSE mount is there: one whose connection something keeps while no daemon
    serves it (a holder this daemon does not find, say one of another version) would make the stat wait
    for ever. A dead one answers ENOTCONN at once."""
    top = guard.mounted_at(mountpoint)
    if top is None or not top.fstype.startswith("fuse"):
        return os.stat(mountpoint)
    result: list[os.stat_result | OSError] = []
    probe = threading.Thread(target=lambda: result.append(_stat_or_error(mountpoint)), daemon=True)
    probe.start()
    probe.join(STALE_MOUNT_STAT_WAIT)
    if not result:
        raise CkptfsError(
            f"mountpoint {mountpoint} is a FUSE mount ({top.describe()}) whose connection is kept alive but that no"
            f" daemon serves, and no holder answers at {holder_path(mountpoint)}: the mount was kept by"
            " another ckptfs version's holder, or another process holds its /dev/fuse. Stop that process, or"
            f" detach the mount (umount -l {mountpoint}: the processes using it then get errors), then mount again")
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def _stat_or_error(path: Path) -> os.stat_result | OSError:
    try:
        _ask_the_daemon(path)
        return os.stat(path)
    except OSError as exc:
        return exc


_AT_FDCWD = -100
_AT_STATX_FORCE_SYNC = 0x2000
_STATX_BASIC_STATS = 0x7FF


def _ask_the_daemon(path: Path) -> None:
    """A stat that the filesystem's daemon answers, not the kernel's cache of its attributes (ckptfs lets
    the kernel keep them for minutes): statx with AT_STATX_FORCE_SYNC, which Python's os module lacks."""
    libc = ctypes.CDLL(None, use_errno=True)
    statx = getattr(libc, "statx", None)
    if statx is None:  # a libc without statx (glibc < 2.28): a plain stat is all there is
        return
    buf = ctypes.create_string_buffer(256)  # struct statx
    if statx(_AT_FDCWD, os.fsencode(path), _AT_STATX_FORCE_SYNC, _STATX_BASIC_STATS, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))


def read_ahead_path(dev: int) -> str:
    """The sysfs file of the kernel's read-ahead for the filesystem on device `dev` (FUSE mounts have a
    backing device info of their own, named by the anonymous device number)."""
    return f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"


async def wait_until_mounted(mountpoint: Path) -> int:
    """Return once the kernel serves the mount on `mountpoint` (its INIT answered, its root's attributes
    read from the daemon): the mount's device number. The daemon calling this serves the mount meanwhile.

    The stat runs in a child process, not in a thread of the daemon: a thread blocked in a FUSE request that
    its own daemon has read cannot be killed. If the daemon died before answering (kill -9, a bug), such a
    thread kept the process from finishing its exit, so /dev/fuse stayed open, nothing answered any more,
    and process and mount hung until someone aborted the connection in /sys/fs/fuse/connections. A child
    is left behind instead (never waited for once cancelled); the connection's end releases it."""
    proc = await trio.lowlevel.open_process(["stat", "--format=%d", "--", str(mountpoint)],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        output = await _read_to_end(proc.stdout)
        errors = await _read_to_end(proc.stderr)
        code = await proc.wait()
    except BaseException:
        proc.kill()
        raise
    if code != 0:
        raise CkptfsError(f"the mount on {mountpoint} did not come up: {errors.decode(errors='replace').strip()}")
    return int(output)


async def _read_to_end(stream: trio.abc.ReceiveStream) -> bytes:
    chunks = []
    while chunk := await stream.receive_some():
        chunks.append(chunk)
    await stream.aclose()
    return b"".join(chunks)


def set_read_ahead(dev: int, nbytes: int) -> None:
    """Make a sequential reader's reads of the mount arrive as few large FUSE requests. The kernel's default
    read-ahead for FUSE is 128 KiB: a 1 GiB read from the cache took 8,000 requests, 1.4-3.1 s and 1.2-4.0 s
    of daemon CPU; with 4 MiB, 1 MiB requests, 0.7 s and 0.55 s. Only root may change it: anyone else
    keeps the default and is told how to change it."""
    path = read_ahead_path(dev)
    kib = max(4, nbytes // 1024)
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.info("cannot set the mount's read-ahead to %d KiB (%s): sequential reads take more requests; as"
                 " root: echo %d > %s", kib, exc.strerror, kib, path)
    else:
        log.debug("read-ahead of the mount: %d KiB", kib)


FUSERMOUNT_MISSING = ("fusermount3 is not installed: install the fuse3 package (apt-get install fuse3; dnf install"
                      " fuse3): it mounts for a user who is not root and unmounts")


def check_fusermount() -> None:
    """A daemon that is not root mounts through libfuse's fusermount3 (setuid root): a clear error now, not
    libfuse's line about an exec that failed."""
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        raise CkptfsError(FUSERMOUNT_MISSING)


def _fusermount_unmount(mountpoint: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)], capture_output=True, text=True,
                              check=False)
    except FileNotFoundError:
        raise CkptfsError(f"cannot unmount {mountpoint}: {FUSERMOUNT_MISSING}") from None


def unmount(mountpoint: Path) -> None:
    try:
        result = _fusermount_unmount(mountpoint)
    except CkptfsError as exc:
        log.warning("%s", exc)
        return
    if result.returncode != 0 and os.path.ismount(mountpoint):
        log.warning("cannot unmount %s: %s", mountpoint, result.stderr.strip())
