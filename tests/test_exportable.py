"""What an NFS server needs from the mount, without a kernel: the lookups of "." and ".." by inode number
that the kernel sends for file handles of inodes it forgot (FUSE_CAP_EXPORT_SUPPORT), ESTALE for handles of
inodes that are gone, inode numbers never used twice, and one generation per journal (fuse_ops). The same
through a real NFS server and client: tests/test_nfs_export.py."""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pyfuse3
import pytest
import trio
from fsharness import GID, UID, Stack, make_stack

from ckptfs.errors import FsError
from ckptfs.fuse_ops import FuseOperations, inode_generation
from ckptfs.journal import ROOT_ID


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
    assert stack.journal.get(f) is None
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
