"""One contract suite for every ObjectStore: LocalStore, and S3Store against two real S3 servers on
127.0.0.1 (SeaweedFS and moto, started by tests/emulators.py). Small part sizes keep it fast: 5 MiB parts
(S3's minimum), so a 12 MiB file is a three-part multipart upload with a short tail."""

from __future__ import annotations

import base64
import os
import stat
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
from emulators import S3Server, moto_s3, s3_bucket, seaweedfs_s3  # noqa: F401

from ckptfs.backends import open_store
from ckptfs.backends.base import DIR, FILE, SYMLINK, TEMP_PREFIX, ObjectMeta, ObjectStore, UploadState
from ckptfs.backends.local import LocalStore
from ckptfs.backends.s3 import (
    ERROR_CODES,
    MARKER_DIR,
    S3Store,
    crc32_combine,
    format_mtime,
    parse_mtime,
    plan_part_size,
    translate_error,
)
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    CkptfsError,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
    UsageError,
)

MiB = 1 << 20
PART = 5 * MiB
BIG = 12 * MiB + 12345  # three parts: 5 + 5 + 2 MiB and a bit
META = ObjectMeta(mtime_ns=1_700_000_000_123_456_789, mode=0o640)
BACKENDS = ["local", "seaweedfs", "moto"]


@dataclass
class Target:
    """A store under test, a way to make more stores on the same bucket/dir, and a look at raw leftovers."""

    name: str
    store: ObjectStore
    make: Callable[..., ObjectStore]
    leftovers: Callable[[], list[str]]
    server: S3Server | None = None
    bucket: str | None = None

    @property
    def is_s3(self) -> bool:
        return self.server is not None


def _local_target(root: Path) -> Target:
    root.mkdir()

    def make(owner: str = "a", **_: Any) -> ObjectStore:
        return LocalStore(root, owner=owner)

    def leftovers() -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.startswith(TEMP_PREFIX))

    return Target("local", make(), make, leftovers)


def _s3_target(name: str, server: S3Server, bucket: str, prefix: str = "run/42") -> Target:
    def make(owner: str = "a", **kwargs: Any) -> ObjectStore:
        options: dict[str, Any] = dict(part_size=PART, multipart_threshold=PART, parts_in_flight=3,
                                       copy_threshold=PART, copy_part_size=PART)
        options.update(kwargs)
        return S3Store(bucket, prefix, endpoint_url=server.endpoint, owner=owner, **options)

    raw = server.client()

    def leftovers() -> list[str]:
        found = []
        for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            found += [o["Key"] for o in page.get("Contents", []) if TEMP_PREFIX in o["Key"]]
        for page in raw.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            found += [f"upload:{u['Key']}" for u in page.get("Uploads", [])]
        return sorted(found)

    return Target(name, make(), make, leftovers, server, bucket)


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    if request.param == "local":
        yield _local_target(tmp_path / "store")
        return
    server: S3Server = request.getfixturevalue(f"{request.param}_s3")
    with s3_bucket(server) as bucket:
        yield _s3_target(request.param, server, bucket)


@pytest.fixture(params=["seaweedfs", "moto"])
def s3_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    server: S3Server = request.getfixturevalue(f"{request.param}_s3")
    with s3_bucket(server) as bucket:
        yield _s3_target(request.param, server, bucket)


def _write(path: Path, size: int, seed: int = 1) -> bytes:
    data = (seed.to_bytes(4, "big") + os.urandom(61)) * (size // 65) + os.urandom(size % 65)
    data = data[:size]
    path.write_bytes(data)
    return data


def _crc(data: bytes) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def _keys(store: ObjectStore, prefix: str = "") -> set[str]:
    return {info.key for info in store.list(prefix)}


def _download(store: ObjectStore, key: str, tmp_path: Path) -> tuple[bytes, str]:
    dst = tmp_path / f"dl-{os.urandom(4).hex()}"
    checksum = store.download(key, str(dst))
    return dst.read_bytes(), checksum


# -- uploads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1000, BIG], ids=["empty", "small", "multipart"])
def test_stage_then_commit_makes_the_object_appear_byte_identical(target: Target, tmp_path: Path, size: int) -> None:
    store = target.store
    data = _write(tmp_path / "src", size)
    staged = store.stage_upload("ckpt/step-1/model.pt", str(tmp_path / "src"), META)
    assert staged.size == size
    assert staged.checksum == _crc(data)
    # Nothing at the key, nothing in listings, between stage and commit.
    assert store.head("ckpt/step-1/model.pt") is None
    assert "ckpt/step-1/model.pt" not in _keys(store)
    assert not any(TEMP_PREFIX in key for key in _keys(store))

    store.commit_upload(staged)
    info = store.head("ckpt/step-1/model.pt")
    assert info is not None
    assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, size, META.mtime_ns, META.mode)
    assert info.checksum in (None, staged.checksum)
    assert "ckpt/step-1/model.pt" in _keys(store)
    content, checksum = _download(store, "ckpt/step-1/model.pt", tmp_path)
    assert content == data
    assert checksum == staged.checksum
    assert target.leftovers() == []


def test_abort_leaves_nothing(target: Target, tmp_path: Path) -> None:
    store = target.store
    _write(tmp_path / "big", BIG)
    _write(tmp_path / "small", 10)
    for key, src in (("a/big", "big"), ("a/small", "small")):
        staged = store.stage_upload(key, str(tmp_path / src), META)
        store.abort_upload(staged)
        store.abort_upload(staged)  # twice is fine
        assert store.head(key) is None
    assert _keys(store) <= {"a/"}  # file:// keeps the directory it staged in
    assert target.leftovers() == []


def test_multipart_upload_reports_its_parts(target: Target, tmp_path: Path) -> None:
    data = _write(tmp_path / "src", BIG)
    states: list[UploadState] = []
    lock = threading.Lock()

    def progress(state: UploadState) -> None:
        with lock:
            states.append(state)

    staged = target.store.stage_upload("big", str(tmp_path / "src"), META, progress=progress)
    if target.is_s3:
        assert isinstance(staged.handle, UploadState)
        assert [p.number for p in staged.handle.parts] == [1, 2, 3]
        assert all(p.etag and p.checksum for p in staged.handle.parts)
        assert staged.handle.part_size == PART
        assert len(states) == 4 and states[0].parts == ()  # created, then one call per finished part
        assert {s.upload_id for s in states} == {staged.handle.upload_id}
        assert UploadState.from_json(states[-1].to_json()) == states[-1]
    else:
        assert states == []
    target.store.commit_upload(staged)
    assert _download(target.store, "big", tmp_path)[0] == data


def test_overwrite_replaces_the_object(target: Target, tmp_path: Path) -> None:
    store = target.store
    _write(tmp_path / "one", BIG, seed=1)
    store.commit_upload(store.stage_upload("f", str(tmp_path / "one"), META))
    two = _write(tmp_path / "two", 100, seed=2)
    store.commit_upload(store.stage_upload("f", str(tmp_path / "two"), ObjectMeta(5 * 10**9, 0o600)))
    info = store.head("f")
    assert info is not None and (info.size, info.mtime_ns, info.mode) == (100, 5 * 10**9, 0o600)
    assert _download(store, "f", tmp_path)[0] == two


def test_download_of_a_missing_key_raises_not_found(target: Target, tmp_path: Path) -> None:
    with pytest.raises(NotFoundBackendError):
        target.store.download("no/such/key", str(tmp_path / "dst"))
    assert target.store.head("no/such/key") is None


def test_stage_of_a_vanished_source_raises_not_found(target: Target, tmp_path: Path) -> None:
    with pytest.raises(NotFoundBackendError):
        target.store.stage_upload("k", str(tmp_path / "missing"), META)


# -- copy, delete, directories, symlinks, listing, metadata -----------------------------------------------


@pytest.mark.parametrize("size", [100, BIG], ids=["small", "multipart-copy"])
def test_copy_preserves_bytes_and_metadata(target: Target, tmp_path: Path, size: int) -> None:
    store = target.store
    data = _write(tmp_path / "src", size)
    store.commit_upload(store.stage_upload("old/f", str(tmp_path / "src"), META))
    store.copy("old/f", "new/f")
    for key in ("old/f", "new/f"):
        info = store.head(key)
        assert info is not None
        assert (info.kind, info.size, info.mtime_ns, info.mode) == (FILE, size, META.mtime_ns, META.mode)
        assert info.checksum in (None, _crc(data))
        assert _download(store, key, tmp_path) == (data, _crc(data))
    store.delete("old/f")
    assert store.head("old/f") is None
    assert store.head("new/f") is not None
    with pytest.raises(NotFoundBackendError):
        store.copy("old/f", "other/f")
    assert target.leftovers() == []


def test_delete_of_a_missing_key_is_fine(target: Target) -> None:
    target.store.delete("never/was")
    target.store.delete("never/was/")


def test_directories_symlinks_and_listing(target: Target, tmp_path: Path) -> None:
    store = target.store
    data = _write(tmp_path / "src", 123)
    store.put_dir("d/", ObjectMeta(META.mtime_ns, 0o750))
    store.put_dir("d/e/", META)
    for key in ("top", "d/f", "d/e/g"):
        store.commit_upload(store.stage_upload(key, str(tmp_path / "src"), META))
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
    assert _download(store, "d/f", tmp_path)[0] == data

    store.copy("d/link", "d/link2")  # a symlink copies as a symlink
    link2 = store.head("d/link2")
    assert link2 is not None and (link2.kind, link2.target) == (SYMLINK, "../top")
    store.delete("d/link")
    assert store.head("d/link") is None


def test_set_meta_rewrites_mode_and_mtime_only(target: Target, tmp_path: Path) -> None:
    store = target.store
    small = _write(tmp_path / "small", 77)
    big = _write(tmp_path / "big", BIG)
    store.commit_upload(store.stage_upload("small", str(tmp_path / "small"), META))
    store.commit_upload(store.stage_upload("big", str(tmp_path / "big"), META))  # set_meta copies it in parts
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
            assert _download(store, key, tmp_path)[0] == data
    with pytest.raises(NotFoundBackendError):
        store.set_meta("missing", new)
    assert target.leftovers() == []


# -- leftovers of interrupted uploads, resume ---------------------------------------------------------------


def test_abort_stale_uploads_removes_only_this_owners_leftovers(target: Target, tmp_path: Path) -> None:
    mine, theirs = target.make(owner="mine"), target.make(owner="theirs")
    _write(tmp_path / "src", BIG)
    my_staged = [mine.stage_upload(key, str(tmp_path / "src"), META) for key in ("a/one", "shared")]
    their_staged = [theirs.stage_upload(key, str(tmp_path / "src"), META) for key in ("a/two", "shared")]
    assert mine.abort_stale_uploads() == 2
    assert mine.abort_stale_uploads() == 0
    for staged in their_staged:  # the other owner's uploads survive, also one to the same key
        theirs.commit_upload(staged)
    assert _keys(theirs) >= {"a/two", "shared"}
    with pytest.raises(BackendError):
        mine.commit_upload(my_staged[0])
    assert mine.head("a/one") is None
    assert target.leftovers() == []


def _interrupted_upload(store: ObjectStore, key: str, src: Path, after_parts: int = 2) -> UploadState:
    """Stage until `after_parts` parts are reported, then fail as a kill -9 would; return the last state
    the caller could have persisted."""
    persisted: list[str] = []

    def progress(state: UploadState) -> None:
        persisted.append(state.to_json())
        if len(state.parts) >= after_parts:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        store.stage_upload(key, str(src), META, progress=progress)
    return UploadState.from_json(persisted[-1])


def test_resume_continues_from_the_finished_parts(s3_target: Target, tmp_path: Path) -> None:
    data = _write(tmp_path / "src", BIG)
    state = _interrupted_upload(s3_target.store, "ckpt/big", tmp_path / "src")
    assert len(state.parts) >= 2
    restarted = s3_target.make()  # a new process: same owner, new client
    assert restarted.abort_stale_uploads(keep={state.upload_id}) == 0
    seen: list[UploadState] = []
    staged = restarted.stage_upload("ckpt/big", str(tmp_path / "src"), META, resume=state, progress=seen.append)
    assert seen[0].upload_id == state.upload_id
    assert {p.number for p in seen[0].parts} == {p.number for p in state.parts}  # kept, not uploaded again
    assert len(seen) == 1 + 3 - len(state.parts)
    restarted.commit_upload(staged)
    assert _download(restarted, "ckpt/big", tmp_path) == (data, _crc(data))
    assert s3_target.leftovers() == []


def test_resume_of_a_changed_file_starts_afresh(s3_target: Target, tmp_path: Path) -> None:
    _write(tmp_path / "src", BIG, seed=1)
    state = _interrupted_upload(s3_target.store, "big", tmp_path / "src")
    data = _write(tmp_path / "src", BIG, seed=2)  # same size, other bytes
    staged = s3_target.store.stage_upload("big", str(tmp_path / "src"), META, resume=state)
    assert staged.handle.upload_id != state.upload_id
    s3_target.store.commit_upload(staged)
    assert _download(s3_target.store, "big", tmp_path)[0] == data
    assert s3_target.leftovers() == []  # the old upload was aborted


def test_resume_after_the_upload_was_aborted_starts_afresh(s3_target: Target, tmp_path: Path) -> None:
    data = _write(tmp_path / "src", BIG)
    state = _interrupted_upload(s3_target.store, "big", tmp_path / "src")
    assert s3_target.store.abort_stale_uploads() == 1  # not kept: aborted
    staged = s3_target.store.stage_upload("big", str(tmp_path / "src"), META, resume=state)
    assert staged.handle.upload_id != state.upload_id
    s3_target.store.commit_upload(staged)
    assert _download(s3_target.store, "big", tmp_path)[0] == data
    assert s3_target.leftovers() == []


class _FailingPartStore(S3Store):
    """An S3Store whose upload of part 2 fails for good (our own code path, not the SDK, is altered)."""

    def _retrying(self, what: str, method: str, **kwargs: Any) -> Any:
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            raise TransientBackendError("injected failure of part 2")
        return super()._retrying(what, method, **kwargs)


def test_failed_stage_without_progress_aborts_its_upload(s3_target: Target, tmp_path: Path) -> None:
    _write(tmp_path / "src", BIG)
    assert s3_target.server is not None and s3_target.bucket is not None
    store = _FailingPartStore(s3_target.bucket, "run/42", endpoint_url=s3_target.server.endpoint, part_size=PART,
                              multipart_threshold=PART, parts_in_flight=3)
    with pytest.raises(TransientBackendError, match="injected"):
        store.stage_upload("big", str(tmp_path / "src"), META)
    assert s3_target.leftovers() == []  # nobody could resume it: aborted, marker gone
    with pytest.raises(TransientBackendError, match="injected"):
        store.stage_upload("big", str(tmp_path / "src"), META, progress=lambda state: None)
    assert len(s3_target.leftovers()) == 2  # the caller may resume it: upload and marker stay
    assert store.abort_stale_uploads() == 1
    assert s3_target.leftovers() == []


def test_commit_after_a_lost_complete_answer_succeeds(s3_target: Target, tmp_path: Path) -> None:
    """A complete whose answer was lost, retried, finds no upload: the object is there, so it succeeded."""
    data = _write(tmp_path / "src", BIG)
    store = s3_target.store
    staged = store.stage_upload("big", str(tmp_path / "src"), META)
    state: UploadState = staged.handle
    assert s3_target.server is not None
    s3_target.server.client().complete_multipart_upload(
        Bucket=s3_target.bucket, Key="run/42/big", UploadId=state.upload_id,
        MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": p.etag, "ChecksumCRC32": p.checksum}
                                   for p in state.parts]},
    )
    if s3_target.name == "moto":
        pytest.skip("moto answers a complete of a completed upload with a 500, not NoSuchUpload")
    store.commit_upload(staged)
    assert _download(store, "big", tmp_path)[0] == data


def test_the_server_verifies_part_checksums(s3_target: Target) -> None:
    """What makes a damaged part fail instead of landing: the CRC32 we send with it."""
    if s3_target.name == "moto":
        pytest.skip("moto accepts any x-amz-checksum-crc32 (it does not verify)")
    store = s3_target.store
    assert isinstance(store, S3Store)
    client = store._client
    upload = client.create_multipart_upload(Bucket=store.bucket, Key="run/42/x", ChecksumAlgorithm="CRC32")
    body = os.urandom(1000)
    wrong = base64.b64encode((zlib.crc32(body) ^ 1).to_bytes(4, "big")).decode()
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.upload_part(Bucket=store.bucket, Key="run/42/x", UploadId=upload["UploadId"], PartNumber=1,
                           Body=body, ChecksumCRC32=wrong)
    assert isinstance(translate_error(caught.value, "upload part"), TransientBackendError)
    client.abort_multipart_upload(Bucket=store.bucket, Key="run/42/x", UploadId=upload["UploadId"])


def test_markers_and_symlink_limits(s3_target: Target, tmp_path: Path) -> None:
    store = s3_target.store
    with pytest.raises(PermanentBackendError):
        store.put_symlink("long", "x" * 4000, META)
    with pytest.raises(PermanentBackendError):
        store.put_dir(f"{TEMP_PREFIX}uploads/", META)
    _write(tmp_path / "src", BIG)
    staged = store.stage_upload("big", str(tmp_path / "src"), META)
    assert any(MARKER_DIR in key for key in s3_target.leftovers())
    assert _keys(store) == set()
    store.abort_upload(staged)


def test_a_bucket_without_prefix(s3_target: Target, tmp_path: Path) -> None:
    assert s3_target.server is not None and s3_target.bucket is not None
    target = _s3_target("bare", s3_target.server, s3_target.bucket, prefix="")
    _write(tmp_path / "src", 10)
    target.store.commit_upload(target.store.stage_upload("x/y", str(tmp_path / "src"), META))
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
        (_client_error("NoSuchUpload", 404), TransientBackendError),
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


def test_plan_part_size() -> None:
    assert plan_part_size(2 << 30, 64 * MiB, 4) == 64 * MiB
    assert plan_part_size(20 * MiB, 64 * MiB, 4) == 5 * MiB  # mid-size files still go in parallel
    assert plan_part_size(100 * MiB, 64 * MiB, 4) == 25 * MiB
    assert plan_part_size(12 * MiB, 1 * MiB, 4) == 5 * MiB  # never below S3's minimum
    huge = 1 << 42  # 4 TiB: parts grow so there are at most 10,000
    assert -(-huge // plan_part_size(huge, 64 * MiB, 4)) <= 10_000


def test_mtime_metadata_round_trips() -> None:
    for ns in (0, 1, 1_700_000_000_123_456_789, -1, -1_500_000_000):
        assert parse_mtime(format_mtime(ns)) == ns
    assert parse_mtime("1700000000") == 1_700_000_000 * 10**9  # s3fs
    assert parse_mtime("1700000000.5") == 1_700_000_000_500_000_000  # rclone, shorter fraction
    assert parse_mtime("garbage") is None
    assert stat.S_IFMT(int("33188")) == stat.S_IFREG
