"""Nothing a program does through the mount can end it (issue 33), driven through real mounts: an
unlinked open file whose attributes change, truncates far beyond the cache budget, writes at far offsets."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

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


def test_an_unusable_journal_ends_the_daemon_and_leaves_the_mount_aborted_not_unmounted(tmp_path: Path) -> None:
    """The cache filesystem fails under the daemon (ext4 on a loop device, errors=remount-ro, an error
    triggered through sysfs): the journal cannot be written. The daemon ends with one clear line, the
    mountpoint answers ENOTCONN instead of letting writes land on the disk below it, and the next mount
    (once the filesystem is fixed) detaches the dead one and serves what was written."""
    image, cachefs = tmp_path / "cachefs.img", tmp_path / "cachefs"
    cachefs.mkdir()
    subprocess.run(["truncate", "-s", "256M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(cachefs)], check=True)
    m = Mount(tmp_path / "m")
    m.cache = cachefs / "cache"
    try:
        source = subprocess.run(["findmnt", "-no", "SOURCE", str(cachefs)], capture_output=True, text=True,
                                check=True).stdout.strip()
        m.start()
        (m.mnt / "kept").write_bytes(b"written before")
        m.flush()
        Path(f"/sys/fs/ext4/{os.path.basename(source)}/trigger_fs_error").write_text("ckptfs test\n")
        with pytest.raises(OSError):
            os.mkdir(m.mnt / "after")  # the journal cannot record it
        assert m.proc is not None
        assert m.proc.wait(timeout=30) == 1
        m.proc = None
        with pytest.raises(OSError) as raised:
            os.listdir(m.mnt)
        assert raised.value.errno == errno.ENOTCONN  # aborted, still mounted: nothing lands below it
        assert "cannot be used any more" in m.log.read_text()
        assert "Traceback" not in m.log.read_text().split("cannot be used any more")[-1]
        # Fixed (here: the filesystem checked and mounted again), the next mount takes over.
        subprocess.run(["umount", str(cachefs)], check=True)
        subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(cachefs)], check=True)
        m.start()
        assert (m.mnt / "kept").read_bytes() == b"written before"
        m.umount()
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(cachefs)], check=False)
