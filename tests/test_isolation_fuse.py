"""Nothing a program does through the mount can end it (issue 33), driven through real mounts: an
unlinked open file whose attributes change, truncates far beyond the cache budget, writes at far offsets."""

from __future__ import annotations

import errno
import os
import time

import pytest
from conftest import Mount


def _alive(mount: Mount) -> None:
    assert mount.proc is not None and mount.proc.poll() is None, "the daemon exited:\n" + mount.log.read_text()
    os.statvfs(mount.mnt)


def test_attribute_changes_of_an_unlinked_open_file_leave_the_mount_serving(mount: Mount) -> None:
    (mount.mnt / "u").write_bytes(b"x" * 1000)
    (mount.mnt / "d").mkdir()
    mount.flush()
    fd = os.open(mount.mnt / "u", os.O_RDWR)
    dir_fd = os.open(mount.mnt / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.unlink(mount.mnt / "u")
        os.rmdir(mount.mnt / "d")
        os.fchmod(fd, 0o600)
        os.utime(fd, ns=(1_000_000_000, 2_000_000_000))
        os.fchmod(dir_fd, 0o700)
        os.pwrite(fd, b"still mine", 0)
        os.fsync(fd)
        # The drain scans at least every upload_delay (0.1 s here): give it a few rounds with the entries.
        time.sleep(1.5)
        _alive(mount)
        (mount.mnt / "after").write_bytes(b"after")
        mount.flush(timeout=30)
        assert os.pread(fd, 10, 0) == b"still mine"
    finally:
        os.close(fd)
        os.close(dir_fd)
    mount.flush(timeout=30)
    assert mount.store_files() == {"after": b"after"}
    assert not (mount.store / "d").exists()
    _alive(mount)
    assert mount.umount().returncode == 0


@pytest.fixture
def small_cache(mount_factory) -> Mount:  # type: ignore[no-untyped-def]
    # dirty-wait 60 s: before the fix each of these waited that long for room, then failed with ENOSPC.
    # Uploads wait for the flush: the store gets the files as they end, not their 100 GiB of zeros.
    return mount_factory(  # type: ignore[no-any-return]
        upload_delay=600, extra_args=("--cache-size", "64M", "--dirty-wait", "60"))


def test_truncate_far_beyond_the_cache_budget_is_a_sparse_extension(small_cache: Mount) -> None:
    path = small_cache.mnt / "sized"
    path.write_bytes(b"")
    started = time.monotonic()
    os.truncate(path, 100 << 30)
    assert time.monotonic() - started < 5
    assert path.stat().st_size == 100 << 30
    with open(path, "r+b") as f:
        f.seek(50 << 30)
        f.write(b"middle")
    with open(path, "rb") as f:
        f.seek(50 << 30)
        assert f.read(6) == b"middle"
    assert small_cache.status()["cache"]["used_bytes"] < 64 << 20
    os.truncate(path, 3)
    assert path.read_bytes() == b"\0\0\0"
    small_cache.flush(timeout=60)
    assert small_cache.store_files()["sized"] == b"\0\0\0"


def test_truncate_beyond_what_the_cache_filesystem_holds_fails_at_once_with_efbig(small_cache: Mount) -> None:
    path = small_cache.mnt / "huge"
    path.write_bytes(b"abc")
    started = time.monotonic()
    with pytest.raises(OSError) as raised:
        os.truncate(path, (1 << 63) - 1)
    assert raised.value.errno == errno.EFBIG
    assert time.monotonic() - started < 5
    assert path.read_bytes() == b"abc"
    _alive(small_cache)
    # The failed truncate left no change open: the file is not taken for one still being written.
    small_cache.flush(timeout=20)
    assert small_cache.store_files()["huge"] == b"abc"


def test_a_write_at_a_far_offset_charges_only_what_it_wrote(small_cache: Mount) -> None:
    path = small_cache.mnt / "far"
    started = time.monotonic()
    with open(path, "wb") as f:
        f.seek(20 << 30)
        f.write(b"end")
        f.seek(0)
        f.write(b"start")
    assert time.monotonic() - started < 5
    assert path.stat().st_size == (20 << 30) + 3
    assert small_cache.status()["cache"]["used_bytes"] < 64 << 20
    os.truncate(path, 5)
    small_cache.flush(timeout=60)
    assert small_cache.store_files()["far"] == b"start"
