"""Streaming reads of remote files at the fs level (no kernel): a read waits only for its own chunks,
sequential readers read ahead, readers share chunks, every chunk comes from one version, the whole file
is verified before it becomes a clean cached file, and partial files never outlive a restart."""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import threading
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from fsharness import Stack, check_consistency, make_stack

from ckptfs.drain.recovery import repair_journal
from ckptfs.errors import FsError
from ckptfs.fs import data_path
from ckptfs.journal import CLEAN, REMOTE, ROOT_ID

KIB = 1 << 10
CHUNK = 64 * KIB


@pytest.fixture
async def stack(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    s = make_stack(tmp_path)
    s.fetcher.chunk_size = CHUNK
    await nursery.start(s.drain.run)
    await nursery.start(s.fetcher.run)
    yield s
    if s.store.range_gate is not None:
        s.store.range_gate.set()
    check_consistency(s)


async def remote_file(stack: Stack, name: str, size: int) -> tuple[int, bytes]:
    """A file that exists only in the store (uploaded, then evicted), and its content."""
    content = random.Random(name).randbytes(size)
    ino = stack.write_file(name, content)
    await stack.flush()
    stack.fs.evictor.evict(1 << 40)
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == REMOTE
    stack.store.ranges.clear()
    return ino, content


def chunk_offsets(stack: Stack, key: str) -> list[int]:
    return [offset for k, offset in stack.store.ranges if k == key]


async def read_all(stack: Stack, fh: int, size: int, step: int = 32 * KIB) -> bytes:
    return b"".join([await stack.fs.read(fh, offset, step) for offset in range(0, size, step)])


async def test_a_read_in_the_middle_is_answered_before_the_rest_is_fetched(stack: Stack) -> None:
    ino, content = await remote_file(stack, "m.bin", 20 * CHUNK + 123)
    # Every range but the one the read needs is held in the store until the test ends.
    stack.store.range_gate = threading.Event()
    stack.store.open_offsets = {10 * CHUNK}
    fh = await stack.fs.open(ino, os.O_RDONLY)
    with trio.fail_after(10):
        got = await stack.fs.read(fh, 10 * CHUNK + 100, 4 * KIB)
    assert got == content[10 * CHUNK + 100:10 * CHUNK + 100 + 4 * KIB]
    assert chunk_offsets(stack, "m.bin") == [10 * CHUNK]  # a random read reads nothing ahead
    assert stack.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]
    assert stack.fs.getattr(ino).size == len(content)
    await stack.fs.fsync(fh, False)  # a partial file is nothing to make durable, and not a data file
    assert not stack.cache.has_data(ino) and ino not in stack.cache.files
    stack.store.range_gate.set()
    stack.fs.release(fh)


async def test_sequential_read_reads_ahead_and_the_file_becomes_clean(stack: Stack) -> None:
    ino, content = await remote_file(stack, "s.bin", 40 * CHUNK + 5)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await read_all(stack, fh, len(content)) == content
    offsets = chunk_offsets(stack, "s.bin")
    assert sorted(offsets) == [i * CHUNK for i in range(41)]  # each chunk once
    assert stack.fetcher.stats.chunks_fetched == 41
    stack.fs.release(fh)
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == CLEAN  # verified and adopted
    assert stack.cache.reserved == 0 and stack.cache.used == len(content)
    assert os.listdir(stack.cache.tmp_dir) == []
    # An ordinary cached file from now on: no more ranges.
    stack.store.ranges.clear()
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 10) == content[:10]
    stack.fs.release(fh)
    assert stack.store.ranges == []


async def test_sequential_reader_gets_chunks_ahead_in_parallel(stack: Stack) -> None:
    ino, content = await remote_file(stack, "p.bin", 40 * CHUNK)
    stack.store.range_gate = threading.Event()
    stack.store.open_offsets = {0}
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 32 * KIB) == content[:32 * KIB]
    await trio.sleep(0.2)
    # The first chunk plus a read-ahead window are asked for at once, not one after the other.
    assert len(set(chunk_offsets(stack, "p.bin"))) >= 3
    stack.store.range_gate.set()
    assert await read_all(stack, fh, len(content)) == content
    stack.fs.release(fh)


async def test_an_empty_remote_file_is_whole_at_its_open(stack: Stack) -> None:
    """The kernel sends no read for a file of size 0: its open alone makes it a clean cached file (found by
    the crash harness: a fresh node that had read every file still held an empty one as 'remote')."""
    ino, _ = await remote_file(stack, "empty", 0)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    assert await stack.fs.read(fh, 0, 4096) == b""
    stack.fs.release(fh)
    assert chunk_offsets(stack, "empty") == []  # nothing to download


async def test_two_readers_share_one_download(stack: Stack) -> None:
    ino, content = await remote_file(stack, "two.bin", 30 * CHUNK + 7)
    fh1 = await stack.fs.open(ino, os.O_RDONLY)
    fh2 = await stack.fs.open(ino, os.O_RDONLY)
    results: dict[int, bytes] = {}

    async def reader(fh: int) -> None:
        results[fh] = await read_all(stack, fh, len(content), step=16 * KIB)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader, fh1)
        nursery.start_soon(reader, fh2)
    assert results == {fh1: content, fh2: content}
    counts = Counter(chunk_offsets(stack, "two.bin"))
    assert set(counts.values()) == {1}, counts  # one fetch per chunk, both readers waited on it
    stack.fs.release(fh1)
    stack.fs.release(fh2)
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]


async def test_random_reads_return_the_right_bytes_and_fetch_each_chunk_once(stack: Stack) -> None:
    ino, content = await remote_file(stack, "r.bin", 25 * CHUNK + 999)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    rng = random.Random(7)
    for _ in range(200):
        offset = rng.randrange(0, len(content) + 100)
        size = rng.choice([1, 100, 4 * KIB, CHUNK + 17, 3 * CHUNK])
        assert await stack.fs.read(fh, offset, size) == content[offset:offset + size]
    assert max(Counter(chunk_offsets(stack, "r.bin")).values()) == 1
    stack.fs.release(fh)


def resident_bytes(fd: int) -> int:
    """How much of the open file is in the page cache (util-linux's fincore)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", f"/proc/{os.getpid()}/fd/{fd}"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


async def test_a_streamed_read_does_not_keep_a_second_copy_in_the_page_cache(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found measuring a 2.44 GiB restore on a fresh node (bench/stream_bench.py): the bytes a reader was
    served stayed in the page cache twice, as the mount's file and as the cache file, and on a VM whose
    fresh memory is slow to touch the restore took 1.7-2.3x a direct download. The cache file's pages behind
    the reader are dropped once written back (here at once, by an fdatasync after each read)."""
    monkeypatch.setattr(data_path, "SHED_LAG", 256 * KIB)
    monkeypatch.setattr(data_path, "SHED_STEP", 64 * KIB)
    ino, content = await remote_file(stack, "big.bin", 8 << 20)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    fd = stack.fs.handles[fh].fd
    step = 128 * KIB
    # As torch.load reads a checkpoint: the zip's directory at the end first, then from the start.
    assert await stack.fs.read(fh, len(content) - step, step) == content[-step:]
    pieces = []
    for offset in range(0, len(content), step):
        pieces.append(await stack.fs.read(fh, offset, step))
        os.fdatasync(fd)
    assert b"".join(pieces) == content
    assert resident_bytes(fd) <= 1 << 20
    stack.fs.release(fh)


async def test_a_file_larger_than_the_cache_is_read_through_it(tmp_path: Path, nursery: trio.Nursery) -> None:
    s = make_stack(tmp_path, cache_size=1000 * KIB)
    s.fetcher.chunk_size = CHUNK
    await nursery.start(s.drain.run)
    await nursery.start(s.fetcher.run)
    ino, content = await remote_file(s, "big.bin", 3000 * KIB)
    fh = await s.fs.open(ino, os.O_RDONLY)
    for _ in range(2):  # the second pass re-fetches the chunks the first one punched
        assert await read_all(s, fh, len(content)) == content
        assert s.cache.used <= s.cache.limit
    assert s.fetcher.stats.chunks_punched > 0
    s.fs.release(fh)
    assert s.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]  # never whole at once
    # Not open any more: the evictor drops it like a clean file.
    assert s.fs.evictor.evict(1 << 40) > 0
    assert s.cache.used == 0 and os.listdir(s.cache.tmp_dir) == []
    check_consistency(s)


async def test_a_read_waiting_for_room_gets_it_once_a_file_is_uploaded(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The cache is full of data not yet uploaded, below the evictor's high-water mark, and a read needs a
    whole chunk more: once that data is uploaded the read must go on, not sleep out dirty_wait and fail
    with ENOSPC (the evictor's rounds only evicted above the high-water mark, whatever waiters needed;
    found by the crash harness with a 24 MiB cache)."""
    s = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600, dirty_wait=30)
    s.fetcher.chunk_size = 256 * KIB
    await nursery.start(s.drain.run)
    await nursery.start(s.fetcher.run)
    await nursery.start(s.fs.evictor.run)
    ino, content = await remote_file(s, "r.bin", 512 * KIB)
    s.write_file("d.bin", b"d" * (800 * KIB))  # dirty for an hour: not evictable
    fh = await s.fs.open(ino, os.O_RDONLY)

    async def upload_soon() -> None:
        await trio.sleep(0.3)
        await s.drain.wait_durable(["d.bin"])

    nursery.start_soon(upload_soon)
    with trio.fail_after(10):
        assert await s.fs.read(fh, 0, 4 * KIB) == content[:4 * KIB]
    s.fs.release(fh)
    assert s.cache.used <= s.cache.limit


async def test_a_checksum_mismatch_fails_reads_and_never_marks_the_file_clean(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    ino, content = await remote_file(stack, "bad.bin", 5 * CHUNK)
    # The store's bytes change behind the journal's back (same size: only the checksum can tell).
    (stack.store.inner.root / "bad.bin").write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
    fh = await stack.fs.open(ino, os.O_RDONLY)
    with caplog.at_level(logging.ERROR, logger="ckptfs.fetch"), pytest.raises(FsError) as exc_info:
        await read_all(stack, fh, len(content))
    assert exc_info.value.errno == errno.EIO
    assert any("checksum mismatch" in r.message and r.levelno == logging.ERROR for r in caplog.records)
    with pytest.raises(FsError) as exc_info:
        await stack.fs.read(fh, 0, 10)
    assert exc_info.value.errno == errno.EIO
    stack.fs.release(fh)
    assert stack.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]
    assert not stack.cache.has_data(ino) and os.listdir(stack.cache.tmp_dir) == []
    assert stack.cache.used == 0
    # Opening for writing needs the whole verified content: EIO too, never a clean file.
    with pytest.raises(FsError) as exc_info:
        await stack.fs.open(ino, os.O_RDWR)
    assert exc_info.value.errno == errno.EIO
    assert stack.journal.names.get(ino).state == REMOTE  # type: ignore[union-attr]


async def test_an_object_replaced_during_a_read_fails_with_estale_then_a_new_open_starts_afresh(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    ino, content = await remote_file(stack, "x.bin", 8 * CHUNK)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 100) == content[:100]
    # Another node replaces the object (same size): the pinned version is gone.
    path = stack.store.inner.root / "x.bin"
    path.unlink()
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="ckptfs.fetch"), pytest.raises(FsError) as exc_info:
        await stack.fs.read(fh, 6 * CHUNK, 100)
    assert exc_info.value.errno == errno.ESTALE
    assert sum("replaced in the store" in r.message for r in caplog.records) == 1
    stack.fs.release(fh)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await read_all(stack, fh, len(content)) == content
    stack.fs.release(fh)
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]


async def test_a_read_follows_a_remote_file_the_drain_moves_meanwhile(stack: Stack) -> None:
    """A remote-only file renamed while it is read: the drain copies its object to the new key and
    deletes the old one. Reads of chunks not fetched yet go on at the new key (found by the crash
    harness: they failed with ENOENT, a NoSuchKey per chunk, on a fresh node resuming a checkpoint)."""
    ino, content = await remote_file(stack, "old.bin", 8 * CHUNK)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 100) == content[:100]
    stack.fs.rename(ROOT_ID, b"old.bin", ROOT_ID, b"new.bin", 0)
    await stack.flush()
    assert "old.bin" not in stack.store_files() and stack.store_files()["new.bin"] == content
    with trio.fail_after(10):
        assert await read_all(stack, fh, len(content)) == content
    stack.fs.release(fh)
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    assert stack.cache.reserved == 0


async def test_open_for_writing_waits_for_the_whole_verified_file(stack: Stack) -> None:
    ino, content = await remote_file(stack, "w.bin", 10 * CHUNK + 3)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(reader, 5 * CHUNK, 10) == content[5 * CHUNK:5 * CHUNK + 10]
    fh = await stack.fs.open(ino, os.O_RDWR)
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    assert sorted(chunk_offsets(stack, "w.bin")) == [i * CHUNK for i in range(11)]
    stack.fs.write(fh, 0, b"NEW")
    stack.fs.release(fh)
    assert await stack.fs.read(reader, 0, 5) == b"NEW" + content[3:5]  # one file, one content
    stack.fs.release(reader)
    await stack.flush()
    assert stack.store_files()["w.bin"] == b"NEW" + content[3:]


async def test_a_kill_while_a_remote_file_is_opened_with_o_trunc_leaves_it_remote_or_dirty(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Crash harness, seed 64 round 21 (file://): the empty cache file of a remote file opened with O_TRUNC
    was journaled as a clean copy of the object, and only then as changed. Killed in between, the daemon
    came back with the file clean and empty while the store kept its bytes: never uploaded, and different
    again once evicted. A journal write failing there stands in for the kill: what was committed must be
    the remote file as it was, or a new version to upload, never an empty clean copy."""
    ino, _ = await remote_file(stack, "latest", 29)

    def killed(_inode_id: int) -> None:
        raise RuntimeError("killed between the journal writes")

    with monkeypatch.context() as patch:
        patch.setattr(stack.journal.names, "mark_dirty", killed)
        with pytest.raises(RuntimeError):
            await stack.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    committed = stack.journal.names.get(ino)
    assert committed is not None
    assert committed.state == REMOTE or committed.state == "dirty", committed
    # And the open, done again, rewrites the file in the store.
    fh = await stack.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    stack.fs.write(fh, 0, b"new marker")
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files()["latest"] == b"new marker"


async def test_a_reader_keeps_its_version_when_the_file_is_rewritten(stack: Stack) -> None:
    ino, content = await remote_file(stack, "t.bin", 6 * CHUNK)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(reader, 0, 10) == content[:10]
    writer = await stack.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    stack.fs.write(writer, 0, b"fresh")
    stack.fs.release(writer)
    # The partial file was the old version's: the reader goes on reading it, like an unlinked file.
    assert await stack.fs.read(reader, 4 * CHUNK, 10) == content[4 * CHUNK:4 * CHUNK + 10]
    stack.fs.release(reader)
    with trio.fail_after(5):  # once the read-ahead still in flight is done
        while os.listdir(stack.cache.tmp_dir):  # noqa: ASYNC110 (nothing to wait on but the directory)
            await trio.sleep(0.01)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 100) == b"fresh"
    stack.fs.release(fh)
    await stack.flush()
    assert stack.cache.reserved == 0


async def test_without_the_fetch_service_a_read_fetches_its_own_chunk(tmp_path: Path, nursery: trio.Nursery) -> None:
    s = make_stack(tmp_path)
    s.fetcher.chunk_size = CHUNK
    await nursery.start(s.drain.run)
    ino, content = await remote_file(s, "n.bin", 4 * CHUNK)
    fh = await s.fs.open(ino, os.O_RDONLY)
    assert await s.fs.read(fh, CHUNK + 1, 10) == content[CHUNK + 1:CHUNK + 11]
    assert chunk_offsets(s, "n.bin") == [CHUNK]
    assert await read_all(s, fh, len(content)) == content
    s.fs.release(fh)
    assert s.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    check_consistency(s)


async def test_a_restart_discards_partial_files_and_a_remote_inodes_data_file(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    s = make_stack(tmp_path)
    s.fetcher.chunk_size = CHUNK
    await nursery.start(s.drain.run)
    await nursery.start(s.fetcher.run)
    ino, content = await remote_file(s, "k.bin", 8 * CHUNK)
    fh = await s.fs.open(ino, os.O_RDONLY)
    assert await s.fs.read(fh, 3 * CHUNK, 10) == content[3 * CHUNK:3 * CHUNK + 10]
    assert os.listdir(s.cache.tmp_dir)  # a partial file
    # What a kill -9 leaves, plus a data file of the remote inode (a fetch that died between moving its
    # file into data/ and the journal's update): neither is a local copy.
    Path(s.cache.data_path(ino)).write_bytes(b"\0" * len(content))  # noqa: ASYNC240
    old_fd = s.fetcher.partials.streams[ino].fd
    # The next daemon on the same cache dir and store.
    s2 = make_stack(tmp_path)
    s2.fetcher.chunk_size = CHUNK
    repair_journal(s2.journal, s2.cache, 0.0)
    s2.cache.scan()
    assert os.listdir(s2.cache.tmp_dir) == []
    assert not s2.cache.has_data(ino) and s2.cache.used == 0
    check_consistency(s2)
    await nursery.start(s2.fetcher.run)
    fh2 = await s2.fs.open(ino, os.O_RDONLY)
    assert await read_all(s2, fh2, len(content)) == content
    s2.fs.release(fh2)
    assert s2.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    check_consistency(s2)
    os.close(old_fd)
    del s.fs.handles[fh]


async def test_a_small_cache_budget_gets_chunks_that_fit(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A budget smaller than four of the engine's chunks (16 MiB each) streams in chunks of a quarter of the
    budget: a chunk larger than the budget could never be fetched, and every read would wait for room
    until dirty_wait and fail."""
    stack = make_stack(tmp_path, cache_size=10 << 20, dirty_wait=5.0)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fetcher.run)
    await nursery.start(stack.fs.evictor.run)
    ino, content = await remote_file(stack, "big.bin", 24 << 20)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    with trio.fail_after(30):
        got = await read_all(stack, fh, len(content), step=1 << 20)
    stack.fs.release(fh)
    assert got == content
    assert sorted(set(chunk_offsets(stack, "big.bin")))[:2] == [0, 2 << 20]  # 10 MiB // 4, in whole MiB
    check_consistency(stack)
