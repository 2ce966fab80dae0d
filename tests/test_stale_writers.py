"""Writers the kernel kept after their daemon died without a takeover (issue: stale passthrough handles).

With FUSE passthrough a handle open for writing writes into its cache file through the kernel. When the
daemon dies and nothing keeps its FUSE connection (`--no-keep-mount`, or daemon and holder both killed),
the kernel still holds those backing files: the process's later writes succeed and land in the cache file,
behind the journal. Recovery takes such a file for changed when its cache file no longer matches the
journal's record, the evictor never drops such a copy, and the files open for writing at the crash are
watched for a while, so those bytes are uploaded too."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import trio
from conftest import Mount
from fsharness import Stack, check_consistency, make_stack
from test_passthrough import needs_passthrough

from ckptfs.cache.evictor import STALE_QUIET
from ckptfs.drain.recovery import repair_journal
from ckptfs.journal import CLEAN, DIRTY, REMOTE, JournalFull

KIB = 1024


# -- kernel-free: a stale writer is simulated by writing the cache file directly ------------------------

def _write_behind(stack: Stack, ino: int, offset: int, data: bytes) -> None:
    """What a handle the kernel kept does: write the cache file without the daemon. Its mtime is set one
    second past the journal's record, as the kernel's write sets it to now (a test must not depend on the
    clock having ticked since the file was closed)."""
    path = stack.cache.data_path(ino)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    inode = stack.journal.names.get(ino)
    assert inode is not None
    os.utime(path, ns=(inode.mtime_ns, inode.mtime_ns + 1_000_000_000))


def _stored(stack: Stack, name: str) -> bytes:
    return (stack.root / "store" / name).read_bytes()


async def _uploaded_clean_file(stack: Stack, nursery: trio.Nursery, data: bytes) -> int:
    await nursery.start(stack.drain.run)
    ino = stack.write_file("f", data)
    await stack.flush()
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == CLEAN
    return ino


async def test_recovery_uploads_a_clean_file_that_a_stale_writer_changed(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Open for writing (no write yet: still clean) when the daemon died without a takeover; the kernel's
    handle wrote afterwards. The journal's record no longer matches: a new version, uploaded; and the file
    stays watched, so a write after a second crash is caught too (its journal row says closed by then)."""
    stack = make_stack(tmp_path)
    data = b"a" * (100 * KIB)
    ino = await _uploaded_clean_file(stack, nursery, data)
    await stack.fs.open(ino, os.O_WRONLY)  # no passthrough here: the journal keeps it clean, open for writing
    version = stack.journal.names.get(ino).version  # type: ignore[union-attr]
    _write_behind(stack, ino, 5, b"B" * 10)

    after = make_stack(tmp_path)
    repair_journal(after.journal, after.cache, time.time())
    inode = after.journal.names.get(ino)
    assert inode is not None and inode.state == DIRTY and inode.version > version and inode.closed_at is not None
    assert ino in after.journal.copies.stale_writers()
    await nursery.start(after.drain.run)
    await after.flush()
    expected = data[:5] + b"B" * 10 + data[15:]
    assert _stored(after, "f") == expected

    _write_behind(after, ino, 50, b"C")  # the same kernel handle, after the next daemon's death too
    third = make_stack(tmp_path)
    repair_journal(third.journal, third.cache, time.time())
    assert third.journal.names.get(ino).state == DIRTY  # type: ignore[union-attr]
    await nursery.start(third.drain.run)
    await third.flush()
    assert _stored(third, "f") == expected[:50] + b"C" + expected[51:]
    check_consistency(third)


async def test_an_unchanged_file_open_at_the_crash_stays_clean(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path)
    ino = await _uploaded_clean_file(stack, nursery, b"a" * KIB)
    await stack.fs.open(ino, os.O_WRONLY)
    after = make_stack(tmp_path)
    repair_journal(after.journal, after.cache, time.time())
    inode = after.journal.names.get(ino)
    assert inode is not None and inode.state == CLEAN and inode.closed_at is not None
    assert ino in after.journal.copies.stale_writers()  # watched all the same


async def test_eviction_never_drops_bytes_written_behind_the_journal(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A clean file whose cache file changed without the daemon (a stale writer the watch no longer
    follows) is not evicted: only the cache file has those bytes. It is uploaded again, and watched."""
    stack = make_stack(tmp_path, cache_size=1000 * KIB)
    data = b"a" * (300 * KIB)
    ino = await _uploaded_clean_file(stack, nursery, data)
    _write_behind(stack, ino, 0, b"Z" * 10)
    assert stack.fs.evictor.evict(10 * KIB) == 0
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == DIRTY and stack.cache.has_data(ino)
    await stack.flush()
    assert _stored(stack, "f") == b"Z" * 10 + data[10:]
    # Its writer may write on: watched from now on, and kept until it has been quiet for STALE_QUIET.
    assert ino in stack.fs.evictor.stale and stack.fs.evictor.evict(10 * KIB) == 0
    stack.fs.evictor.watch_stale_writers(time.time() + STALE_QUIET)
    assert stack.fs.evictor.evict(10 * KIB) > 0  # clean and matching its record again: evicted as usual
    assert stack.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]
    check_consistency(stack)


async def test_the_watch_uploads_later_writes_then_lets_the_file_go(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Writes through a kept handle after the new daemon started: the evictor's rounds see them. A watched
    file is not evicted; once unchanged for STALE_QUIET it is no longer watched."""
    stack = make_stack(tmp_path, cache_size=1000 * KIB)
    data = b"a" * (300 * KIB)
    ino = await _uploaded_clean_file(stack, nursery, data)
    await stack.fs.open(ino, os.O_WRONLY)
    after = make_stack(tmp_path, cache_size=1000 * KIB)
    repair_journal(after.journal, after.cache, time.time())
    after.cache.scan()
    after.fs.evictor.start({})
    await nursery.start(after.drain.run)
    await after.flush()
    assert after.fs.evictor.evict(10 * KIB) == 0  # watched: kept
    now = time.time()
    after.fs.evictor.watch_stale_writers(now)
    assert after.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    _write_behind(after, ino, 7, b"W")
    after.fs.evictor.watch_stale_writers(now + 1)
    assert after.journal.names.get(ino).state == DIRTY  # type: ignore[union-attr]
    await after.flush()
    assert _stored(after, "f") == data[:7] + b"W" + data[8:]
    after.fs.evictor.watch_stale_writers(now + 1 + STALE_QUIET - 1)
    assert ino in after.journal.copies.stale_writers()
    after.fs.evictor.watch_stale_writers(now + 1 + STALE_QUIET)
    assert after.fs.evictor.stale == {} and after.journal.copies.stale_writers() == {}
    assert after.fs.evictor.evict(10 * KIB) > 0
    check_consistency(after)


async def test_the_watch_lets_a_file_go_once_nothing_holds_it_open(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A watched file whose writer is gone (nothing holds its cache file open any more) leaves the watch at
    the next round, not STALE_QUIET later, and can be evicted. The crash harness (SeaweedFS, a kill mid-spill
    with the cache full: seeds 108 and 4414) found a restarted daemon whose one clean file, watched, filled
    the cache: a read of a remote file waited dirty_wait for room, then failed with ENOSPC."""
    stack = make_stack(tmp_path, cache_size=1000 * KIB)
    ino = await _uploaded_clean_file(stack, nursery, b"a" * (300 * KIB))
    fh = await stack.fs.open(ino, os.O_WRONLY)  # the handle the kernel kept when this daemon died
    after = make_stack(tmp_path, cache_size=1000 * KIB)
    repair_journal(after.journal, after.cache, time.time())
    after.cache.scan()
    after.fs.evictor.start({})
    await nursery.start(after.drain.run)
    await after.flush()
    now = time.time()
    after.fs.evictor.watch_stale_writers(now)
    assert ino in after.fs.evictor.stale and after.fs.evictor.evict(10 * KIB) == 0  # held open: watched
    os.close(stack.fs.handles[fh].fd)  # the writer goes away (its process ends: nothing releases it here)
    after.fs.evictor.watch_stale_writers(now + 1)
    assert after.fs.evictor.stale == {} and after.journal.copies.stale_writers() == {}
    assert after.fs.evictor.evict(10 * KIB) > 0
    assert after.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]
    check_consistency(after)


# -- through a real mount --------------------------------------------------------------------------------


def _wait_store(m: Mount, name: str, expected: bytes, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m.flush()
        if m.store_files().get(name) == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert m.store_files().get(name) == expected


def _open_stale_writer(m: Mount, name: str, data: bytes) -> int:
    (m.mnt / name).write_bytes(data)
    m.flush()
    fd = os.open(m.mnt / name, os.O_WRONLY)
    if m.status()["passthrough"]["files_open"] != 1:
        os.close(fd)
        pytest.skip("the kernel did not give the writer a passthrough backing file")
    return fd


@needs_passthrough
@pytest.mark.parametrize(
    "when", ["before the new daemon", "after the new daemon started", "after a second crash", "after a stop"]
)
def test_a_write_through_a_handle_the_dead_daemon_left_is_uploaded(mount_factory, when: str) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(extra_args=("--drain-timeout", "2"))
    m.allowed_log_words += ["changed without the daemon", "not yet durable"]
    data = b"a" * 100_000
    fd = _open_stale_writer(m, "f", data)
    try:
        if when == "after a stop":
            # A stop with the file still open for writing: the connection goes, the kernel's handle stays.
            assert m.proc is not None
            m.proc.send_signal(signal.SIGTERM)
            assert m.proc.wait(timeout=60) == 3  # the file open for writing is pending: not drained
            m.proc = None
        else:
            m.kill9()  # holder and daemon: the connection is aborted, the kernel keeps the backing file
        if when == "before the new daemon":
            assert os.pwrite(fd, b"B" * 10, 5) == 10
            m.start()
        elif when == "after the new daemon started":
            m.start()
            assert os.pwrite(fd, b"B" * 10, 5) == 10
        elif when == "after a second crash":
            # The next daemon uploads the file as it is (clean again); it dies too; then the handle writes.
            m.start()
            _wait_store(m, "f", data)
            m.kill9()
            assert os.pwrite(fd, b"B" * 10, 5) == 10
            m.start()
        else:
            m.start()
            _wait_store(m, "f", data)
            assert os.pwrite(fd, b"B" * 10, 5) == 10
        expected = data[:5] + b"B" * 10 + data[15:]
        assert (m.mnt / "f").read_bytes() == expected
        _wait_store(m, "f", expected)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


async def test_a_full_journal_leaves_the_watch_running_and_it_tries_again(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch runs in the evictor's task: a journal the full cache filesystem refuses must not end it."""
    stack = make_stack(tmp_path)
    data = b"a" * KIB
    ino = await _uploaded_clean_file(stack, nursery, data)
    stack.fs.evictor.watch({ino}, time.time())
    _write_behind(stack, ino, 0, b"F")

    def refuse(*args: object, **kwargs: object) -> None:
        raise JournalFull("database or disk is full")

    with monkeypatch.context() as m:
        m.setattr(stack.journal.copies, "rewritten_behind", refuse)
        stack.fs.evictor.watch_stale_writers(time.time())
    assert stack.journal.names.get(ino).state == CLEAN and ino in stack.fs.evictor.stale  # type: ignore[union-attr]
    stack.fs.evictor.watch_stale_writers(time.time())  # room again
    assert stack.journal.names.get(ino).state == DIRTY  # type: ignore[union-attr]
    await stack.flush()
    assert _stored(stack, "f") == b"F" + data[1:]
