"""The stores the contract suites run against, one `target` fixture for all of them: LocalStore, S3Store on
two real S3 servers on 127.0.0.1 (SeaweedFS and moto), GcsStore on fake-gcs-server and AzureBlobStore on
Azurite (all started by tests/emulators.py). Small
parts keep them fast: 5 MiB (S3's minimum), so a 12 MiB file is a three-part upload with a short tail.

Also sync helpers that move whole files through the transfer engine, for tests of the other primitives."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import trio
from emulators import AzuriteServer, GcsServer, S3Server, s3_bucket

from ckptfs.backends.base import TEMP_PREFIX, ObjectMeta, ObjectStore
from ckptfs.backends.local import LocalStore
from ckptfs.backends.s3 import S3Store
from ckptfs.checksums import combine_crcs, crc_text
from ckptfs.transfer import Transfers

MiB = 1 << 20
PART = 5 * MiB
BIG = 12 * MiB + 12345  # three parts: 5 + 5 + 2 MiB and a bit
META = ObjectMeta(mtime_ns=1_700_000_000_123_456_789, mode=0o640)
BACKENDS = ["local", "seaweedfs", "moto", "fake-gcs", "azurite"]


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

    @property
    def is_object_store(self) -> bool:
        """An object store (S3, GCS, Azure): resumes staged uploads and refuses reserved names itself."""
        return self.name != "local"


def local_target(root: Path) -> Target:
    root.mkdir()

    def make(owner: str = "a", **_: Any) -> ObjectStore:
        return LocalStore(root, owner=owner)

    def leftovers() -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if TEMP_PREFIX in str(p) and not p.is_dir())

    return Target("local", make(), make, leftovers)


_s3_session: boto3.session.Session | None = None


def shared_s3_session() -> boto3.session.Session:
    """One boto3 session for the contract suites' S3Stores in this process (S3Store's `session`): a store made
    with a session of its own costs a quarter of a CPU-second, most of it loading botocore's S3 model again.
    Every S3 target uses the emulators' credentials, which the session keeps once resolved."""
    global _s3_session
    if _s3_session is None:
        _s3_session = boto3.session.Session()
    return _s3_session


def s3_target_on(name: str, server: S3Server, bucket: str, prefix: str = "run/42") -> Target:
    def make(owner: str = "a", **kwargs: Any) -> ObjectStore:
        return S3Store(bucket, prefix, endpoint_url=server.endpoint, owner=owner, session=shared_s3_session(),
                       **kwargs)

    raw = server.client()

    def leftovers() -> list[str]:
        found = []
        for page in raw.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            found += [o["Key"] for o in page.get("Contents", []) if TEMP_PREFIX in o["Key"]]
        for page in raw.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            found += [f"upload:{u['Key']}" for u in page.get("Uploads", [])]
        return sorted(found)

    return Target(name, make(), make, leftovers, server, bucket)


def gcs_target_on(server: GcsServer, prefix: str = "run/42") -> Target:
    from ckptfs.backends.gcs import GcsStore

    bucket = server.new_bucket()

    def make(owner: str = "a", **kwargs: Any) -> ObjectStore:
        return GcsStore(bucket, prefix, endpoint_url=server.endpoint, owner=owner, **kwargs)

    raw = server.client()

    def leftovers() -> list[str]:
        return sorted(b.name for b in raw.list_blobs(bucket) if TEMP_PREFIX in b.name)

    return Target(server.name, make(), make, leftovers, bucket=bucket)


def azure_target_on(server: AzuriteServer, monkeypatch: pytest.MonkeyPatch, prefix: str = "run/42") -> Target:
    """Uncommitted blocks of an aborted upload stay on their blob until Azure collects them (a week), and
    no API removes them: leftovers() reports what ckptfs can remove, the marker blobs."""
    from ckptfs.backends.azure import AzureBlobStore

    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string)
    container = server.new_container()

    def make(owner: str = "a", **kwargs: Any) -> ObjectStore:
        return AzureBlobStore(container, prefix, owner=owner, **kwargs)

    raw = server.service().get_container_client(container)

    def leftovers() -> list[str]:
        return sorted(b.name for b in raw.list_blobs() if TEMP_PREFIX in b.name)

    return Target("azurite", make(), make, leftovers, bucket=container)


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    if request.param == "local":
        yield local_target(tmp_path / "store")
        return
    if request.param == "fake-gcs":
        yield gcs_target_on(request.getfixturevalue("fake_gcs"))
        return
    if request.param == "azurite":
        yield azure_target_on(request.getfixturevalue("azurite"), request.getfixturevalue("monkeypatch"))
        return
    server: S3Server = request.getfixturevalue(f"{request.param}_s3")
    with s3_bucket(server) as bucket:
        yield s3_target_on(request.param, server, bucket)


@pytest.fixture(params=["seaweedfs", "moto"])
def s3_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    server: S3Server = request.getfixturevalue(f"{request.param}_s3")
    with s3_bucket(server) as bucket:
        yield s3_target_on(request.param, server, bucket)


def engine(store: ObjectStore, **kwargs: Any) -> Transfers:
    """The transfer engine with the suite's small parts."""
    options: dict[str, Any] = dict(part_size=PART, multipart_threshold=PART, parts_in_flight=3,
                                   download_part_size=PART, memory_budget=64 * MiB)
    options.update(kwargs)
    return Transfers(store, **options)


def write(path: Path, size: int, seed: int = 1) -> bytes:
    data = (seed.to_bytes(4, "big") + os.urandom(61)) * (size // 65) + os.urandom(size % 65)
    data = data[:size]
    path.write_bytes(data)
    return data


def put(store: ObjectStore, key: str, src: Path, meta: ObjectMeta = META) -> str:
    """Upload a whole file through the engine (from sync test code); return its checksum."""

    async def run() -> str:
        transfers = engine(store)
        staged = await transfers.stage_upload(key, str(src), meta)
        await transfers.commit_upload(staged)
        return staged.checksum

    return trio.run(run)


def download(store: ObjectStore, key: str, tmp_path: Path) -> tuple[bytes, str]:
    """fetch(), from sync test code."""
    return trio.run(fetch, store, key, tmp_path)


async def fetch(store: ObjectStore, key: str, tmp_path: Path) -> tuple[bytes, str]:
    """The whole object, read range by range through the engine (fetch_range, pinned to the version of the
    first range) and checked against the checksum in its metadata: its bytes and their checksum."""
    transfers = engine(store)
    dst = tmp_path / f"dl-{os.urandom(4).hex()}"
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        first = await transfers.fetch_range(key, fd, 0, PART)
        pieces = [(first.crc, first.length)]
        offset = first.length
        while pieces[-1][1] > 0 and offset < first.size:
            got = await transfers.fetch_range(key, fd, offset, PART, if_match=first.etag)
            pieces.append((got.crc, got.length))
            offset += got.length
    finally:
        os.close(fd)
    checksum = crc_text(combine_crcs(pieces))
    assert offset == first.size, f"{key}: read {offset} of {first.size} bytes"
    if first.checksum is not None and first.checksum.startswith("crc32:"):
        assert first.checksum == checksum, f"{key}: the bytes read have {checksum}, the object says {first.checksum}"
    return dst.read_bytes(), checksum
