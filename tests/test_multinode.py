"""Two nodes on one store: two daemons, each with its own cache dir and mountpoint, on one S3 bucket prefix
(SeaweedFS) or one file:// directory. Two gloo ranks save one torch.distributed.checkpoint, each through
its own node's mount; after flush and `ckptfs refresh` both nodes see the whole checkpoint and load it.
Also: a directory is listed lazily, one level at a time; deletes and new files of the other node appear
after refresh."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Mount
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401
from rank_server import SERVER, Rank

RANK_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint")
RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
state = {f"rank{rank}.weight": torch.full((1 << 18,), float(rank + 1)), "shared.step": torch.tensor(42)}
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1]))
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_rank_save(mounts: list[Mount], name: str) -> None:
    """Rank r saves through mounts[r]: forks of the worker's rank server (tests/rank_server.py), which
    imported torch once."""
    port = _free_port()
    ranks = [Rank(["-c", RANK_SCRIPT, str(mount.mnt / name)],
                  dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank, mount in enumerate(mounts)]
    for code, out in SERVER.run(ranks, preload=RANK_IMPORTS, timeout=300):
        assert code == 0, out


def _load(mount: Mount, name: str) -> dict[str, torch.Tensor]:
    target = {"rank0.weight": torch.zeros(1 << 18), "rank1.weight": torch.zeros(1 << 18),
              "shared.step": torch.tensor(0)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(mount.mnt / name)), no_dist=True)
    return target


def _check_whole_checkpoint(mounts: list[Mount], name: str) -> None:
    for mount in mounts:
        assert mount.cli("refresh", str(mount.mnt)).returncode == 0
        names = sorted(os.listdir(mount.mnt / name))
        assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 2, names
        loaded = _load(mount, name)
        assert torch.equal(loaded["rank0.weight"], torch.full((1 << 18,), 1.0))
        assert torch.equal(loaded["rank1.weight"], torch.full((1 << 18,), 2.0))
        assert int(loaded["shared.step"]) == 42


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


def test_two_nodes_save_one_dcp_checkpoint_into_one_bucket(
    mount_factory, seaweedfs_s3: S3Server, bucket: str  # type: ignore[no-untyped-def]
) -> None:
    nodes = [
        mount_factory(f"node{i}", source=f"s3://{bucket}/run-1", extra_args=("--endpoint-url", seaweedfs_s3.endpoint))
        for i in range(2)
    ]
    for node in nodes:
        (node.mnt / "step_100").mkdir(exist_ok=True)  # each rank's FileSystemWriter makes it anyway
    _two_rank_save(nodes, "step_100")
    for node in nodes:
        node.flush()
    _check_whole_checkpoint(nodes, "step_100")


def test_two_nodes_on_one_file_store_see_each_others_files_and_deletes(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    nodes: list[Mount] = [
        mount_factory(f"node{i}", source=f"file://{shared}", extra_args=("--refresh-interval", "3600"))
        for i in range(2)
    ]
    _two_rank_save(nodes, "step_1")
    for node in nodes:
        node.flush()
    _check_whole_checkpoint(nodes, "step_1")
    # A file node 0 writes is not listed on node 1 before refresh_interval (an hour here) or a refresh.
    (nodes[0].mnt / "latest").write_text("step_1")
    nodes[0].flush()
    assert not (nodes[1].mnt / "latest").exists()
    assert nodes[1].cli("refresh", str(nodes[1].mnt)).returncode == 0
    assert (nodes[1].mnt / "latest").read_text() == "step_1"
    # A delete on node 1 reaches the store; node 0 drops the checkpoint at its next refresh.
    for entry in os.listdir(nodes[1].mnt / "step_1"):
        (nodes[1].mnt / "step_1" / entry).unlink()
    (nodes[1].mnt / "step_1").rmdir()
    nodes[1].flush()
    assert not (shared / "step_1").exists()
    assert nodes[0].cli("refresh", str(nodes[0].mnt)).returncode == 0
    assert sorted(os.listdir(nodes[0].mnt)) == ["latest"]
