"""The cache budget without a kernel: accounting, LRU eviction of clean files, back-pressure, ENOSPC."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.lowlevel
from fsharness import GID, UID, Stack, check_consistency, make_stack

from ckptfs.errors import FsError, PermanentBackendError, TransientBackendError
from ckptfs.fs import RoomNeeded, SetAttrs
from ckptfs.journal import CLEAN, REMOTE, ROOT_ID

KIB = 1024


def data_bytes(stack: Stack) -> int:
    return sum(os.stat(stack.cache.data_path(i)).st_size for i in stack.cache.data_ids())


async def write_waiting(stack: Stack, fh: int, offset: int, data: bytes) -> None:
    """What fuse_ops.write does: write, and wait for room when the cache is over its budget."""
    while True:
        try:
            stack.fs.write(fh, offset, data)
            return
        except RoomNeeded:
            await stack.fs.wait_for_room()


async def read_all(stack: Stack, ino: int) -> bytes:
    fh = await stack.fs.open(ino, os.O_RDONLY)
    try:
        return await stack.fs.read(fh, 0, 1 << 24)
    finally:
        stack.fs.release(fh)


async def test_accounting_follows_writes_truncates_and_removes(tmp_path: Path) -> None:
    stack = make_stack(tmp_path, cache_size=10 << 20)
    assert stack.cache.limit == 10 << 20
    fh, attr = stack.fs.create(ROOT_ID, b"f", 0o644, os.O_RDWR, UID, GID)
    stack.fs.write(fh, 0, b"x" * 1000)
    stack.fs.write(fh, 500, b"y" * 100)  # inside: no growth
    stack.fs.write(fh, 4000, b"z")  # past the end: the gap is a hole, not charged
    assert stack.cache.used == 1001
    stack.fs.release(fh)
    assert stack.cache.used == 4001  # measured at close: one block of the filesystem holds it all
    await stack.fs.setattr(attr.ino, SetAttrs(size=10), None)
    assert stack.cache.used == 10
    stack.fs.unlink(ROOT_ID, b"f")
    stack.fs.forget(attr.ino, 1)
    assert stack.cache.used == 0
    # A fresh scan (what a restart sees) agrees with the running count.
    stack.write_file("g", b"g" * 3000)
    before = stack.cache.used
    stack.cache.scan()
    assert stack.cache.used == before == data_bytes(stack)
    check_consistency(stack)


async def test_clean_files_are_evicted_least_recently_used_first_and_come_back(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB)
    await nursery.start(stack.drain.run)
    inos = [stack.write_file(f"ckpt-{i}", bytes([i]) * (300 * KIB)) for i in range(3)]
    await stack.flush()
    # Read ckpt-0 so that ckpt-1 becomes the least recently used.
    assert await read_all(stack, inos[0]) == bytes([0]) * (300 * KIB)
    inos.append(stack.write_file("ckpt-3", b"\3" * (300 * KIB)))  # 1200 KiB > 950 KiB high-water mark
    stack.fs.evictor.evict_if_needed()
    states = {i: stack.journal.names.get(i).state for i in inos}  # type: ignore[union-attr]
    assert states[inos[1]] == REMOTE, states
    assert states[inos[0]] == CLEAN and states[inos[2]] == CLEAN
    assert stack.cache.used <= 1000 * KIB
    assert stack.fs.getxattr(inos[1], b"user.ckptfs.state") == b"remote"
    assert stack.fs.getattr(inos[1]).size == 300 * KIB  # stat still answers, from the journal
    # Reading it back fetches it, which evicts the next least recently used clean file.
    assert await read_all(stack, inos[1]) == b"\1" * (300 * KIB)
    assert stack.cache.used <= 1000 * KIB
    assert stack.fs.evictor.stats.evicted_files >= 2
    check_consistency(stack)


async def test_open_and_dirty_files_are_never_evicted(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"open", 0o644, os.O_RDWR, UID, GID)
    stack.fs.write(fh, 0, b"o" * (300 * KIB))
    stack.fs.release(fh)
    await stack.flush()
    fh = await stack.fs.open(attr.ino, os.O_RDONLY)  # clean now, but open
    dirty = stack.write_file("dirty", b"d" * (400 * KIB))  # waits out the upload delay: stays dirty
    stack.write_file("more", b"m" * (400 * KIB))
    assert stack.fs.evictor.evict(1 << 30) == 0
    assert stack.journal.names.get(dirty).state != REMOTE  # type: ignore[union-attr]
    assert stack.journal.names.get(attr.ino).state == CLEAN  # type: ignore[union-attr]
    stack.fs.release(fh)
    assert stack.fs.evictor.evict(1 << 30) > 0
    assert stack.journal.names.get(attr.ino).state == REMOTE  # type: ignore[union-attr]
    check_consistency(stack)


async def test_writes_wait_for_the_drain_instead_of_failing(tmp_path: Path, nursery: trio.Nursery) -> None:
    # upload_delay is an hour: only the back-pressure's "upload now" gets the first file out in time.
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    stack.write_file("first", b"1" * (800 * KIB))
    fh, _ = stack.fs.create(ROOT_ID, b"second", 0o644, os.O_WRONLY, UID, GID)
    peak = 0
    with trio.fail_after(20):
        for offset in range(0, 768 * KIB, 64 * KIB):
            await write_waiting(stack, fh, offset, b"2" * (64 * KIB))
            peak = max(peak, data_bytes(stack))
    stack.fs.release(fh)
    # Never more than the budget plus one write request.
    assert peak <= 1000 * KIB + 64 * KIB
    assert stack.fs.evictor.stats.waits >= 1 and stack.fs.evictor.stats.enospc == 0
    await stack.flush()
    assert stack.store_files() == {"first": b"1" * (800 * KIB), "second": b"2" * (768 * KIB)}
    check_consistency(stack)


async def test_write_fails_with_enospc_after_dirty_wait(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, dirty_wait=0.5)
    stack.store.failures = [PermanentBackendError("AccessDenied")] * 1000  # the bucket refuses writes
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    stack.write_file("first", b"1" * (900 * KIB))
    fh, _ = stack.fs.create(ROOT_ID, b"second", 0o644, os.O_WRONLY, UID, GID)
    with pytest.raises(FsError) as exc_info:
        for offset in range(0, 768 * KIB, 64 * KIB):
            await write_waiting(stack, fh, offset, b"2" * (64 * KIB))
    assert exc_info.value.errno == errno.ENOSPC
    assert len(stack.store.failures) < 1000, "the store never refused a write"
    assert stack.fs.evictor.stats.enospc == 1
    stack.fs.release(fh)
    # Nothing written before is lost: both files are still in the cache, dirty, and journaled.
    assert stack.journal.names.by_path("first").state != REMOTE  # type: ignore[union-attr]
    check_consistency(stack)


async def test_statfs_reports_the_budget(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    await nursery.start(stack.drain.run)
    info = stack.fs.statfs()
    assert info.blocks * info.block_size <= 1000 * KIB
    assert info.blocks_free == info.blocks
    stack.write_file("dirty", b"d" * (400 * KIB))
    info = stack.fs.statfs()
    assert (info.blocks - info.blocks_free) * info.block_size >= 390 * KIB
    await stack.flush()  # clean files can be evicted: they count as free
    assert stack.fs.statfs().blocks_free == info.blocks


async def test_a_file_larger_than_the_budget_is_read_but_not_opened_for_writing(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB)
    stack.fetcher.chunk_size = 64 * KIB
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fetcher.run)
    content = os.urandom(900 * KIB)
    ino = stack.write_file("big", content)
    await stack.flush()
    assert stack.fs.evictor.evict(1 << 30) > 0
    stack.cache.configure_budget(500 * KIB, 0)
    fh = await stack.fs.open(ino, os.O_RDONLY)
    got = b"".join([await stack.fs.read(fh, offset, 32 * KIB) for offset in range(0, len(content), 32 * KIB)])
    assert got == content
    assert stack.cache.used <= 500 * KIB
    assert stack.fetcher.stats.chunks_punched > 0
    stack.fs.release(fh)
    # Writing needs the whole content local, and it could not be evicted while dirty: a clear error.
    with pytest.raises(FsError) as exc_info:
        await stack.fs.open(ino, os.O_RDWR)
    assert exc_info.value.errno == errno.EFBIG
    check_consistency(stack)


def small_spills(stack: Stack) -> None:
    stack.drain.spills.part_size = 64 * KIB
    stack.drain.spills.lookahead = 64 * KIB


async def test_a_file_larger_than_the_cache_is_spilled_while_it_is_written(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    fh, attr = stack.fs.create(ROOT_ID, b"big.pt", 0o644, os.O_WRONLY, UID, GID)
    expected = bytearray()
    peak = 0
    with trio.fail_after(30):
        for i in range(64):  # 4 MiB through a 1000 KiB cache
            chunk = bytes([i]) * (64 * KIB)
            await write_waiting(stack, fh, len(expected), chunk)
            expected += chunk
            peak = max(peak, stack.cache.used)
        # Data already spilled can no longer be rewritten or read.
        with pytest.raises(FsError) as exc_info:
            await write_waiting(stack, fh, 0, b"late")
        assert exc_info.value.errno == errno.EIO
        stack.fs.release(fh)
        await stack.flush()
    assert peak <= 1000 * KIB + 64 * KIB
    assert stack.drain.stats.spilled_bytes > 0
    assert stack.store_files() == {"big.pt": bytes(expected)}
    # Its local copy had holes: it was evicted, and reads come back whole from the store.
    assert stack.journal.names.get(attr.ino).state == REMOTE  # type: ignore[union-attr]
    stack.cache.configure_budget(8 << 20, 0)
    assert await read_all(stack, attr.ino) == bytes(expected)
    assert not [p for p in (tmp_path / "store").rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]
    check_consistency(stack)


async def test_writes_go_on_through_spills_when_others_filled_the_filesystem_past_min_free(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """min_free larger than the filesystem's free space used to leave a budget of 0: every write waited
    out dirty_wait and failed, even of a file that spills could have taken to the store."""
    stack = make_stack(tmp_path, upload_delay=3600, dirty_wait=10)
    small_spills(stack)
    stack.cache.configure_budget("100%", "100%", working_room=stack.drain.spill_room)
    assert stack.cache.squeezed and stack.cache.limit == stack.drain.spill_room
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    fh, _ = stack.fs.create(ROOT_ID, b"big.pt", 0o644, os.O_WRONLY, UID, GID)
    expected = bytearray()
    with trio.fail_after(30):
        for i in range(32):  # 2 MiB through a working room of 192 KiB
            chunk = bytes([i]) * (64 * KIB)
            await write_waiting(stack, fh, len(expected), chunk)
            expected += chunk
        stack.fs.release(fh)
        await stack.flush()
    assert stack.fs.evictor.stats.enospc == 0 and stack.drain.stats.spilled_bytes > 0
    assert stack.store_files() == {"big.pt": bytes(expected)}
    check_consistency(stack)


async def test_a_spilled_file_opened_before_its_upload_ends_is_read_whole_from_the_store(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Closed, its start spilled, its upload not finished (upload_delay, or a restart mid-spill): an open
    waits for the upload and then reads the store's copy. It used to fail every read of the spilled part
    with EIO until the upload happened to finish (found by the crash harness, right after a restart)."""
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    stack.fetcher.chunk_size = 64 * KIB
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    await nursery.start(stack.fetcher.run)
    fh, attr = stack.fs.create(ROOT_ID, b"big.pt", 0o644, os.O_WRONLY, UID, GID)
    expected = b"".join(bytes([i]) * (64 * KIB) for i in range(32))
    with trio.fail_after(30):
        for offset in range(0, len(expected), 64 * KIB):
            await write_waiting(stack, fh, offset, expected[offset:offset + 64 * KIB])
        stack.fs.release(fh)
        assert stack.drain.stats.spilled_bytes > 0 and stack.cache.file(attr.ino).freed
        reader = await stack.fs.open(attr.ino, os.O_RDONLY)
        assert await stack.fs.read(reader, 0, 64 * KIB) == expected[:64 * KIB]
        assert await stack.fs.read(reader, len(expected) - 10, 10) == expected[-10:]
        stack.fs.release(reader)
    assert stack.store_files() == {"big.pt": expected}
    check_consistency(stack)


async def test_two_writers_that_together_exceed_the_cache_both_finish(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)

    async def writer(name: bytes, fill: int) -> None:
        fh, _ = stack.fs.create(ROOT_ID, name, 0o644, os.O_WRONLY, UID, GID)
        for offset in range(0, 1536 * KIB, 32 * KIB):
            await write_waiting(stack, fh, offset, bytes([fill]) * (32 * KIB))
            await trio.lowlevel.checkpoint()
        stack.fs.release(fh)

    with trio.fail_after(30):
        async with trio.open_nursery() as writers:
            writers.start_soon(writer, b"rank0", 0)
            writers.start_soon(writer, b"rank1", 1)
        await stack.flush()
    assert stack.store_files() == {"rank0": b"\0" * (1536 * KIB), "rank1": b"\1" * (1536 * KIB)}
    check_consistency(stack)


async def test_truncating_a_spilled_file_to_zero_starts_it_afresh(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    fh, attr = stack.fs.create(ROOT_ID, b"f", 0o644, os.O_RDWR, UID, GID)
    with trio.fail_after(30):
        for offset in range(0, 2048 * KIB, 64 * KIB):
            await write_waiting(stack, fh, offset, b"a" * (64 * KIB))
        assert stack.cache.files[attr.ino].freed > 0
        with pytest.raises(FsError) as exc_info:
            await stack.fs.read(fh, 0, 10)
        assert exc_info.value.errno == errno.EIO
        with pytest.raises(FsError) as exc_info:
            await stack.fs.setattr(attr.ino, SetAttrs(size=10), fh)
        assert exc_info.value.errno == errno.EIO
        await stack.fs.setattr(attr.ino, SetAttrs(size=0), fh)
        await write_waiting(stack, fh, 0, b"fresh")
        assert await stack.fs.read(fh, 0, 10) == b"fresh"
        stack.fs.release(fh)
        await stack.flush()
    assert stack.store_files() == {"f": b"fresh"}
    assert not [p for p in (tmp_path / "store").rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]
    check_consistency(stack)


async def test_a_waiting_writer_does_not_spin(tmp_path: Path, nursery: trio.Nursery) -> None:
    # Regression: the waiter kicked the evictor on every wake-up and the evictor woke it at once, so a
    # write waiting for room spun a CPU (the drain's store calls then starved).
    stack = make_stack(tmp_path, cache_size=1000 * KIB, dirty_wait=1.0)
    stack.store.failures = [PermanentBackendError("AccessDenied")] * 1000
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    stack.write_file("first", b"1" * (1001 * KIB))
    fh, _ = stack.fs.create(ROOT_ID, b"second", 0o644, os.O_WRONLY, UID, GID)
    cpu = time.process_time()
    with pytest.raises(FsError):
        await write_waiting(stack, fh, 0, b"2" * (64 * KIB))
    assert time.process_time() - cpu < 0.5
    assert len(stack.store.failures) < 1000, "the store never refused a write"
    stack.fs.release(fh)


async def test_truncate_while_a_spilled_part_is_uploading_keeps_the_new_bytes(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Regression: the part finished uploading after the truncate, and the drain then punched its range out
    # of the file's new content and committed the old spilled start.
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    stack.store.spill_gate = threading.Event()
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    fh, attr = stack.fs.create(ROOT_ID, b"f", 0o644, os.O_RDWR, UID, GID)
    offset = 0
    with trio.fail_after(30):
        while True:
            try:
                stack.fs.write(fh, offset, b"a" * (64 * KIB))
            except RoomNeeded:
                break
            offset += 64 * KIB
        # Over budget now: the evictor's next round starts a spill, whose first part is held at the gate.
        await trio.to_thread.run_sync(stack.store.spilling.wait, 10)
        await stack.fs.setattr(attr.ino, SetAttrs(size=0), fh)
        stack.fs.write(fh, 0, b"fresh")
        stack.store.spill_gate.set()
        await trio.sleep(0.5)  # the spill job sees its part done
        assert await stack.fs.read(fh, 0, 10) == b"fresh"
        stack.fs.release(fh)
        await stack.flush()
    assert stack.store_files() == {"f": b"fresh"}
    assert not [p for p in (tmp_path / "store").rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]
    check_consistency(stack)


async def test_a_failed_spill_commit_is_retried_not_replaced_by_an_upload_of_the_holes(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Regression: after the rest of the file was staged, a failed commit was retried; the retry took the spill
    # for stale (it compared the bytes staged with the bytes punched) and uploaded the cache file, holes and all.
    stack = make_stack(tmp_path, cache_size=1000 * KIB, upload_delay=3600)
    small_spills(stack)
    stack.store.spill_commit_failures = [TransientBackendError("503 SlowDown")]
    await nursery.start(stack.drain.run)
    await nursery.start(stack.fs.evictor.run)
    fh, _ = stack.fs.create(ROOT_ID, b"big.pt", 0o644, os.O_WRONLY, UID, GID)
    expected = bytearray()
    with trio.fail_after(30):
        for i in range(40):
            chunk = bytes([i]) * (64 * KIB)
            await write_waiting(stack, fh, len(expected), chunk)
            expected += chunk
        stack.fs.release(fh)
        await stack.flush()
    assert stack.drain.stats.spilled_bytes > 0 and not stack.store.spill_commit_failures
    assert stack.store_files() == {"big.pt": bytes(expected)}


async def test_a_file_removed_while_its_upload_is_staged_leaves_nothing_in_the_store(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Its staged parts were left for the next start-up's cleanup: for a daemon that runs for weeks, parts
    of deleted checkpoints in the bucket (the crash harness saw the temp file after a flush)."""
    stack = make_stack(tmp_path)
    stack.drain.engine.part_size = 1 << 20
    stack.store.part_gate = threading.Event()
    await nursery.start(stack.drain.run)
    data = os.urandom(12 << 20)
    ino = stack.write_file("big.bin", data)
    assert await trio.to_thread.run_sync(stack.store.parting.wait, 20), "no part reached the store"
    stack.fs.unlink(ROOT_ID, b"big.bin")
    stack.fs.forget(ino, 1)
    stack.store.part_gate.set()
    await stack.flush()
    leftovers = [str(p) for p in (tmp_path / "store").rglob("*") if not p.is_dir()]
    assert leftovers == [] and stack.store_files() == {}
    check_consistency(stack)
