"""fs-level tests: POSIX semantics and drain convergence without a kernel. Each ends with a consistency
check of journal against cache."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from fsharness import GID, UID, Stack, check_consistency, list_tree, make_stack
from waiting import drain_had_its_chance, until

from ckptfs.drain import BURST_QUIET, SMALL_BATCH, SMALL_FILE
from ckptfs.drain.recovery import recover, repair_journal
from ckptfs.drain.scheduler import BURST_SCAN_INTERVAL
from ckptfs.errors import FsError, PermanentBackendError, TransientBackendError
from ckptfs.fs import RENAME_EXCHANGE, RENAME_NOREPLACE, SetAttrs
from ckptfs.journal import CLEAN, DIRTY, REMOTE, ROOT_ID, Journal


@pytest.fixture
async def stack(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    s = make_stack(tmp_path)
    await nursery.start(s.drain.run)
    yield s
    check_consistency(s)


def errno_of(exc_info: pytest.ExceptionInfo[FsError]) -> int:
    return exc_info.value.errno


async def test_write_close_uploads_identical_bytes(stack: Stack) -> None:
    stack.write_file("a.bin", b"x" * 100_000)
    await stack.flush()
    assert stack.store_files() == {"a.bin": b"x" * 100_000}
    inode = stack.journal.names.by_path("a.bin")
    assert inode is not None and inode.state == CLEAN
    assert inode.uploaded_version == inode.version
    assert inode.checksum is not None and inode.checksum.startswith("crc32:")


async def test_random_writes_and_sparse_file(stack: Stack) -> None:
    fh, attr = stack.fs.create(ROOT_ID, b"sparse", 0o644, os.O_RDWR, UID, GID)
    stack.fs.write(fh, 1 << 20, b"end")
    stack.fs.write(fh, 10, b"mid")
    assert await stack.fs.read(fh, 0, 13) == b"\0" * 10 + b"mid"
    assert stack.fs.getattr(attr.ino).size == (1 << 20) + 3
    stack.fs.release(fh)
    await stack.flush()
    data = stack.store_files()["sparse"]
    assert len(data) == (1 << 20) + 3 and data[10:13] == b"mid" and data[-3:] == b"end"


async def test_truncate_marks_dirty_and_uploads(stack: Stack) -> None:
    ino = stack.write_file("t", b"0123456789")
    await stack.flush()
    await stack.fs.setattr(ino, SetAttrs(size=4), None)
    assert stack.journal.names.get(ino).state == DIRTY  # type: ignore[union-attr]
    await stack.flush()
    assert stack.store_files()["t"] == b"0123"


async def test_reopen_without_writing_does_not_reupload(stack: Stack) -> None:
    ino = stack.write_file("r", b"data")
    await stack.flush()
    fh = await stack.fs.open(ino, os.O_RDWR)
    assert await stack.fs.read(fh, 0, 4) == b"data"
    stack.fs.release(fh)
    await stack.flush()
    assert stack.journal.names.get(ino).state == CLEAN  # type: ignore[union-attr]
    assert [c for c in stack.store.calls if c[0] == "commit"] == [("commit", "r")]


async def test_names_the_store_cannot_keep(stack: Stack) -> None:
    with pytest.raises(FsError) as exc:
        stack.fs.create(ROOT_ID, b"\xff\xfe", 0o644, os.O_WRONLY, UID, GID)
    assert errno_of(exc) == errno.EINVAL
    with pytest.raises(FsError) as exc:
        stack.fs.create(ROOT_ID, b"n" * 256, 0o644, os.O_WRONLY, UID, GID)
    assert errno_of(exc) == errno.ENAMETOOLONG
    with pytest.raises(FsError) as exc:
        stack.fs.create(ROOT_ID, b".ckptfs-tmp.x", 0o644, os.O_WRONLY, UID, GID)
    assert errno_of(exc) == errno.EINVAL
    with pytest.raises(FsError) as exc:
        stack.fs.link()
    assert errno_of(exc) == errno.EPERM
    with pytest.raises(FsError) as exc:
        stack.fs.mknod(ROOT_ID, b"fifo", stat.S_IFIFO | 0o644, UID, GID)
    assert errno_of(exc) == errno.EPERM
    attr = stack.fs.mknod(ROOT_ID, b"plain", stat.S_IFREG | 0o644, UID, GID)
    assert attr.size == 0 and stack.journal.names.by_path("plain") is not None


async def test_rename_before_upload_uploads_new_name_only(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, upload_delay=30)
    await nursery.start(stack.drain.run)
    stack.write_file("tmp.pt", b"content")
    stack.fs.rename(ROOT_ID, b"tmp.pt", ROOT_ID, b"final.pt", 0)
    await stack.flush()
    assert stack.store_files() == {"final.pt": b"content"}
    assert [c for c in stack.store.calls if c[0] == "commit"] == [("commit", "final.pt")]
    check_consistency(stack)


async def test_rename_during_upload_abandons_and_restarts(stack: Stack) -> None:
    stack.store.stage_gate = threading.Event()
    stack.write_file("old", b"payload")
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    stack.fs.rename(ROOT_ID, b"old", ROOT_ID, b"new", 0)
    stack.store.stage_gate.set()
    await stack.flush()
    assert stack.store_files() == {"new": b"payload"}
    # A small file is staged locally (nothing in the store to abort); it is never completed at the old key.
    commits = [c for c in stack.store.calls if c[0] == "commit"]
    assert commits == [("commit", "new")], "never completed at the old key"


async def test_small_files_upload_in_batches(stack: Stack) -> None:
    """Closed small files go to the store together (one journal transaction and one worker-thread hop for
    many), at most SMALL_BATCH at a time; each is recorded clean with its own checksum."""
    contents = {f"f{i:03d}": f"content {i}".encode() * (i + 1) for i in range(SMALL_BATCH * 2 + 3)}
    for name, data in contents.items():
        stack.write_file(name, data)
    await stack.flush()
    assert stack.store_files() == contents
    batches = stack.drain.engine.batches  # type: ignore[attr-defined]
    assert sorted(key for batch in batches for key in batch) == sorted(contents)
    assert len(batches) == 3 and max(len(batch) for batch in batches) == SMALL_BATCH
    for name in contents:
        inode = stack.journal.names.by_path(name)
        assert inode is not None and inode.state == CLEAN and inode.checksum is not None


def _small_burst_step(stack: Stack, i: int) -> str:
    """One file of a save writing many small files: written under a temporary name, renamed into place."""
    stack.write_file(f".f{i}.tmp", b"small %d" % i)
    stack.fs.rename(ROOT_ID, f".f{i}.tmp".encode(), ROOT_ID, f"f{i}".encode(), 0)
    return f"f{i}"


async def test_small_files_wait_for_a_pause_in_a_burst_of_changes(tmp_path: Path, nursery: trio.Nursery) -> None:
    """While a save keeps creating and renaming small files, their uploads wait (the writer has the CPU and
    the GIL); a large file closed meanwhile does not. Once the mount has been quiet for BURST_QUIET, all of
    them go, without a flush."""
    stack = make_stack(tmp_path, small_file_wait=60)
    await nursery.start(stack.drain.run)
    big = b"B" * (SMALL_FILE + 1)
    stack.write_file("big.bin", big)
    names: list[str] = []
    with trio.fail_after(20):
        started = trio.current_time()
        while "big.bin" not in stack.store_files() or trio.current_time() - started < 3 * BURST_QUIET:
            names.append(_small_burst_step(stack, len(names)))
            assert set(stack.store_files()) <= {"big.bin"}, "a small file was uploaded during the burst"
            await trio.sleep(0.02)
    ended = trio.current_time()
    with trio.fail_after(20):
        while set(stack.store_files()) != {"big.bin", *names}:  # noqa: ASYNC110 (polling the store directory)
            await trio.sleep(0.02)
    assert trio.current_time() - ended >= BURST_QUIET * 0.9
    assert stack.store_files()[names[-1]] == b"small %d" % (len(names) - 1)
    check_consistency(stack)


async def test_a_burst_of_changes_does_not_rescan_at_every_change(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scans a burst's own changes cause start at least BURST_SCAN_INTERVAL apart (a scan runs on the
    thread that answers the writer's next request); before, every change rescanned after 20 ms."""
    stack = make_stack(tmp_path, small_file_wait=60)
    scans = 0
    scan = stack.drain._scan

    def counted() -> object:
        nonlocal scans
        scans += 1
        return scan()

    monkeypatch.setattr(stack.drain, "_scan", counted)
    await nursery.start(stack.drain.run)
    await trio.sleep(0.05)
    scans = 0
    started = trio.current_time()
    for i in range(60):
        _small_burst_step(stack, i)
        await trio.sleep(0.01)
    elapsed = trio.current_time() - started
    assert scans <= elapsed / BURST_SCAN_INTERVAL + 2, (scans, elapsed)
    await stack.flush()
    assert len(stack.store_files()) == 60


async def test_small_files_wait_in_a_burst_for_small_file_wait_at_most(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A burst that does not end (files written all the time): small files still go once they have waited
    small_file_wait beyond upload_delay."""
    stack = make_stack(tmp_path, small_file_wait=0.3)
    await nursery.start(stack.drain.run)
    names: list[str] = []
    with trio.fail_after(20):
        while not stack.store_files():
            names.append(_small_burst_step(stack, len(names)))
            await trio.sleep(0.02)
    uploaded = set(stack.store_files())
    assert uploaded < set(names), "the first files went during the burst, not all of them"
    assert names[0] in uploaded and names[-1] not in uploaded
    await stack.flush()
    assert set(stack.store_files()) == set(names)
    check_consistency(stack)


async def test_a_flush_does_not_wait_for_the_end_of_a_burst(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, small_file_wait=60)
    await nursery.start(stack.drain.run)
    since = time.time()
    names = [_small_burst_step(stack, i) for i in range(50)]
    await drain_had_its_chance(stack.drain, since=since, what="upload small files in the burst")
    assert not stack.store_files()
    # Changes keep coming while the flush runs: it ends anyway, with every file in the store.
    async with trio.open_nursery() as writers:
        writers.start_soon(stack.flush, 5)
        for i in range(50, 60):
            _small_burst_step(stack, i)
            await trio.sleep(0.01)
    assert set(names) <= set(stack.store_files())
    check_consistency(stack)


async def test_a_file_written_while_its_batch_puts_another_is_not_put_stale(stack: Stack) -> None:
    """Two small files in one batch; while the first one's PUT is held, the second is rewritten. The
    second must not be PUT with its old bytes (which the batch read before the rewrite): it is uploaded
    once, with the new ones."""
    hold = threading.Event()
    stack.store.put_gates = {"a": hold}
    stack.write_file("a", b"a-bytes")
    b = stack.write_file("b", b"b-version-1")
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.putting.wait, 10)
    fh = await stack.fs.open(b, os.O_WRONLY | os.O_TRUNC)
    stack.fs.write(fh, 0, b"b-version-2")
    stack.fs.release(fh)
    hold.set()
    await stack.flush()
    assert stack.store_files() == {"a": b"a-bytes", "b": b"b-version-2"}
    assert [content for key, content in stack.store.committed if key == "b"] == [b"b-version-2"]


async def test_write_during_upload_never_commits_stale_content(stack: Stack) -> None:
    stack.store.stage_gate = threading.Event()
    ino = stack.write_file("f", b"version-1")
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    fh = await stack.fs.open(ino, os.O_WRONLY | os.O_TRUNC)
    stack.fs.write(fh, 0, b"version-2")
    stack.fs.release(fh)
    stack.store.stage_gate.set()
    await stack.flush()
    assert stack.store_files() == {"f": b"version-2"}
    assert stack.store.committed == [("f", b"version-2")]


async def test_rename_after_upload_moves_object(stack: Stack) -> None:
    stack.fs.mkdir(ROOT_ID, b"step_1.tmp", 0o755, UID, GID)
    d = stack.resolve_dir("step_1.tmp")
    stack.write_file("step_1.tmp/a", b"A")
    stack.write_file("step_1.tmp/b", b"B")
    await stack.flush()
    stack.fs.rename(ROOT_ID, b"step_1.tmp", ROOT_ID, b"step_1", 0)
    await stack.flush()
    assert stack.store_files() == {"step_1/a": b"A", "step_1/b": b"B"}
    assert stack.store_dirs() == {"step_1"}
    assert stack.journal.names.get(d).remote_key == "step_1/"  # type: ignore[union-attr]


async def test_rename_over_clean_file_never_deletes_the_new_object(stack: Stack) -> None:
    stack.write_file("ckpt", b"old")
    await stack.flush()
    stack.write_file("ckpt.tmp", b"new")
    stack.fs.rename(ROOT_ID, b"ckpt.tmp", ROOT_ID, b"ckpt", 0)
    await stack.flush()
    assert stack.store_files() == {"ckpt": b"new"}
    assert ("delete", "ckpt") not in stack.store.calls
    assert stack.journal.deletes.pending_deletes() == []


async def test_rename_flags(stack: Stack) -> None:
    stack.write_file("a", b"1")
    stack.write_file("b", b"2")
    with pytest.raises(FsError) as exc:
        stack.fs.rename(ROOT_ID, b"a", ROOT_ID, b"b", RENAME_NOREPLACE)
    assert errno_of(exc) == errno.EEXIST
    with pytest.raises(FsError) as exc:
        stack.fs.rename(ROOT_ID, b"a", ROOT_ID, b"b", RENAME_EXCHANGE)
    assert errno_of(exc) == errno.EINVAL
    stack.fs.mkdir(ROOT_ID, b"d", 0o755, UID, GID)
    d = stack.resolve_dir("d")
    with pytest.raises(FsError) as exc:
        stack.fs.rename(ROOT_ID, b"d", d, b"inside", 0)
    assert errno_of(exc) == errno.EINVAL
    with pytest.raises(FsError) as exc:
        stack.fs.rename(ROOT_ID, b"a", ROOT_ID, b"d", 0)
    assert errno_of(exc) == errno.EISDIR
    await stack.flush()


async def test_unlink_open_file_stays_readable_then_goes(stack: Stack) -> None:
    ino = stack.write_file("victim", b"still here")
    await stack.flush()
    fh = await stack.fs.open(ino, os.O_RDONLY)
    stack.fs.lookup(ROOT_ID, b"victim")  # the kernel holds a reference, as it would
    stack.fs.unlink(ROOT_ID, b"victim")
    assert await stack.fs.read(fh, 0, 100) == b"still here"
    await stack.flush()
    assert stack.store_files() == {}
    stack.fs.release(fh)
    assert stack.journal.names.get(ino) is not None  # the kernel has not forgotten it yet
    stack.fs.forget(ino, 1)
    assert stack.journal.names.get(ino) is not None  # one of the two references (create, lookup) is left
    stack.fs.forget(ino, 1)
    assert stack.journal.names.get(ino) is None
    assert not stack.cache.has_data(ino)


async def test_rmdir_and_empty_directory_marker(stack: Stack) -> None:
    stack.fs.mkdir(ROOT_ID, b"empty", 0o755, UID, GID)
    await stack.flush()
    assert stack.store_dirs() == {"empty"}
    stack.fs.mkdir(ROOT_ID, b"full", 0o755, UID, GID)
    stack.write_file("full/x", b"x")
    with pytest.raises(FsError) as exc:
        stack.fs.rmdir(ROOT_ID, b"full")
    assert errno_of(exc) == errno.ENOTEMPTY
    stack.fs.rmdir(ROOT_ID, b"empty")
    await stack.flush()
    assert stack.store_dirs() == {"full"}


async def test_commit_marker_waits_for_earlier_files(stack: Stack) -> None:
    stack.store.stage_gate = threading.Event()
    stack.write_file("shard-0", b"0" * 1000)
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    since = time.time()
    stack.write_file("latest", b"shard-0")
    await drain_had_its_chance(stack.drain, since=since, what="upload the marker early")
    assert not any(key == "latest" for _, key in stack.store.calls)
    stack.store.stage_gate.set()
    await stack.flush()
    keys = [key for op, key in stack.store.calls if op == "commit"]
    assert keys == ["shard-0", "latest"]


async def test_commit_marker_waits_for_an_earlier_marker(stack: Stack) -> None:
    """Megatron's tracker names a step whose own DCP `.metadata` marker came before it: the tracker must not
    reach the store first (seen on SeaweedFS before markers waited for markers)."""
    stack.fs.mkdir(ROOT_ID, b"iter_1", 0o755, UID, GID)
    stack.write_file("iter_1/__0_0.distcp", b"shard")
    await stack.flush()
    stack.store.gated_keys = {"iter_1/.metadata"}
    stack.store.stage_gate = threading.Event()
    stack.write_file("iter_1/.metadata", b"meta")
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    since = time.time()
    stack.write_file("latest_checkpointed_iteration.txt", b"1")
    await drain_had_its_chance(stack.drain, since=since, what="upload the tracker early")
    assert not any(key == "latest_checkpointed_iteration.txt" for _, key in stack.store.calls)
    stack.store.stage_gate.set()
    await stack.flush()
    keys = [key for op, key in stack.store.calls if op == "commit"]
    assert keys == ["iter_1/__0_0.distcp", "iter_1/.metadata", "latest_checkpointed_iteration.txt"]
    check_consistency(stack)


async def test_transient_and_permanent_errors_are_retried(stack: Stack) -> None:
    stack.store.failures = [TransientBackendError("503 slow down"), PermanentBackendError("access denied")]
    stack.write_file("f", b"data")
    await stack.flush(seconds=30)
    assert stack.store_files() == {"f": b"data"}
    # The engine retries the transient error itself; the permanent one fails the job, which the drain retries.
    assert stack.drain.engine.statistics().retries == 1
    assert stack.drain.stats.errors == 1
    assert stack.drain.stats.last_error is not None and "access denied" in stack.drain.stats.last_error


async def test_flush_scoped_to_paths_and_timeout(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack = make_stack(tmp_path, upload_delay=0)
    await nursery.start(stack.drain.run)
    fh, _ = stack.fs.create(ROOT_ID, b"open-forever", 0o644, os.O_WRONLY, UID, GID)
    stack.fs.write(fh, 0, b"x")
    stack.write_file("done", b"y")
    now = trio.current_time()
    assert (await stack.drain.flush(["done"], now + 10)).ok
    result = await stack.drain.flush(None, trio.current_time() + 0.5)
    assert not result.ok and result.remaining == ["open-forever"]
    stack.fs.release(fh)
    assert (await stack.drain.flush(None, trio.current_time() + 10)).ok
    check_consistency(stack)


async def test_symlink_persists(stack: Stack) -> None:
    stack.fs.symlink(ROOT_ID, b"latest-link", b"step_9", UID, GID)
    await stack.flush()
    assert os.readlink(stack.store.inner.root / "latest-link") == "step_9"


async def test_state_xattr(stack: Stack) -> None:
    ino = stack.write_file("x", b"1")
    assert stack.fs.getxattr(ino, b"user.ckptfs.state") in (b"dirty", b"uploading", b"clean")
    await stack.flush()
    assert stack.fs.getxattr(ino, b"user.ckptfs.state") == b"clean"
    with pytest.raises(FsError):
        stack.fs.setxattr(ino, b"user.ckptfs.state")


async def test_fresh_cache_imports_store_and_fetches_on_open(tmp_path: Path, nursery: trio.Nursery) -> None:
    store_dir = tmp_path / "store"
    (store_dir / "run" / "step_1").mkdir(parents=True)
    (store_dir / "run" / "step_1" / "model.pt").write_bytes(b"weights" * 1000)
    (store_dir / "empty-dir").mkdir()
    stack = make_stack(tmp_path)
    recover(stack.journal, stack.cache, stack.drain.engine, 0.0)
    assert stack.journal.names.by_path("run") is None  # nothing is listed before the mount looks
    await list_tree(stack.fs)
    paths = {i.path for i in stack.journal.names.all_inodes()}
    assert paths == {"", "run", "run/step_1", "run/step_1/model.pt", "empty-dir"}
    inode = stack.journal.names.by_path("run/step_1/model.pt")
    assert inode is not None and inode.state == REMOTE and inode.size == 7000
    assert (inode.uid, inode.gid) == (os.getuid(), os.getgid())
    fh = await stack.fs.open(inode.id, os.O_RDONLY)
    assert await stack.fs.read(fh, 0, 14) == b"weightsweights"
    stack.fs.release(fh)
    assert stack.journal.names.get(inode.id).state == CLEAN  # type: ignore[union-attr]
    await nursery.start(stack.drain.run)
    await stack.flush()
    assert [c for c in stack.store.calls if c[0] == "commit"] == []
    assert stack.journal.names.by_path("empty-dir") is not None
    check_consistency(stack)


def test_keys_that_cannot_be_paths_are_skipped() -> None:
    from ckptfs.fetch.lister import _valid_path

    assert _valid_path("a/b.pt") == "a/b.pt"
    assert _valid_path("dir/") == "dir"
    for bad in ("../escape", "a/../../b", "/abs", "a\0b", "a//b", "./x", "x" * 1001):
        assert _valid_path(bad) is None, bad


async def test_crash_recovery_resumes_pending_work(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A daemon that dies with files open, uploads pending and unlinked-but-open files loses nothing."""
    stack = make_stack(tmp_path, upload_delay=3600)
    fh, attr = stack.fs.create(ROOT_ID, b"open-at-crash", 0o644, os.O_WRONLY, UID, GID)
    stack.fs.write(fh, 0, b"a" * 5000)
    stack.write_file("closed", b"b" * 10)
    ghost = stack.write_file("ghost", b"c")
    stack.fs.lookup(ROOT_ID, b"ghost")
    await stack.fs.open(ghost, os.O_RDONLY)
    stack.fs.unlink(ROOT_ID, b"ghost")
    stack.journal.close()  # the process dies here: no release, no forget, nothing uploaded

    journal = Journal(stack.cache.journal_path)
    report = repair_journal(journal, stack.cache, now=0.0)
    assert report.purged_unlinked == 1 and report.resumed_uploads == 2
    reopened = journal.names.get(attr.ino)
    assert reopened is not None and reopened.size == 5000 and reopened.closed_at == 0.0
    journal.close()
    fresh = make_stack(tmp_path, upload_delay=3600)
    await nursery.start(fresh.drain.run)
    await fresh.flush()
    assert fresh.store_files() == {"open-at-crash": b"a" * 5000, "closed": b"b" * 10}
    check_consistency(fresh)


async def test_file_open_for_writing_does_not_hold_back_markers(stack: Stack) -> None:
    fh, _ = stack.fs.create(ROOT_ID, b"train.log", 0o644, os.O_WRONLY, UID, GID)
    stack.fs.write(fh, 0, b"step 1\n")
    stack.write_file("shard", b"s")
    stack.write_file("latest", b"shard")
    assert (await stack.drain.flush(["latest", "shard"], trio.current_time() + 10)).ok
    assert stack.store_files() == {"shard": b"s", "latest": b"shard"}
    stack.fs.release(fh)


async def test_flush_of_many_files_reads_each_a_bounded_number_of_times(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Regression: a flush re-read every pending inode after every finished upload (quadratic), and every
    close rescanned every pending row; 2000 small files took 40 s to flush."""
    stack = make_stack(tmp_path, upload_delay=3600)
    await nursery.start(stack.drain.run)
    count = 300
    for i in range(count):
        stack.write_file(f"f{i}", b"x")
    reads = 0
    real_get = stack.journal.names.get

    def counting_get(inode_id: int):  # type: ignore[no-untyped-def]
        nonlocal reads
        reads += 1
        return real_get(inode_id)

    stack.journal.names.get = counting_get  # type: ignore[method-assign]
    await stack.flush(seconds=60)
    assert len(stack.store_files()) == count
    assert reads < 15 * count, f"{reads} journal reads to flush {count} files"
    check_consistency(stack)


async def test_chmod_and_utime_of_uploaded_file_rewrite_store_metadata(stack: Stack) -> None:
    ino = stack.write_file("run.sh", b"#!/bin/sh\n")
    await stack.flush()
    await stack.fs.setattr(ino, SetAttrs(mode=0o755, mtime_ns=1_600_000_000_000_000_000), None)
    await stack.flush()
    stored = (stack.store.inner.root / "run.sh").stat()
    assert stat.S_IMODE(stored.st_mode) == 0o755 and stored.st_mtime_ns == 1_600_000_000_000_000_000
    calls = [c for c in stack.store.calls if c[0] in ("commit", "set_meta")]
    assert calls == [("commit", "run.sh"), ("set_meta", "run.sh")]
    assert stack.journal.names.get(ino).meta_dirty == 0  # type: ignore[union-attr]


async def test_chmod_during_first_upload_reaches_store(stack: Stack) -> None:
    stack.store.stage_gate = threading.Event()
    ino = stack.write_file("s.sh", b"x")
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    await stack.fs.setattr(ino, SetAttrs(mode=0o700), None)
    stack.store.stage_gate.set()
    await stack.flush()
    assert stat.S_IMODE((stack.store.inner.root / "s.sh").stat().st_mode) == 0o700


async def test_moving_a_tree_deeper_cannot_outgrow_key_length(stack: Stack) -> None:
    stack.fs.mkdir(ROOT_ID, b"a", 0o755, UID, GID)
    stack.fs.mkdir(ROOT_ID, b"deep", 0o755, UID, GID)
    stack.write_file("a/" + "n" * 250, b"x")
    parent = stack.resolve_dir("deep")
    for _ in range(3):
        stack.fs.mkdir(parent, b"d" * 255, 0o755, UID, GID)
        parent = stack.journal.names.lookup(parent, "d" * 255).id  # type: ignore[union-attr]
    with pytest.raises(FsError) as exc:
        stack.fs.rename(ROOT_ID, b"a", parent, b"a", 0)
    assert errno_of(exc) == errno.ENAMETOOLONG
    await stack.flush()


async def test_object_committed_by_a_dying_daemon_does_not_outlive_its_file(tmp_path: Path) -> None:
    """Die after the object appeared but before the journal recorded it; the file is then removed. The
    orphan must go, or a fresh node would import a file that was deleted."""

    class Died(BaseException):
        pass

    stack = make_stack(tmp_path)

    def die(*args: object, **kwargs: object) -> None:
        raise Died

    stack.drain.records.record_uploads = die  # type: ignore[method-assign]
    stack.write_file("gone.pt", b"bytes")
    with pytest.raises(BaseExceptionGroup) as group:
        async with trio.open_nursery() as nursery:
            await nursery.start(stack.drain.run)
            await stack.drain.wait_durable(None)
    assert group.group_contains(Died)
    assert "gone.pt" in stack.store_files()  # the object is there, unrecorded
    stack.journal.close()

    restarted = make_stack(tmp_path)
    repair_journal(restarted.journal, restarted.cache, now=0.0)
    restarted.fs.unlink(ROOT_ID, b"gone.pt")
    async with trio.open_nursery() as nursery:
        await nursery.start(restarted.drain.run)
        await restarted.flush()
        nursery.cancel_scope.cancel()
    assert restarted.store_files() == {}
    check_consistency(restarted)


async def test_a_directory_renamed_while_a_file_below_it_commits_leaves_no_empty_directory(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """`mv D D2` lands while D/x is being committed, before D's own marker was written: the commit creates
    D/ in a store with real directories (file://, SeaweedFS), the object then moves to D2/x, and D/ stayed
    behind, empty, for good, shown by every fresh node (the crash harness found it on SeaweedFS)."""
    stack = make_stack(tmp_path)
    renamed = threading.Event()
    put_dir, put_object = stack.store.put_dir, stack.store.put_object

    def marker_after_the_rename(key: str, meta: object) -> None:
        if key == "D/" and not renamed.is_set():
            raise PermanentBackendError("access denied")  # the marker of D waits until after the rename
        put_dir(key, meta)  # type: ignore[arg-type]

    def rename_during_commit(key: str, data: bytes, meta: object, checksum: str) -> None:
        if key == "D/x" and not renamed.is_set():
            trio.from_thread.run_sync(stack.fs.rename, ROOT_ID, b"D", ROOT_ID, b"D2", 0)
            renamed.set()
        put_object(key, data, meta, checksum)  # type: ignore[arg-type]

    stack.store.put_dir = marker_after_the_rename  # type: ignore[method-assign]
    stack.store.put_object = rename_during_commit  # type: ignore[method-assign]
    d = stack.fs.mkdir(ROOT_ID, b"D", 0o755, UID, GID)
    stack.write_file("x", b"weights", parent=d.ino)
    await nursery.start(stack.drain.run)
    with trio.fail_after(30):
        await stack.flush()
    assert renamed.is_set()
    assert stack.store_files() == {"D2/x": b"weights"}
    assert stack.store_dirs() == {"D2"}
    check_consistency(stack)


async def test_a_directory_removed_before_its_marker_was_written_leaves_no_empty_directory(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """D/x is in the store but D's own marker is not yet (its upload failed and waits for a retry) when
    `rm D/x; rmdir D` land: nothing owns D/ any more, and a store with real or implicit directories
    (file://, SeaweedFS) kept D, empty, for good, shown by every fresh node (the crash harness found it on
    SeaweedFS: "fresh node: directory step_00002 should not exist")."""
    stack = make_stack(tmp_path)
    put_dir = stack.store.put_dir
    removed = threading.Event()

    def marker_after_the_rmdir(key: str, meta: object) -> None:
        if key == "D/" and not removed.is_set():
            raise PermanentBackendError("access denied")
        put_dir(key, meta)  # type: ignore[arg-type]

    put_object, committed = stack.store.put_object, threading.Event()

    def note_commit(key: str, data: bytes, meta: object, checksum: str) -> None:
        put_object(key, data, meta, checksum)  # type: ignore[arg-type]
        committed.set()

    stack.store.put_dir = marker_after_the_rmdir  # type: ignore[method-assign]
    stack.store.put_object = note_commit  # type: ignore[method-assign]
    d = stack.fs.mkdir(ROOT_ID, b"D", 0o755, UID, GID)
    stack.write_file("x", b"weights", parent=d.ino)
    await nursery.start(stack.drain.run)
    assert await trio.to_thread.run_sync(committed.wait, 30)
    assert stack.store_files() == {"D/x": b"weights"} and ("put_dir", "D/") not in stack.store.calls
    stack.fs.unlink(d.ino, b"x")
    stack.fs.rmdir(ROOT_ID, b"D")
    removed.set()
    with trio.fail_after(30):
        await stack.flush()
    assert stack.store_files() == {}
    assert stack.store_dirs() == set()
    check_consistency(stack)


async def test_file_deleted_from_store_by_another_node_goes_here_too(stack: Stack) -> None:
    stack.write_file("shared.pt", b"x")
    stack.write_file("mine-dirty.pt", b"y")
    await stack.flush()
    (stack.store.inner.root / "shared.pt").unlink()
    await list_tree(stack.fs)
    assert stack.journal.names.by_path("shared.pt") is None
    assert stack.journal.names.by_path("mine-dirty.pt") is not None


async def test_unexpected_error_in_a_job_is_retried_not_fatal(stack: Stack) -> None:
    stack.store.failures = [RuntimeError("bug in a backend")]
    stack.write_file("f", b"data")
    await stack.flush(seconds=30)
    assert stack.store_files() == {"f": b"data"}
    assert stack.drain.stats.last_error is not None and "bug in a backend" in stack.drain.stats.last_error


async def test_write_updates_ctime(stack: Stack) -> None:
    ino = stack.write_file("c", b"1")
    before = stack.fs.getattr(ino).ctime_ns
    await trio.sleep(0.01)
    fh = await stack.fs.open(ino, os.O_WRONLY)
    stack.fs.write(fh, 0, b"2")
    stack.fs.release(fh)
    assert stack.fs.getattr(ino).ctime_ns > before
    await stack.flush()


async def test_write_only_handles_bypass_the_page_cache_and_readers_then_drop_it(stack: Stack) -> None:
    ino = stack.write_file("p", b"old")  # written through a write-only handle
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.caching(reader) == (False, False)
    stack.fs.release(reader)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.caching(reader) == (False, True)  # nothing changed behind the kernel's cached pages
    stack.fs.release(reader)
    writer = await stack.fs.open(ino, os.O_WRONLY)
    assert stack.fs.caching(writer) == (True, False)
    stack.fs.write(writer, 0, b"new")
    stack.fs.release(writer)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.caching(reader) == (False, False)  # this open drops pages cached before the write
    stack.fs.release(reader)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.caching(reader) == (False, True)
    stack.fs.release(reader)
    await stack.flush()


async def test_new_file_under_a_moved_files_old_name_keeps_both_objects(stack: Stack) -> None:
    stack.write_file("x", b"AAAA")
    await stack.flush()
    stack.fs.rename(ROOT_ID, b"x", ROOT_ID, b"y", 0)
    stack.write_file("x", b"BBBB")
    await stack.flush()
    assert stack.store_files() == {"x": b"BBBB", "y": b"AAAA"}


async def test_new_file_under_a_remote_only_files_old_name_waits_for_its_move(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "x").write_bytes(b"REMOTE")
    stack = make_stack(tmp_path)
    await list_tree(stack.fs)
    await nursery.start(stack.drain.run)
    stack.fs.rename(ROOT_ID, b"x", ROOT_ID, b"y", 0)
    stack.write_file("x", b"NEW")
    await stack.flush()
    assert stack.store_files() == {"x": b"NEW", "y": b"REMOTE"}
    check_consistency(stack)


async def test_marker_inside_a_renamed_directory_still_follows_its_siblings(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack = make_stack(tmp_path, upload_delay=3600)
    await nursery.start(stack.drain.run)
    stack.fs.mkdir(ROOT_ID, b"step.tmp", 0o755, UID, GID)
    await stack.flush()  # the directory marker is in the store; the files below wait for upload_delay
    stack.write_file("step.tmp/shard", b"s" * 1000)
    stack.write_file("step.tmp/commit_success.txt", b"ok")
    stack.fs.rename(ROOT_ID, b"step.tmp", ROOT_ID, b"step", 0)
    stack.store.gated_keys = {"step/shard"}
    stack.store.stage_gate = threading.Event()
    flushed = trio.Event()

    async def flush() -> None:
        await stack.flush()
        flushed.set()

    since = time.time()
    nursery.start_soon(flush)
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    await drain_had_its_chance(stack.drain, since=since, what="upload the marker early")
    assert not any(key.endswith("commit_success.txt") for _, key in stack.store.calls)
    stack.store.stage_gate.set()
    await flushed.wait()
    keys = [key for op, key in stack.store.calls if op == "commit"]
    assert keys.index("step/shard") < keys.index("step/commit_success.txt")


async def test_tree_deleted_by_another_node_goes_here_too(stack: Stack) -> None:
    import shutil

    stack.fs.mkdir(ROOT_ID, b"old_step", 0o755, UID, GID)
    stack.write_file("old_step/model.pt", b"m")
    await stack.flush()
    shutil.rmtree(stack.store.inner.root / "old_step")
    await list_tree(stack.fs)
    assert stack.journal.names.by_path("old_step") is None
    assert stack.journal.names.by_path("old_step/model.pt") is None


async def test_the_store_is_listed_one_directory_at_a_time(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    for step in range(3):
        (store_dir / f"step_{step}").mkdir(parents=True)
        for shard in range(50):
            (store_dir / f"step_{step}" / f"shard_{shard}.pt").write_bytes(b"s")
    stack = make_stack(tmp_path)
    await stack.fs.ensure_listed(ROOT_ID)
    assert stack.fs.lister.listings == 1  # type: ignore[attr-defined]
    assert {i.path for i in stack.journal.names.all_inodes()} == {"", "step_0", "step_1", "step_2"}
    step_1 = stack.journal.names.by_path("step_1")
    assert step_1 is not None
    stack.fs.lookup(ROOT_ID, b"step_1")
    await stack.fs.ensure_listed(step_1.id)
    assert stack.fs.lister.listings == 2  # type: ignore[attr-defined]
    assert len(stack.journal.names.all_children(step_1.id)) == 50
    assert stack.journal.names.by_path("step_0/shard_0.pt") is None  # not looked into: not listed
    check_consistency(stack)


async def test_store_keys_that_cannot_be_paths_warn_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ckptfs.backends.base import DirListing, ObjectInfo
    from ckptfs.fetch.lister import apply_dir_listing

    stack = make_stack(tmp_path)
    root = stack.journal.names.get(ROOT_ID)
    assert root is not None
    listing = DirListing(
        [ObjectInfo("ok.pt", "file", 1, 0, 0o644), ObjectInfo("x" * 300, "file", 1, 0, 0o644)], ["..", "fine"],
        marker=True,
    )
    warned: set[str] = set()
    for _ in range(2):
        apply_dir_listing(stack.journal, root, listing, now=0.0, exact_mtimes=True, vanished=stack.fs.vanished,
                          warned=warned, cache=stack.cache)
    assert {i.path for i in stack.journal.names.all_inodes()} == {"", "ok.pt", "fine"}
    skipped = [r for r in caplog.records if "cannot be a path" in r.getMessage()]
    assert len(skipped) == 2, [r.getMessage() for r in skipped]


async def test_rename_of_a_store_only_tree_lists_it_first_or_is_refused(stack: Stack) -> None:
    """A tree another node wrote, never listed here: prepare_rename lists all of it, so the rename moves
    every object; while the store cannot be listed, the rename is refused rather than leaving objects
    behind under the old name."""
    store = stack.root / "store"
    (store / "s0" / "sub").mkdir(parents=True)
    for rel, data in {"s0/f0": b"zero", "s0/sub/f1": b"one"}.items():
        (store / rel).write_bytes(data)
    await stack.fs.ensure_listed(ROOT_ID)
    # The root (listed before, for the old and the new name) goes on with what the journal holds; s0,
    # never listed, cannot.
    stack.store.list_failures = [TransientBackendError("503 slow down")] * 3
    with pytest.raises(FsError) as raised:
        await stack.fs.prepare_rename(ROOT_ID, b"s0", ROOT_ID, b"s1")
    assert errno_of(raised) == errno.EIO
    await stack.fs.prepare_rename(ROOT_ID, b"s0", ROOT_ID, b"s1")
    stack.fs.rename(ROOT_ID, b"s0", ROOT_ID, b"s1", 0)
    await stack.flush()
    assert stack.store_files() == {"s1/f0": b"zero", "s1/sub/f1": b"one"}


async def test_a_file_renamed_to_a_commit_marker_while_its_upload_waits_for_a_slot_still_goes_last(
    stack: Stack,
) -> None:
    """The drain chooses `.latest.tmp` (no marker) for upload and the job waits for a free slot; meanwhile
    `.latest.tmp` becomes `latest`. The job must not upload the marker ahead of the shard closed before
    it (crash harness, SeaweedFS seed 7300 round 295)."""
    hold_a, hold_shard = threading.Event(), threading.Event()
    stack.store.key_gates = {"a": hold_a, "shard": hold_shard}
    # Above SMALL_FILE: one job (and one slot) each, not one batch for both.
    stack.write_file("a", b"a" * (SMALL_FILE + 1))
    stack.write_file("shard", b"s" * (SMALL_FILE + 1))
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    await until(stack.drain.in_flight, what="both upload slots held, by a and by shard", done=lambda n: n == 2)
    stack.write_file(".latest.tmp", b"shard")
    stack.drain.notify()
    # The drain chose .latest.tmp: its scan's dispatch waits for an upload slot.
    slots = stack.drain.dispatcher.upload_slots
    await until(lambda: slots.statistics().tasks_waiting, what="a job of .latest.tmp waiting for a slot")
    stack.fs.rename(ROOT_ID, b".latest.tmp", ROOT_ID, b"latest", 0)
    since = time.time()
    hold_a.set()
    await drain_had_its_chance(stack.drain, since=since, what="upload the marker early")
    assert not any(key in ("latest", ".latest.tmp") for _, key in stack.store.calls)
    hold_shard.set()
    await stack.flush()
    keys = [key for op, key in stack.store.calls if op == "commit"]
    assert keys.index("shard") < keys.index("latest")
    assert stack.store_files()["latest"] == b"shard"


async def test_nothing_is_written_below_a_directory_until_its_marker_is_in(stack: Stack) -> None:
    """SeaweedFS drops a directory marker PUT made at the same moment as an object below it; the
    directory then lists only as an implicit folder (crash harness, SeaweedFS + faults, seed 1203
    round 1: `step_00001/` missing after flush). The drain writes nothing below a directory, nor moves
    anything into it, while its marker is on its way."""
    hold = threading.Event()
    stack.store.key_gates = {"d/": hold}
    d = stack.fs.mkdir(ROOT_ID, b"d", 0o755, UID, GID).ino
    stack.fs.mkdir(d, b"sub", 0o755, UID, GID)
    stack.write_file("d/f", b"f" * 1000)
    stack.write_file("g", b"g" * 1000)
    since = time.time()
    stack.drain.notify()
    await trio.to_thread.run_sync(stack.store.staging.wait, 10)
    # Two upload slots: one is free.
    await drain_had_its_chance(stack.drain, since=since, what="write below d/")
    assert [key for _, key in stack.store.calls if key.startswith("d/")] == []
    with trio.fail_after(10):  # the rest of the tree goes on meanwhile
        await stack.drain.wait_durable(["g"])
    hold.set()
    await stack.flush()
    keys = [key for _, key in stack.store.calls]
    assert keys.index("d/") < keys.index("d/sub/") and keys.index("d/") < keys.index("d/f")
    assert stack.store_files()["d/f"] == b"f" * 1000


@pytest.mark.parametrize("change", ["new file", "rewritten file"])
async def test_an_upload_that_commits_while_its_directory_is_listed_is_not_taken_for_another_nodes_change(
    stack: Stack, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Found by bench/small_files_bench.py: a directory relisted after refresh_interval while the drain
    uploaded into it. The listing, read before an upload committed and applied after, lacked the new
    object (the file was removed from the mount as "deleted from the store by someone else") or showed its
    previous version (the journal took the old object's size and dropped the new local copy)."""
    if change == "rewritten file":
        inode_id = stack.write_file("a", b"old")
        await stack.flush()
    listed = threading.Event()
    release = threading.Event()
    inner_list_dir = stack.store.inner.list_dir

    def slow_list_dir(prefix: str = ""):  # type: ignore[no-untyped-def]
        listing = inner_list_dir(prefix)  # read now, returned after the upload below committed
        listed.set()
        release.wait(10)
        return listing

    monkeypatch.setattr(stack.store, "list_dir", slow_list_dir)
    nursery.start_soon(lambda: stack.fs.lister.ensure(ROOT_ID, fresh=True))  # type: ignore[call-arg]
    await trio.to_thread.run_sync(listed.wait, 10)
    if change == "new file":
        inode_id = stack.write_file("a", b"new bytes")
    else:
        fh = await stack.fs.open(inode_id, os.O_WRONLY | os.O_TRUNC)
        stack.fs.write(fh, 0, b"new bytes")
        stack.fs.release(fh)
    await stack.flush()
    release.set()
    with trio.fail_after(10):
        while stack.fs.lister._in_flight:  # type: ignore[attr-defined]  # noqa: ASYNC110 (no event to wait on)
            await trio.sleep(0.01)
    entry = stack.journal.names.lookup(ROOT_ID, "a")
    assert entry is not None and entry.id == inode_id, "the mount lost a file it had just uploaded"
    assert entry.state == CLEAN and entry.size == len(b"new bytes")
    assert stack.store_files() == {"a": b"new bytes"}


async def test_a_flushs_sweep_of_leftovers_that_the_store_refuses_is_tried_again(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A flush ends with a sweep when a cleanup failed. It made one attempt (the engine's retries of each
    call aside): a store refusing it for those few seconds, as in a storm of 503s, left the staged upload
    in the store after a flush that succeeded (crash harness, SeaweedFS with faults, seed 9422 round 0).
    A refusal is now tried again, a second later and doubling, within the flush's bound."""
    stack = make_stack(tmp_path)
    await nursery.start(stack.drain.run)
    stack.store.inner.open_upload("lost.bin", None, None)  # what an abort that failed leaves
    stack.drain.engine.leftovers.cleanup_failed()
    # The first sweep's every try, and the second sweep's first, refused.
    stack.store.leftover_list_failures = [TransientBackendError("503 slow down")] * 6
    assert (await stack.drain.flush(None, trio.current_time() + 60)).ok
    assert stack.store.leftover_listings == 7
    assert stack.store.inner.list_leftovers() == []
    assert not stack.drain.engine.leftovers.due


async def test_a_delete_that_completes_while_its_directory_is_listed_brings_nothing_back(tmp_path: Path) -> None:
    """shutil.rmtree unlinks every file, then removes the directory: the rmdir lists the directory from the
    store (another node may have written into it), and the drain's deletes of the unlinked files run
    meanwhile. A delete that completed while the listing ran was no longer pending when the listing was
    applied, so its object, still in the listing, came back as a remote file and the rmdir failed with
    ENOTEMPTY (seen once in CI: transformers' checkpoint rotation kept checkpoint-2)."""
    stack = make_stack(tmp_path)  # no drain running: the test completes the delete itself, mid-listing
    store_dir = stack.store.inner.root
    (store_dir / "ckpt").mkdir()
    (store_dir / "ckpt" / "x").write_bytes(b"x")
    await stack.fs.lister.ensure(ROOT_ID)
    ckpt = stack.journal.names.by_path("ckpt")
    assert ckpt is not None
    await stack.fs.lister.ensure(ckpt.id, required=True)
    stack.fs.unlink(ckpt.id, b"x")
    [pending] = stack.journal.deletes.pending_deletes()
    listed = stack.store.list_dir

    def list_while_the_delete_completes(prefix: str):  # type: ignore[no-untyped-def]
        listing = listed(prefix)
        if prefix == "ckpt/":  # the drain's delete lands between the listing and its use
            (store_dir / "ckpt" / "x").unlink()

            def done() -> None:
                with stack.journal.transaction():
                    stack.journal.deletes.delete_done(pending.id)

            trio.from_thread.run_sync(done)
        return listing

    stack.store.list_dir = list_while_the_delete_completes  # type: ignore[method-assign]
    await stack.fs.prepare_rmdir(ROOT_ID, b"ckpt")
    stack.fs.rmdir(ROOT_ID, b"ckpt")  # before: ENOTEMPTY, x listed back as a remote file
    assert stack.journal.names.by_path("ckpt/x") is None


async def test_a_deferred_delete_waits_its_turn_instead_of_spinning(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The delete of a removed file's object waits (defers itself) while a new file of that name is to replace
    it. The deferral was taken for the job's success, which forgot its retry time: the delete ran again at
    every scan, and the drain rescanned 50 times a second, never idle, for as long as the new file waited (seen
    as a drain that never went idle while the store refused uploads, test_s3_faults)."""
    stack = make_stack(tmp_path, upload_delay=3600)
    await nursery.start(stack.drain.run)
    stack.write_file("a", b"old")
    await stack.flush()
    stack.fs.unlink(ROOT_ID, b"a")
    since = time.time()
    stack.write_file("a", b"new")  # waits out upload_delay: the old object stays until it replaces it
    await drain_had_its_chance(stack.drain, since=since, what="defer the delete of the old a, then wait", seconds=10)
    assert stack.drain.stats.next_scan_at is not None, "the delete's next try is a timed scan"
    assert stack.store_files() == {"a": b"old"}
    await stack.flush()
    assert stack.store_files() == {"a": b"new"}
    check_consistency(stack)
