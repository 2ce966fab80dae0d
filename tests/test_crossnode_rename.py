"""A directory renamed on one node carries every node's files (issue 46): Orbax's multi-host save writes
into `<step>.orbax-checkpoint-tmp-<ts>/` from every host, a barrier follows, then the primary host renames
the directory to `<step>`. A directory this node made counted as fully listed here, so its rename moved only
what this node knew, and the other host's shard stayed under the old name in the store for good."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Mount
from emulators import seaweedfs_s3  # noqa: F401
from test_crossnode_fuse import _store_view, _wait

TMP = "step_1.orbax-checkpoint-tmp-1700000000"


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
    _wait(lambda: sorted(os.listdir(other.mnt / "step_1")) == ["commit_success.txt", "shard_a", "shard_b"],
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
