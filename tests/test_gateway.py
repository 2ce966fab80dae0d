"""Gateway mode without a kernel: files an NFS server keeps open for writing are uploaded once idle, after an
fsync, and for a flush, from a snapshot of their cache file that a change during the upload throws away; a
commit marker still goes after the files changed before it. Without the option nothing of this happens."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import trio
from fsharness import GID, UID, Stack, check_consistency, make_stack
from waiting import until

from ckptfs.drain.recovery import repair_journal
from ckptfs.journal import CLEAN, DIRTY, ROOT_ID


def open_writer(stack: Stack, name: str) -> tuple[int, int]:
    fh, attr = stack.fs.create(ROOT_ID, name.encode(), 0o644, os.O_RDWR, UID, GID)
    return fh, attr.ino


async def store_has(stack: Stack, name: str, data: bytes, seconds: float = 10) -> None:
    """Wait until the store shows `data` at `name` and the journal has recorded it."""
    await until(
        lambda: stack.store_files().get(name) == data and not any(
            inode.state == "uploading" for inode in stack.journal.names.all_inodes() if inode.path == name),
        seconds=seconds, what=f"{name} in the store as written ({len(data)} bytes), its upload recorded")


def commits(stack: Stack, name: str) -> list[bytes]:
    return [content for key, content in stack.store.committed if key == name]


async def test_an_open_file_is_uploaded_once_idle_and_its_close_needs_no_second_upload(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, idle_upload=0.3)
    await nursery.start(stack.drain.run)
    fh, ino = open_writer(stack, "shard.pt")
    stack.fs.write(fh, 0, b"A" * 5000)
    written_at = time.monotonic()
    await store_has(stack, "shard.pt", b"A" * 5000)
    assert time.monotonic() - written_at >= 0.3  # not before it was idle
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == DIRTY  # still open: only its close can call it clean
    stack.fs.release(fh)
    await stack.flush()
    with trio.fail_after(10):
        while (inode := stack.journal.names.get(ino)) is not None and inode.state != CLEAN:  # noqa: ASYNC110 (no event)
            await trio.sleep(0.02)
    assert commits(stack, "shard.pt") == [b"A" * 5000]  # the close uploaded nothing again
    check_consistency(stack)


async def test_a_file_written_on_and_on_is_not_uploaded_until_it_pauses(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, idle_upload=1.0)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "log.bin")
    data = b""
    for i in range(15):  # 3 s, a write every 0.2 s
        chunk = bytes([65 + i]) * 1000
        stack.fs.write(fh, len(data), chunk)
        data += chunk
        await trio.sleep(0.2)
        assert "log.bin" not in stack.store_files()
    await store_has(stack, "log.bin", data, 5)
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"log.bin": data}
    check_consistency(stack)


async def test_a_change_while_uploading_never_commits_a_torn_object(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The snapshot staged no longer holds after the write: the staged copy is thrown away, and the file is
    uploaded again as it is; every object the store ever showed is one whole content."""
    stack = make_stack(tmp_path, idle_upload=0.2)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "model.pt")
    first = b"1" * 300_000
    stack.fs.write(fh, 0, first)
    stack.store.stage_gate = threading.Event()
    assert await trio.to_thread.run_sync(stack.store.staging.wait, 10), "never uploaded while open"
    second = b"2" * 100_000
    stack.fs.write(fh, 0, second)  # overwrites in place: same size
    final = second + first[len(second):]
    stack.store.stage_gate.set()
    await store_has(stack, "model.pt", final)
    assert commits(stack, "model.pt") == [final]  # the first staged copy was never committed
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"model.pt": final}
    check_consistency(stack)


async def test_a_change_after_the_upload_is_uploaded_again(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, idle_upload=0.2)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "a.bin")
    stack.fs.write(fh, 0, b"one")
    await store_has(stack, "a.bin", b"one")
    stack.fs.write(fh, 3, b"two")
    await store_has(stack, "a.bin", b"onetwo")
    stack.fs.release(fh)
    await stack.flush()
    assert commits(stack, "a.bin") == [b"one", b"onetwo"]


async def test_fsyncs_in_the_middle_of_a_write_upload_nothing_until_it_pauses(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The Linux NFS client COMMITs whenever its writeback caught up, also in the middle of a long save:
    those fsyncs must not stage the start of a file still being written (the writer here pauses 0.2 s
    between writes, far more than a snapshot's 50 ms of quiet)."""
    stack = make_stack(tmp_path, idle_upload=60)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "big.pt")
    for i in range(10):
        stack.fs.write(fh, i * 4096, bytes([i]) * 4096)
        await stack.fs.fsync(fh, False)
        await trio.sleep(0.2)
        assert "big.pt" not in stack.store_files(), f"uploaded during write {i}"
    await store_has(stack, "big.pt", b"".join(bytes([i]) * 4096 for i in range(10)), 5)
    assert len(commits(stack, "big.pt")) == 1
    stack.fs.release(fh)


async def test_fsync_makes_an_open_file_due_once_its_last_write_is_a_second_old(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, idle_upload=60)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "commit.bin")
    stack.fs.write(fh, 0, b"x" * 4096)
    await trio.sleep(0.5)
    assert "commit.bin" not in stack.store_files()
    await stack.fs.fsync(fh, False)
    await store_has(stack, "commit.bin", b"x" * 4096, 5)
    stack.fs.release(fh)


async def test_flush_uploads_an_open_file_as_it_is_and_returns_while_it_is_open(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, idle_upload=60)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "open.bin")
    stack.fs.write(fh, 0, b"first")
    await stack.flush(10)
    assert stack.store_files() == {"open.bin": b"first"}
    # Changed since the store's copy: the next flush waits for the content as it is now, not the old one.
    stack.fs.write(fh, 0, b"FIRST, then more")
    await stack.flush(10)
    assert stack.store_files() == {"open.bin": b"FIRST, then more"}
    assert stack.fs.handles  # still open
    stack.fs.release(fh)
    await stack.flush()
    check_consistency(stack)


async def test_without_the_option_files_open_for_writing_are_not_uploaded(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "open.bin")
    stack.fs.write(fh, 0, b"data")
    await stack.fs.fsync(fh, False)
    result = await stack.drain.flush(None, trio.current_time() + 1.0)
    assert not result.ok and result.remaining == ["open.bin"]
    assert stack.store_files() == {}
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"open.bin": b"data"}


async def test_a_marker_goes_after_open_files_changed_before_it(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Over NFS the server keeps the shard open: the marker written after the shard's last write waits for
    the shard's upload (idle), though the shard was never closed."""
    stack = make_stack(tmp_path, idle_upload=1.0)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "shard.pt")
    stack.fs.write(fh, 0, b"S" * 10_000)
    await trio.sleep(0.05)
    stack.write_file("latest", b"step_1")  # closed at once: alone it would upload before the shard
    await store_has(stack, "latest", b"step_1")
    assert stack.store_files()["shard.pt"] == b"S" * 10_000
    order = [key for key, _ in stack.store.committed]
    assert order.index("shard.pt") < order.index("latest")
    stack.fs.release(fh)
    await stack.flush()


async def test_an_open_file_renamed_after_its_upload_goes_to_its_new_name(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A client's temp + rename while the server still holds the temp file open: the store's copy was made
    under the temp name, unchanged since; the flush puts it under the new name and removes the old one."""
    stack = make_stack(tmp_path, idle_upload=0.2)
    await nursery.start(stack.drain.run)
    fh, _ = open_writer(stack, "shard.tmp")
    stack.fs.write(fh, 0, b"T" * 3000)
    await store_has(stack, "shard.tmp", b"T" * 3000)
    stack.fs.rename(ROOT_ID, b"shard.tmp", ROOT_ID, b"shard.pt", 0)
    await stack.flush(10)
    assert stack.store_files() == {"shard.pt": b"T" * 3000}
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"shard.pt": b"T" * 3000}
    check_consistency(stack)


async def test_a_file_written_after_its_upload_while_open_is_a_new_version_after_a_crash(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Found by test_gateway_fuse's kill -9 test, which failed now and then: the store got the file while it
    was open, it grew, and the daemon died. Recovery recorded the close with the cache file's size but kept
    the version the store already held, so a flush right after the restart took the file for durable and
    returned while the drain was still uploading the new bytes."""
    stack = make_stack(tmp_path, idle_upload=0.05)
    await nursery.start(stack.drain.run)
    fh, ino = open_writer(stack, "shard.pt")
    stack.fs.write(fh, 0, b"1" * 2000)
    await store_has(stack, "shard.pt", b"1" * 2000)
    stack.fs.write(fh, 2000, b"2" * 1000)  # then the daemon dies, the file still open

    after = make_stack(tmp_path)
    repair_journal(after.journal, after.cache, time.time())
    inode = after.journal.names.get(ino)
    assert inode is not None and inode.state == DIRTY and inode.version > inode.uploaded_version
    await nursery.start(after.drain.run)
    await after.flush()
    assert after.store_files()["shard.pt"] == b"1" * 2000 + b"2" * 1000
