"""The handle table and a takeover without a kernel: what a daemon that takes a mount over rebuilds from the
table the daemon before kept (fs/handle_table.py, Filesystem.restore_handles, repair_journal's still_open)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fsharness import make_stack

from ckptfs.drain.recovery import repair_journal
from ckptfs.fs.handle_table import HandleTable
from ckptfs.journal import ROOT_ID

RW_CREATE = os.O_RDWR | os.O_CREAT


def _contents(path: str) -> bytes:
    return Path(path).read_bytes()


def test_the_table_keeps_what_a_handle_needs_and_starts_empty_unless_kept(tmp_path: Path) -> None:
    table = HandleTable(tmp_path / "handles")
    assert table.open(keep=False) == []
    table.put(1, 10, os.O_WRONLY, 0, dirtied=False, direct=True, stream=False)
    table.put(3000, 11, os.O_RDONLY, 7, dirtied=False, direct=False, stream=False)  # past the first 1024 slots
    table.put(2, 12, os.O_RDONLY, 0, dirtied=False, direct=False, stream=True)
    table.dirtied(1)
    table.drop(2)
    table.close()
    kept = HandleTable(tmp_path / "handles")
    records = kept.open(keep=True)
    assert [(r.fh, r.inode_id, r.writable, r.dirtied, r.direct, r.backing, r.stream) for r in records] == [
        (1, 10, True, True, True, 0, False), (3000, 11, False, False, False, 7, False)]
    kept.close()
    assert HandleTable(tmp_path / "handles").open(keep=False) == []


async def test_a_takeover_restores_open_files_and_purges_an_unlinked_one_once_the_kernel_forgot_it(
    tmp_path: Path,
) -> None:
    stack = make_stack(tmp_path)
    table = HandleTable(stack.cache.root / "handles")
    table.open(keep=False)
    stack.fs.handle_table = table
    gone_fh, gone = stack.fs.create(ROOT_ID, b"gone", 0o644, RW_CREATE, 0, 0)
    stack.fs.handed_out(gone_fh)
    stack.fs.write(gone_fh, 0, b"abc")
    kept_fh, kept = stack.fs.create(ROOT_ID, b"kept", 0o644, RW_CREATE, 0, 0)
    stack.fs.write(kept_fh, 0, b"xyz")  # its first write before the reply: recorded with it
    stack.fs.handed_out(kept_fh)
    _, unanswered = stack.fs.create(ROOT_ID, b"unanswered", 0o644, RW_CREATE, 0, 0)  # the daemon dies first
    stack.fs.unlink(ROOT_ID, b"gone")
    stack.fs.forget(gone.ino, 1)  # the kernel forgets the name, not the open file
    assert stack.journal.names.get(gone.ino) is not None

    # The daemon dies with both files open; the next one takes the connection over.
    table.close()
    after = make_stack(tmp_path)
    table = HandleTable(after.cache.root / "handles")
    records = table.open(keep=True)
    assert {r.fh for r in records} == {gone_fh, kept_fh}  # not `unanswered`: the kernel never got it
    assert all(r.dirtied and r.writable for r in records)
    repair_journal(after.journal, after.cache, time.time(), still_open={r.inode_id for r in records},
                   still_writing={r.inode_id for r in records if r.writable})
    after.fs.handle_table = table
    assert after.fs.restore_handles(records) == 2
    kept_inode = after.journal.names.get(kept.ino)
    assert kept_inode is not None and kept_inode.closed_at is None  # still open for writing: not uploaded
    assert after.fs.open_writers() == 2
    unanswered_inode = after.journal.names.get(unanswered.ino)
    assert unanswered_inode is not None and unanswered_inode.closed_at is not None  # closed by recovery
    assert await after.fs.read(gone_fh, 0, 3) == b"abc"
    assert after.fs.write(kept_fh, 3, b"!") == 1

    after.fs.release(gone_fh)
    # The kernel's references from before are unknown: only its FORGET lets the inode go.
    assert after.journal.names.get(gone.ino) is not None
    after.fs.forget(gone.ino, 1)
    assert after.journal.names.get(gone.ino) is None
    assert not after.cache.has_data(gone.ino)
    after.fs.release(gone_fh)  # sent again by the kernel: nothing happens

    after.fs.release(kept_fh)
    kept_inode = after.journal.names.get(kept.ino)
    assert kept_inode is not None and kept_inode.closed_at is not None and kept_inode.state == "dirty"
    assert _contents(after.cache.data_path(kept.ino)) == b"xyz!"
    fh, _ = after.fs.create(ROOT_ID, b"new", 0o644, RW_CREATE, 0, 0)
    assert fh == min(gone_fh, kept_fh)  # the lowest free handle number
    after.fs.release(fh)


async def test_without_a_takeover_recovery_purges_unlinked_files_and_closes_open_ones(tmp_path: Path) -> None:
    stack = make_stack(tmp_path)
    _, gone = stack.fs.create(ROOT_ID, b"gone", 0o644, RW_CREATE, 0, 0)
    _, kept = stack.fs.create(ROOT_ID, b"kept", 0o644, RW_CREATE, 0, 0)
    stack.fs.unlink(ROOT_ID, b"gone")
    after = make_stack(tmp_path)
    repair_journal(after.journal, after.cache, time.time())
    assert after.journal.names.get(gone.ino) is None
    kept_inode = after.journal.names.get(kept.ino)
    assert kept_inode is not None and kept_inode.closed_at is not None
