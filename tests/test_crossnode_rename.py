"""A directory renamed on one node carries every node's files (issue 46): Orbax's multi-host save writes
into `<step>.orbax-checkpoint-tmp-<ts>/` from every host, a barrier follows, then the primary host renames
the directory to `<step>`. A directory this node made counted as fully listed here, so its rename moved only
what this node knew, and the other host's shard stayed under the old name in the store for good."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount
from emulators import seaweedfs_s3  # noqa: F401
from fsharness import GID, UID, make_stack
from test_crossnode_fuse import _store_view
from waiting import wait_until

from ckptfs.errors import FsError, TransientBackendError, errno_for_backend_error
from ckptfs.journal import ROOT_ID

TMP = "step_1.orbax-checkpoint-tmp-1700000000"
HOLD = ("--upload-delay", "3600")  # a host whose uploads wait (until it is flushed)


@pytest.mark.parametrize("store", ["file", "s3"])
def test_an_orbax_rename_on_one_host_moves_every_hosts_shards(
    mount_factory, tmp_path: Path, store: str, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    source, extra, keys = _store_view(store, tmp_path, request)
    primary: Mount = mount_factory("host0", source=source, extra_args=extra)
    other: Mount = mount_factory("host1", source=source, extra_args=extra)
    shard_a, shard_b = os.urandom(300_000), os.urandom(200_000)
    (primary.mnt / TMP).mkdir()
    (primary.mnt / TMP / "shard_a").write_bytes(shard_a)
    primary.flush()
    other.cli("refresh", str(other.mnt))
    (other.mnt / TMP / "shard_b").write_bytes(shard_b)
    other.flush()  # the barrier: every host's shards are durable
    os.rename(primary.mnt / TMP, primary.mnt / "step_1")
    (primary.mnt / "step_1" / "commit_success.txt").write_text("ok")
    assert sorted(os.listdir(primary.mnt / "step_1")) == ["commit_success.txt", "shard_a", "shard_b"]
    primary.flush()
    assert keys() >= {"step_1/shard_a", "step_1/shard_b", "step_1/commit_success.txt"}, keys()
    assert not {k for k in keys() if k.startswith(TMP)}, keys()  # nothing stays under the old name
    assert (primary.mnt / "step_1" / "shard_b").read_bytes() == shard_b
    other.cli("refresh", str(other.mnt))
    wait_until(lambda: sorted(os.listdir(other.mnt / "step_1")) == ["commit_success.txt", "shard_a", "shard_b"],
          what="the other host's view of the renamed step")
    assert not (other.mnt / TMP).exists()
    assert (other.mnt / "step_1" / "shard_a").read_bytes() == shard_a


def test_an_rmdir_of_a_directory_another_node_wrote_into_is_enotempty(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shared = tmp_path / "shared"
    shared.mkdir()
    a: Mount = mount_factory("a", source=f"file://{shared}")
    b: Mount = mount_factory("b", source=f"file://{shared}")
    (a.mnt / "tmpdir").mkdir()
    a.flush()
    b.cli("refresh", str(b.mnt))
    (b.mnt / "tmpdir" / "x").write_bytes(b"x")
    b.flush()
    with pytest.raises(OSError) as raised:  # before: a removed it, and b's file stayed in the store, unseen
        os.rmdir(a.mnt / "tmpdir")
    assert raised.value.errno == 39  # ENOTEMPTY
    assert os.listdir(a.mnt / "tmpdir") == ["x"]


def _orbax_tmp_with_a_held_shard(mount_factory, tmp_path: Path, *primary_args: str) -> tuple[Mount, Mount, bytes]:  # type: ignore[no-untyped-def]
    """The primary made the tmp dir; the other host wrote its shard into it and closed it, without a flush,
    and holds its uploads back (as a slow or busy drain would): its record names the tmp dir."""
    shared = tmp_path / "shared"
    shared.mkdir()
    primary: Mount = mount_factory("host0", source=f"file://{shared}", extra_args=primary_args)
    other: Mount = mount_factory("host1", source=f"file://{shared}", extra_args=HOLD)
    (primary.mnt / TMP).mkdir()
    (primary.mnt / TMP / "shard_a").write_bytes(b"a" * 1000)
    primary.flush()
    other.cli("refresh", str(other.mnt))
    shard_b = os.urandom(100_000)
    (other.mnt / TMP / "shard_b").write_bytes(shard_b)
    wait_until(lambda: any(TMP in line for line in _peer_lines(primary)), what="the other host's record of the tmp dir")
    return primary, other, shard_b


def _peer_lines(mount: Mount) -> list[str]:
    result = mount.cli("nodes", str(mount.mnt))
    return result.stdout.splitlines()


def test_a_rename_waits_for_the_shards_another_host_closed_and_has_not_uploaded(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    primary, other, shard_b = _orbax_tmp_with_a_held_shard(mount_factory, tmp_path)
    flushed = threading.Timer(1.5, other.flush)  # the other host's drain gets there a little later
    flushed.start()
    started = time.monotonic()
    os.rename(primary.mnt / TMP, primary.mnt / "step_1")  # before: at once, without shard_b
    waited = time.monotonic() - started
    flushed.join()
    print(f"\nthe rename waited {waited:.2f} s for the other host's upload (its flush began at 1.5 s)")
    assert waited >= 1.0, waited
    assert sorted(os.listdir(primary.mnt / "step_1")) == ["shard_a", "shard_b"]
    primary.flush()
    assert (tmp_path / "shared" / "step_1" / "shard_b").read_bytes() == shard_b
    assert not (tmp_path / "shared" / TMP).exists()


def test_past_rename_wait_the_rename_goes_on_and_names_the_node_left_behind(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    primary, other, _ = _orbax_tmp_with_a_held_shard(mount_factory, tmp_path, "--rename-wait", "1")
    primary.allowed_log_words.append("while other nodes still have work pending in")
    os.rename(primary.mnt / TMP, primary.mnt / "step_1")
    assert os.listdir(primary.mnt / "step_1") == ["shard_a"]
    status = primary.status()
    assert "rename: renaming step_1.orbax-checkpoint-tmp" in status["last_error"], status["last_error"]
    assert other.status()["nodes"]["node"] in status["last_error"]
    assert "while other nodes still have work pending in" in primary.log.read_text()


def test_a_rename_waits_for_a_record_that_named_the_tmp_dir_only_after_this_node_read_it(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    """The other host's record was read here while it covered only its previous checkpoint (a marker's or
    `ckptfs nodes`' listing); the host then wrote into the tmp dir, and its record, still pending, was
    rewritten in place to name the tmp dir too. The rename must read it again, not go by the old body."""
    shared = tmp_path / "shared"
    shared.mkdir()
    primary: Mount = mount_factory("host0", source=f"file://{shared}")
    other: Mount = mount_factory("host1", source=f"file://{shared}", extra_args=HOLD)
    (other.mnt / "step_0").mkdir()
    (other.mnt / "step_0" / "shard_b").write_bytes(b"b" * 1000)  # pending: the other host holds its uploads
    wait_until(lambda: any("step_0" in line for line in _peer_lines(primary)), what="the other host's record")
    (primary.mnt / TMP).mkdir()
    primary.flush()
    other.cli("refresh", str(other.mnt))
    shard_b = os.urandom(100_000)
    (other.mnt / TMP / "shard_b").write_bytes(shard_b)  # the same record, now naming the tmp dir too
    flushed = threading.Timer(1.5, other.flush)
    flushed.start()
    os.rename(primary.mnt / TMP, primary.mnt / "step_1")
    flushed.join()
    assert os.listdir(primary.mnt / "step_1") == ["shard_b"]
    primary.flush()
    assert (shared / "step_1" / "shard_b").read_bytes() == shard_b
    assert not (shared / TMP).exists()


class _RecordsUnreachable:
    """The other nodes' records, where the store refuses every listing of them."""

    async def wait_for_entry(self, entry: str) -> None:
        raise TransientBackendError("503 SlowDown (and every retry too)")

    def pending_in(self, entry: str) -> list[str]:
        return []


async def test_a_store_that_cannot_be_asked_does_not_fail_the_rename_of_a_directory_made_here(
    tmp_path: Path,
) -> None:
    """The mount serves renames locally: a directory this node made is renamed (and one it emptied is
    removed) with what the journal holds when the store refuses both the other nodes' records and the
    directory's fresh listing, and what the store may have beyond that is named as left behind. (The crash
    harness's SeaweedFS rounds with a 503 storm failed the writer's rename of its tmp dir with EIO.)"""
    stack = make_stack(tmp_path)
    stack.fs.listing.other_nodes = _RecordsUnreachable()
    named: list[str] = []
    stack.fs.listing.on_straggler = named.append
    await stack.fs.ensure_listed(ROOT_ID)
    stack.fs.mkdir(ROOT_ID, TMP.encode(), 0o755, UID, GID)
    stack.write_file(f"{TMP}/shard_a", b"a")
    # (this stack's listings are never fresh: the root's, for the old and the new name, and the tmp dir's)
    stack.store.list_failures = [TransientBackendError("503 SlowDown (and every retry too)")] * 3
    await stack.fs.requests.rename(ROOT_ID, TMP.encode(), ROOT_ID, b"step_1", 0)
    assert stack.fs.lookup(stack.fs.lookup(ROOT_ID, b"step_1").ino, b"shard_a").size == 1
    assert any("their records cannot be read" in line for line in named), named
    assert any("the store cannot list it now" in line for line in named), named

    stack.fs.mkdir(ROOT_ID, b"old", 0o755, UID, GID)
    stack.store.list_failures = [TransientBackendError("503 SlowDown (and every retry too)")] * 2
    await stack.fs.requests.rmdir(ROOT_ID, b"old")
    assert stack.fs.find(ROOT_ID, b"old") is None


async def test_a_directory_never_listed_here_is_not_renamed_when_the_store_cannot_list_it(tmp_path: Path) -> None:
    """A directory only in the store (another node's) must be listed before it is renamed: renamed as the
    journal holds it, its objects would stay at the old keys. A store that refuses fails the rename with
    the store's errno."""
    (tmp_path / "shared" / "theirs").mkdir(parents=True)
    (tmp_path / "shared" / "theirs" / "shard").write_bytes(b"s")  # another node's, uploaded
    reader = make_stack(tmp_path / "reader", store_dir=tmp_path / "shared")
    await reader.fs.ensure_listed(ROOT_ID)
    reader.store.list_failures = [TransientBackendError("503 SlowDown (and every retry too)")] * 8
    with pytest.raises(FsError) as raised:
        await reader.fs.requests.rename(ROOT_ID, b"theirs", ROOT_ID, b"mine", 0)
    assert raised.value.errno == errno_for_backend_error(TransientBackendError("x"))
    assert reader.fs.find(ROOT_ID, b"theirs") is not None
