"""The primitives of GcsStore and AzureBlobStore against real emulators on 127.0.0.1 (tests/emulators.py):
fake-gcs-server (honours generation preconditions), gcp-storage-emulator (uploads only: it loses
metadata on rewrite and cannot hold a `dir/` marker next to `dir/x`, see docs/SEMANTICS.md) and Azurite.
Until the contract suite (tests/test_backends.py) is parametrized over these stores, this file is their
contract; the error tables are tested without a server."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from emulators import AzuriteServer, GcsServer, azurite, fake_gcs, free_ports, gcp_emulator  # noqa: F401

from ckptfs.backends import open_store
from ckptfs.backends.base import DIR, FILE, SYMLINK, TEMP_PREFIX, ObjectMeta, ObjectStore, UploadPart
from ckptfs.checksums import crc_text
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    CkptfsError,
    NotFoundBackendError,
    ObjectChangedError,
    PermanentBackendError,
    TransientBackendError,
    UploadGoneError,
    UsageError,
)

KiB = 1 << 10
MiB = 1 << 20
META = ObjectMeta(mtime_ns=1_700_000_000_123_456_789, mode=0o640)
UPLOAD_TARGETS = ["fake-gcs", "gcp-emulator", "azurite"]
TARGETS = ["fake-gcs", "azurite"]


@dataclass
class Target:
    name: str
    make: Callable[..., ObjectStore]  # make(owner="a", prefix="run/42") -> a store on the same bucket
    raw_names: Callable[[], list[str]]  # every name in the bucket/container, bookkeeping included

    @property
    def store(self) -> ObjectStore:
        return self.make()


def _gcs_target(server: GcsServer) -> Target:
    from ckptfs.backends.gcs import GcsStore

    bucket = server.new_bucket()

    def make(owner: str = "a", prefix: str = "run/42") -> ObjectStore:
        return GcsStore(bucket, prefix, endpoint_url=server.endpoint, owner=owner)

    def raw_names() -> list[str]:
        return sorted(b.name for b in server.client().list_blobs(bucket))

    return Target(server.name, make, raw_names)


def _azure_target(server: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> Target:
    from ckptfs.backends.azure import AzureBlobStore

    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string)
    container = server.new_container()

    def make(owner: str = "a", prefix: str = "run/42") -> ObjectStore:
        return AzureBlobStore(container, prefix, owner=owner)

    def raw_names() -> list[str]:
        client = server.service().get_container_client(container)
        return sorted(b.name for b in client.list_blobs())

    return Target("azurite", make, raw_names)


def _target(name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    if name == "azurite":
        return _azure_target(request.getfixturevalue("azurite"), monkeypatch)
    return _gcs_target(request.getfixturevalue(name.replace("-", "_")))


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    return _target(request.param, request, monkeypatch)


@pytest.fixture(params=UPLOAD_TARGETS)
def upload_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Target:
    return _target(request.param, request, monkeypatch)


def _crc(data: bytes) -> str:
    return crc_text(zlib.crc32(data))


def _stage(store: ObjectStore, key: str, data: bytes, part: int, meta: ObjectMeta | None = META,
           checksum: str | None = "") -> tuple[Any, list[UploadPart]]:
    upload = store.open_upload(key, meta, _crc(data) if checksum == "" else checksum)
    parts = []
    for number, offset in enumerate(range(0, len(data), part), start=1):
        chunk = data[offset:offset + part]
        parts.append(store.put_part(upload, number, offset, chunk, zlib.crc32(chunk)))
    return upload, parts


def _read_all(store: ObjectStore, key: str) -> bytes:
    first = store.get_range(key, 0, 1 << 30)
    return first.data


def _payload(size: int) -> bytes:
    return (bytes(range(251)) * (size // 251 + 1))[:size]


# -- staged uploads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [1, 3, 40])  # 40: more than one compose (32 sources) on GCS
def test_staged_upload_appears_complete_with_its_metadata(upload_target: Target, parts: int) -> None:
    store = upload_target.store
    data = _payload(parts * 64 * KiB - 1000)
    upload, staged = _stage(store, "ckpt/model.pt", data, 64 * KiB)
    assert store.head("ckpt/model.pt") is None  # invisible until complete
    assert len(staged) == parts
    store.complete_upload(upload, staged, len(data), _crc(data))
    info = store.head("ckpt/model.pt")
    assert info is not None and info.kind == FILE and info.size == len(data)
    assert (info.mtime_ns, info.mode, info.checksum) == (META.mtime_ns, META.mode, _crc(data))
    assert _read_all(store, "ckpt/model.pt") == data
    # A retry after a lost answer (bookkeeping already gone): the upload is gone, the engine checks the key.
    with pytest.raises(UploadGoneError):
        store.complete_upload(upload, staged, len(data), _crc(data))
    assert not [n for n in upload_target.raw_names() if TEMP_PREFIX in n]
    assert store.list_leftovers() == []


def test_a_part_above_the_single_request_size_uploads(upload_target: Target) -> None:
    """Parts above 8 MiB go through the SDK's resumable session on GCS (one session per part object)."""
    store = upload_target.store
    data = _payload(9 * MiB + 7)
    upload, staged = _stage(store, "big", data, 9 * MiB)
    store.complete_upload(upload, staged, len(data), _crc(data))
    assert store.get_range("big", 9 * MiB - 3, 100).data == data[9 * MiB - 3:]


def test_list_parts_tells_what_the_server_holds(upload_target: Target) -> None:
    store = upload_target.store
    data = _payload(3 * 64 * KiB)
    upload, staged = _stage(store, "resume/me", data, 64 * KiB)
    # A new process (a new store object) asks for the parts of the upload its journal remembers.
    held = upload_target.make().list_parts(upload)
    assert held == {p.number: (p.etag, 64 * KiB) for p in staged}
    store.abort_upload(upload)
    assert store.list_parts(upload) is None
    assert store.head("resume/me") is None
    assert store.list_leftovers() == []


def test_a_retried_part_replaces_the_first(upload_target: Target) -> None:
    store = upload_target.store
    data = _payload(2 * 64 * KiB)
    upload, staged = _stage(store, "retried", data, 64 * KiB)
    again = store.put_part(upload, 2, 64 * KiB, data[64 * KiB:], zlib.crc32(data[64 * KiB:]))
    store.complete_upload(upload, [staged[0], again], len(data), _crc(data))
    assert _read_all(store, "retried") == data


def test_leftovers_are_reported_to_their_owner_only(upload_target: Target) -> None:
    mine, theirs = upload_target.make(owner="node-a"), upload_target.make(owner="node-b")
    data = _payload(128 * KiB)
    a1, _ = _stage(mine, "x/one", data, 64 * KiB)
    a2, _ = _stage(mine, "x/two", data, 64 * KiB)
    b1, b_parts = _stage(theirs, "x/one", data, 64 * KiB)
    found = mine.list_leftovers()
    assert sorted((r.key, r.upload_id) for r in found) == sorted([("x/one", a1.upload_id), ("x/two", a2.upload_id)])
    for ref in found:
        mine.abort_upload(ref)
    assert mine.list_leftovers() == []
    # The other owner's upload is untouched and still completes.
    assert [(r.key, r.upload_id) for r in theirs.list_leftovers()] == [("x/one", b1.upload_id)]
    theirs.complete_upload(b1, b_parts, len(data), _crc(data))
    assert _read_all(theirs, "x/one") == data


def test_spill_is_staged_hidden_then_copied_with_its_metadata(upload_target: Target) -> None:
    store = upload_target.store
    if upload_target.name == "gcp-emulator":
        pytest.skip("gcp-storage-emulator drops the destination metadata of a rewrite (docs/SEMANTICS.md)")
    data = _payload(100 * KiB)
    spill = f"{TEMP_PREFIX}spill.a.0123456789abcdef"
    upload, staged = _stage(store, spill, data, 64 * KiB, meta=None, checksum=None)
    store.complete_upload(upload, staged, len(data), None)
    assert [i.key for i in store.list()] == []  # hidden
    store.copy(spill, "ckpt/spilled", META, _crc(data))
    store.delete(spill)
    info = store.head("ckpt/spilled")
    assert info is not None and (info.size, info.mtime_ns, info.mode, info.checksum) == (
        len(data), META.mtime_ns, META.mode, _crc(data))
    assert _read_all(store, "ckpt/spilled") == data
    assert not [n for n in upload_target.raw_names() if TEMP_PREFIX in n]


def test_keys_with_reserved_names_are_refused(target: Target) -> None:
    with pytest.raises(PermanentBackendError):
        target.store.open_upload(f"a/{TEMP_PREFIX}x", META, "")
    with pytest.raises(PermanentBackendError):
        target.store.put_object(f"{TEMP_PREFIX}y", b"", META, _crc(b""))


# -- objects, reads, metadata -------------------------------------------------------------------------------


def test_put_object_round_trips_bytes_and_metadata(target: Target) -> None:
    store = target.store
    store.put_object("a/small", b"hello world", META, _crc(b"hello world"))
    store.put_object("a/empty", b"", META, _crc(b""))
    info = store.head("a/small")
    assert info is not None
    assert (info.kind, info.size, info.mtime_ns, info.mode, info.checksum) == (
        FILE, 11, META.mtime_ns, META.mode, _crc(b"hello world"))
    read = store.get_range("a/small", 6, 100)
    assert (read.data, read.size, read.etag, read.checksum) == (b"world", 11, info.etag, _crc(b"hello world"))
    assert store.get_range("a/small", 11, 5).data == b""
    empty = store.get_range("a/empty", 0, 10)
    assert (empty.data, empty.size) == (b"", 0)
    assert store.head("a/missing") is None
    with pytest.raises(NotFoundBackendError):
        store.get_range("a/missing", 0, 10)


def test_get_range_pinned_to_a_version_notices_a_replacement(target: Target) -> None:
    store = target.store
    store.put_object("v", b"version one", META, _crc(b"version one"))
    first = store.get_range("v", 0, 4)
    assert store.get_range("v", 4, 4, if_match=first.etag).data == b"ion "
    store.put_object("v", b"version two", META, _crc(b"version two"))
    with pytest.raises(ObjectChangedError):
        store.get_range("v", 4, 4, if_match=first.etag)
    # a fresh store object (no cached version) notices too
    with pytest.raises(ObjectChangedError):
        target.make().get_range("v", 0, 4, if_match=first.etag)
    store.delete("v")
    with pytest.raises((NotFoundBackendError, ObjectChangedError)):
        target.make().get_range("v", 0, 4, if_match=first.etag)


def test_copy_with_and_without_new_metadata(target: Target) -> None:
    store = target.store
    data = _payload(300 * KiB)
    store.put_object("src", data, META, _crc(data))
    store.copy("src", "same")
    same = store.head("same")
    assert same is not None and (same.mtime_ns, same.mode, same.checksum) == (META.mtime_ns, META.mode, _crc(data))
    new = ObjectMeta(1_600_000_000_000_000_001, 0o600)
    store.copy("src", "dir/renamed", new, "crc32:feedbeef")
    info = store.head("dir/renamed")
    assert info is not None and (info.size, info.mtime_ns, info.mode, info.checksum) == (
        len(data), new.mtime_ns, new.mode, "crc32:feedbeef")
    assert _read_all(store, "dir/renamed") == data
    with pytest.raises(NotFoundBackendError):
        store.copy("nothing-here", "dst")


def test_set_meta_rewrites_mode_and_mtime_only(target: Target) -> None:
    store = target.store
    store.put_object("f", b"data", META, _crc(b"data"))
    store.put_symlink("l", "f", META)
    store.put_dir("d/", META)
    new = ObjectMeta(1_650_000_000_500_000_000, 0o600)
    for key in ("f", "l", "d/"):
        store.set_meta(key, new)
    f, link, d = store.head("f"), store.head("l"), store.head("d/")
    assert f is not None and (f.mtime_ns, f.mode, f.checksum, f.size) == (new.mtime_ns, 0o600, _crc(b"data"), 4)
    assert link is not None and (link.kind, link.target, link.mtime_ns) == (SYMLINK, "f", new.mtime_ns)
    assert d is not None and (d.kind, d.mode, d.mtime_ns) == (DIR, 0o600, new.mtime_ns)
    assert _read_all(store, "f") == b"data"
    with pytest.raises(NotFoundBackendError):
        store.set_meta("missing", new)


def test_directories_symlinks_and_listings_hide_bookkeeping(target: Target) -> None:
    store = target.store
    store.put_dir("ckpt/", META)
    store.put_object("ckpt/a.pt", b"aa", META, _crc(b"aa"))
    store.put_object("ckpt/sub/b.pt", b"bbb", META, _crc(b"bbb"))
    store.put_symlink("ckpt/latest", "sub/b.pt ü%", META)
    store.put_object("top", b"t", META, _crc(b"t"))
    pending, _ = _stage(store, "ckpt/pending", _payload(64 * KiB), 64 * KiB)  # bookkeeping exists meanwhile
    spill = f"{TEMP_PREFIX}spill.a.00"
    up, parts = _stage(store, spill, b"x" * 10, 64 * KiB, meta=None, checksum=None)
    store.complete_upload(up, parts, 10, None)

    root = store.list_dir("")
    assert [e.key for e in root.entries] == ["top"] and root.subdirs == ["ckpt"] and not root.marker
    ckpt = store.list_dir("ckpt/")
    assert ckpt.marker and ckpt.subdirs == ["sub"]
    kinds = {e.key: (e.kind, e.size, e.target, e.mtime_ns, e.mode) for e in ckpt.entries}
    assert kinds == {
        "ckpt/a.pt": (FILE, 2, None, META.mtime_ns, META.mode),
        "ckpt/latest": (SYMLINK, 0, "sub/b.pt ü%", META.mtime_ns, 0o777),
    }
    everything = {i.key: i.kind for i in store.list()}
    assert everything == {"ckpt/": DIR, "ckpt/a.pt": FILE, "ckpt/sub/b.pt": FILE, "ckpt/latest": SYMLINK,
                          "top": FILE}
    assert {i.key for i in store.list("ckpt/sub")} == {"ckpt/sub/b.pt"}
    assert store.list_dir("nothing/").entries == []
    store.abort_upload(pending)
    for key in ("ckpt/a.pt", "ckpt/sub/b.pt", "ckpt/latest", "ckpt/", "top", spill):
        store.delete(key)
    store.delete("never-was")
    assert list(store.list()) == []


def test_a_store_on_the_whole_bucket(target: Target) -> None:
    store = target.make(prefix="")
    store.put_object("rootfile", b"r", META, _crc(b"r"))
    assert [i.key for i in store.list()] == ["rootfile"]
    assert store.url.count("/") == 2 and not store.url.endswith("/")


# -- server-side verification -----------------------------------------------------------------------------


def test_gcs_server_rejects_a_part_with_a_wrong_crc32c(fake_gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfs.backends.gcswire as gcswire

    store = _gcs_target(fake_gcs).store
    upload = store.open_upload("k", META, "")
    monkeypatch.setattr(gcswire, "_crc32c_b64", lambda data: "AAAAAA==")  # what a flipped bit on the wire looks like
    # GCS rejects the request; the emulators store the object and answer their own CRC32C, which
    # put_part compares with the one it sent.
    with pytest.raises(TransientBackendError):
        store.put_part(upload, 1, 0, b"some bytes", zlib.crc32(b"some bytes"))


def test_azure_server_rejects_a_block_with_a_wrong_md5(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_part sends the block's MD5 (validate_content); the server refuses bytes that do not match it."""
    import base64
    import hashlib

    from azure.core.exceptions import HttpResponseError

    from ckptfs.backends.azure import AzureBlobStore
    from ckptfs.backends.azureerrors import translate_error

    store = _azure_target(azurite, monkeypatch).store
    assert isinstance(store, AzureBlobStore)
    upload = store.open_upload("k", META, "")
    wrong = base64.b64encode(hashlib.md5(b"other bytes").digest()).decode()
    with pytest.raises(HttpResponseError, match="MD5") as caught:
        store.wire.blob(store.wire.full("k")).stage_block(store._block_id(upload, 1), b"some bytes",
                                                  headers={"Content-MD5": wrong})
    # Azure answers Md5Mismatch (transient: the bytes were damaged on the way); Azurite InvalidOperation.
    assert caught.value.status_code == 400
    assert isinstance(translate_error(caught.value, "put"), BackendError)
    store.put_part(upload, 1, 0, b"some bytes", zlib.crc32(b"some bytes"))  # the right MD5 passes


# -- check() -----------------------------------------------------------------------------------------------


def test_check_accepts_a_usable_store(target: Target) -> None:
    target.store.check()


def test_gcs_check_names_the_problem_and_the_fix(fake_gcs: GcsServer, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Any) -> None:
    from ckptfs.backends.gcs import GcsStore

    with pytest.raises(CkptfsError, match=r"bucket 'no-such-bucket' does not exist.*gcloud storage buckets create"):
        GcsStore("no-such-bucket", endpoint_url=fake_gcs.endpoint).check()
    (port,) = free_ports(1)
    with pytest.raises(CkptfsError, match=f"cannot reach http://127.0.0.1:{port} .*--endpoint-url"):
        GcsStore("b", endpoint_url=f"http://127.0.0.1:{port}").check()
    # No credentials: ADC finds no key file (and must not look for a metadata server off this machine).
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    with pytest.raises(CkptfsError, match=r"no Google credentials found.*GOOGLE_APPLICATION_CREDENTIALS"):
        GcsStore("b", endpoint_url=f"https://127.0.0.1:{port}").check()


def test_gcs_emulator_host_is_the_standard_way(fake_gcs: GcsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = fake_gcs.new_bucket()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.endpoint)
    store = open_store(f"gs://{bucket}/p")
    store.check()
    store.put_object("x", b"1", META, _crc(b"1"))
    assert store.head("x") is not None


def test_azure_check_names_the_problem_and_the_fix(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfs.backends.azure import AzureBlobStore

    _azure_target(azurite, monkeypatch)
    with pytest.raises(CkptfsError, match=r"container 'nope' does not exist.*az storage container create"):
        AzureBlobStore("nope").check()
    wrong = azurite.connection_string.replace("AccountKey=Eby8", "AccountKey=AAAA")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    with pytest.raises(CkptfsError, match=r"(rejected|denied).*AZURE_STORAGE_CONNECTION_STRING") as caught:
        AzureBlobStore("nope").check()
    assert "AAAA" not in str(caught.value)
    (port,) = free_ports(1)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string)
    with pytest.raises(CkptfsError, match=f"cannot reach http://127.0.0.1:{port}/x"):
        AzureBlobStore("c", endpoint_url=f"http://127.0.0.1:{port}/x").check()
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    with pytest.raises(CkptfsError, match=r"no Azure storage account.*AZURE_STORAGE_ACCOUNT"):
        AzureBlobStore("c").check()


def test_azure_account_and_key_from_the_environment(azurite: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from emulators import AZURITE_ACCOUNT, AZURITE_KEY

    container = _azure_target(azurite, monkeypatch).store.container  # type: ignore[attr-defined]
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    store = open_store(f"az://{container}/p", endpoint_url=azurite.endpoint)
    store.check()
    store.put_object("x", b"1", META, _crc(b"1"))
    assert AZURITE_KEY not in repr(store) and AZURITE_KEY not in store.url


# -- URLs and error tables (no server) ---------------------------------------------------------------------


def test_open_store_maps_gs_and_az_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfs.backends.azure import AzureBlobStore
    from ckptfs.backends.gcs import GcsStore

    gs = open_store("gs://bucket/run/42/")
    assert isinstance(gs, GcsStore) and (gs.url, gs.prefix) == ("gs://bucket/run/42", "run/42/")
    az = open_store("az://container", endpoint_url="http://127.0.0.1:1/acct")
    assert isinstance(az, AzureBlobStore) and (az.url, az.prefix) == ("az://container", "")
    for bad in ("gs://", "az://", "gs://user:secret@bucket/p", "az://key@container", "gs://bucket:443/p"):
        with pytest.raises(UsageError):
            open_store(bad)


def _gcs_errors() -> Iterator[tuple[BaseException, type[BackendError]]]:
    import google.api_core.exceptions as gexc
    import google.auth.exceptions
    import requests

    for status, cls in [(400, PermanentBackendError), (401, AuthBackendError), (403, AuthBackendError),
                        (404, NotFoundBackendError), (408, TransientBackendError), (409, TransientBackendError),
                        (412, TransientBackendError), (416, PermanentBackendError), (429, TransientBackendError),
                        (500, TransientBackendError), (502, TransientBackendError), (503, TransientBackendError),
                        (504, TransientBackendError), (507, TransientBackendError), (418, PermanentBackendError)]:
        yield gexc.from_http_status(status, "x"), cls
    yield requests.exceptions.ConnectionError("reset by peer"), TransientBackendError
    yield requests.exceptions.ReadTimeout("timed out"), TransientBackendError
    yield ConnectionResetError(104, "reset"), TransientBackendError
    yield google.auth.exceptions.DefaultCredentialsError("none"), AuthBackendError
    yield google.auth.exceptions.RefreshError("invalid_grant"), AuthBackendError
    yield google.auth.exceptions.TransportError("metadata server"), TransientBackendError


def _azure_errors() -> Iterator[tuple[BaseException, type[BackendError]]]:
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ResourceModifiedError,
        ResourceNotFoundError,
        ServiceRequestError,
        ServiceResponseError,
    )

    def http(cls: type[HttpResponseError], status: int, code: str) -> HttpResponseError:
        exc = cls(message=code)
        exc.status_code = status
        exc.error_code = code  # type: ignore[attr-defined]
        return exc

    for status, code, expected in [
        (404, "BlobNotFound", NotFoundBackendError), (404, "ContainerNotFound", PermanentBackendError),
        (403, "AuthenticationFailed", AuthBackendError), (403, "AuthorizationPermissionMismatch", AuthBackendError),
        (412, "ConditionNotMet", TransientBackendError), (409, "LeaseIdMissing", TransientBackendError),
        (409, "SomethingNew", TransientBackendError), (429, "", TransientBackendError),
        (500, "InternalError", TransientBackendError), (503, "ServerBusy", TransientBackendError),
        (500, "OperationTimedOut", TransientBackendError), (400, "Md5Mismatch", TransientBackendError),
        (400, "InvalidBlockList", PermanentBackendError), (400, "", PermanentBackendError),
        (401, "", AuthBackendError), (404, "", NotFoundBackendError),
    ]:
        yield http(HttpResponseError, status, code), expected
    yield http(ResourceNotFoundError, 404, "BlobNotFound"), NotFoundBackendError
    yield http(ResourceModifiedError, 412, "ConditionNotMet"), TransientBackendError
    yield ClientAuthenticationError(message="DefaultAzureCredential failed"), AuthBackendError
    yield ServiceRequestError("connection refused"), TransientBackendError
    yield ServiceResponseError("connection reset"), TransientBackendError
    yield TimeoutError("timed out"), TransientBackendError


@pytest.mark.parametrize("sdk", ["gcs", "azure"])
def test_error_mapping(sdk: str) -> None:
    if sdk == "gcs":
        from ckptfs.backends.gcserrors import translate_error

        cases = list(_gcs_errors())
    else:
        from ckptfs.backends.azureerrors import translate_error  # type: ignore[assignment]

        cases = list(_azure_errors())
    for error, expected in cases:
        got = translate_error(error, "op")
        assert type(got) is expected, (error, got)
        assert str(got).startswith("op: ")


def test_error_tables_are_consistent() -> None:
    from ckptfs.backends.azureerrors import ERROR_CODES
    from ckptfs.backends.gcserrors import STATUS_ERRORS

    for table in (ERROR_CODES, STATUS_ERRORS):
        assert set(table.values()) <= {TransientBackendError, PermanentBackendError, AuthBackendError,
                                       NotFoundBackendError}


def test_no_credential_in_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfs.backends.azure import AzureBlobStore

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       "DefaultEndpointsProtocol=http;AccountName=acct;AccountKey=U0VDUkVU;"
                       f"BlobEndpoint=http://127.0.0.1:{free_ports(1)[0]}/acct;")
    store = AzureBlobStore("c")
    with pytest.raises(CkptfsError) as caught:
        store.check()
    assert "U0VDUkVU" not in str(caught.value) and "U0VDUkVU" not in repr(store)
    assert os.environ["AZURE_STORAGE_CONNECTION_STRING"]  # untouched


def test_azure_errors_never_carry_a_sas_or_key() -> None:
    from azure.core.exceptions import ServiceRequestError

    from ckptfs.backends.azureerrors import translate_error

    url = "https://acct.blob.core.windows.net/c/k?sv=2024-01-01&sp=racwdl&sig=c2VjcmV0c2lnbmF0dXJl%3D&se=2030"
    got = translate_error(ServiceRequestError(f"Max retries exceeded with url: {url}"), "op")
    assert "c2VjcmV0" not in str(got) and "sig=REDACTED" in str(got) and "sp=racwdl" in str(got)
    got = translate_error(ValueError("bad AccountKey=U0VDUkVU;"), "op")
    assert "U0VDUkVU" not in str(got)


def test_check_messages_for_denied_access() -> None:
    """Neither emulator has IAM: the messages for a 403 are checked on the translated errors themselves."""
    import google.api_core.exceptions as gexc
    from azure.core.exceptions import HttpResponseError

    from ckptfs.backends import azureerrors, gcserrors

    def raised(translate: Callable[[BaseException, str], BackendError], exc: BaseException) -> BackendError:
        error = translate(exc, "list")
        error.__cause__ = exc  # as `raise ... from` in the store does
        return error

    where = {"url": "gs://b/p", "bucket": "b", "endpoint_url": "http://127.0.0.1:1"}
    message = gcserrors.check_message(raised(gcserrors.translate_error, gexc.Forbidden("no storage.objects.list")),
                                      **where)
    assert "access denied" in message and "roles/storage.object" in message
    message = gcserrors.check_message(raised(gcserrors.translate_error, gexc.Unauthorized("bad token")), **where)
    assert "rejected" in message and "gcloud auth application-default login" in message
    denied = HttpResponseError(message="denied")
    denied.status_code = 403
    denied.error_code = "AuthorizationPermissionMismatch"  # type: ignore[attr-defined]
    message = azureerrors.check_message(raised(azureerrors.translate_error, denied), url="az://c",
                                        container="c", endpoint_url="http://127.0.0.1:1/a", credential_source="")
    assert "access denied (AuthorizationPermissionMismatch)" in message and "Storage Blob Data Contributor" in message
