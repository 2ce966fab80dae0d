"""One contract suite for the store primitives (backends/base.py), run unchanged against every store of
tests/store_targets.py: a store that gets a primitive wrong fails here, not in a FUSE test. The engine's
work on top of them (parts, resume, spills, downloads) has its own suite, tests/test_transfer.py."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import errno
import os
import stat
import zlib
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import trio
from emulators import azurite, fake_gcs, moto_s3, seaweedfs_s3  # noqa: F401
from store_targets import (  # noqa: F401
    BIG,
    META,
    PART,
    Target,
    download,
    engine,
    put,
    s3_target,
    s3_target_on,
    target,
    write,
)

from ckptfs.backends import open_store
from ckptfs.backends.base import (
    DIR,
    FILE,
    RANGE_PIECE,
    SYMLINK,
    TEMP_PREFIX,
    WHOLE_FETCH_PIECE,
    ObjectMeta,
    ObjectStore,
)
from ckptfs.backends.common import format_mtime, parse_mtime
from ckptfs.backends.local import LocalStore
from ckptfs.backends.s3 import S3Store
from ckptfs.backends.s3errors import ERROR_CODES, translate_error
from ckptfs.backends.s3markers import MARKER_DIR
from ckptfs.checksums import crc32_combine
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    CkptfsError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    TooLargeToCopyError,
    TransientBackendError,
    UploadGoneError,
    UsageError,
)

MiB = 1 << 20


def _crc(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def _keys(store: ObjectStore, prefix: str = "") -> set[str]:
    return {info.key for info in store.list(prefix)}


# -- staged uploads --------------------------------------------------------------------------------------


def test_a_staged_upload_appears_only_at_complete(target: Target) -> None:
    store = target.store
    data = os.urandom(PART) + os.urandom(PART) + os.urandom(1234)
    offsets = [0, PART, 2 * PART]
    upload = store.open_upload("ckpt/step-1/model.pt", META, _crc(data))
    # Parts may arrive in any order.
    parts = sorted(
        (store.put_part(upload, n + 1, off, data[off:off + PART], zlib.crc32(data[off:off + PART]))
         for n, off in reversed(list(enumerate(offsets)))),
        key=lambda p: p.number,
    )
    assert [p.number for p in parts] == [1, 2, 3] and all(p.etag and p.checksum for p in parts)
    assert store.head("ckpt/step-1/model.pt") is None
    assert "ckpt/step-1/model.pt" not in _keys(store)
    assert not any(TEMP_PREFIX in key for key in _keys(store))
    assert any(ref.upload_id == upload.upload_id for ref in store.list_leftovers())

    store.complete_upload(upload, parts, len(data), _crc(data))
    info = store.head("ckpt/step-1/model.pt")
    assert info is not None
    assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, len(data), META.mtime_ns, META.mode)
    assert info.checksum in (None, _crc(data))
    assert store.get_range("ckpt/step-1/model.pt", 0, len(data) + 10).data == data
    if target.name != "moto":  # moto answers a complete of a completed upload with a 500
        # A retry after a lost answer succeeds again (SeaweedFS), or finds the upload gone: the engine then
        # finds the object at its key (test_the_engine_finds_a_retried_complete_got_through).
        with contextlib.suppress(UploadGoneError):
            store.complete_upload(upload, parts, len(data), _crc(data))
    assert store.list_leftovers() == []
    assert target.leftovers() == []


def test_a_store_that_completes_anywhere_places_a_hidden_upload_at_any_key_with_its_metadata(target: Target) -> None:
    """What a spill (a file staged while it is written, its name and metadata known only at close) needs;
    a store that cannot do it says so (limits.completes_anywhere) and refuses."""
    store = target.store
    data = os.urandom(PART) + os.urandom(999)
    hidden = f"{TEMP_PREFIX}spill.{store.owner}.0123456789abcdef"
    upload = store.open_upload(hidden, None, None)
    parts = [store.put_part(upload, n + 1, off, data[off:off + PART], zlib.crc32(data[off:off + PART]))
             for n, off in enumerate((0, PART))]
    if not store.limits.completes_anywhere:
        with pytest.raises(ValueError):
            store.complete_upload(upload, parts, len(data), _crc(data), key="ckpt/renamed.pt", meta=META)
        store.abort_upload(upload)
        return
    store.complete_upload(upload, parts, len(data), _crc(data), key="ckpt/renamed.pt", meta=META)
    info = store.head("ckpt/renamed.pt")
    assert info is not None
    assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, len(data), META.mtime_ns, META.mode)
    assert info.checksum in (None, _crc(data))
    assert store.get_range("ckpt/renamed.pt", 0, len(data) + 10).data == data
    assert store.head(hidden) is None and not any(TEMP_PREFIX in key for key in _keys(store))
    # A retry after a lost answer: the upload is gone (the engine then finds the object at its key).
    with pytest.raises(UploadGoneError):
        store.complete_upload(upload, parts, len(data), _crc(data), key="ckpt/renamed.pt", meta=META)
    assert store.list_leftovers() == [] and target.leftovers() == []


@pytest.mark.parametrize("size", [0, 1000], ids=["empty", "small"])
def test_put_object_is_one_atomic_write(target: Target, size: int) -> None:
    data = os.urandom(size)
    target.store.put_object("a/b", data, META, _crc(data))
    info = target.store.head("a/b")
    assert info is not None and (info.size, info.mtime_ns, info.mode) == (size, META.mtime_ns, META.mode)
    answer = target.store.get_range("a/b", 0, 4096)
    assert (answer.data, answer.size) == (data, size)
    assert target.leftovers() == []


def test_abort_leaves_nothing(target: Target) -> None:
    store = target.store
    upload = store.open_upload("a/big", META, "crc32:00000000")
    store.put_part(upload, 1, 0, b"x" * PART, zlib.crc32(b"x" * PART))
    store.abort_upload(upload)
    store.abort_upload(upload)  # twice is fine
    assert store.head("a/big") is None
    assert _keys(store) == set()  # not even the directory of the key: nothing was ever written there
    assert store.list_leftovers() == []
    assert target.leftovers() == []


def test_an_upload_in_flight_keeps_no_directory_alive(target: Target) -> None:
    """A directory renamed away while one of its files is still uploading: the drain deletes the old
    directory's marker, the daemon is killed, the upload is aborted at the next start. The old directory
    must not come back (file:// staged uploads next to their key and left it behind, empty, for good)."""
    store = target.store
    store.put_dir("step.tmp/", META)
    upload = store.open_upload("step.tmp/shard-1", META, None)
    store.put_part(upload, 1, 0, b"x" * PART, zlib.crc32(b"x" * PART))
    store.delete("step.tmp/")
    assert store.list_dir("").subdirs == []
    for ref in store.list_leftovers():
        store.abort_upload(ref)
    assert _keys(store) == set()
    assert store.list_dir("").subdirs == []
    assert target.leftovers() == []


def test_list_parts_reports_what_the_server_holds(target: Target) -> None:
    store = target.store
    upload = store.open_upload("p", META, None)
    part = store.put_part(upload, 1, 0, b"y" * PART, zlib.crc32(b"y" * PART))
    held = store.list_parts(upload)
    if target.is_object_store:
        assert held == {1: (part.etag.strip('"'), PART)}
    else:
        assert held is None  # file:// cannot tell: an interrupted upload starts afresh
    store.abort_upload(upload)
    if target.is_object_store:
        assert store.list_parts(upload) is None


def test_list_leftovers_reports_only_this_owners_uploads(target: Target) -> None:
    mine, theirs = target.make(owner="mine"), target.make(owner="theirs")
    my_uploads = [mine.open_upload(key, META, None) for key in ("a/one", "shared")]
    their_upload = theirs.open_upload("shared", META, None)
    found = mine.list_leftovers()
    assert {ref.upload_id for ref in found if ref.upload_id} == {u.upload_id for u in my_uploads}
    assert their_upload.upload_id not in {ref.upload_id for ref in found}
    for ref in found:
        mine.abort_upload(ref)
    assert mine.list_leftovers() == []
    data = b"z" * 10
    part = theirs.put_part(their_upload, 1, 0, data, zlib.crc32(data))  # the other owner's upload survives
    theirs.complete_upload(their_upload, [part], len(data), None)
    assert theirs.get_range("shared", 0, 100).data == data
    assert target.leftovers() == []


def test_an_owner_set_after_the_store_is_made_tags_its_uploads(target: Target) -> None:
    """The daemon makes the store, then sets `owner` from the journal (daemon.py): the helper that tags and
    finds uploads by owner (S3's markers, GCS's composed uploads) must see the new value, not the one the
    store was made with, or a restart never finds its own leftovers."""
    first, later = target.make(owner="made-with"), target.make(owner="set-later")
    first.owner = "set-later"
    assert first.owner == "set-later"
    upload = first.open_upload("k", META, None)
    assert upload.upload_id in {ref.upload_id for ref in later.list_leftovers()}
    assert all(ref.upload_id != upload.upload_id for ref in target.make(owner="made-with").list_leftovers())
    first.abort_upload(upload)
    assert later.list_leftovers() == []
    assert target.leftovers() == []


def test_get_range_reads_ranges_of_one_version(target: Target) -> None:
    store = target.store
    data = os.urandom(3000)
    store.put_object("r", data, META, _crc(data))
    first = store.get_range("r", 0, 1000)
    assert (first.data, first.size) == (data[:1000], 3000)
    assert first.checksum in (None, _crc(data))
    assert store.get_range("r", 2500, 1000, if_match=first.etag).data == data[2500:]
    assert store.get_range("r", 3000, 10, if_match=first.etag).data == b""  # at the end: nothing, no error
    other = os.urandom(3000)
    store.put_object("r", other, META, _crc(other))
    with pytest.raises(ObjectChangedError):
        store.get_range("r", 1000, 1000, if_match=first.etag)
    with pytest.raises(NotFoundBackendError):
        store.get_range("no/such/key", 0, 10)


def test_get_range_streams_its_bytes_to_a_sink(target: Target) -> None:
    store = target.store
    data = os.urandom(3 * RANGE_PIECE + 1234)
    store.put_object("s", data, META, _crc(data))
    pieces: list[bytes] = []

    def keep(piece: bytes | memoryview) -> None:  # a piece is valid during the call only (RangeSink)
        pieces.append(bytes(piece))

    answer = store.get_range("s", 1000, len(data), sink=keep)
    assert answer.data == b"" and answer.size == len(data)
    assert b"".join(pieces) == data[1000:]
    if target.name in ("local", "seaweedfs", "moto"):  # SDKs that let the store choose the pieces
        assert len(pieces) > 1 and max(map(len, pieces)) <= RANGE_PIECE
        pieces.clear()
        store.get_range("s", 0, len(data), sink=keep, piece_size=WHOLE_FETCH_PIECE)
        assert b"".join(pieces) == data and max(map(len, pieces)) == WHOLE_FETCH_PIECE
    pieces.clear()
    store.get_range("s", len(data) - 10, 100, if_match=answer.etag, sink=keep)
    assert b"".join(pieces) == data[-10:]
    past: list[bytes] = []
    assert store.get_range("s", len(data), 10, sink=past.append).size == len(data)
    assert past == []


def test_a_sink_failure_is_not_taken_for_the_stores(target: Target) -> None:
    """A full cache disk while a range is written must not look like a failing store (it would be retried
    as one): the sink's own exception comes out as it is."""
    store = target.store
    data = os.urandom(2 * RANGE_PIECE)
    store.put_object("f", data, META, _crc(data))

    def full_disk(piece: bytes | memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as raised:
        store.get_range("f", 0, len(data), sink=full_disk)
    assert not isinstance(raised.value, BackendError) and raised.value.errno == errno.ENOSPC
    assert store.get_range("f", 0, len(data)).data == data  # the store is fine afterwards


def test_open_upload_refuses_reserved_names(target: Target) -> None:
    if not target.is_object_store:
        pytest.skip("file:// keeps its own temp files; the fs refuses reserved names before any store sees them")
    with pytest.raises(PermanentBackendError):
        target.store.open_upload(f"x/{TEMP_PREFIX}y", META, None)


# -- copy, delete, directories, symlinks, listing, metadata -----------------------------------------------


@pytest.mark.parametrize("size", [100, BIG], ids=["small", "multipart-copy"])
def test_copy_preserves_bytes_and_metadata(target: Target, tmp_path: Path, size: int) -> None:
    store = target.store
    data = write(tmp_path / "src", size)
    put(store, "old/f", tmp_path / "src", META)
    store.copy("old/f", "new/f")
    for key in ("old/f", "new/f"):
        info = store.head(key)
        assert info is not None
        assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, size, META.mtime_ns, META.mode)
        assert info.checksum in (None, _crc(data))
        assert download(store, key, tmp_path) == (data, _crc(data))
    store.delete("old/f")
    assert store.head("old/f") is None
    assert store.head("new/f") is not None
    with pytest.raises(NotFoundBackendError):
        store.copy("old/f", "other/f")
    assert target.leftovers() == []


def test_a_copy_larger_than_the_store_copies_at_once_goes_part_by_part(target: Target, tmp_path: Path) -> None:
    """Transfers.copy: S3 copies at most 5 GiB in one request (here, a store made to copy at most PART), so
    above that the engine copies it part by part (copy_part); the other stores copy any size whole. With
    new metadata (a move of a spill) or the source's (a rename), the copy is the object, byte for byte."""
    store = target.make(copy_threshold=PART) if target.is_s3 else target.store
    data = write(tmp_path / "src", BIG)
    put(store, "old/f", tmp_path / "src", META)
    if store.limits.max_copy_size is not None:
        with pytest.raises(TooLargeToCopyError):
            store.copy("old/f", "new/f")
    new = ObjectMeta(mtime_ns=1_750_000_000_000_000_001, mode=0o600)
    transfers = engine(store)
    trio.run(transfers.copies.copy, "old/f", "same/f")
    trio.run(transfers.copies.copy, "old/f", "new/f", new, _crc(data))
    for key, meta in (("same/f", META), ("new/f", new)):
        info = store.head(key)
        assert info is not None
        assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, BIG, meta.mtime_ns, meta.mode)
        assert info.checksum in (None, _crc(data))
        assert download(store, key, tmp_path) == (data, _crc(data))
    trio.run(transfers.copies.set_meta, "new/f", META)  # S3: a copy onto itself, part by part here
    info = store.head("new/f")
    assert info is not None and (info.size, info.mtime_ns, info.mode) == (BIG, META.mtime_ns, META.mode)
    assert download(store, "new/f", tmp_path) == (data, _crc(data))
    with pytest.raises(NotFoundBackendError):
        trio.run(transfers.copies.copy, "no/such", "other/f")
    assert store.list_leftovers() == [] and target.leftovers() == []


def test_an_aborted_upload_is_gone(target: Target) -> None:
    if target.name == "moto":
        pytest.skip("moto answers a complete of an upload it no longer has with a 500, not NoSuchUpload")
    store = target.store
    upload = store.open_upload("a/gone", META, None)
    part = store.put_part(upload, 1, 0, b"x" * PART, zlib.crc32(b"x" * PART))
    store.abort_upload(upload)
    with pytest.raises(UploadGoneError):
        store.complete_upload(upload, [part], PART, None)
    assert store.head("a/gone") is None
    assert store.list_leftovers() == [] and target.leftovers() == []


def test_the_engine_finds_a_retried_complete_got_through(target: Target, tmp_path: Path) -> None:
    """A complete whose answer was lost, retried, finds the upload gone: the engine checks the object at
    the key (once, for every store) and calls it done, leaving nothing behind."""
    if target.name == "moto":
        pytest.skip("moto answers a complete of a completed upload with a 500, not NoSuchUpload")
    data = write(tmp_path / "src", BIG)

    async def run() -> None:
        transfers = engine(target.store)
        staged = await transfers.stage_upload("big", str(tmp_path / "src"), META)
        assert staged.state is not None
        target.store.complete_upload(staged.state.ref, staged.state.parts, staged.size, staged.checksum)
        await transfers.commit_upload(staged)  # its retry

    trio.run(run)
    assert download(target.store, "big", tmp_path) == (data, _crc(data))
    assert target.store.list_leftovers() == [] and target.leftovers() == []


def test_a_copy_redone_leaves_nothing_but_the_copy(target: Target) -> None:
    """A move redone after a crash between the store's copy and the journal's record of it (found by the
    crash harness on file://, where the copy is a hard link and rename(2) of a link over a link of the same
    file does nothing)."""
    data = b"weights"
    target.store.put_object("step_1/shard", data, META, _crc(data))
    target.store.copy("step_1/shard", "archive/shard")
    target.store.copy("step_1/shard", "archive/shard")
    assert _keys(target.store, "archive/") == {"archive/shard"}
    assert target.store.get_range("archive/shard", 0, 100).data == data
    assert target.leftovers() == []


def test_delete_of_a_missing_key_is_fine(target: Target) -> None:
    target.store.delete("never/was")
    target.store.delete("never/was/")


def test_directories_symlinks_and_listing(target: Target, tmp_path: Path) -> None:
    store = target.store
    data = write(tmp_path / "src", 123)
    store.put_dir("d/", ObjectMeta(META.mtime_ns, 0o750))
    store.put_dir("d/e/", META)
    for key in ("top", "d/f", "d/e/g"):
        put(store, key, tmp_path / "src", META)
    odd_target = "../dir with spaces/ünïcödé%20 & more"
    store.put_symlink("d/link", "../top", META)
    store.put_symlink("d/odd", odd_target, META)

    listing = {(i.key, i.kind, i.size if i.kind == FILE else 0, i.target) for i in store.list()}
    assert listing == {
        ("top", FILE, 123, None), ("d/", DIR, 0, None), ("d/e/", DIR, 0, None), ("d/f", FILE, 123, None),
        ("d/e/g", FILE, 123, None), ("d/link", SYMLINK, 0, "../top"), ("d/odd", SYMLINK, 0, odd_target),
    }
    assert _keys(store, "d/e") == {"d/e/g"}
    assert _keys(store, "d/e/") == {"d/e/g"}
    assert _keys(store, "d") == {"d/e/", "d/e/g", "d/f", "d/link", "d/odd"}

    d = store.head("d/")
    assert d is not None and d.kind == DIR
    if target.name != "seaweedfs":  # SeaweedFS keeps `dir/` markers as directories, without user metadata
        assert d.mode == 0o750
    link = store.head("d/link")
    assert link is not None and (link.kind, link.target) == (SYMLINK, "../top")
    f = store.head("d/f")
    assert f is not None and f.kind == FILE
    assert download(store, "d/f", tmp_path)[0] == data

    store.copy("d/link", "d/link2")  # a symlink copies as a symlink
    link2 = store.head("d/link2")
    assert link2 is not None and (link2.kind, link2.target) == (SYMLINK, "../top")
    store.delete("d/link")
    assert store.head("d/link") is None


def test_set_meta_rewrites_mode_and_mtime_only(target: Target, tmp_path: Path) -> None:
    store = target.store
    small = write(tmp_path / "small", 77)
    big = write(tmp_path / "big", BIG)
    put(store, "small", tmp_path / "small", META)
    put(store, "big", tmp_path / "big", META)  # set_meta copies it in parts
    store.put_dir("dir/", META)
    new = ObjectMeta(mtime_ns=1_800_000_000_000_000_001, mode=0o600)
    for key, data in (("small", small), ("big", big), ("dir/", None)):
        store.set_meta(key, new)
        info = store.head(key)
        assert info is not None
        if key == "dir/" and target.name == "seaweedfs":  # no metadata on its directory markers
            continue
        assert (info.mtime_ns, info.mode) == (new.mtime_ns, new.mode), key
        if data is not None:
            assert info.checksum in (None, _crc(data))
            assert download(store, key, tmp_path)[0] == data
    with pytest.raises(NotFoundBackendError):
        store.set_meta("missing", new)
    assert target.leftovers() == []


def test_the_server_verifies_part_checksums(s3_target: Target) -> None:
    """What makes a damaged part fail instead of landing: the CRC32 we send with it."""
    if s3_target.name == "moto":
        pytest.skip("moto accepts any x-amz-checksum-crc32 (it does not verify)")
    store = s3_target.store
    assert isinstance(store, S3Store)
    client = store.wire.client
    upload = client.create_multipart_upload(Bucket=store.bucket, Key="run/42/x", ChecksumAlgorithm="CRC32")
    body = os.urandom(1000)
    wrong = base64.b64encode((zlib.crc32(body) ^ 1).to_bytes(4, "big")).decode()
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.upload_part(Bucket=store.bucket, Key="run/42/x", UploadId=upload["UploadId"], PartNumber=1,
                           Body=body, ChecksumCRC32=wrong)
    assert isinstance(translate_error(caught.value, "upload part"), TransientBackendError)
    client.abort_multipart_upload(Bucket=store.bucket, Key="run/42/x", UploadId=upload["UploadId"])


def test_bodies_are_not_hashed_for_the_signature(s3_target: Target) -> None:
    """Every body goes with its CRC32, which the server checks: a SHA-256 of it for the signature as well
    (botocore's way on a plain-HTTP endpoint) cost the daemon about 0.7 s of CPU per GiB uploaded."""
    store = s3_target.store
    assert isinstance(store, S3Store)
    signed: dict[str, str] = {}

    def record(request: Any, event_name: str, **_: Any) -> None:
        signed[event_name.rsplit(".", 1)[-1]] = request.headers["X-Amz-Content-SHA256"]

    store.wire.client.meta.events.register("before-send.s3", record)
    data = os.urandom(PART)
    store.put_object("small", data[:1000], META, _crc(data[:1000]))
    upload = store.open_upload("big", META, _crc(data))
    part = store.put_part(upload, 1, 0, data, zlib.crc32(data))
    store.complete_upload(upload, [part], len(data), _crc(data))
    assert signed["PutObject"] == signed["UploadPart"] == b"UNSIGNED-PAYLOAD"
    assert store.get_range("small", 0, 1000).data == data[:1000]
    assert store.get_range("big", 0, PART).data == data


def test_small_puts_do_not_wait_for_100_continue(s3_target: Target) -> None:
    """botocore sends every PutObject with `Expect: 100-continue` and reads the interim answer one byte per
    system call, each one handing the GIL over: in a drain of 2,000 small files about 50 system calls and
    300 futex calls per file (strace). A PutObject goes without it; the object still arrives whole."""
    store = s3_target.store
    assert isinstance(store, S3Store)
    sent: dict[str, str | None] = {}

    def record(request: Any, event_name: str, **_: Any) -> None:
        sent[event_name.rsplit(".", 1)[-1]] = request.headers.get("Expect")

    store.wire.client.meta.events.register("before-send.s3", record)
    data = os.urandom(100_000)
    store.put_object("small", data, META, _crc(data))
    assert sent == {"PutObject": None}
    assert store.get_range("small", 0, len(data)).data == data


def test_markers_and_symlink_limits(s3_target: Target) -> None:
    store = s3_target.store
    with pytest.raises(PermanentBackendError):
        store.put_symlink("long", "x" * 4000, META)
    with pytest.raises(PermanentBackendError):
        store.put_dir(f"{TEMP_PREFIX}uploads/", META)
    upload = store.open_upload("big", META, None)
    assert any(MARKER_DIR in key for key in s3_target.leftovers())
    assert _keys(store) == set()
    store.abort_upload(upload)
    assert s3_target.leftovers() == []


def test_a_bucket_without_prefix(s3_target: Target, tmp_path: Path) -> None:
    assert s3_target.server is not None and s3_target.bucket is not None
    target = s3_target_on("bare", s3_target.server, s3_target.bucket, prefix="")
    write(tmp_path / "src", 10)
    put(target.store, "x/y", tmp_path / "src", META)
    target.store.put_dir("x/", META)
    assert _keys(target.store) == {"x/", "x/y"}
    assert target.store.url == f"s3://{s3_target.bucket}"


# -- check() ---------------------------------------------------------------------------------------------


def test_check_accepts_a_usable_store(target: Target) -> None:
    target.store.check()


def test_check_names_the_problem_and_the_fix(s3_target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    assert s3_target.server is not None
    endpoint = s3_target.server.endpoint

    with pytest.raises(CkptfsError, match=r"bucket 'no-such-bucket' does not exist .*create it"):
        S3Store("no-such-bucket", endpoint_url=endpoint).check()

    (port,) = __import__("emulators").free_ports(1)
    with pytest.raises(CkptfsError, match=r"cannot reach http://127\.0\.0\.1:\d+ .*--endpoint-url"):
        S3Store("b", endpoint_url=f"http://127.0.0.1:{port}").check()

    if s3_target.name == "seaweedfs":  # moto accepts any key
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
        with pytest.raises(CkptfsError, match=r"access key is unknown .*check the credentials"):
            S3Store(s3_target.bucket or "", endpoint_url=endpoint).check()

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(CkptfsError, match=r"no AWS credentials found .*AWS_ACCESS_KEY_ID"):
        S3Store(s3_target.bucket or "", endpoint_url=endpoint).check()


def test_check_of_a_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(CkptfsError, match="does not exist"):
        LocalStore(tmp_path / "nope").check()


def test_a_drained_local_store_holds_only_its_objects(tmp_path: Path) -> None:
    """file:// stages uploads in a hidden directory of the store; once no upload is in flight it is gone,
    so a listing of the store directory shows exactly the files written (CI saw it left behind)."""
    store = LocalStore(tmp_path)
    store.put_object("a", b"small", META, "crc32:00000000")
    upload = store.open_upload("d/big", META, None)
    store.put_part(upload, 1, 0, b"x" * PART, zlib.crc32(b"x" * PART))
    assert len(os.listdir(tmp_path)) == 2  # the staging directory is there while an upload is
    store.complete_upload(upload, [], PART, None)
    store.copy("a", "b", META)
    store.put_symlink("l", "a", META)
    aborted = store.open_upload("c", META, None)
    store.abort_upload(aborted)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "d", "l"]


def test_concurrent_copies_never_mistake_a_tidied_staging_directory_for_a_missing_source(tmp_path: Path) -> None:
    """Each staged write removes the staging directory when it is left empty. A copy whose link(2) into it
    failed because another copy had just removed it, while a third had already recreated it, was reported
    as "source not found": the drain then dropped a renamed file as vanished (CI lost 13 of 1,200)."""
    store = LocalStore(tmp_path)
    sources = [f"src/f{i:04d}" for i in range(400)]
    for key in sources:
        (tmp_path / key).parent.mkdir(exist_ok=True)
        (tmp_path / key).write_bytes(key.encode())
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        done = list(pool.map(lambda key: store.copy(key, key.replace("src/", "dst/")), sources))
    assert len(done) == len(sources)
    assert sorted(os.listdir(tmp_path / "dst")) == sorted(key[4:] for key in sources)
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_open_store_maps_s3_urls() -> None:
    store = open_store("s3://bucket/run-42/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url, store.endpoint_url) == (
        "bucket", "run-42/", "s3://bucket/run-42", "http://127.0.0.1:9")
    with pytest.raises(UsageError):
        open_store("s3:///run-42")


# -- units: error mapping, checksums, part sizes, metadata ---------------------------------------------------


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": "msg"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_client_error("InternalError", 500), TransientBackendError),
        (_client_error("ServiceUnavailable", 503), TransientBackendError),
        (_client_error("SlowDown", 503), TransientBackendError),
        (_client_error("RequestTimeout", 400), TransientBackendError),
        (_client_error("BadDigest", 400), TransientBackendError),
        (_client_error("NoSuchUpload", 404), UploadGoneError),
        (_client_error("PreconditionFailed", 412), TransientBackendError),
        (_client_error("SomethingNew", 502), TransientBackendError),
        (_client_error("", 429), TransientBackendError),
        (_client_error("NoSuchBucket", 404), PermanentBackendError),
        (_client_error("InvalidArgument", 400), PermanentBackendError),
        (_client_error("SomethingNew", 400), PermanentBackendError),
        (_client_error("AccessDenied", 403), AuthBackendError),
        (_client_error("InvalidAccessKeyId", 403), AuthBackendError),
        (_client_error("SignatureDoesNotMatch", 403), AuthBackendError),
        (_client_error("403", 403), AuthBackendError),
        (_client_error("NoSuchKey", 404), NotFoundBackendError),
        (_client_error("404", 404), NotFoundBackendError),
        (botocore.exceptions.NoCredentialsError(), AuthBackendError),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), TransientBackendError),
        (botocore.exceptions.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"), TransientBackendError),
        (botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), TransientBackendError),
        (botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"), TransientBackendError),
        (botocore.exceptions.ResponseStreamingError(error="reset"), TransientBackendError),
        (ConnectionResetError(104, "reset"), TransientBackendError),
        (botocore.exceptions.ParamValidationError(report="bad"), PermanentBackendError),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else type(v).__name__ + (
        f"-{v.response['Error']['Code']}-{v.response['ResponseMetadata']['HTTPStatusCode']}"
        if isinstance(v, botocore.exceptions.ClientError) else ""),
)
def test_error_mapping(error: BaseException, expected: type[BackendError]) -> None:
    translated = translate_error(error, "op")
    assert type(translated) is expected
    assert str(translated).startswith("op: ")


def test_error_table_is_consistent() -> None:
    assert ERROR_CODES["SlowDown"] is TransientBackendError
    assert issubclass(ERROR_CODES["AccessDenied"], PermanentBackendError)  # auth errors are permanent too


def test_crc32_combine() -> None:
    a, b = os.urandom(1000), os.urandom(777)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b""), 0) == zlib.crc32(a)
    big = bytes(5 * MiB)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(big), len(big)) == zlib.crc32(a + big)


def test_mtime_metadata_round_trips() -> None:
    for ns in (0, 1, 1_700_000_000_123_456_789, -1, -1_500_000_000):
        assert parse_mtime(format_mtime(ns)) == ns
    assert parse_mtime("1700000000") == 1_700_000_000 * 10**9  # s3fs
    assert parse_mtime("1700000000.5") == 1_700_000_000_500_000_000  # rclone, shorter fraction
    assert parse_mtime("garbage") is None
    assert stat.S_IFMT(int("33188")) == stat.S_IFREG
