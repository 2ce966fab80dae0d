"""A kernel-free harness for fs-level tests: Filesystem + Journal + CacheDir + Drain + Fetcher over a real
LocalStore, wrapped in a store that records every call and can hold or fail them on demand."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from conftest import file_store_objects

from ckptfs.backends.base import (
    RANGE_PIECE,
    TEMP_PREFIX,
    DirListing,
    ObjectInfo,
    ObjectMeta,
    RangeRead,
    RangeSink,
    UploadPart,
    UploadRef,
)
from ckptfs.backends.local import LocalStore
from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor
from ckptfs.config import DEFAULT_COMMIT_MARKERS
from ckptfs.drain import Drain
from ckptfs.fetch import Fetcher
from ckptfs.fetch.lister import DirLister
from ckptfs.fs import Filesystem
from ckptfs.journal import DIR, FILE, REMOTE, ROOT_ID, Journal
from ckptfs.transfer import SmallFile, StagedUpload, Transfers

UID = os.getuid()
GID = os.getgid()


class RecordingStore:
    """LocalStore's primitives plus: a log of completed mutations, gates that hold an upload after it is
    staged (see GatedTransfers) or a spilled part after it is in the store, and injected failures."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.owner = inner.owner
        self.listing_has_metadata = inner.listing_has_metadata
        self.limits = inner.limits
        self.calls: list[tuple[str, str]] = []
        self.committed: list[tuple[str, bytes]] = []
        self.stage_gate: threading.Event | None = None
        self.gated_keys: set[str] | None = None  # hold only these keys' stages (None: all)
        # A gate of its own per key: a staged upload waits after staging (before stage_gate), a
        # directory marker before it is written.
        self.key_gates: dict[str, threading.Event] = {}
        self.staging = threading.Event()
        # Holds a spilled part (once set) until the test sets it; `spilling` says a part reached the gate.
        self.spill_gate: threading.Event | None = None
        self.spill_commit_failures: list[Exception] = []
        self.spilling = threading.Event()
        # Holds each part of a (non-spill) staged upload, once it is in the store, until the test sets it;
        # `parting` says a part reached the gate.
        self.part_gate: threading.Event | None = None
        self.parting = threading.Event()
        # Holds the one-request PUT of these keys (put_object) until the test sets the gate; `putting` says
        # one reached it.
        self.put_gates: dict[str, threading.Event] = {}
        self.putting = threading.Event()
        self.failures: list[Exception] = []
        self.list_failures: list[Exception] = []  # raised by list_dir, one per call, before `failures`
        self.leftover_list_failures: list[Exception] = []  # raised by list_leftovers, one per call
        self.leftover_listings = 0
        # Ranged reads: every (key, offset) asked for, and a gate that holds each range whose offset is
        # not in `open_offsets` until the test sets it (streaming tests: what a read waits for).
        self.ranges: list[tuple[str, int]] = []
        self.range_gate: threading.Event | None = None
        self.open_offsets: set[int] = set()
        self._lock = threading.Lock()

    @property
    def left_behind(self) -> bool:
        return self.inner.left_behind

    @left_behind.setter
    def left_behind(self, value: bool) -> None:
        self.inner.left_behind = value

    def _maybe_fail(self) -> None:
        with self._lock:
            if self.failures:
                raise self.failures.pop(0)

    def _record(self, op: str, key: str, content: bytes | None = None) -> None:
        with self._lock:
            self.calls.append((op, key))
            if content is not None:
                self.committed.append((key, content))

    def check(self) -> None:
        self.inner.check()

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        gate = self.put_gates.get(key)
        if gate is not None:
            self.putting.set()
            gate.wait(30)
        self._maybe_fail()
        self.inner.put_object(key, data, meta, checksum)
        self._record("commit", key, data)

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        self._maybe_fail()
        return self.inner.open_upload(key, meta, checksum)

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        self._maybe_fail()
        part = self.inner.put_part(upload, number, offset, data, crc)
        if self.spill_gate is not None and _is_spill(upload.key):  # the part is in the store; its answer waits
            self.spilling.set()
            self.spill_gate.wait(30)
        if self.part_gate is not None and not _is_spill(upload.key):
            self.parting.set()
            self.part_gate.wait(30)
        return part

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        return self.inner.list_parts(upload)

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        self._maybe_fail()
        if key is not None and _is_spill(upload.key) and self.spill_commit_failures:
            raise self.spill_commit_failures.pop(0)
        staged = self.inner.root / upload.upload_id
        content = staged.read_bytes() if staged.exists() else None
        self.inner.complete_upload(upload, parts, size, checksum, key=key, meta=meta)
        if key is not None and _is_spill(upload.key):  # a spill committed at its key (no copy on file://)
            self._record("spill_commit", key)
        elif not _is_spill(upload.key):
            self._record("commit", upload.key, content)

    def abort_upload(self, upload: UploadRef) -> None:
        self.inner.abort_upload(upload)
        self._record("abort", upload.key)

    def list_leftovers(self) -> list[UploadRef]:
        with self._lock:
            self.leftover_listings += 1
            if self.leftover_list_failures:
                raise self.leftover_list_failures.pop(0)
        return self.inner.list_leftovers()

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        self._maybe_fail()
        with self._lock:
            self.ranges.append((key, offset))
        gate = self.range_gate
        if gate is not None and offset not in self.open_offsets:
            gate.wait(30)
        return self.inner.get_range(key, offset, length, if_match=if_match, sink=sink, piece_size=piece_size)

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        self._maybe_fail()
        if _is_spill(src_key) and self.spill_commit_failures:
            raise self.spill_commit_failures.pop(0)
        self.inner.copy(src_key, dst_key, meta, checksum)
        self._record("spill_commit" if _is_spill(src_key) else "copy", dst_key if _is_spill(src_key)
                     else f"{src_key}->{dst_key}")

    def delete(self, key: str) -> None:
        self._maybe_fail()
        self.inner.delete(key)
        self._record("delete", key)

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        self._maybe_fail()
        gate = self.key_gates.get(key)
        if gate is not None:
            self.staging.set()
            gate.wait(30)
        self.inner.put_dir(key, meta)
        self._record("put_dir", key)

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        self._maybe_fail()
        self.inner.set_meta(key, meta)
        self._record("set_meta", key)

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        self._maybe_fail()
        self.inner.put_symlink(key, target, meta)
        self._record("put_symlink", key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def list_dir(self, prefix: str = "") -> DirListing:
        with self._lock:
            if self.list_failures:
                raise self.list_failures.pop(0)
        return self.inner.list_dir(prefix)

    # Notes (cross-node ordering records): passed through, recorded.
    def put_note(self, name: str, data: bytes) -> None:
        self._maybe_fail()
        self._record("put_note", name)
        self.inner.put_note(name, data)

    def get_note(self, name: str) -> bytes | None:
        return self.inner.get_note(name)

    def list_notes(self, prefix: str = "") -> list[str]:
        return self.inner.list_notes(prefix)

    def delete_note(self, name: str) -> None:
        self._maybe_fail()
        self._record("delete_note", name)
        self.inner.delete_note(name)


def _is_spill(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(f"{TEMP_PREFIX}spill.")


class GatedTransfers(Transfers):
    """The engine, holding a staged upload before it returns while the store's stage_gate is set: the
    window in which a test renames, rewrites or removes the file under an upload."""

    store: RecordingStore

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[str]] = []  # the keys of every batch of small files (put_files), in order

    async def _hold(self, key: str) -> None:
        """Wait at the gate of `key` (its own, else stage_gate if it is among gated_keys), if any."""
        gate = self.store.key_gates.get(key)
        if gate is None and (self.store.gated_keys is None or key in self.store.gated_keys):
            gate = self.store.stage_gate
        if gate is not None:
            self.store.staging.set()
            await trio.to_thread.run_sync(gate.wait, 30)

    async def stage_upload(self, key: str, src_path: str, meta: ObjectMeta, **kwargs: Any) -> StagedUpload:
        staged = await super().stage_upload(key, src_path, meta, **kwargs)
        await self._hold(key)
        return staged

    async def _read_files(self, files: Sequence[SmallFile]) -> list[bytes | BaseException]:
        """Small files that upload together (Transfers.put_files) are held the same way, after they are
        read and before the drain re-checks them."""
        self.batches.append([small.key for small in files])
        read = await super()._read_files(files)
        for small in files:
            await self._hold(small.key)
        return read


async def list_tree(fs: Filesystem, inode_id: int = ROOT_ID) -> None:
    """What a `find` of the mount does to the lazy listing: list every directory, depth first."""
    await fs.ensure_listed(inode_id)
    for child in fs.journal.names.all_children(inode_id):
        if child.kind == DIR:
            await list_tree(fs, child.id)


@dataclass
class Stack:
    root: Path
    cache: CacheDir
    journal: Journal
    store: RecordingStore
    drain: Drain
    fetcher: Fetcher
    fs: Filesystem

    # Small conveniences that do what a kernel would do around the fs calls.
    def write_file(self, path: str, data: bytes, *, parent: int = ROOT_ID) -> int:
        parent_id = self.resolve_dir(path.rsplit("/", 1)[0]) if "/" in path else parent
        name = path.rsplit("/", 1)[-1].encode()
        existing = self.journal.names.lookup(parent_id, name.decode())
        if existing is None:
            fh, attr = self.fs.create(parent_id, name, 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
            inode_id = attr.ino
        else:
            raise AssertionError("use overwrite() for existing files")
        self.fs.write(fh, 0, data)
        self.fs.release(fh)
        return inode_id

    def resolve_dir(self, path: str) -> int:
        inode = self.journal.names.by_path(path)
        assert inode is not None and inode.kind == DIR, path
        return inode.id

    def _store_walk(self) -> Iterator[tuple[str, list[str], list[str]]]:
        """os.walk of the store without its temp entries (what vanishes while it is walked is skipped, as in
        conftest.file_store_objects)."""
        for top, dirnames, filenames in os.walk(self.store.inner.root):
            dirnames[:] = sorted(d for d in dirnames if TEMP_PREFIX not in d)
            yield top, dirnames, sorted(f for f in filenames if TEMP_PREFIX not in f)

    def store_files(self) -> dict[str, bytes]:
        return file_store_objects(self.store.inner.root)

    def store_dirs(self) -> set[str]:
        root = self.store.inner.root
        return {str(Path(top, d).relative_to(root)) for top, dirnames, _ in self._store_walk() for d in dirnames
                if not Path(top, d).is_symlink()}

    async def flush(self, seconds: float = 20) -> None:
        result = await self.drain.flush(None, trio.current_time() + seconds)
        assert result.ok, result.remaining


def make_stack(
    root: Path, *, upload_delay: float = 0.0, markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS,
    cache_size: int | None = None, dirty_wait: float = 600.0, small_file_wait: float = 0.0,
    upload_while_writing: bool = False, store_dir: Path | None = None, idle_upload: float | None = None,
) -> Stack:
    """Wired like daemon.py. `cache_size` (bytes) sets a budget (min_free 0); the evictor's background
    task runs only if a test starts it (stack.fs.evictor.run)."""
    cache = CacheDir(root / "cache")
    cache.prepare()
    journal = Journal(cache.journal_path)
    store_dir = store_dir or root / "store"  # several stacks on one store_dir: several nodes
    store_dir.mkdir(exist_ok=True)
    store = RecordingStore(LocalStore(store_dir))
    engine = GatedTransfers(store, parts_in_flight=4)  # type: ignore[arg-type]
    drain = Drain(journal, cache, engine, transfers=2, upload_delay=upload_delay, small_file_wait=small_file_wait,
                  commit_markers=markers, upload_while_writing="auto" if upload_while_writing else "off",
                  open_upload_idle=idle_upload)
    in_use: list[Filesystem] = []
    evictor = Evictor(
        journal, cache, in_use=lambda i: in_use[0].in_use(i), dirty_wait=dirty_wait, on_pressure=drain.set_pressure,
        on_changed=drain.mount_changed,
    )
    fetcher = Fetcher(journal, cache, engine, evictor=evictor)
    lister = DirLister(journal, cache, store, refresh_interval=0.0)  # type: ignore[arg-type]
    fs = Filesystem(journal, cache, fetcher.fetch, drain.mount_changed, evictor, lister, streams=fetcher,
                    wait_uploaded=lambda path: drain.wait_durable([path]), discard_upload=drain.discard_upload,
                    failure_of=drain.failure_of)
    lister.vanished = fs.vanished
    fs.on_fsync = drain.fsynced
    in_use.append(fs)
    drain.on_spilled = evictor.evict_if_clean
    if cache_size is not None:
        cache.configure_budget(cache_size, 0)
    return Stack(root, cache, journal, store, drain, fetcher, fs)


def check_consistency(stack: Stack) -> None:
    """The invariants between journal and cache that every test ends with."""
    journal, cache = stack.journal, stack.cache
    # The journal's row cache holds nothing its tables do not (a stale row or entry would be served).
    assert journal.names.stale_cache_entries() == []
    inodes = {i.id: i for i in journal.names.all_inodes()}
    paths: dict[str, int] = {}
    for inode in inodes.values():
        if inode.id == ROOT_ID:
            assert inode.path == ""
            continue
        if inode.parent is None:
            assert inode.path is None and inode.name is None
            continue
        parent = inodes[inode.parent]
        assert parent.kind == DIR
        expected = f"{parent.path}/{inode.name}" if parent.path else inode.name
        assert inode.path == expected, (inode.path, expected)
        assert inode.path not in paths, f"duplicate path {inode.path}"
        paths[inode.path] = inode.id
        if inode.kind == FILE and inode.state != REMOTE:
            assert cache.has_data(inode.id), f"{inode.path}: cache file missing"
    data_ids = cache.data_ids()
    file_ids = {i.id for i in inodes.values() if i.kind == FILE and i.state != REMOTE}
    assert data_ids <= file_ids, f"orphan cache files {data_ids - file_ids}"


def attr_dict(attr: Any) -> dict[str, Any]:
    return dict(attr._asdict())
