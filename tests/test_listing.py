"""Lazy listing through real mounts: a fresh node lists a big directory of an S3 bucket (SeaweedFS) in
seconds, objects written behind the mount's back appear after refresh_interval or `ckptfs refresh` (the
kernel's caches included), replaced objects are read anew, keys that cannot be paths warn once each, and
which directories were listed survives a restart."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator

import pytest
from conftest import Mount
from emulators import S3Server, moto_s3, s3_bucket, seaweedfs_s3  # noqa: F401

PREFIX = "run-1/"


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


def _s3_mount(mount_factory, server: S3Server, bucket: str, *extra: str, name: str = "m") -> Mount:  # type: ignore[no-untyped-def]
    return mount_factory(  # type: ignore[no-any-return]
        name, source=f"s3://{bucket}/{PREFIX}", extra_args=("--endpoint-url", server.endpoint, *extra)
    )


def _warnings(mount: Mount, word: str) -> list[str]:
    return [line for line in mount.log.read_text(errors="replace").splitlines() if " WARNING " in line and word in line]


def test_fresh_node_lists_10000_files_in_seconds(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    files = 10_000
    # Another node's objects: put_many, not boto3, whose client CPU for 10,000 puts was most of this test's.
    seaweedfs_s3.put_many(bucket, {f"{PREFIX}many/file_{i:05d}": b"x" * 16 for i in range(files)})
    seaweedfs_s3.client().put_object(Bucket=bucket, Key=f"{PREFIX}step_1/model.pt", Body=b"weights")
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket)
    # Reaching a file in another directory lists only the directories on its path, not the big one.
    started = time.monotonic()
    assert (m.mnt / "step_1" / "model.pt").read_bytes() == b"weights"
    first_file = time.monotonic() - started
    started = time.monotonic()
    names = os.listdir(m.mnt / "many")
    listed = time.monotonic() - started
    assert len(names) == files
    started = time.monotonic()
    assert len(os.listdir(m.mnt / "many")) == files  # listed already: from the journal
    again = time.monotonic() - started
    print(f"first file {first_file:.2f}s; first listing of {files} files {listed:.2f}s; again {again:.2f}s")
    assert first_file < 5
    assert listed < 20, listed  # 1.5-3 s measured on SeaweedFS here (10 pages of 1000)
    assert os.stat(m.mnt / "many" / "file_09999").st_size == 16


def test_objects_of_others_appear_after_refresh_interval(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    client = seaweedfs_s3.client()
    client.put_object(Bucket=bucket, Key=f"{PREFIX}ckpt/a", Body=b"a")
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket, "--refresh-interval", "2")
    assert os.listdir(m.mnt / "ckpt") == ["a"]
    # A failed lookup must not be cached by the kernel past the relisting.
    with pytest.raises(FileNotFoundError):
        os.stat(m.mnt / "ckpt" / "b")
    client.put_object(Bucket=bucket, Key=f"{PREFIX}ckpt/b", Body=b"bb")
    client.delete_object(Bucket=bucket, Key=f"{PREFIX}ckpt/a")
    started = time.monotonic()
    while not (m.mnt / "ckpt" / "b").exists():
        assert time.monotonic() - started < 10, "a new object did not appear within refresh_interval"
        time.sleep(0.2)
    assert (m.mnt / "ckpt" / "b").read_bytes() == b"bb"
    deadline = time.monotonic() + 5
    while "a" in os.listdir(m.mnt / "ckpt"):
        assert time.monotonic() < deadline, "a deleted object stayed"
        time.sleep(0.2)


def test_refresh_shows_new_and_replaced_objects_at_once(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    client = seaweedfs_s3.client()
    client.put_object(Bucket=bucket, Key=f"{PREFIX}latest", Body=b"step_1")
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket, "--refresh-interval", "3600")
    # Read once: the cache file and the kernel's page cache hold the old bytes.
    assert (m.mnt / "latest").read_bytes() == b"step_1"
    assert (m.mnt / "latest").read_bytes() == b"step_1"
    with pytest.raises(FileNotFoundError):
        os.stat(m.mnt / "step_2")
    client.put_object(Bucket=bucket, Key=f"{PREFIX}step_2/model.pt", Body=b"w2")
    client.put_object(Bucket=bucket, Key=f"{PREFIX}latest", Body=b"step_2!")  # another node replaced it
    assert not (m.mnt / "step_2").exists()  # listed an hour ago as far as the mount knows
    assert m.cli("refresh", str(m.mnt)).returncode == 0
    assert (m.mnt / "step_2" / "model.pt").read_bytes() == b"w2"
    assert (m.mnt / "latest").read_bytes() == b"step_2!"


def test_keys_that_cannot_be_paths_warn_once_each(mount_factory, moto_s3: S3Server) -> None:  # type: ignore[no-untyped-def]
    # moto keeps any key (SeaweedFS refuses '.' and '..' components and normalises '//').
    client = moto_s3.client()
    bad = [f"{PREFIX}d/../escape", f"{PREFIX}d/" + "n" * 300, f"{PREFIX}d/./dot", f"{PREFIX}d//double"]
    with s3_bucket(moto_s3) as bucket:
        for key in [*bad, f"{PREFIX}d/good"]:
            client.put_object(Bucket=bucket, Key=key, Body=b"x")
        _check_warn_once(mount_factory, moto_s3, bucket, len(bad))


def _check_warn_once(mount_factory, server: S3Server, bucket: str, bad: int) -> None:  # type: ignore[no-untyped-def]
    m = _s3_mount(mount_factory, server, bucket, "--refresh-interval", "3600")
    m.allowed_log_words.append("skipping store key")
    for _ in range(3):
        assert os.listdir(m.mnt / "d") == ["good"]
        assert m.cli("refresh", str(m.mnt)).returncode == 0
    lines = _warnings(m, "skipping store key")
    assert len(lines) == bad, lines


def test_non_utf8_names_in_a_file_store_are_skipped(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(start=False)
    (m.store / "d").mkdir()
    (m.store / "d" / "good").write_bytes(b"ok")
    with open(os.path.join(os.fsencode(m.store / "d"), b"bad\xff"), "wb") as f:
        f.write(b"x")
    m.allowed_log_words.append("skipping store key")
    m.start()
    for _ in range(2):
        assert os.listdir(m.mnt / "d") == ["good"]
        assert (m.mnt / "d" / "good").read_bytes() == b"ok"
        assert m.cli("refresh", str(m.mnt)).returncode == 0
    assert len(_warnings(m, "skipping store key")) == 1


def test_listed_directories_survive_a_restart(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(extra_args=("--refresh-interval", "3600"))
    (m.mnt / "ckpt").mkdir()
    (m.mnt / "ckpt" / "mine").write_bytes(b"1")
    m.flush()
    assert os.listdir(m.mnt / "ckpt") == ["mine"]
    m.umount()
    # Written behind the mount's back while it was down: within refresh_interval of the last listing the
    # restarted mount serves its journal and does not list again; refresh does.
    (m.store / "ckpt" / "theirs").write_bytes(b"2")
    m.start()
    assert os.listdir(m.mnt / "ckpt") == ["mine"]
    assert m.cli("refresh", str(m.mnt)).returncode == 0
    assert sorted(os.listdir(m.mnt / "ckpt")) == ["mine", "theirs"]


def test_listing_after_refresh_interval_on_restart(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(extra_args=("--refresh-interval", "1"))
    (m.mnt / "ckpt").mkdir()
    m.flush()
    assert os.listdir(m.mnt / "ckpt") == []
    m.umount()
    (m.store / "ckpt" / "theirs").write_bytes(b"2")
    time.sleep(1.2)
    m.start()
    assert os.listdir(m.mnt / "ckpt") == ["theirs"]
    with pytest.raises(OSError) as exc:
        os.stat(m.mnt / "ckpt" / "missing")
    assert exc.value.errno == errno.ENOENT



def test_shared_bucket_keys_no_file_system_can_hold(mount_factory, moto_s3: S3Server) -> None:  # type: ignore[no-untyped-def]
    """Keys another tool wrote into the shared bucket: a leading '/' below the prefix, '..' at the top, an
    empty component deeper down, a name over 255 bytes (but under 255 characters), and a key that is both a
    file and a directory prefix. None escapes the mount or breaks a listing; each warns once."""
    client = moto_s3.client()
    bad_keys = [
        f"{PREFIX}/absolute",
        f"{PREFIX}../escape",
        f"{PREFIX}d/sub//deep",
        f"{PREFIX}d/" + "é" * 200,
    ]
    with s3_bucket(moto_s3) as bucket:
        for key in [*bad_keys, f"{PREFIX}d/good", f"{PREFIX}d/x", f"{PREFIX}d/x/y", f"{PREFIX}d/sub/ok"]:
            client.put_object(Bucket=bucket, Key=key, Body=b"x")
        m = _s3_mount(mount_factory, moto_s3, bucket, "--refresh-interval", "3600")
        m.allowed_log_words += ["skipping store key", "skipping store directory"]
        for _ in range(3):
            assert os.listdir(m.mnt) == ["d"]
            assert sorted(os.listdir(m.mnt / "d")) == ["good", "sub", "x"]
            assert (m.mnt / "d" / "x").read_bytes() == b"x"  # the file wins; x/ is skipped
            assert os.listdir(m.mnt / "d" / "sub") == ["ok"]
            assert m.cli("refresh", str(m.mnt)).returncode == 0
        warned = _warnings(m, "skipping store")
        assert len(warned) == len(bad_keys) + 1, warned
        assert len(_warnings(m, "d/x/")) == 1
        # Nothing reached outside the mount or its cache.
        assert not (m.root / "escape").exists() and not (m.mnt.parent / "escape").exists()
