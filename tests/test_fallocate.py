"""fallocate(2) through a real mount (issue 46): space reserved (util-linux `fallocate -l`, posix_fallocate,
FALLOC_FL_KEEP_SIZE), holes punched and ranges zeroed in the cache file, with FUSE passthrough on and off;
the file is dirty as after a write and the store receives exactly what it holds; the reserved space is
charged to the cache budget (waits for room, then ENOSPC, as writes do; a punched hole gives room back); a
kill -9 right after loses nothing. With the stock pyfuse3 (no fallocate handler) fallocate(2) still fails
with EOPNOTSUPP, as it always did."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable

import pyfuse3
import pytest
from conftest import Mount, fuse_requests, stock_pyfuse3

from ckptfs.daemon import METRICS_INTERVAL

MIB = 1 << 20
KEEP_SIZE = 0x01
PUNCH_HOLE = 0x02
COLLAPSE_RANGE = 0x08
ZERO_RANGE = 0x10
INSERT_RANGE = 0x20
UNSHARE_RANGE = 0x40

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int

MountFactory = Callable[..., Mount]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) itself (glibc's posix_fallocate would write zeros where it is refused)."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _kernel_has_passthrough() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 9) and os.geteuid() == 0


# Each test that goes through handles runs with passthrough on (the kernel reads and writes the cache file
# itself, and still sends FALLOCATE to the daemon) and off (every request through the daemon).
PASSTHROUGH = pytest.mark.parametrize("passthrough", [
    pytest.param("auto", marks=pytest.mark.skipif(
        not getattr(pyfuse3, "PASSTHROUGH_BUILD", False) or not _kernel_has_passthrough(),
        reason="FUSE passthrough needs a root daemon on Linux >= 6.9 and pyfuse3 built by scripts/build-fuse.sh")),
    "off",
])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mount(mount_factory: MountFactory, passthrough: str, *extra: str, **kwargs: object) -> Mount:
    mount = mount_factory(extra_args=("--passthrough", passthrough, *extra), **kwargs)
    assert mount.status()["passthrough"]["enabled"] == (passthrough == "auto")
    return mount


def _opens_with_passthrough(mount: Mount) -> int:
    return int(mount.status()["passthrough"]["opens"])


def _used(mount: Mount) -> int:
    return int(mount.status()["cache"]["used_bytes"])


def _state(path: os.PathLike[str] | str) -> str:
    return os.getxattr(path, "user.ckptfs.state").decode()


def _daemon_requests(port: int) -> dict[str, float]:
    """The daemon's FUSE request counts by operation, once its metrics have been published again."""
    time.sleep(METRICS_INTERVAL * 1.5)
    return fuse_requests(port)


@PASSTHROUGH
def test_fallocate_l_and_posix_fallocate_reserve_zeros_and_the_store_receives_them(
    mount_factory: MountFactory, passthrough: str
) -> None:
    port = _free_port()
    mount = _mount(mount_factory, passthrough, "--metrics-addr", f"127.0.0.1:{port}")
    opens = _opens_with_passthrough(mount)
    # util-linux fallocate(1): fallocate(2) mode 0 on a new file (before: "Operation not supported")
    result = subprocess.run(["fallocate", "-l", "48M", str(mount.mnt / "a")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    st = os.stat(mount.mnt / "a")
    assert st.st_size == 48 * MIB and st.st_blocks * 512 >= 48 * MIB
    assert _state(mount.mnt / "a") == "dirty"
    # posix_fallocate after a write: one FALLOCATE request, not the byte per block glibc writes where the
    # filesystem refuses it
    before = _daemon_requests(port)
    fd = os.open(mount.mnt / "b", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"head", 0)
        written = time.time_ns()
        time.sleep(0.01)
        os.posix_fallocate(fd, 0, 24 * MIB)
        st = os.fstat(fd)
        assert st.st_size == 24 * MIB and st.st_blocks * 512 >= 24 * MIB
        assert st.st_mtime_ns > written
        assert os.pread(fd, 24 * MIB, 0) == b"head" + bytes(24 * MIB - 4)
    finally:
        os.close(fd)
    after = _daemon_requests(port)
    assert after.get("fallocate", 0) - before.get("fallocate", 0) == 1
    assert after.get("write", 0) - before.get("write", 0) <= 1  # "head", when passthrough is off
    if passthrough == "auto":
        assert _opens_with_passthrough(mount) >= opens + 2
    assert _used(mount) >= 72 * MIB  # both are charged to the cache budget
    mount.flush()
    assert mount.store_files() == {"a": bytes(48 * MIB), "b": b"head" + bytes(24 * MIB - 4)}
    assert _state(mount.mnt / "a") == _state(mount.mnt / "b") == "clean"


@PASSTHROUGH
def test_keep_size_reserves_blocks_without_changing_the_size(mount_factory: MountFactory, passthrough: str) -> None:
    mount = _mount(mount_factory, passthrough)
    path = mount.mnt / "f"
    path.write_bytes(b"x" * MIB)
    mount.flush()
    used = _used(mount)
    fd = os.open(path, os.O_WRONLY)
    try:
        fallocate(fd, KEEP_SIZE, 0, 16 * MIB)
        st = os.fstat(fd)
        assert st.st_size == MIB and st.st_blocks * 512 >= 16 * MIB
        # charged: the blocks past the end are the cache filesystem's too
        assert _used(mount) >= used + 15 * MIB
        assert _state(path) == "dirty"  # as after a write: a new version
        os.pwrite(fd, b"y" * MIB, MIB)  # a write into what was reserved
    finally:
        os.close(fd)
    assert os.stat(path).st_size == 2 * MIB
    mount.flush()
    assert mount.store_files() == {"f": b"x" * MIB + b"y" * MIB}


@PASSTHROUGH
def test_punch_hole_and_zero_range_read_as_zeros_and_the_store_receives_them(
    mount_factory: MountFactory, passthrough: str
) -> None:
    mount = _mount(mount_factory, passthrough)
    path = mount.mnt / "f"
    content = bytearray(os.urandom(12 * MIB))
    path.write_bytes(content)
    mount.flush()
    used = _used(mount)
    mtime = os.stat(path).st_mtime_ns
    time.sleep(0.01)
    fd = os.open(path, os.O_RDWR)
    try:
        fallocate(fd, PUNCH_HOLE | KEEP_SIZE, MIB, 2 * MIB)
        content[MIB:3 * MIB] = bytes(2 * MIB)
        st = os.fstat(fd)
        assert st.st_size == 12 * MIB and st.st_mtime_ns > mtime
        assert _state(path) == "dirty"
        assert _used(mount) <= used - 2 * MIB  # a punched hole gives room back
        fallocate(fd, ZERO_RANGE | KEEP_SIZE, 5 * MIB, 2 * MIB)
        content[5 * MIB:7 * MIB] = bytes(2 * MIB)
        fallocate(fd, ZERO_RANGE | KEEP_SIZE, 11 * MIB, 4 * MIB)  # past the end: the size stays
        content[11 * MIB:] = bytes(MIB)
        assert os.fstat(fd).st_size == 12 * MIB
        fallocate(fd, ZERO_RANGE, 10 * MIB, 4 * MIB)  # without KEEP_SIZE: zeroed and extended
        content[10 * MIB:] = bytes(4 * MIB)
        assert os.fstat(fd).st_size == 14 * MIB
        # The other modes: EOPNOTSUPP (the kernel's own answer), changing nothing
        for mode in (COLLAPSE_RANGE, INSERT_RANGE, UNSHARE_RANGE, PUNCH_HOLE):
            with pytest.raises(OSError) as refused:
                fallocate(fd, mode, 0, MIB)
            assert refused.value.errno == errno.EOPNOTSUPP, mode
        assert os.pread(fd, 16 * MIB, 0) == content
    finally:
        os.close(fd)
    with open(path, "rb") as reader, pytest.raises(OSError) as not_writable:
        fallocate(reader.fileno(), 0, 0, MIB)
    assert not_writable.value.errno == errno.EBADF
    assert path.read_bytes() == content
    mount.flush()
    assert mount.store_files() == {"f": bytes(content)}


def test_reserving_space_waits_for_room_like_a_write_then_fails_with_enospc(mount_factory: MountFactory) -> None:
    # upload_delay 600: only the back-pressure's "upload now" makes room in time
    mount = mount_factory(upload_delay=600, extra_args=("--cache-size", "64M", "--dirty-wait", "3"))
    mount.allowed_log_words += ["gave up after waiting", "fallocate failed"]
    (mount.mnt / "old").write_bytes(b"o" * (40 * MIB))
    # 40 MiB more do not fit: it waits until the drain uploaded "old" and the evictor removed it
    result = subprocess.run(["fallocate", "-l", "40M", str(mount.mnt / "new")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    cache = mount.status()["cache"]
    assert cache["waits"] >= 1 and cache["enospc"] == 0 and cache["used_bytes"] <= 64 * MIB
    assert mount.store_files()["old"] == b"o" * (40 * MIB)
    held = os.open(mount.mnt / "held", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(held, b"keep", 0)
        fallocate(held, 0, 0, 40 * MIB)  # waits for "new" to go the same way
        # Now nothing can make room: "held" is open (never evicted) and reserved (never spilled)
        other = os.open(mount.mnt / "other", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as full:
                fallocate(other, 0, 0, 40 * MIB)
            assert full.value.errno == errno.ENOSPC
            assert time.monotonic() - started >= 2.5  # after dirty_wait, as a write
            assert mount.status()["cache"]["enospc"] == 1
            assert os.fstat(other).st_size == 0 and os.fstat(other).st_blocks == 0  # nothing reserved
            # More than the whole budget: at once
            started = time.monotonic()
            with pytest.raises(OSError) as too_large:
                fallocate(other, KEEP_SIZE, 0, 100 * MIB)
            assert too_large.value.errno == errno.ENOSPC and time.monotonic() - started < 2
            # A punched hole gives room back: then it fits without a wait
            fallocate(held, PUNCH_HOLE | KEEP_SIZE, 8 * MIB, 32 * MIB)
            waits = mount.status()["cache"]["waits"]
            fallocate(other, 0, 0, 16 * MIB)
            assert mount.status()["cache"]["waits"] == waits
        finally:
            os.close(other)
        assert os.pread(held, 40 * MIB, 0) == b"keep" + bytes(40 * MIB - 4)  # nothing lost
    finally:
        os.close(held)
    mount.flush()
    files = mount.store_files()
    assert files["held"] == b"keep" + bytes(40 * MIB - 4) and files["other"] == bytes(16 * MIB)
    assert files["new"] == bytes(40 * MIB)


def test_a_file_with_reserved_space_is_not_spilled_while_another_is(mount_factory: MountFactory) -> None:
    """A spill uploads the start of a file being written and fails later writes there (EIO): for a file whose
    size is what fallocate reserved, that start is zeros its writer has yet to write. The writer that
    needs the room is spilled instead, and both finish."""
    mount = mount_factory(upload_delay=600, extra_args=("--cache-size", "64M", "--part-size", "5M",
                                                        "--dirty-wait", "60"))
    held = os.open(mount.mnt / "held", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(held, b"keep", 0)
        fallocate(held, 0, 0, 32 * MIB)
        chunk = os.urandom(MIB)
        with open(mount.mnt / "big", "wb") as big:  # 64 MiB through the 32 MiB left: spilled as it goes
            for _ in range(64):
                big.write(chunk)
        assert mount.status()["uploaded"]["spilled_bytes"] > 0
        for offset in range(MIB, 32 * MIB, MIB):  # the reserved range is written now: no EIO
            os.pwrite(held, chunk, offset)
    finally:
        os.close(held)
    mount.flush()
    files = mount.store_files()
    assert files["big"] == chunk * 64
    assert files["held"] == b"keep" + bytes(MIB - 4) + chunk * 31


def _journal_size(mount: Mount, name: str) -> int:
    db = sqlite3.connect(f"file:{mount.cache / 'journal.db'}?mode=ro", uri=True)
    try:
        (size,) = db.execute("SELECT size FROM inodes WHERE path = ?", (name,)).fetchone()
    finally:
        db.close()
    return int(size)


@PASSTHROUGH
def test_kill_9_after_fallocate_then_restart_loses_nothing(mount_factory: MountFactory, passthrough: str) -> None:
    mount = _mount(mount_factory, passthrough, upload_delay=600)
    result = subprocess.run(["fallocate", "-l", "4M", str(mount.mnt / "closed")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fd = os.open(mount.mnt / "open", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"head", 0)
        fallocate(fd, 0, 0, 8 * MIB)
        fallocate(fd, KEEP_SIZE, 0, 16 * MIB)
        mount.kill9()  # while "open" is still open for writing
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    # The journal knew the sizes before the daemon died
    assert _journal_size(mount, "closed") == 4 * MIB and _journal_size(mount, "open") == 8 * MIB
    mount.start()
    assert (mount.mnt / "closed").read_bytes() == bytes(4 * MIB)
    assert (mount.mnt / "open").read_bytes() == b"head" + bytes(8 * MIB - 4)
    mount.flush()
    assert mount.store_files() == {"closed": bytes(4 * MIB), "open": b"head" + bytes(8 * MIB - 4)}


@pytest.mark.core
def test_fallocate_reserves_space_or_is_refused_as_before_with_the_stock_pyfuse3(mount: Mount) -> None:
    path = mount.mnt / "f"
    result = subprocess.run(["fallocate", "-l", "1M", str(path)], capture_output=True, text=True)
    if stock_pyfuse3():
        # No fallocate handler: libfuse answers ENOSYS, the kernel EOPNOTSUPP (as before issue 46)
        assert result.returncode != 0 and "Operation not supported" in result.stderr
        assert path.stat().st_size == 0
        path.write_bytes(bytes(MIB))  # the mount works on
    else:
        assert result.returncode == 0, result.stderr
        assert path.stat().st_size == MIB
    mount.flush()
    assert mount.store_files() == {"f": bytes(MIB)}
