"""Early spills without a kernel: the written start of a large file is staged while it is still open (on a
store that can place the staged upload at any key), and the object is always the file as closed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio
from fsharness import GID, UID, Stack, check_consistency, make_stack
from waiting import drain_had_its_chance

from ckptfs.backends.base import UploadState
from ckptfs.fs import SetAttrs
from ckptfs.journal import CLEAN, ROOT_ID

KIB = 1024
PART = 64 * KIB


def small_parts(stack: Stack) -> None:
    stack.drain.spills.part_size = PART
    stack.drain.spills.lookahead = PART


async def write_parts(stack: Stack, fh: int, parts: range, *, seed: int = 0) -> bytes:
    """Write whole parts at their offsets, pausing so that the drain's polls see the file grow."""
    written = bytearray()
    for i in parts:
        chunk = bytes([(i + seed) % 256]) * PART
        stack.fs.write(fh, i * PART, chunk)
        written += chunk
        await trio.sleep(0.02)
    return bytes(written)


async def staged_bytes(stack: Stack, ino: int, at_least: int) -> int:
    """Wait until the journal holds an early spill of at least `at_least` bytes of the file; its size."""
    with trio.fail_after(10):
        while True:
            inode = stack.journal.names.get(ino)
            assert inode is not None
            if inode.upload_state is not None:
                state = UploadState.from_json(inode.upload_state)
                if state.early and state.size >= at_least:
                    return state.size
            await trio.sleep(0.02)


def leftovers(stack: Stack) -> list[Path]:
    return [p for p in (stack.root / "store").rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]


async def test_a_file_being_written_is_staged_and_placed_at_its_key_without_a_copy(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"big.pt", 0o640, os.O_WRONLY, UID, GID)
    data = await write_parts(stack, fh, range(12))
    # Open still, and most of it is in the store already: all but the lookahead and the part being written.
    assert await staged_bytes(stack, attr.ino, 8 * PART) <= 12 * PART - PART
    assert "big.pt" not in stack.store_files()
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"big.pt": data}
    placed = os.stat(tmp_path / "store" / "big.pt")
    inode = stack.journal.names.get(attr.ino)
    assert inode is not None and inode.state == CLEAN and inode.upload_state is None
    assert placed.st_mode & 0o7777 == 0o640 and placed.st_mtime_ns == inode.mtime_ns
    # Completed at its key: no copy of the whole file, nothing staged left behind, the local copy kept.
    assert ("spill_commit", "big.pt") in stack.store.calls
    assert not [call for call in stack.store.calls if call[0] == "copy"]
    assert not leftovers(stack) and stack.cache.has_data(attr.ino)
    check_consistency(stack)


async def test_a_write_into_a_staged_part_still_gives_the_file_as_closed(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A pressure spill refuses such a write (EIO); an early one keeps the file writable and, finding at close
    that the staged start is no longer the file's, uploads it whole."""
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"header.bin", 0o644, os.O_RDWR, UID, GID)
    data = bytearray(await write_parts(stack, fh, range(10)))
    await staged_bytes(stack, attr.ino, 2 * PART)
    stack.fs.write(fh, 100, b"patched header")  # a writer going back to fill in a header
    data[100:114] = b"patched header"
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"header.bin": bytes(data)}
    assert ("spill_commit", "header.bin") not in stack.store.calls  # the staged start was not used
    assert not leftovers(stack)
    check_consistency(stack)


async def test_a_truncate_and_rewrite_while_staged_gives_the_new_content(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"f", 0o644, os.O_WRONLY, UID, GID)
    await write_parts(stack, fh, range(8))
    await staged_bytes(stack, attr.ino, 2 * PART)
    await stack.fs.setattr(attr.ino, SetAttrs(size=0), fh)
    data = await write_parts(stack, fh, range(9), seed=7)  # longer than before, other bytes
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"f": data}
    assert not leftovers(stack)
    check_consistency(stack)


async def test_a_file_renamed_while_it_is_written_lands_under_its_new_name(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"ckpt.tmp", 0o644, os.O_WRONLY, UID, GID)
    data = await write_parts(stack, fh, range(6))
    await staged_bytes(stack, attr.ino, PART)
    stack.fs.rename(ROOT_ID, b"ckpt.tmp", ROOT_ID, b"ckpt.pt", 0)
    data += await write_parts(stack, fh, range(6, 10))
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"ckpt.pt": data}
    assert ("spill_commit", "ckpt.pt") in stack.store.calls
    assert not leftovers(stack)
    check_consistency(stack)


async def test_a_file_appended_to_after_its_early_upload_is_uploaded_again_whole(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A second early spill of the same file (reopened without O_TRUNC) starts from nothing staged: it used
    to see the first spill's count, discard itself and start again, round after round."""
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"log.bin", 0o644, os.O_WRONLY, UID, GID)
    data = await write_parts(stack, fh, range(6))
    await staged_bytes(stack, attr.ino, 2 * PART)
    stack.fs.release(fh)
    await stack.flush()
    fh = await stack.fs.open(attr.ino, os.O_WRONLY)
    data += await write_parts(stack, fh, range(6, 14))
    await staged_bytes(stack, attr.ino, 8 * PART)
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"log.bin": data}
    assert not [call for call in stack.store.calls if call[0] == "abort"]
    assert not leftovers(stack)
    check_consistency(stack)


async def test_nothing_is_staged_while_writing_when_turned_off(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, upload_while_writing=False)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    since = time.time()
    fh, attr = stack.fs.create(ROOT_ID, b"big.pt", 0o644, os.O_WRONLY, UID, GID)
    data = await write_parts(stack, fh, range(12))
    await drain_had_its_chance(stack.drain, since=since, due=time.time(), what="stage parts of big.pt")
    assert stack.drain.stats.spilled_bytes == 0 and stack.journal.names.get(attr.ino).upload_state is None  # type: ignore[union-attr]
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"big.pt": data}


async def test_a_file_removed_while_its_spill_is_being_finished_ends_quietly(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """The file was unlinked and purged during the awaits before its spill's finish (crash harness, seed
    4502 round 12): the finish met its missing cache file and the drain logged an unexpected error and
    retried. Now the job ends: the purge queued the staged upload's abort, and there is nothing to upload."""
    stack = make_stack(tmp_path, upload_while_writing=True)
    small_parts(stack)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"big.pt", 0o640, os.O_WRONLY, UID, GID)
    await write_parts(stack, fh, range(8))
    await staged_bytes(stack, attr.ino, 2 * PART)
    spills = stack.drain.spills
    early_spill_holds = spills.early_spill_holds
    removed: list[int] = []

    async def removed_meanwhile(inode, state):  # type: ignore[no-untyped-def]
        holds = await early_spill_holds(inode, state)
        if not removed:  # the application removes the file while the drain awaits
            stack.fs.unlink(ROOT_ID, b"big.pt")
            stack.fs.forget(inode.id, 1)
            removed.append(inode.id)
        return holds

    spills.early_spill_holds = removed_meanwhile  # type: ignore[method-assign]
    stack.fs.release(fh)
    await stack.flush()
    assert removed == [attr.ino]
    assert stack.drain.faults.counts.get("drain", 0) == 0, stack.drain.faults.last
    assert stack.store_files() == {} and not leftovers(stack)
    check_consistency(stack)
