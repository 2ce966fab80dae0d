"""Lazy listing through real mounts: a fresh node lists a big directory of an S3 bucket (SeaweedFS) in
seconds, objects written behind the mount's back appear after refresh_interval or `ckptfs refresh` (the
kernel's caches included), replaced objects are read anew, keys that cannot be paths warn once each, and
which directories were listed survives a restart."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator

import pyfuse3
import pytest
from conftest import Mount, fuse_requests
from emulators import S3Server, free_ports, moto_s3, s3_bucket, seaweedfs_s3  # noqa: F401

PREFIX = "run-1/"


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


def _s3_mount(mount_factory, server: S3Server, bucket: str, *extra: str, name: str = "m") -> Mount:  # type: ignore[no-untyped-def]
    return mount_factory(  # type: ignore[no-any-return]
        name, source=f"s3://{bucket}/{PREFIX}", extra_args=("--endpoint-url", server.endpoint, *extra)
    )


def _requests_after(mount: Mount, port: int) -> dict[str, float]:
    """The request counts once they include everything done before this call: a statfs marks the point
    (the metrics are published every second)."""
    marker = fuse_requests(port).get("statfs", 0)
    os.statvfs(mount.mnt)
    deadline = time.monotonic() + 30
    while (counts := fuse_requests(port)).get("statfs", 0) <= marker:
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)
    return counts


def _warnings(mount: Mount, word: str) -> list[str]:
    return [line for line in mount.log.read_text(errors="replace").splitlines() if " WARNING " in line and word in line]


def test_fresh_node_lists_thousands_of_files_in_seconds(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    # Four pages of the store's listing (1000 keys each), the last one partial: what a bigger directory adds is
    # more of the same pages (10,000 files cost this test 54 CPU-seconds, mostly the emulator's puts).
    files = 3_500
    # Another node's objects: put_many, not boto3, whose client CPU for thousands of puts was most of this test's.
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
    assert listed < 20, listed  # 1.5-3 s measured on SeaweedFS here for 10 pages of 1000
    assert os.stat(m.mnt / "many" / f"file_{files - 1:05d}").st_size == 16


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


def test_the_kernel_keeps_names_and_listings_until_they_change(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A directory listed again, and its files looked up again, are answered by the kernel (entries kept
    while the listing is fresh; the listing itself with FOPEN_CACHE_DIR where pyfuse3 can ask for it).
    Both are dropped when the directory changes here (a create through the mount) or behind the kernel's
    back: another node's new file and delete, seen at once after `ckptfs refresh`."""
    [port] = free_ports(1)
    m: Mount = mount_factory(extra_args=("--refresh-interval", "3600", "--metrics-addr", f"127.0.0.1:{port}"))
    (m.mnt / "d").mkdir()
    names = [f"f{i:03d}" for i in range(300)]
    for name in names:
        (m.mnt / "d" / name).write_bytes(b"x")
    m.flush()

    def walk() -> list[str]:
        listing = sorted(os.listdir(m.mnt / "d"))
        for name in listing:
            os.lstat(m.mnt / "d" / name)
        return listing

    assert walk() == names
    before = _requests_after(m, port)
    assert walk() == names
    after = _requests_after(m, port)
    # None of the 300 names is looked up again. One lookup more was seen once in CI under load (not found
    # out which name: the directory's own entry is the likely one, as with getattr below): tolerated.
    assert after.get("lookup", 0) <= before.get("lookup", 0) + 1
    assert after.get("getattr", 0) <= before.get("getattr", 0) + 2  # the directory's own, at most
    if hasattr(pyfuse3.FileInfo(), "cache_readdir"):  # else every listing is read from the daemon
        assert after.get("readdir", 0) == before.get("readdir", 0)
    (m.mnt / "d" / "mine").write_bytes(b"y")  # through the kernel: it drops its listing itself
    assert walk() == sorted([*names, "mine"])
    (m.store / "d" / "theirs").write_bytes(b"z")  # another node's new file, and its delete of f000
    (m.store / "d" / "f000").unlink()
    assert walk() == sorted([*names, "mine"])  # listed an hour ago as far as the mount knows
    assert m.cli("refresh", str(m.mnt)).returncode == 0
    assert walk() == sorted([*names[1:], "mine", "theirs"])
    with pytest.raises(FileNotFoundError):
        os.lstat(m.mnt / "d" / "f000")


def test_a_file_whose_object_vanished_leaves_the_kernels_listing_too(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A file known only from the store (no local copy) whose object vanished, found so by the drain (here:
    rewriting its metadata after a chmod): the daemon removes it, and the kernel drops its name and with it
    the listing it keeps of the directory (which it would otherwise show for an hour: --refresh-interval)."""
    m: Mount = mount_factory(start=False, extra_args=("--refresh-interval", "3600"))
    (m.store / "d").mkdir()
    for name in ("kept", "lost"):
        (m.store / "d" / name).write_bytes(b"x")
    m.allowed_log_words += ["vanished from the store"]
    m.start()
    assert sorted(os.listdir(m.mnt / "d")) == ["kept", "lost"]
    (m.store / "d" / "lost").unlink()
    os.chmod(m.mnt / "d" / "lost", 0o600)
    deadline = time.monotonic() + 30
    while "vanished from the store" not in m.log.read_text() or os.listdir(m.mnt / "d") != ["kept"]:
        assert time.monotonic() < deadline, f"listed after its object vanished: {os.listdir(m.mnt / 'd')}"
        time.sleep(0.05)
    with pytest.raises(FileNotFoundError):
        os.lstat(m.mnt / "d" / "lost")


def test_a_name_is_kept_no_longer_than_its_directory_listing(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The kernel keeps a name only while its directory's listing is fresh: a file another node replaced
    or deleted is seen refresh_interval after the listing without `ckptfs refresh`, through names the
    kernel held."""
    m: Mount = mount_factory(extra_args=("--refresh-interval", "2"))
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "gone").write_bytes(b"1")
    (m.mnt / "d" / "replaced").write_bytes(b"1")
    m.flush()
    assert os.stat(m.mnt / "d" / "gone").st_size == 1
    assert os.stat(m.mnt / "d" / "replaced").st_size == 1
    (m.store / "d" / "gone").unlink()
    (m.store / "d" / "replaced").write_bytes(b"22")
    deadline = time.monotonic() + 30
    while (m.mnt / "d" / "gone").exists() or os.stat(m.mnt / "d" / "replaced").st_size != 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (m.mnt / "d" / "replaced").read_bytes() == b"22"
