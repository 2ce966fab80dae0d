"""What an NFS server needs from the mount: the lookups of "." and ".." by inode number that the kernel sends
for file handles of inodes it forgot (FUSE_CAP_EXPORT_SUPPORT), ESTALE for handles of inodes that are gone,
inode numbers never used twice, and one generation per journal (fuse_ops); without a kernel, then through
the kernel's name_to_handle_at and open_by_handle_at on a mount (what an NFS server calls). Through a real
NFS server and client: tests/test_nfs_export.py."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pyfuse3
import pytest
import trio
from conftest import Mount
from fsharness import GID, UID, Stack, make_stack

from ckptfs.errors import FsError
from ckptfs.journal import ROOT_ID
from ckptfs.mount.adapter import FuseOperations, inode_generation


@pytest.fixture
async def stack(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    s = make_stack(tmp_path)
    nursery.start_soon(s.drain.run)
    yield s


def errno_of(call: object, *args: object) -> int:
    with pytest.raises(FsError) as raised:
        call(*args)  # type: ignore[operator]
    return raised.value.errno


async def test_dot_is_the_inode_itself_of_any_kind(stack: Stack) -> None:
    """The kernel resolves a file handle of an inode it forgot with LOOKUP(inode, "."): for a file too (it
    was ENOTDIR, so a restarted NFS server's client got NFS4ERR_STALE for a file that exists)."""
    d = stack.fs.mkdir(ROOT_ID, b"d", 0o755, UID, GID).ino
    f = stack.write_file("d/f", b"abc", parent=d)
    s = stack.fs.symlink(d, b"s", b"f", UID, GID).ino
    for ino, size in ((f, 3), (d, 0), (s, 1), (ROOT_ID, 0)):
        attr = stack.fs.lookup(ino, b".")
        assert (attr.ino, attr.size) == (ino, size)
    stack.fs.forget(f, 1)  # the lookup counted a kernel reference, as the kernel counts it


async def test_dotdot_is_a_directorys_parent(stack: Stack) -> None:
    a = stack.fs.mkdir(ROOT_ID, b"a", 0o755, UID, GID).ino
    b = stack.fs.mkdir(a, b"b", 0o755, UID, GID).ino
    assert stack.fs.lookup(b, b"..").ino == a
    assert stack.fs.lookup(a, b"..").ino == ROOT_ID
    assert stack.fs.lookup(ROOT_ID, b"..").ino == ROOT_ID
    stack.fs.rename(a, b"b", ROOT_ID, b"b2", 0)
    assert stack.fs.lookup(b, b"..").ino == ROOT_ID


async def test_handles_of_inodes_that_are_gone_are_stale(stack: Stack) -> None:
    """ESTALE, which the kernel and an NFS server pass on as a stale handle: an inode number never given out,
    a file unlinked and forgotten, and ".." of a directory removed (it answered the root before)."""
    assert errno_of(stack.fs.lookup, 999, b".") == errno.ESTALE
    assert errno_of(stack.fs.lookup, 999, b"..") == errno.ESTALE
    f = stack.write_file("f", b"x")
    stack.fs.unlink(ROOT_ID, b"f")
    stack.fs.forget(f, 1)
    assert errno_of(stack.fs.lookup, f, b".") == errno.ESTALE
    d = stack.fs.mkdir(ROOT_ID, b"d", 0o755, UID, GID).ino
    stack.fs.lookup(d, b".")  # the kernel holds it
    stack.fs.rmdir(ROOT_ID, b"d")
    assert errno_of(stack.fs.lookup, d, b"..") == errno.ESTALE
    assert stack.fs.lookup(d, b".").nlink == 0  # still held: the inode itself is there, unlinked


async def test_an_unlinked_file_held_open_is_still_found_by_number(stack: Stack) -> None:
    f = stack.write_file("f", b"open")
    fh = await stack.fs.open(f, os.O_RDONLY)
    stack.fs.unlink(ROOT_ID, b"f")
    assert stack.fs.lookup(f, b".").nlink == 0
    stack.fs.release(fh)
    stack.fs.forget(f, 2)
    assert errno_of(stack.fs.lookup, f, b".") == errno.ESTALE


async def test_inode_numbers_are_never_used_twice(stack: Stack) -> None:
    """A handle of a removed file must not name the next file created: the journal's ids are AUTOINCREMENT,
    so SQLite never hands out the highest id again after it was deleted (a plain rowid would)."""
    f = stack.write_file("f", b"x")
    stack.fs.unlink(ROOT_ID, b"f")
    stack.fs.forget(f, 1)
    assert stack.journal.names.get(f) is None
    assert stack.write_file("g", b"y") > f


async def test_every_entry_carries_the_journals_generation(tmp_path: Path) -> None:
    """One generation for every inode of a journal, from its owner tag: the same after a daemon restart (same
    journal), another for a journal made anew, whose inode numbers mean other files."""
    stack = make_stack(tmp_path)
    generation = inode_generation("a1b2c3d4e5f6")
    assert generation == 0xA1B2C3D4 and inode_generation("0123456789ab") != generation
    ops = FuseOperations(stack.fs, generation=generation)
    ctx = pyfuse3.RequestContext()
    info, created = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, ctx)
    await ops.release(info.fh)
    found = await ops.lookup(pyfuse3.ROOT_INODE, b"f", ctx)
    by_number = await ops.lookup(pyfuse3.InodeT(found.st_ino), b".", ctx)
    attrs = await ops.getattr(pyfuse3.InodeT(found.st_ino), ctx)
    assert {e.generation for e in (created, found, by_number, attrs)} == {generation}


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int), ("f_handle", ctypes.c_ubyte * 128)]


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100


def name_to_handle(path: Path) -> _FileHandle:
    handle, mount_id = _FileHandle(handle_bytes=128), ctypes.c_int()
    if _libc.name_to_handle_at(AT_FDCWD, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0):
        raise OSError(ctypes.get_errno(), f"name_to_handle_at {path}")
    return handle


def open_by_handle(mount_fd: int, handle: _FileHandle) -> os.stat_result:
    fd = _libc.open_by_handle_at(mount_fd, ctypes.byref(handle), os.O_RDONLY)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "open_by_handle_at")
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def forget_kernel_inodes() -> None:
    """The kernel drops unused dentries and inodes, and sends FORGET for them to the daemon."""
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def test_kernel_file_handles_of_forgotten_inodes(mount: Mount) -> None:
    """An NFS server's view of the mount: handles taken with name_to_handle_at open with open_by_handle_at
    after the kernel forgot the inodes (a file, a directory, one two levels down, which the kernel connects
    to the tree with ".." lookups), after a rename (a handle names the inode, not the path), and are ESTALE
    once the file is deleted. The file's handle failed before (ENOTDIR from the lookup of "." made it
    ESTALE)."""
    (mount.mnt / "a" / "b").mkdir(parents=True)
    (mount.mnt / "a" / "b" / "f").write_bytes(b"12345")
    (mount.mnt / "a" / "r").write_bytes(b"renamed")
    (mount.mnt / "gone").write_bytes(b"x")
    paths = ["a", "a/b", "a/b/f", "a/r", "gone"]
    handles = {p: name_to_handle(mount.mnt / p) for p in paths}
    inodes = {p: (mount.mnt / p).stat().st_ino for p in paths}
    (mount.mnt / "a" / "r").rename(mount.mnt / "a" / "b" / "r2")
    (mount.mnt / "gone").unlink()
    forget_kernel_inodes()
    mount_fd = os.open(mount.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for p in ("a", "a/b", "a/b/f", "a/r"):
            assert open_by_handle(mount_fd, handles[p]).st_ino == inodes[p], p
        assert open_by_handle(mount_fd, handles["a/b/f"]).st_size == 5
        assert open_by_handle(mount_fd, handles["a/r"]).st_size == 7
        with pytest.raises(OSError) as raised:
            open_by_handle(mount_fd, handles["gone"])
        assert raised.value.errno == errno.ESTALE
    finally:
        os.close(mount_fd)
