"""The transfer engine's suite, run on every store of tests/store_targets.py: staged uploads (parts in
parallel, progress for the journal, resume after a crash, clean-up of leftovers), spills, ranged
downloads, and the memory budget shared by all of them."""

from __future__ import annotations

import math
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from emulators import azurite, fake_gcs, moto_s3, seaweedfs_s3  # noqa: F401
from store_targets import BIG, META, PART, Target, engine, fetch, local_target, s3_target, target, write  # noqa: F401

from ckptfs.backends.base import TEMP_PREFIX, ObjectMeta, ObjectStore, UploadPart, UploadRef, UploadState
from ckptfs.backends.local import LocalStore
from ckptfs.errors import NotFoundBackendError, PermanentBackendError, TransientBackendError
from ckptfs.transfer import Priority, PutFile, SmallFile, Transfers, plan_part_size
from ckptfs.transfer.leftovers import SWEEP_RETRY_FIRST
from ckptfs.transfer.local_io import SourceChangedError
from ckptfs.transfer.memory import MemoryBudget

MiB = 1 << 20


def _crc(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


class Crash(Exception):
    """What a kill -9 looks like to the code that was running."""


async def _interrupted_upload(store: ObjectStore, key: str, src: Path, after_parts: int = 2) -> UploadState:
    """Stage until `after_parts` parts are reported, then stop as a crash would; return the last state the
    caller could have journaled."""
    persisted: list[str] = []

    def progress(state: UploadState) -> None:
        persisted.append(state.to_json())
        if len(state.parts) >= after_parts:
            raise Crash

    with pytest.raises(Crash):
        await engine(store, parts_in_flight=1).stage_upload(key, str(src), META, progress=progress)
    return UploadState.from_json(persisted[-1])


@pytest.mark.parametrize("size", [0, 1000, BIG], ids=["empty", "small", "multipart"])
async def test_stage_then_commit_makes_the_object_appear_byte_identical(
    target: Target, tmp_path: Path, size: int
) -> None:
    store = target.store
    data = write(tmp_path / "src", size)
    transfers = engine(store)
    staged = await transfers.stage_upload("ckpt/step-1/model.pt", str(tmp_path / "src"), META)
    assert (staged.size, staged.checksum) == (size, _crc(data))
    # Nothing at the key, nothing in listings, between stage and commit.
    assert store.head("ckpt/step-1/model.pt") is None
    assert not any(TEMP_PREFIX in info.key for info in store.list())
    await transfers.commit_upload(staged)
    info = store.head("ckpt/step-1/model.pt")
    assert info is not None
    assert (info.size, info.mtime_ns, info.mode) == (size, META.mtime_ns, META.mode)
    assert info.checksum in (None, staged.checksum)
    assert await fetch(store, "ckpt/step-1/model.pt", tmp_path) == (data, staged.checksum)
    assert target.leftovers() == []
    assert transfers.memory.in_use == 0


async def test_put_files_puts_what_commit_keeps_each_with_its_checksum(target: Target, tmp_path: Path) -> None:
    """Small files together (the drain's batches): every file read, then the caller's commit chooses
    which to put; the others, and one whose source went, are not; each object carries its checksum."""
    datas = {name: write(tmp_path / name, 1000 + i, seed=i) for i, name in enumerate(["a", "b", "c", "d"])}
    (tmp_path / "d").unlink()
    files = [SmallFile(f"small/{name}", str(tmp_path / name), META, lambda: False) for name in datas]
    offered: list[int] = []

    def commit(read: list[int]) -> list[int]:
        offered.extend(read)
        return [i for i in read if i != 1]  # b: renamed meanwhile, say

    transfers = engine(target.store)
    outcomes = await transfers.put_files(files, size=4000, commit=commit)
    assert offered == [0, 1, 2]
    assert isinstance(outcomes[3], NotFoundBackendError) and outcomes[1] is None
    for index, name in ((0, "a"), (2, "c")):
        assert outcomes[index] == PutFile(len(datas[name]), _crc(datas[name]))
        info = target.store.head(f"small/{name}")
        assert info is not None and info.checksum in (None, _crc(datas[name]))
        assert (await fetch(target.store, f"small/{name}", tmp_path))[0] == datas[name]
    assert target.store.head("small/b") is None
    assert transfers.memory.in_use == 0
    assert target.leftovers() == []


async def test_put_files_puts_nothing_stale_and_stops_at_a_refusal(tmp_path: Path) -> None:
    """A file whose change began after it was chosen is not put; after a store refuses a write for good,
    the rest of the batch is not tried (they would be refused the same way)."""
    class Refusing(LocalStore):
        def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
            if key == "refused":
                raise PermanentBackendError("bucket refuses writes")
            super().put_object(key, data, meta, checksum)

    (tmp_path / "store").mkdir()
    store = Refusing(tmp_path / "store")
    for name in ("changed", "ok", "refused", "after"):
        write(tmp_path / name, 100)
    changed = [False]
    files = [SmallFile(name, str(tmp_path / name), META, (lambda: changed[0]) if name == "changed" else lambda: False)
             for name in ("changed", "ok", "refused", "after")]

    def commit(read: list[int]) -> list[int]:
        changed[0] = True  # a write of it begins after the re-check, before its PUT
        return read

    outcomes = await engine(store).put_files(files, size=400, commit=commit)
    assert isinstance(outcomes[0], SourceChangedError) and isinstance(outcomes[1], PutFile)
    assert isinstance(outcomes[2], PermanentBackendError) and outcomes[3] is outcomes[2]
    assert [store.head(name) is not None for name in ("changed", "ok", "refused", "after")] == [
        False, True, False, False]


async def test_parts_go_in_parallel_and_report_progress(target: Target, tmp_path: Path) -> None:
    data = write(tmp_path / "src", BIG)
    states: list[UploadState] = []
    transfers = engine(target.store)
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, progress=states.append)
    assert staged.state is not None
    assert [p.number for p in staged.state.parts] == [1, 2, 3]
    assert staged.state.part_size == PART
    assert len(states) == 4 and states[0].parts == ()  # opened, then one call per finished part
    assert {s.upload_id for s in states} == {staged.state.upload_id}
    assert UploadState.from_json(states[-1].to_json()) == states[-1]
    await transfers.commit_upload(staged)
    assert (await fetch(target.store, "big", tmp_path))[0] == data
    assert transfers.statistics().bytes_up == BIG


async def test_abort_leaves_nothing(target: Target, tmp_path: Path) -> None:
    transfers = engine(target.store)
    for key, size in (("a/big", BIG), ("a/small", 10)):
        write(tmp_path / "src", size)
        staged = await transfers.stage_upload(key, str(tmp_path / "src"), META)
        await transfers.abandon(staged.state)
        await transfers.abandon(staged.state)  # twice is fine
        assert target.store.head(key) is None
    assert target.leftovers() == []


async def test_a_vanished_source_raises_not_found(target: Target, tmp_path: Path) -> None:
    with pytest.raises(NotFoundBackendError):
        await engine(target.store).stage_upload("k", str(tmp_path / "missing"), META)


async def swept_at_start(transfers: Transfers, keep: set[UploadRef]) -> int:
    """What a start does: recovery's hold of the store calls, then the drain's sweep of the last run's leftovers."""
    transfers.leftovers.hold_until_swept(keep)
    return await transfers.leftovers.sweep_at_start()


async def test_abort_stale_uploads_removes_only_this_owners_leftovers(target: Target, tmp_path: Path) -> None:
    mine, theirs = target.make(owner="mine"), target.make(owner="theirs")
    write(tmp_path / "src", BIG)
    for key in ("a/one", "shared"):
        await _interrupted_upload(mine, key, tmp_path / "src", after_parts=1)
    their_state = await _interrupted_upload(theirs, "shared", tmp_path / "src", after_parts=1)
    assert await swept_at_start(engine(mine), set()) >= 2
    assert await swept_at_start(engine(mine), set()) == 0
    # The other owner's upload to the same key survives and resumes.
    staged = await engine(theirs).stage_upload("shared", str(tmp_path / "src"), META, resume=their_state)
    assert staged.state is not None
    if target.is_object_store:  # file:// cannot resume (no parts recorded), must not lose it
        assert staged.state.upload_id == their_state.upload_id
    await engine(theirs).commit_upload(staged)
    assert mine.head("a/one") is None and mine.head("shared") is not None
    assert target.leftovers() == []


async def test_resume_continues_from_the_finished_parts(s3_target: Target, tmp_path: Path) -> None:
    data = write(tmp_path / "src", BIG)
    state = await _interrupted_upload(s3_target.store, "ckpt/big", tmp_path / "src")
    assert len(state.parts) >= 2
    restarted = engine(s3_target.make())  # a new process: same owner, new client
    assert await swept_at_start(restarted, {state.ref}) == 0
    seen: list[UploadState] = []
    staged = await restarted.stage_upload("ckpt/big", str(tmp_path / "src"), META, resume=state,
                                          progress=seen.append)
    assert seen[0].upload_id == state.upload_id
    assert {p.number for p in seen[0].parts} == {p.number for p in state.parts}  # kept, not uploaded again
    assert len(seen) == 1 + 3 - len(state.parts)
    await restarted.commit_upload(staged)
    assert await fetch(s3_target.store, "ckpt/big", tmp_path) == (data, _crc(data))
    assert s3_target.leftovers() == []


async def test_resume_of_a_changed_file_starts_afresh(target: Target, tmp_path: Path) -> None:
    write(tmp_path / "src", BIG, seed=1)
    state = await _interrupted_upload(target.store, "big", tmp_path / "src")
    data = write(tmp_path / "src", BIG, seed=2)  # same size, other bytes
    transfers = engine(target.store)
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, resume=state)
    assert staged.state is not None and staged.state.upload_id != state.upload_id
    await transfers.commit_upload(staged)
    assert (await fetch(target.store, "big", tmp_path))[0] == data
    assert target.leftovers() == []  # the old upload was aborted


async def test_resume_after_the_upload_was_aborted_starts_afresh(target: Target, tmp_path: Path) -> None:
    data = write(tmp_path / "src", BIG)
    state = await _interrupted_upload(target.store, "big", tmp_path / "src")
    transfers = engine(target.store)
    assert await swept_at_start(transfers, set()) == 1  # not kept: aborted
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, resume=state)
    assert staged.state is not None and staged.state.upload_id != state.upload_id
    await transfers.commit_upload(staged)
    assert (await fetch(target.store, "big", tmp_path))[0] == data
    assert target.leftovers() == []


class _FailingPart2:
    """A store whose part 2 always fails transiently; everything else goes to the real store."""

    def __init__(self, inner: ObjectStore) -> None:
        self._inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        if number == 2:
            self.calls += 1
            raise TransientBackendError("injected failure of part 2")
        return self._inner.put_part(upload, number, offset, data, crc)


async def test_a_failed_stage_aborts_its_upload_unless_the_caller_can_resume_it(
    target: Target, tmp_path: Path
) -> None:
    write(tmp_path / "src", BIG)
    failing = _FailingPart2(target.store)
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    transfers = engine(failing, sleep=sleep, attempts=3)  # type: ignore[arg-type]
    with pytest.raises(TransientBackendError, match="injected"):
        await transfers.stage_upload("big", str(tmp_path / "src"), META)
    assert failing.calls == 3 and len(slept) == 2  # retried with backoff, then given up
    assert target.leftovers() == []  # nobody could resume it: aborted
    with pytest.raises(TransientBackendError, match="injected"):
        await transfers.stage_upload("big", str(tmp_path / "src"), META, progress=lambda state: None)
    assert target.leftovers() != []  # the caller may resume it: it stays
    assert await transfers.leftovers.sweep() == 0  # and this process may still finish it
    assert await swept_at_start(engine(target.store), set()) == 1  # the next start removes it
    assert target.leftovers() == []


class _PartsWaitForTheSync:
    """A store whose part uploads each wait (a little) for the source's fsync: it sees whether the engine
    writes the local copy back while the parts go, rather than after the last one."""

    def __init__(self, inner: ObjectStore, synced: threading.Event) -> None:
        self._inner = inner
        self._synced = synced
        self.parts_before_sync = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        if not self._synced.wait(timeout=2):
            self.parts_before_sync += 1
        return self._inner.put_part(upload, number, offset, data, crc)


async def test_the_source_is_synced_while_its_parts_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing back a freshly written GiB takes as long as uploading a part of it or more: the caller about
    to call the local copy clean (sync_source) must not wait for the two one after the other."""
    data = write(tmp_path / "src", BIG)
    synced = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.set()

    monkeypatch.setattr(os, "fsync", fsync)
    (tmp_path / "store").mkdir()
    store = _PartsWaitForTheSync(LocalStore(tmp_path / "store", owner="a"), synced)
    transfers = engine(store, parts_in_flight=1)  # type: ignore[arg-type]
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, sync_source=True)
    assert synced.is_set() and store.parts_before_sync == 0
    await transfers.commit_upload(staged)
    assert (tmp_path / "store" / "big").read_bytes() == data


async def test_commit_after_a_lost_complete_answer_succeeds(s3_target: Target, tmp_path: Path) -> None:
    """A complete whose answer was lost, retried, finds no upload: the object is there, so it succeeded."""
    data = write(tmp_path / "src", BIG)
    transfers = engine(s3_target.store)
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META)
    assert staged.state is not None
    s3_target.store.complete_upload(staged.state.ref, staged.state.parts, staged.size, staged.checksum)
    if s3_target.name == "moto":
        pytest.skip("moto answers a complete of a completed upload with a 500, not NoSuchUpload")
    await transfers.commit_upload(staged)
    assert (await fetch(s3_target.store, "big", tmp_path))[0] == data


async def test_a_spill_stages_the_start_of_a_file_and_lands_whole_at_its_key(target: Target, tmp_path: Path) -> None:
    data = write(tmp_path / "src", 4 * PART + 777)
    transfers = engine(target.store)
    state = await transfers.spills.begin(PART)
    state = await transfers.spills.stage(state, str(tmp_path / "src"), PART)  # one part, as under pressure
    state = await transfers.spills.stage(state, str(tmp_path / "src"), 3 * PART)  # two at once (early spills)
    assert (state.size, state.checksum, len(state.parts)) == (3 * PART, _crc(data[:3 * PART]), 3)
    state = UploadState.from_json(state.to_json())  # as a restarted daemon reads it from the journal
    state = await transfers.spills.stage(state, str(tmp_path / "src"), 4 * PART + 777)  # the rest, at close
    assert (state.size, state.checksum) == (len(data), _crc(data))
    assert target.store.head("final/key") is None
    meta = ObjectMeta(mtime_ns=1_750_000_000_000_000_000, mode=0o600)
    await transfers.spills.commit(state, "final/key", meta)
    await transfers.spills.commit(state, "final/key", meta)  # a retry after a lost answer succeeds
    info = target.store.head("final/key")
    assert info is not None and (info.size, info.mtime_ns, info.mode) == (len(data), meta.mtime_ns, meta.mode)
    assert await fetch(target.store, "final/key", tmp_path) == (data, _crc(data))
    assert target.leftovers() == []


async def test_spill_matches_tells_whether_the_staged_start_is_still_the_files(tmp_path: Path) -> None:
    """What an early spill's finish relies on: its parts stayed writable in the cache."""
    src = tmp_path / "src"
    data = write(src, 3 * PART)
    (tmp_path / "store").mkdir()
    transfers = engine(LocalStore(tmp_path / "store"))
    begun = await transfers.spills.begin(PART, early=True)
    assert begun.early and await transfers.spills.matches(begun, str(src))  # nothing staged yet
    state = begun
    for _ in range(2):
        state = await transfers.spills.stage(state, str(src), state.size + PART)
    assert await transfers.spills.matches(state, str(src))
    fd = os.open(src, os.O_WRONLY)
    try:
        os.pwrite(fd, b"later", 2 * PART)  # beyond the staged start: still a match
        assert await transfers.spills.matches(state, str(src))
        os.pwrite(fd, bytes([data[PART + 7] ^ 1]), PART + 7)  # inside the second part
    finally:
        os.close(fd)
    assert not await transfers.spills.matches(state, str(src))
    os.truncate(src, PART)
    assert not await transfers.spills.matches(state, str(src))
    await transfers.abandon(state)


async def test_an_aborted_spill_leaves_nothing(target: Target, tmp_path: Path) -> None:
    write(tmp_path / "src", PART)
    transfers = engine(target.store)
    state = await transfers.spills.stage(await transfers.spills.begin(PART), str(tmp_path / "src"), PART)
    await transfers.abandon(state)
    assert target.leftovers() == []


async def test_a_sweep_spares_the_uploads_this_process_works_on(target: Target, tmp_path: Path) -> None:
    data = write(tmp_path / "src", BIG)
    await _interrupted_upload(target.store, "killed", tmp_path / "src")  # a killed run's, same owner
    transfers = engine(target.store)
    staged = await transfers.stage_upload("live", str(tmp_path / "src"), META, progress=lambda state: None)
    spill = await transfers.spills.stage(await transfers.spills.begin(PART), str(tmp_path / "src"), PART)
    assert await transfers.leftovers.sweep() == 1  # the killed run's only
    await transfers.commit_upload(staged)
    await transfers.spills.commit(spill, "spilled", META)
    assert (await fetch(target.store, "live", tmp_path))[0] == data
    assert (await fetch(target.store, "spilled", tmp_path))[0] == data[:PART]
    assert await transfers.leftovers.sweep() == 0
    assert target.leftovers() == []


async def test_a_sweep_keeps_the_hidden_key_of_a_live_spill_whose_create_was_sent_twice(
    s3_target: Target, tmp_path: Path
) -> None:
    """A CreateMultipartUpload that botocore sent again leaves its first marker, without an upload id, for the
    next sweep (s3markers.begin). That sweep removed the marker and deleted the object at its key, which is
    the live spill's hidden key: a spill completed there, its start already freed from the cache and its
    copy to the final key still to come (a kill in between), lost its bytes. Crash harness, seed 802,
    S3 with faults."""
    data = write(tmp_path / "src", BIG)
    transfers = engine(s3_target.store)
    spill = await transfers.spills.stage(await transfers.spills.begin(PART), str(tmp_path / "src"), PART)
    s3_target.store.markers.put(f"{s3_target.store.owner}/{'0' * 16}", spill.key, None)  # the first try's
    await transfers.staging.complete(spill.ref, spill.parts, spill.size, None)  # at the hidden key, not copied
    assert await transfers.leftovers.sweep() == 1  # the marker without an upload
    assert s3_target.store.head(spill.key) is not None, "the sweep deleted the live spill's bytes"
    if s3_target.name == "moto":
        pytest.skip("moto answers a complete of a completed upload with a 500, not NoSuchUpload")
    await transfers.spills.commit(spill, "spilled", META)
    assert (await fetch(s3_target.store, "spilled", tmp_path))[0] == data[:PART]
    assert await transfers.leftovers.sweep() == 0
    assert s3_target.leftovers() == []


class _Gates:
    """A store whose put_object and list_leftovers can be held in the middle (threading events), to see
    whether a sweep's listing and the other store calls ever overlap."""

    def __init__(self, inner: ObjectStore) -> None:
        self._inner = inner
        self.put_entered, self.put_release = threading.Event(), threading.Event()
        self.list_entered, self.list_release = threading.Event(), threading.Event()
        self.puts_running = 0
        self.puts_running_at_list: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        self.puts_running += 1
        try:
            self.put_entered.set()
            assert self.put_release.wait(30)
            self._inner.put_object(key, data, meta, checksum)
        finally:
            self.puts_running -= 1

    def list_leftovers(self) -> list[UploadRef]:
        self.puts_running_at_list.append(self.puts_running)
        self.list_entered.set()
        assert self.list_release.wait(30)
        return self._inner.list_leftovers()


async def test_a_sweep_never_lists_while_a_store_call_runs(target: Target, tmp_path: Path) -> None:
    """What a call has half made (file://: the temp file of a put; S3: the upload of a large copy) looks like
    a leftover: the listing waits for calls in flight, and calls wait for the listing."""
    data = write(tmp_path / "src", 1000)
    gates = _Gates(target.store)
    transfers = engine(gates)  # type: ignore[arg-type]

    async def put(key: str) -> None:
        await transfers.commit_upload(await transfers.stage_upload(key, str(tmp_path / "src"), META))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put, "first")
        await trio.to_thread.run_sync(gates.put_entered.wait, 10)
        nursery.start_soon(transfers.leftovers.sweep)
        await trio.sleep(0.3)
        assert not gates.list_entered.is_set()  # waits for the put in flight
        gates.put_release.set()
        await trio.to_thread.run_sync(gates.list_entered.wait, 10)
        gates.put_entered.clear()
        nursery.start_soon(put, "second")
        await trio.sleep(0.3)
        assert not gates.put_entered.is_set()  # waits for the listing
        gates.list_release.set()
    assert gates.puts_running_at_list == [0]
    for key in ("first", "second"):
        assert (await fetch(target.store, key, tmp_path))[0] == data
    assert target.leftovers() == []


async def test_after_a_start_store_calls_wait_for_the_start_up_sweep_and_notes_do_not(tmp_path: Path) -> None:
    """Recovery holds every store call that may leave something until the drain's start-up sweep has listed
    the last run's leftovers (what this run stages must not be taken for one of them), while the mount
    serves; a note does not wait. The sweep runs once: a drain started again does not sweep unannounced."""
    local = local_target(tmp_path / "store")
    write(tmp_path / "big", BIG)
    await _interrupted_upload(local.store, "lost", tmp_path / "big")
    data = write(tmp_path / "src", 1000)
    gates = _Gates(local.store)
    gates.put_release.set()
    transfers = engine(gates)  # type: ignore[arg-type]
    transfers.leftovers.hold_until_swept(set())

    async def put(key: str) -> None:
        await transfers.commit_upload(await transfers.stage_upload(key, str(tmp_path / "src"), META))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(put, "mine")
        with trio.fail_after(10):
            await transfers.note_call(local.store.put_note, "pending/n", b"x")
        await trio.sleep(0.3)
        assert not gates.put_entered.is_set()  # waits for the start-up sweep
        nursery.start_soon(transfers.leftovers.sweep_at_start)
        await trio.to_thread.run_sync(gates.list_entered.wait, 10)
        gates.list_release.set()
    assert gates.puts_running_at_list == [0]
    assert local.store.get_note("pending/n") == b"x"
    local.store.delete_note("pending/n")
    assert local.leftovers() == []
    assert (await fetch(local.store, "mine", tmp_path))[0] == data
    await _interrupted_upload(local.store, "lost-later", tmp_path / "big")
    assert await transfers.leftovers.sweep_at_start() == 0  # not announced again: the background sweeps' work
    assert local.leftovers() != []


class _FailingAborts:
    """A store whose aborts fail (transiently) until `healed`."""

    def __init__(self, inner: ObjectStore) -> None:
        self._inner = inner
        self.healed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def abort_upload(self, upload: UploadRef) -> None:
        if not self.healed:
            raise TransientBackendError("injected failure of an abort")
        self._inner.abort_upload(upload)


async def test_an_abort_that_failed_is_done_by_a_later_sweep(target: Target, tmp_path: Path) -> None:
    write(tmp_path / "src", BIG)
    failing = _FailingAborts(target.store)
    transfers = engine(failing, attempts=2)  # type: ignore[arg-type]
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, progress=lambda state: None)
    assert staged.state is not None
    await transfers.abandon(staged.state)  # best effort: fails quietly
    assert transfers.leftovers.due and target.leftovers() != []
    with pytest.raises(TransientBackendError, match="injected"):
        await transfers.leftovers.sweep()
    assert transfers.leftovers.due
    failing.healed = True
    assert await transfers.leftovers.sweep() == 1
    assert not transfers.leftovers.due
    assert target.leftovers() == []


async def test_background_sweeps_back_off_while_the_store_refuses_them(tmp_path: Path) -> None:
    target = local_target(tmp_path / "store")
    write(tmp_path / "src", BIG)
    failing = _FailingAborts(target.store)
    transfers = engine(failing, attempts=1)  # type: ignore[arg-type]
    leftovers = transfers.leftovers
    assert leftovers.next_sweep_at() == math.inf  # no cleanup failed: none wanted
    staged = await transfers.stage_upload("big", str(tmp_path / "src"), META, progress=lambda state: None)
    await transfers.abandon(staged.state)  # fails quietly: a sweep is wanted, after a while
    assert leftovers.next_sweep_at() - trio.current_time() == pytest.approx(SWEEP_RETRY_FIRST, abs=1)
    for delay in (SWEEP_RETRY_FIRST, 2 * SWEEP_RETRY_FIRST):  # refused: logged, never raised; backing off
        await leftovers.sweep_in_background()
        assert leftovers.next_sweep_at() - trio.current_time() == pytest.approx(delay, abs=1)
    failing.healed = True
    await leftovers.sweep_in_background()
    assert leftovers.next_sweep_at() == math.inf and target.leftovers() == []


async def test_a_ranged_read_of_a_missing_key_raises_not_found(target: Target, tmp_path: Path) -> None:
    with pytest.raises(NotFoundBackendError):
        await fetch(target.store, "no/such/key", tmp_path)


def test_the_checksum_of_an_object_is_read_range_by_range(tmp_path: Path) -> None:
    """A retried spill commit on file:// (no checksum in metadata) recognises its object by its bytes."""
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store", owner="a")
    data = write(tmp_path / "src", BIG)  # three ranges of the engine's download part size, the last short
    store.put_object("k", data, META, f"crc32:{zlib.crc32(data):08x}")
    staging = engine(store).staging
    assert trio.run(staging.holds, "k", len(data), f"crc32:{zlib.crc32(data):08x}")
    assert not trio.run(staging.holds, "k", len(data), f"crc32:{zlib.crc32(data) ^ 1:08x}")


async def test_memory_stays_within_the_budget_with_many_files_at_once(target: Target, tmp_path: Path) -> None:
    transfers = engine(target.store, memory_budget=2 * PART, parts_in_flight=8)
    sources = {f"f{i}": write(tmp_path / f"f{i}", BIG, seed=i) for i in range(4)}

    async def one(key: str) -> None:
        await transfers.commit_upload(await transfers.stage_upload(key, str(tmp_path / key), META))

    async with trio.open_nursery() as nursery:
        for key in sources:
            nursery.start_soon(one, key)
    assert 0 < transfers.memory.peak <= 2 * PART
    for key, data in sources.items():
        assert (await fetch(target.store, key, tmp_path))[0] == data


async def test_the_budget_grants_by_priority_and_survives_cancellation() -> None:
    budget = MemoryBudget(100)
    order: list[str] = []
    assert await budget.acquire(100, Priority.UPLOAD) == 100

    async def wants(name: str, nbytes: int, priority: Priority) -> None:
        granted = await budget.acquire(nbytes, priority)
        order.append(name)
        budget.release(granted)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wants, "upload", 60, Priority.UPLOAD)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wants, "marker", 60, Priority.MARKER)
        nursery.start_soon(wants, "read", 60, Priority.READ)
        with trio.move_on_after(0.01):
            await budget.acquire(50, Priority.READAHEAD)  # gives up waiting: its place must not block others
        await trio.testing.wait_all_tasks_blocked()
        assert order == []
        budget.release(100)
    assert order == ["read", "upload", "marker"]
    assert budget.in_use == 0 and budget.peak == 100
    assert await budget.acquire(1000, Priority.READ) == 100  # larger than the budget: all of it, alone


async def test_the_buffer_of_a_finished_part_goes_to_the_next_part_of_its_size() -> None:
    budget = MemoryBudget(100)
    first, first_buffer = await budget.acquire_buffer(40, Priority.UPLOAD)
    second, second_buffer = await budget.acquire_buffer(40, Priority.UPLOAD)
    assert len(first_buffer) == 40 and first_buffer is not second_buffer
    handed: list[bytearray] = []

    async def next_part() -> None:
        granted, buffer = await budget.acquire_buffer(40, Priority.UPLOAD)
        handed.append(buffer)
        try:
            await trio.sleep_forever()
        finally:  # a part that failed: its buffer is not kept
            budget.release(granted)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(next_part)  # 80 + 40 > 100: waits
        await trio.testing.wait_all_tasks_blocked()
        assert handed == []
        budget.keep(first_buffer, first)
        budget.release(first)
        await trio.testing.wait_all_tasks_blocked()
        assert handed[0] is first_buffer  # no fresh pages to fault in
        nursery.cancel_scope.cancel()
    budget.keep(second_buffer, second)
    assert (budget.in_use, budget.spare_bytes) == (40, 40)
    budget.release(second)
    assert (budget.in_use, budget.spare_bytes) == (0, 0)
    assert budget.peak <= budget.limit


async def test_spare_buffers_give_way_and_go_when_nothing_is_in_flight() -> None:
    budget = MemoryBudget(100)
    parts = [await budget.acquire_buffer(30, Priority.UPLOAD) for _ in range(3)]
    for granted, buffer in parts[:2]:
        budget.keep(buffer, granted)
        budget.release(granted)
    assert (budget.in_use, budget.spare_bytes) == (30, 60)
    # A read that needs the room gets it at once: the spares are dropped, not waited for.
    with trio.fail_after(1):
        read = await budget.acquire(50, Priority.READ)
    assert budget.in_use + budget.spare_bytes <= budget.limit
    _, other_size = await budget.acquire_buffer(20, Priority.UPLOAD)  # a spare of another size is not it
    assert len(other_size) == 20
    budget.release(20)
    budget.release(read)
    granted, buffer = parts[2]
    budget.keep(buffer, granted)
    budget.release(granted)
    assert (budget.in_use, budget.spare_bytes) == (0, 0)  # an idle engine holds no buffers


class _RecordingParts:
    """A store that remembers the buffer each part came in."""

    def __init__(self, inner: ObjectStore) -> None:
        self._inner = inner
        self.buffers: list[bytes | bytearray] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        self.buffers.append(data)
        return self._inner.put_part(upload, number, offset, data, crc)


async def test_parts_reuse_their_buffers_and_the_objects_are_right(target: Target, tmp_path: Path) -> None:
    """Eight parts through a budget of two: the buffers of finished parts carry the next ones (in the stores
    that take them), and each store sends what is in a reused buffer when it is given, not what a later part
    puts there."""
    size = 8 * PART
    sources = {f"f{i}": write(tmp_path / f"f{i}", size, seed=i) for i in range(2)}
    recording = _RecordingParts(target.store)
    transfers = engine(recording, memory_budget=2 * PART, parts_in_flight=2)  # type: ignore[arg-type]
    for key in sources:
        staged = await transfers.stage_upload(key, str(tmp_path / key), META)
        await transfers.commit_upload(staged)
    assert len(recording.buffers) >= 16
    if target.store.limits.reusable_buffers:
        # At most two in flight, a short last part, and fresh ones for the second file (none kept while idle).
        assert len({id(buffer) for buffer in recording.buffers}) <= 6
    else:  # an SDK that takes only bytes gets bytes: no copy of each part outside the budget
        assert all(type(buffer) is bytes for buffer in recording.buffers)
    assert transfers.memory.in_use == transfers.memory.spare_bytes == 0
    for key, data in sources.items():
        assert (await fetch(target.store, key, tmp_path))[0] == data


def test_plan_part_size() -> None:
    s3 = {"min_part": 5 * MiB, "max_parts": 10_000}
    assert plan_part_size(2 << 30, 64 * MiB, 4, **s3) == 64 * MiB
    assert plan_part_size(20 * MiB, 64 * MiB, 4, **s3) == 5 * MiB  # mid-size files still go in parallel
    assert plan_part_size(100 * MiB, 64 * MiB, 4, **s3) == 25 * MiB
    assert plan_part_size(12 * MiB, 1 * MiB, 4, **s3) == 5 * MiB  # never below the store's minimum
    huge = 1 << 42  # 4 TiB: parts grow so there are at most 10,000
    assert -(-huge // plan_part_size(huge, 64 * MiB, 4, **s3)) <= 10_000
