"""POSIX behaviour of a real ckptfs mount (kernel FUSE, daemon in a subprocess, file:// store).

Every test checks what a user sees through the mount and, where the store matters, what the store
directory holds after `ckptfs flush`. Mounts with a long upload_delay make "not uploaded yet" states
deterministic: nothing is uploaded until a flush expedites it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount
from waiting import wait_until

STATE = "user.ckptfs.state"
SLOW = 30.0  # an upload_delay that no test waits out: uploads happen only when a flush asks for them

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(old: Path, new: Path, flags: int) -> None:
    """renameat2(2) via the raw syscall wrapper in libc (Python's os.rename has no flags)."""
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), ctypes.c_uint(flags))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(old), None, str(new))


def state(path: Path) -> bytes:
    return os.getxattr(path, STATE, follow_symlinks=False)


def uploaded_order(m: Mount) -> list[str]:
    """Store keys in the order the drain finished uploading them (from the daemon's DEBUG log)."""
    return re.findall(r" uploaded (\S+) \(\d+ bytes", m.log.read_text())


def store_dirs(m: Mount) -> set[str]:
    return {str(p.relative_to(m.store)) for p in m.store.rglob("*") if p.is_dir() and not p.is_symlink()
            and ".ckptfs-tmp." not in str(p)}


def expect_errno(code: int, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


# -- data: create, read, write -------------------------------------------------------------------------


def test_create_read_write_at_offsets(mount: Mount) -> None:
    path = mount.mnt / "data.bin"
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o644)
    try:
        assert os.pwrite(fd, b"A" * 10_000, 0) == 10_000
        assert os.pwrite(fd, b"middle", 4_000) == 6
        assert os.pwrite(fd, b"tail", 9_998) == 4  # overlaps EOF: extends by 2 bytes
        assert os.pread(fd, 6, 4_000) == b"middle"
        assert os.pread(fd, 100, 9_990) == b"A" * 8 + b"tail"
        assert os.pread(fd, 10, 20_000) == b""  # read past EOF
        assert os.fstat(fd).st_size == 10_002
    finally:
        os.close(fd)
    expect_errno(errno.EEXIST, os.open, path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)

    expected = bytearray(b"A" * 10_000)
    expected[4_000:4_006] = b"middle"
    expected[9_998:] = b"tail"
    assert path.read_bytes() == expected
    # Seek-and-write through a buffered file object, in the middle of an existing file.
    with open(path, "r+b") as f:
        f.seek(123)
        f.write(b"xyz")
    expected[123:126] = b"xyz"
    assert path.read_bytes() == expected
    assert path.stat().st_size == len(expected)

    mount.flush()
    assert mount.store_files() == {"data.bin": bytes(expected)}
    assert state(path) == b"clean"

    # Overwriting part of a clean file re-uploads it whole.
    with open(path, "r+b") as f:
        f.seek(5)
        f.write(b"again")
    expected[5:10] = b"again"
    mount.flush()
    assert mount.store_files() == {"data.bin": bytes(expected)}
    assert path.read_bytes() == expected


def test_create_variants(mount: Mount) -> None:
    os.close(os.open(mount.mnt / "created-rdonly", os.O_CREAT | os.O_RDONLY, 0o600))  # O_CREAT, read-only
    with open(mount.mnt / "x-mode", "x") as f:  # O_EXCL
        f.write("exclusive")
    assert stat.S_IMODE(os.stat(mount.mnt / "created-rdonly").st_mode) == 0o600
    fd = os.open(mount.mnt / "created-rdonly", os.O_RDONLY)
    try:
        expect_errno(errno.EBADF, os.write, fd, b"no")
    finally:
        os.close(fd)
    expect_errno(errno.EISDIR, os.open, mount.mnt, os.O_WRONLY)
    mount.flush()
    assert mount.store_files() == {"created-rdonly": b"", "x-mode": b"exclusive"}


def test_concurrent_writers(mount: Mount) -> None:
    payloads = {f"rank-{i}.bin": os.urandom(512 * 1024 + i) for i in range(8)}

    def write(name: str) -> None:
        data = payloads[name]
        with open(mount.mnt / name, "wb") as f:
            for start in range(0, len(data), 64 * 1024):
                f.write(data[start:start + 64 * 1024])

    threads = [threading.Thread(target=write, args=(name,)) for name in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, data in payloads.items():
        assert (mount.mnt / name).read_bytes() == data
    mount.flush()
    assert mount.store_files() == payloads


def test_large_sequential_write_and_read(mount: Mount) -> None:
    payload = os.urandom(3 * 1024 * 1024 + 17)  # not a multiple of any block or request size
    (mount.mnt / "big.bin").write_bytes(payload)
    assert (mount.mnt / "big.bin").read_bytes() == payload
    mount.flush()
    assert mount.store_files() == {"big.bin": payload}


def test_sparse_file_hole_reads_zeros(mount: Mount) -> None:
    path = mount.mnt / "sparse.bin"
    with open(path, "wb") as f:
        f.write(b"head")
        f.seek(1 << 20)
        f.write(b"tail")
    size = (1 << 20) + 4
    assert path.stat().st_size == size
    with open(path, "rb") as f:
        f.seek(4)
        assert f.read((1 << 20) - 4) == bytes((1 << 20) - 4)
        assert f.read() == b"tail"
    # pwrite far past EOF on an existing file, then read across the hole
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"end", 3 << 20)
    finally:
        os.close(fd)
    expected = b"head" + bytes((1 << 20) - 4) + b"tail" + bytes((3 << 20) - size) + b"end"
    assert path.stat().st_size == len(expected)
    assert path.read_bytes() == expected
    mount.flush()
    assert mount.store_files() == {"sparse.bin": expected}


def test_append_mode(mount: Mount) -> None:
    path = mount.mnt / "log.txt"
    with open(path, "ab") as f:
        f.write(b"one\n")
    with open(path, "ab") as f:
        f.write(b"two\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"three\n")
        os.lseek(fd, 0, os.SEEK_SET)  # O_APPEND writes go to the end regardless of the offset
        os.write(fd, b"four\n")
    finally:
        os.close(fd)
    # Two appenders at once share the end of the file.
    a = os.open(path, os.O_WRONLY | os.O_APPEND)
    b = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(a, b"five\n")
        os.write(b, b"six\n")
    finally:
        os.close(a)
        os.close(b)
    expected = b"one\ntwo\nthree\nfour\nfive\nsix\n"
    assert path.read_bytes() == expected
    mount.flush()
    assert mount.store_files() == {"log.txt": expected}
    # Appending to a clean (uploaded) file
    with open(path, "ab") as f:
        f.write(b"seven\n")
    mount.flush()
    assert mount.store_files() == {"log.txt": expected + b"seven\n"}


def test_truncate_and_ftruncate(mount: Mount) -> None:
    path = mount.mnt / "t.bin"
    path.write_bytes(b"0123456789")
    os.truncate(path, 4)  # shrink by path, no open handle
    assert path.stat().st_size == 4
    assert path.read_bytes() == b"0123"
    os.truncate(path, 8)  # grow by path: zeros
    assert path.read_bytes() == b"0123" + bytes(4)

    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 2)
        assert os.fstat(fd).st_size == 2
        assert os.pread(fd, 100, 0) == b"01"
        os.ftruncate(fd, 6)
        assert os.pread(fd, 100, 0) == b"01" + bytes(4)
        os.pwrite(fd, b"Z", 5)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"01\0\0\0Z"
    mount.flush()
    assert mount.store_files() == {"t.bin": b"01\0\0\0Z"}

    # Truncating a clean file by path (no handle) makes it dirty and re-uploads it.
    os.truncate(path, 3)
    assert state(path) in (b"dirty", b"uploading", b"clean")
    mount.flush()
    assert mount.store_files() == {"t.bin": b"01\0"}
    assert state(path) == b"clean"
    # O_TRUNC on a clean file
    with open(path, "wb") as f:
        f.write(b"new")
    mount.flush()
    assert mount.store_files() == {"t.bin": b"new"}
    # to zero
    os.truncate(path, 0)
    mount.flush()
    assert mount.store_files() == {"t.bin": b""}
    assert path.stat().st_size == 0


def test_truncate_directory_fails(mount: Mount) -> None:
    (mount.mnt / "d").mkdir()
    expect_errno(errno.EISDIR, os.truncate, mount.mnt / "d", 0)


def test_fsync_and_fdatasync(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    path = m.mnt / "synced.bin"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"a" * 5000)
        os.fsync(fd)
        assert os.stat(path).st_size == 5000
        assert state(path) == b"dirty"  # fsync is local durability, not an upload
        os.write(fd, b"b" * 100)
        os.fdatasync(fd)
        assert path.read_bytes() == b"a" * 5000 + b"b" * 100
    finally:
        os.close(fd)
    # fsync on a directory (fsyncdir) and on a read-only handle work too
    dfd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    rfd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(rfd)
    finally:
        os.close(rfd)
    assert m.store_files() == {}  # upload_delay has not passed: nothing uploaded yet
    m.flush()
    assert m.store_files() == {"synced.bin": b"a" * 5000 + b"b" * 100}


def test_mmap_read(mount: Mount) -> None:
    payload = os.urandom(200_000)
    path = mount.mnt / "mapped.bin"
    path.write_bytes(payload)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert len(mm) == len(payload)
        assert mm[:] == payload
        assert mm[150_000:150_010] == payload[150_000:150_010]
    mount.flush()
    # mapping a clean file
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[-100:] == payload[-100:]


def test_mmap_shared_write(mount: Mount) -> None:
    path = mount.mnt / "mapped-rw.bin"
    path.write_bytes(bytes(8192))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        mm[100:105] = b"hello"
        mm[8000:8003] = b"end"
        mm.flush()
    expected = bytearray(8192)
    expected[100:105] = b"hello"
    expected[8000:8003] = b"end"
    assert path.read_bytes() == expected
    mount.flush()
    assert mount.store_files() == {"mapped-rw.bin": bytes(expected)}


# -- directories ---------------------------------------------------------------------------------------


def test_mkdir_rmdir(mount: Mount) -> None:
    os.makedirs(mount.mnt / "a" / "b" / "c")
    (mount.mnt / "a" / "b" / "f.txt").write_bytes(b"f")
    (mount.mnt / "empty").mkdir()
    (mount.mnt / "gone").mkdir()
    assert stat.S_ISDIR((mount.mnt / "a" / "b" / "c").stat().st_mode)
    expect_errno(errno.EEXIST, os.mkdir, mount.mnt / "a")
    expect_errno(errno.ENOTEMPTY, os.rmdir, mount.mnt / "a")
    expect_errno(errno.ENOTEMPTY, os.rmdir, mount.mnt / "a" / "b")
    expect_errno(errno.ENOTDIR, os.rmdir, mount.mnt / "a" / "b" / "f.txt")
    expect_errno(errno.EISDIR, os.unlink, mount.mnt / "a" / "b" / "c")
    expect_errno(errno.ENOENT, os.rmdir, mount.mnt / "nope")
    expect_errno(errno.ENOTDIR, os.mkdir, mount.mnt / "a" / "b" / "f.txt" / "x")
    mount.flush()
    assert mount.store_files() == {"a/b/f.txt": b"f"}
    assert store_dirs(mount) == {"a", "a/b", "a/b/c", "empty", "gone"}  # empty dirs persist

    before = os.stat(mount.mnt / "a" / "b").st_mtime_ns
    time.sleep(0.01)
    os.rmdir(mount.mnt / "a" / "b" / "c")
    assert os.stat(mount.mnt / "a" / "b").st_mtime_ns > before  # the parent changed
    os.rmdir(mount.mnt / "gone")
    assert not (mount.mnt / "gone").exists()
    assert sorted(os.listdir(mount.mnt / "a" / "b")) == ["f.txt"]
    mount.flush()
    assert store_dirs(mount) == {"a", "a/b", "empty"}
    # remove a whole tree bottom-up
    os.unlink(mount.mnt / "a" / "b" / "f.txt")
    os.rmdir(mount.mnt / "a" / "b")
    os.rmdir(mount.mnt / "a")
    mount.flush()
    assert store_dirs(mount) == {"empty"}
    assert mount.store_files() == {}
    assert os.listdir(mount.mnt) == ["empty"]


def test_readdir_large_directory(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """~2000 entries: more than one kernel readdir buffer and more than one journal page (1000 rows).
    They are put in the store before mounting (creating and flushing 2000 files through the mount takes
    tens of seconds: the drain's per-notification scans and flush's re-checks are O(pending) each); a
    fresh mount must list every one of them, and more made through the mount, completely and without
    duplicates."""
    m: Mount = mount_factory(start=False)
    (m.store / "big").mkdir()
    names = {f"file-{i:05d}-{'x' * 40}.bin" for i in range(2000)}  # long names: fewer per buffer
    for name in names:
        (m.store / "big" / name).write_bytes(name[:10].encode())
    m.start()
    big = m.mnt / "big"
    listed = os.listdir(big)
    assert len(listed) == len(names)
    assert set(listed) == names
    with os.scandir(big) as it:
        entries = list(it)
    assert len(entries) == len(names)
    assert all(e.is_file(follow_symlinks=False) for e in entries)
    assert all(e.stat(follow_symlinks=False).st_size == 10 for e in entries[::100])
    assert (big / sorted(names)[1234]).read_bytes() == sorted(names)[1234][:10].encode()

    # entries made through the mount come after them; removed ones disappear
    created = {f"new-{i:03d}" for i in range(200)}
    for name in created:
        os.close(os.open(big / name, os.O_CREAT | os.O_WRONLY, 0o644))
    removed = set(sorted(names)[::7])
    for name in removed:
        os.unlink(big / name)
    expected = (names - removed) | created
    listed = os.listdir(big)
    assert len(listed) == len(expected)
    assert set(listed) == expected
    assert os.listdir(m.mnt) == ["big"]
    m.flush()
    assert {p.name for p in (m.store / "big").iterdir()} == expected


def test_readdir_while_modifying(mount: Mount) -> None:
    d = mount.mnt / "d"
    d.mkdir()
    for i in range(50):
        (d / f"{i}").write_bytes(b"")
    seen = []
    with os.scandir(d) as it:
        for entry in it:
            seen.append(entry.name)
    assert sorted(seen, key=int) == [str(i) for i in range(50)]
    assert set(os.listdir(d)) == {str(i) for i in range(50)}


# -- unlink -----------------------------------------------------------------------------------------------


def test_unlink_open_file(mount: Mount) -> None:
    path = mount.mnt / "victim.bin"
    payload = os.urandom(100_000)
    path.write_bytes(payload)
    mount.flush()
    assert mount.store_files() == {"victim.bin": payload}

    rfd = os.open(path, os.O_RDONLY)
    wfd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)
        assert not path.exists()
        assert "victim.bin" not in os.listdir(mount.mnt)
        assert os.pread(rfd, len(payload) + 10, 0) == payload  # still readable through the open fd
        os.pwrite(wfd, b"more", len(payload))  # and writable
        assert os.pread(rfd, 10, len(payload)) == b"more"
        assert os.fstat(rfd).st_size == len(payload) + 4
        mount.flush()
        assert mount.store_files() == {}  # the delete reached the store while the file is still open
        # a new file with the same name is independent of the open one
        path.write_bytes(b"newcomer")
        assert os.pread(rfd, 4, 0) == payload[:4]
    finally:
        os.close(rfd)
        os.close(wfd)
    mount.flush()
    assert mount.store_files() == {"victim.bin": b"newcomer"}  # the unlinked data never resurfaced
    assert path.read_bytes() == b"newcomer"
    # once closed (and forgotten by the kernel) the unlinked file's cache data goes away
    wait_until(lambda: os.listdir(mount.cache / "data"), done=lambda files: len(files) == 1, timeout=5,
               what="one file in the cache")


def test_rename_over_file_open_for_reading(mount: Mount) -> None:
    (mount.mnt / "cur").write_bytes(b"old version")
    fd = os.open(mount.mnt / "cur", os.O_RDONLY)
    try:
        (mount.mnt / "cur.tmp").write_bytes(b"new version")
        os.replace(mount.mnt / "cur.tmp", mount.mnt / "cur")
        assert os.pread(fd, 100, 0) == b"old version"  # the reader keeps what it opened
        assert (mount.mnt / "cur").read_bytes() == b"new version"
        mount.flush()
        assert mount.store_files() == {"cur": b"new version"}
    finally:
        os.close(fd)


def test_unlink_before_upload(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    (m.mnt / "keep.bin").write_bytes(b"keep")
    (m.mnt / "tmp.bin").write_bytes(b"tmp")
    os.unlink(m.mnt / "tmp.bin")
    m.flush()
    assert m.store_files() == {"keep.bin": b"keep"}
    assert "tmp.bin" not in uploaded_order(m)
    expect_errno(errno.ENOENT, os.unlink, m.mnt / "tmp.bin")
    # unlinked while still open for writing, written and closed afterwards: never uploaded either
    fd = os.open(m.mnt / "scratch.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"scratch")
        os.unlink(m.mnt / "scratch.bin")
        os.write(fd, b" more")
    finally:
        os.close(fd)
    m.flush()
    assert m.store_files() == {"keep.bin": b"keep"}
    assert "scratch.bin" not in uploaded_order(m)


# -- rename --------------------------------------------------------------------------------------------


@pytest.mark.core
def test_rename_replaces_existing_file(mount: Mount) -> None:
    old, new = mount.mnt / "a.bin", mount.mnt / "b.bin"
    old.write_bytes(b"new content")
    new.write_bytes(b"old content of b")
    mount.flush()
    assert mount.store_files() == {"a.bin": b"new content", "b.bin": b"old content of b"}
    os.rename(old, new)
    assert not old.exists()
    assert new.read_bytes() == b"new content"
    assert os.listdir(mount.mnt) == ["b.bin"]
    mount.flush()
    assert mount.store_files() == {"b.bin": b"new content"}


def test_rename_replaces_existing_file_before_upload(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    (m.mnt / "target").write_bytes(b"v1")
    m.flush()
    (m.mnt / "incoming").write_bytes(b"v2")
    os.replace(m.mnt / "incoming", m.mnt / "target")
    assert (m.mnt / "target").read_bytes() == b"v2"
    m.flush()
    assert m.store_files() == {"target": b"v2"}
    assert "incoming" not in uploaded_order(m)


def test_rename_open_file(mount: Mount) -> None:
    fd = os.open(mount.mnt / "writing", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"first half ")
        os.rename(mount.mnt / "writing", mount.mnt / "done")
        os.write(fd, b"second half")
    finally:
        os.close(fd)
    assert (mount.mnt / "done").read_bytes() == b"first half second half"
    mount.flush()
    assert mount.store_files() == {"done": b"first half second half"}


@pytest.mark.core
def test_rename_directory_with_contents(mount: Mount) -> None:
    src = mount.mnt / "ckpt-tmp"
    (src / "sub").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "model.bin").write_bytes(b"model")
    (src / "sub" / "optim.bin").write_bytes(b"optim")
    mount.flush()
    assert mount.store_files() == {"ckpt-tmp/model.bin": b"model", "ckpt-tmp/sub/optim.bin": b"optim"}

    os.rename(src, mount.mnt / "ckpt-100")
    assert not src.exists()
    assert (mount.mnt / "ckpt-100" / "sub" / "optim.bin").read_bytes() == b"optim"
    assert sorted(os.listdir(mount.mnt / "ckpt-100")) == ["empty", "model.bin", "sub"]
    mount.flush()
    assert mount.store_files() == {"ckpt-100/model.bin": b"model", "ckpt-100/sub/optim.bin": b"optim"}
    assert store_dirs(mount) == {"ckpt-100", "ckpt-100/sub", "ckpt-100/empty"}

    # into another directory, and renamed back under a name that existed before
    (mount.mnt / "archive").mkdir()
    os.rename(mount.mnt / "ckpt-100", mount.mnt / "archive" / "ckpt-tmp")
    mount.flush()
    assert mount.store_files() == {
        "archive/ckpt-tmp/model.bin": b"model", "archive/ckpt-tmp/sub/optim.bin": b"optim",
    }
    assert store_dirs(mount) == {
        "archive", "archive/ckpt-tmp", "archive/ckpt-tmp/sub", "archive/ckpt-tmp/empty",
    }


def test_rename_directory_holding_open_file(mount: Mount) -> None:
    (mount.mnt / "partial").mkdir()
    fd = os.open(mount.mnt / "partial" / "shard.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"written before ")
        os.rename(mount.mnt / "partial", mount.mnt / "final")
        os.write(fd, b"and after the rename")
    finally:
        os.close(fd)
    assert (mount.mnt / "final" / "shard.bin").read_bytes() == b"written before and after the rename"
    mount.flush()
    assert mount.store_files() == {"final/shard.bin": b"written before and after the rename"}
    assert store_dirs(mount) == {"final"}


def test_rename_directory_errors(mount: Mount) -> None:
    (mount.mnt / "d" / "inner").mkdir(parents=True)
    (mount.mnt / "full" / "x").mkdir(parents=True)
    (mount.mnt / "f").write_bytes(b"f")
    expect_errno(errno.EINVAL, os.rename, mount.mnt / "d", mount.mnt / "d" / "inner" / "d")
    expect_errno(errno.ENOTEMPTY, os.rename, mount.mnt / "d", mount.mnt / "full")
    expect_errno(errno.ENOTDIR, os.rename, mount.mnt / "d", mount.mnt / "f")
    expect_errno(errno.EISDIR, os.rename, mount.mnt / "f", mount.mnt / "d")
    # replacing an empty directory works
    os.rename(mount.mnt / "d", mount.mnt / "full" / "x")
    assert os.listdir(mount.mnt / "full" / "x") == ["inner"]
    mount.flush()
    assert store_dirs(mount) == {"full", "full/x", "full/x/inner"}
    assert mount.store_files() == {"f": b"f"}


def test_rename_before_and_after_upload_converge(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    (m.mnt / "after").mkdir()
    (m.mnt / "after" / "a").write_bytes(b"payload")
    m.flush()
    assert m.store_files() == {"after/a": b"payload"}

    (m.mnt / "before").mkdir()
    (m.mnt / "before" / "a").write_bytes(b"payload")
    os.rename(m.mnt / "before" / "a", m.mnt / "before" / "b")  # not uploaded yet: upload as b only
    os.rename(m.mnt / "after" / "a", m.mnt / "after" / "b")  # uploaded: copy, then delete the old key
    # The new file waits for upload_delay (the move of the uploaded one may already have run: moves do not).
    assert not any(key.startswith("before/") for key in m.store_files())
    m.flush()
    assert m.store_files() == {"before/b": b"payload", "after/b": b"payload"}
    assert "before/a" not in uploaded_order(m)
    assert (m.mnt / "before" / "b").read_bytes() == (m.mnt / "after" / "b").read_bytes() == b"payload"
    assert state(m.mnt / "before" / "b") == state(m.mnt / "after" / "b") == b"clean"


def test_rename_chain_and_back(mount: Mount) -> None:
    (mount.mnt / "x").write_bytes(b"x")
    mount.flush()
    os.rename(mount.mnt / "x", mount.mnt / "y")
    os.rename(mount.mnt / "y", mount.mnt / "z")
    os.rename(mount.mnt / "z", mount.mnt / "x")  # back to the key the store already has
    mount.flush()
    assert mount.store_files() == {"x": b"x"}
    os.rename(mount.mnt / "x", mount.mnt / "y")
    os.rename(mount.mnt / "y", mount.mnt / "z")
    mount.flush()
    assert mount.store_files() == {"z": b"x"}
    os.rename(mount.mnt / "z", mount.mnt / "z")  # same name: no-op
    assert (mount.mnt / "z").read_bytes() == b"x"


@pytest.mark.core
def test_renameat2_flags(mount: Mount) -> None:
    a, b, c = mount.mnt / "a", mount.mnt / "b", mount.mnt / "c"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    expect_errno(errno.EEXIST, renameat2, a, b, RENAME_NOREPLACE)
    assert a.read_bytes() == b"A" and b.read_bytes() == b"B"
    expect_errno(errno.EINVAL, renameat2, a, b, RENAME_EXCHANGE)
    assert a.read_bytes() == b"A" and b.read_bytes() == b"B"
    renameat2(a, c, RENAME_NOREPLACE)  # target absent: a normal rename
    assert not a.exists()
    assert c.read_bytes() == b"A"
    renameat2(c, b, 0)
    assert b.read_bytes() == b"A"
    mount.flush()
    assert mount.store_files() == {"b": b"A"}


# -- attributes ----------------------------------------------------------------------------------------


def test_stat_chmod_chown_utime(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    path = m.mnt / "attrs.bin"
    mtime_ns = 1_600_000_000_123_456_789
    atime_ns = 1_500_000_000_000_000_000
    with open(path, "wb") as f:
        f.write(b"x" * 1234)
        f.flush()
        st = os.stat(path)
        assert stat.S_ISREG(st.st_mode)
        assert st.st_size == 1234
        assert st.st_nlink == 1
        assert st.st_uid == os.getuid()
        assert st.st_ino > 1
        os.chmod(path, 0o640)
        os.chown(path, 1234, 5678)
        os.utime(path, ns=(atime_ns, mtime_ns))
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert st.st_mtime_ns == mtime_ns
    assert st.st_atime_ns == atime_ns
    assert st.st_size == 1234
    assert st.st_blocks > 0
    m.flush()
    stored = (m.store / "attrs.bin").stat()
    assert stat.S_IMODE(stored.st_mode) == 0o640  # mode and mtime travel with the object
    assert stored.st_mtime_ns == mtime_ns
    # same through the mount after the upload
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_mtime_ns == mtime_ns

    # directories
    d = m.mnt / "dir"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o700)
    os.utime(d, ns=(atime_ns, mtime_ns))
    st = os.stat(d)
    assert stat.S_ISDIR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_mtime_ns == mtime_ns
    assert st.st_nlink >= 2
    # the root
    assert stat.S_ISDIR(os.stat(m.mnt).st_mode)
    # a write updates mtime
    before = os.stat(path).st_mtime_ns
    with open(path, "ab") as f:
        f.write(b"y")
    assert os.stat(path).st_mtime_ns > before


def test_chmod_utime_after_upload_reach_store(mount: Mount) -> None:
    path = mount.mnt / "script.sh"
    path.write_bytes(b"#!/bin/sh\n")
    os.chmod(path, 0o644)
    mount.flush()
    assert stat.S_IMODE((mount.store / "script.sh").stat().st_mode) == 0o644
    os.chmod(path, 0o755)
    os.utime(path, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    assert stat.S_IMODE(path.stat().st_mode) == 0o755  # the mount shows it at once
    mount.flush()
    stored = (mount.store / "script.sh").stat()
    assert stat.S_IMODE(stored.st_mode) == 0o755
    assert stored.st_mtime_ns == 1_600_000_000_000_000_000


def test_statfs(mount: Mount) -> None:
    st = os.statvfs(mount.mnt)
    assert st.f_bsize > 0
    assert st.f_frsize > 0
    assert st.f_blocks > 0
    assert 0 < st.f_bavail <= st.f_blocks
    assert st.f_files > 0
    assert st.f_namemax == 255


# -- special files ---------------------------------------------------------------------------------------


def test_symlink_readlink(mount: Mount) -> None:
    (mount.mnt / "ckpt-7").mkdir()
    (mount.mnt / "ckpt-7" / "w.bin").write_bytes(b"weights")
    os.symlink("ckpt-7", mount.mnt / "current")
    os.symlink("../nowhere/at all", mount.mnt / "dangling")
    assert os.readlink(mount.mnt / "current") == "ckpt-7"
    assert os.readlink(mount.mnt / "dangling") == "../nowhere/at all"
    assert stat.S_ISLNK(os.lstat(mount.mnt / "current").st_mode)
    assert (mount.mnt / "current" / "w.bin").read_bytes() == b"weights"  # followed by the kernel
    assert not (mount.mnt / "dangling").exists()
    expect_errno(errno.EEXIST, os.symlink, "x", mount.mnt / "current")
    expect_errno(errno.EINVAL, os.readlink, mount.mnt / "ckpt-7" / "w.bin")
    mount.flush()
    assert os.path.islink(mount.store / "current")
    assert os.readlink(mount.store / "current") == "ckpt-7"
    assert os.readlink(mount.store / "dangling") == "../nowhere/at all"
    assert mount.store_files() == {"ckpt-7/w.bin": b"weights"}
    # re-point the link atomically (a common "latest" idiom)
    os.symlink("ckpt-8", mount.mnt / "current.new")
    os.replace(mount.mnt / "current.new", mount.mnt / "current")
    assert os.readlink(mount.mnt / "current") == "ckpt-8"
    os.unlink(mount.mnt / "dangling")
    mount.flush()
    assert os.readlink(mount.store / "current") == "ckpt-8"
    assert not os.path.lexists(mount.store / "current.new")
    assert not os.path.lexists(mount.store / "dangling")


def test_hard_link_and_device_nodes_refused(mount: Mount) -> None:
    (mount.mnt / "f").write_bytes(b"f")
    expect_errno(errno.EPERM, os.link, mount.mnt / "f", mount.mnt / "f2")
    expect_errno(errno.EPERM, os.mknod, mount.mnt / "fifo", stat.S_IFIFO | 0o600)
    expect_errno(errno.EPERM, os.mkfifo, mount.mnt / "fifo2")
    expect_errno(errno.EPERM, os.mknod, mount.mnt / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert sorted(os.listdir(mount.mnt)) == ["f"]
    mount.flush()
    assert mount.store_files() == {"f": b"f"}


def test_mknod_regular_file(mount: Mount) -> None:
    """mknod(S_IFREG) is how some programs (and the kernel's vfs_create path) create an empty file."""
    os.mknod(mount.mnt / "plain", stat.S_IFREG | 0o644)
    assert stat.S_ISREG(os.stat(mount.mnt / "plain").st_mode)
    assert (mount.mnt / "plain").read_bytes() == b""
    (mount.mnt / "plain").write_bytes(b"filled")
    mount.flush()
    assert mount.store_files() == {"plain": b"filled"}


# -- xattr -----------------------------------------------------------------------------------------------


def test_state_xattr(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=SLOW)
    path = m.mnt / "x.bin"
    path.write_bytes(b"data")
    assert state(path) == b"dirty"
    assert STATE in os.listxattr(path)
    (m.mnt / "d").mkdir()
    # A directory does not wait for upload_delay: it may be in the store already (it was, under load).
    assert state(m.mnt / "d") in (b"dirty", b"uploading", b"clean")
    m.flush()
    assert state(path) == b"clean"
    assert state(m.mnt / "d") == b"clean"
    # read-only: setting or removing it fails, the value is unchanged
    expect_errno(errno.EPERM, os.setxattr, path, STATE, b"clean")
    expect_errno(errno.EPERM, os.removexattr, path, STATE)
    with pytest.raises(OSError) as info:
        os.setxattr(path, "user.other", b"v")
    assert info.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
    expect_errno(errno.ENODATA, os.getxattr, path, "user.missing")
    assert state(path) == b"clean"
    # writing makes it dirty again (while open for write it is never uploaded)
    with open(path, "ab") as f:
        f.write(b"more")
        f.flush()
        assert state(path) == b"dirty"
    m.flush()
    assert state(path) == b"clean"
    assert m.store_files() == {"x.bin": b"datamore"}


# -- names -----------------------------------------------------------------------------------------------


def test_invalid_names(mount: Mount) -> None:
    root = os.fsencode(mount.mnt)
    bad = root + b"/bad-\xff\xfe.bin"
    expect_errno(errno.EINVAL, os.open, bad, os.O_CREAT | os.O_WRONLY, 0o644)
    expect_errno(errno.EINVAL, os.mkdir, bad)
    expect_errno(errno.EINVAL, os.symlink, b"x", bad)
    (mount.mnt / "ok").write_bytes(b"ok")
    expect_errno(errno.EINVAL, os.rename, root + b"/ok", bad)
    expect_errno(errno.ENOENT, os.stat, bad)

    long_name = "n" * 256
    expect_errno(errno.ENAMETOOLONG, os.open, mount.mnt / long_name, os.O_CREAT | os.O_WRONLY, 0o644)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, mount.mnt / long_name)
    expect_errno(errno.ENAMETOOLONG, os.rename, mount.mnt / "ok", mount.mnt / long_name)
    # multi-byte UTF-8: 128 characters = 256 bytes
    expect_errno(errno.ENAMETOOLONG, os.mkdir, mount.mnt / ("é" * 128))

    # A name that cannot exist is ENAMETOOLONG for every call that looks it up (pjdfstest: ENOENT before).
    for call in (os.stat, os.lstat, os.unlink, os.rmdir, os.listdir):
        expect_errno(errno.ENAMETOOLONG, call, mount.mnt / long_name)
    expect_errno(errno.ENAMETOOLONG, os.chmod, mount.mnt / long_name, 0o600)
    expect_errno(errno.ENAMETOOLONG, os.stat, mount.mnt / long_name / "below")
    expect_errno(errno.ENAMETOOLONG, os.open, mount.mnt / long_name, os.O_RDONLY)

    # the limits themselves are fine
    max_name = "m" * 255
    (mount.mnt / max_name).write_bytes(b"max")
    (mount.mnt / "ünïcødé ✓.bin").write_bytes(b"utf8")
    assert set(os.listdir(mount.mnt)) == {"ok", max_name, "ünïcødé ✓.bin"}
    mount.flush()
    assert mount.store_files() == {"ok": b"ok", max_name: b"max", "ünïcødé ✓.bin": b"utf8"}


def test_path_too_long_for_store(mount: Mount) -> None:
    d = mount.mnt
    for i in range(4):
        d = d / (f"{i}" * 200)
        d.mkdir()
    # 4 * 201 bytes of directories; a 250-byte name would pass 1000 bytes
    expect_errno(errno.ENAMETOOLONG, os.open, d / ("f" * 250), os.O_CREAT | os.O_WRONLY, 0o644)
    # Looking the too-long path up says so too (pjdfstest: ENOENT before).
    expect_errno(errno.ENAMETOOLONG, os.stat, d / ("f" * 250))
    expect_errno(errno.ENAMETOOLONG, os.unlink, d / ("f" * 250))
    expect_errno(errno.ENOENT, os.stat, d / "missing")
    (d / "short").write_bytes(b"s")
    mount.flush()
    assert list(mount.store_files().values()) == [b"s"]


def test_directory_link_count_counts_subdirectories(mount: Mount) -> None:
    """2 + subdirectories, as on a local filesystem (find and fts rely on it); files do not count."""
    top = mount.mnt / "top"
    top.mkdir()
    (top / "file").write_bytes(b"f")
    assert os.stat(top).st_nlink == 2
    for name in ("a", "b", "c"):
        (top / name).mkdir()
    assert os.stat(top).st_nlink == 5
    assert os.stat(top / "a").st_nlink == 2
    (top / "c").rmdir()
    os.rename(top / "b", mount.mnt / "moved")
    assert os.stat(top).st_nlink == 3
    assert os.stat(mount.mnt).st_nlink == 4  # top, moved and the root's own two
    # readdir's attributes (readdirplus) agree with stat
    with os.scandir(mount.mnt) as entries:
        assert {e.name: e.stat(follow_symlinks=False).st_nlink for e in entries if e.is_dir()} == {"top": 3, "moved": 2}


# -- ordering -----------------------------------------------------------------------------------------


def test_commit_marker_uploaded_after_data(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(extra_args=("--transfers", "8"))
    data = {f"ckpt/shard-{i}.bin": os.urandom(2 << 20) for i in range(6)}
    violations: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        # Sound check: if `latest` exists at t1 and a data file is missing at t2 > t1, the pointer was
        # in the store before the data it points at.
        while not stop.is_set():
            if (m.store / "latest").exists():
                missing = [k for k in data if not (m.store / k).exists()]
                if missing:
                    violations.append(f"latest present while {missing} missing")
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    (m.mnt / "ckpt").mkdir()
    for key, payload in data.items():
        (m.mnt / key).write_bytes(payload)
    (m.mnt / "latest").write_text("ckpt")
    m.flush()
    stop.set()
    watcher.join(timeout=10)
    assert not violations
    assert m.store_files() == {**data, "latest": b"ckpt"}
    order = uploaded_order(m)
    assert order.index("latest") > max(order.index(k) for k in data), order



def test_rewrite_through_write_only_handle_is_seen_by_the_next_reader(mount: Mount) -> None:
    """Write-only handles bypass the kernel page cache (direct_io); pages a reader cached before must not be
    served after such a rewrite."""
    path = mount.mnt / "cached.bin"
    path.write_bytes(b"A" * 1_000_000)
    assert path.read_bytes() == b"A" * 1_000_000  # now in the kernel's page cache (keep_cache)
    with open(path, "r+b") as f:  # a read-write handle goes through the page cache
        f.seek(10)
        f.write(b"B")
    fd = os.open(path, os.O_WRONLY)  # write-only: direct_io
    try:
        os.pwrite(fd, b"C" * 1_000_000, 0)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"C" * 1_000_000
    mount.flush()
    assert (mount.store / "cached.bin").read_bytes() == b"C" * 1_000_000
