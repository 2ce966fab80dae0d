"""Cross-node ordering of commit markers with real daemons (issue 28): several mounts of one prefix, each
with its own cache dir, on file:// and on the S3, GCS and Azure emulators. One node's uploads are held back
(upload_delay of an hour), then it is killed with kill -9: the marker written on another node after the
job's barrier never reaches the store before that node's files; retention keeps the last checkpoint that
is complete on every node; once the killed node restarts with its cache, its files land, then the marker,
and a fresh node loads the new checkpoint. DCP with two gloo ranks, DeepSpeed's `latest` and Megatron's
tracker file; `ckptfs nodes`, `--forget`, `flush --all-nodes`, status and metrics name what waits."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Mount, live_files
from emulators import AzuriteServer, GcsServer, S3Server, azurite, fake_gcs, s3_bucket, seaweedfs_s3  # noqa: F401
from rank_server import SERVER, Rank
from test_multinode import RANK_IMPORTS, _free_port
from waiting import mount_drain_had_its_chance, wait_until

HOLD = ("--upload-delay", "3600")  # a node whose uploads wait (until it is flushed or killed)

RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
step = int(sys.argv[2])
state = {f"rank{rank}.weight": torch.full((1 << 16,), float(step * 10 + rank)), "shared.step": torch.tensor(step)}
dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1]))
dist.barrier()
dist.destroy_process_group()
"""


def _node_id(mount: Mount) -> str:
    return str(mount.status()["nodes"]["node"])


def _dcp_save(mounts: list[Mount], name: str, step: int) -> None:
    """Rank r saves through mounts[r]; rank 0 (the coordinator) writes .metadata after the barrier. The ranks
    are forks of the worker's rank server (tests/rank_server.py), which imported torch once."""
    port = _free_port()
    ranks = [Rank(["-c", RANK_SCRIPT, str(mount.mnt / name), str(step)],
                  dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank, mount in enumerate(mounts)]
    for code, out in SERVER.run(ranks, preload=RANK_IMPORTS, timeout=300):
        assert code == 0, out


def _dcp_load(mount: Mount, name: str) -> dict[str, torch.Tensor]:
    target = {"rank0.weight": torch.zeros(1 << 16), "rank1.weight": torch.zeros(1 << 16),
              "shared.step": torch.tensor(0)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(mount.mnt / name)), no_dist=True)
    return target


def _store_view(
    store: str, tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[str, tuple[str, ...], Callable[[], set[str]]]:
    """(source, mount args, the keys in the store now) of a fresh prefix on file:// or SeaweedFS."""
    if store == "file":
        shared = tmp_path / "shared"
        shared.mkdir()

        def files() -> set[str]:
            return {str(p.relative_to(shared)) for p in live_files(shared)}
        return f"file://{shared}", (), files
    server: S3Server = request.getfixturevalue("seaweedfs_s3")
    bucket_cm = s3_bucket(server)
    bucket = bucket_cm.__enter__()
    request.addfinalizer(lambda: bucket_cm.__exit__(None, None, None))
    return f"s3://{bucket}/run-1", ("--endpoint-url", server.endpoint), _objects_s3(server, bucket)


@pytest.mark.parametrize("store", ["file", "s3"])
def test_dcp_metadata_waits_for_a_killed_nodes_shards_and_lands_after_it_restarts(
    mount_factory, tmp_path: Path, store: str, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    source, extra, keys = _store_view(store, tmp_path, request)
    rank0: Mount = mount_factory("node0", source=source, extra_args=(*extra, "--keep-last", "1"))
    rank1: Mount = mount_factory("node1", source=source, extra_args=extra)
    _dcp_save([rank0, rank1], "step_1", 1)
    rank0.flush()
    rank1.flush()
    wait_until(lambda: "step_1/.metadata" in keys(), what="step_1's marker")

    # Step 2: rank 1's node holds its shard back and dies before it is uploaded.
    rank1.umount()
    rank1.extra_args = (*extra, *HOLD)
    rank1.start()
    since = time.time()
    _dcp_save([rank0, rank1], "step_2", 2)
    rank1.kill9()
    wait_until(lambda: "step_2/__0_0.distcp" in keys(), what="rank 0's own shard")
    mount_drain_had_its_chance(rank0.status, since=since, due=time.time() + rank0.upload_delay,
                               what="upload step_2/.metadata before rank 1's shard")
    assert "step_2/.metadata" not in keys(), "the marker went before rank 1's shard"
    assert "step_2/__1_0.distcp" not in keys()
    # What waits is named: status, `ckptfs nodes`, the flush of all nodes.
    waiting = rank0.status()["nodes"]["waiting_markers"]
    assert [w["path"] for w in waiting] == ["step_2/.metadata"], waiting
    assert "step_2" in waiting[0]["waits_for"][0]
    listed = rank0.cli("nodes", str(rank0.mnt))
    assert listed.returncode == 0 and "step_2" in listed.stdout and "marker step_2/.metadata waits" in listed.stdout
    flush_all = rank0.cli("flush", str(rank0.mnt), "--all-nodes", "--timeout", "1")
    assert flush_all.returncode == 3 and "step_2" in flush_all.stderr, flush_all
    # Retention keeps the last checkpoint complete on every node: step_2 is not, whatever rank 0 sees.
    pruned = rank0.cli("prune", str(rank0.mnt), "--keep-last", "1")
    assert pruned.returncode == 0 and "kept    step_1" in pruned.stdout, pruned.stdout
    assert "step_1/.metadata" in keys()
    fresh: Mount = mount_factory("fresh", source=source, extra_args=extra)
    loaded = _dcp_load(fresh, "step_1")
    assert int(loaded["shared.step"]) == 1 and torch.equal(loaded["rank1.weight"], torch.full((1 << 16,), 11.0))
    fresh.umount()

    # Rank 1's node comes back with its cache: its shard lands, then the marker.
    rank1.extra_args = extra
    rank1.start()
    wait_until(lambda: "step_2/.metadata" in keys(), timeout=60, what="step_2's marker")
    assert "step_2/__1_0.distcp" in keys()
    assert rank0.cli("flush", str(rank0.mnt), "--all-nodes", "--timeout", "60").returncode == 0
    # Retention (keep_last 1, after the marker) deletes step_1 whole, rank 1's shard included.
    wait_until(lambda: not any(k.startswith("step_1/") for k in keys()), what="retention after the complete step_2")
    fresh = mount_factory("fresh2", source=source, extra_args=extra)
    loaded = _dcp_load(fresh, "step_2")
    assert int(loaded["shared.step"]) == 2
    assert torch.equal(loaded["rank0.weight"], torch.full((1 << 16,), 20.0))
    assert torch.equal(loaded["rank1.weight"], torch.full((1 << 16,), 21.0))


LAYOUTS = {
    # DeepSpeed: each rank's states in global_stepN/, rank 0 writes `latest` naming the directory.
    "deepspeed": (["global_step2/mp_rank_00_model_states.pt", "global_step2/zero_pp_rank_0_optim_states.pt"],
                  ["global_step2/zero_pp_rank_1_optim_states.pt"], "latest", "global_step2"),
    # Megatron: iter_NNNNNNN/mp_rank_RR/, rank 0 writes the tracker file.
    "megatron": (["iter_0000002/mp_rank_00/model_optim_rng.pt"], ["iter_0000002/mp_rank_01/model_optim_rng.pt"],
                 "latest_checkpointed_iteration.txt", "2"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_tracker_file_waits_for_the_other_nodes_states(
    mount_factory, tmp_path: Path, layout: str  # type: ignore[no-untyped-def]
) -> None:
    ours, theirs, tracker, text = LAYOUTS[layout]
    shared = tmp_path / "shared"
    shared.mkdir()
    node0: Mount = mount_factory("node0", source=f"file://{shared}")
    node1: Mount = mount_factory("node1", source=f"file://{shared}", extra_args=HOLD)
    for node, files in ((node0, ours), (node1, theirs)):
        for rel in files:
            (node.mnt / rel).parent.mkdir(parents=True, exist_ok=True)
            torch.save({"file": rel, "w": torch.arange(1000)}, node.mnt / rel)
    # The barrier; then rank 0 writes the tracker, the way both frameworks do (a plain write).
    since = time.time()
    (node0.mnt / tracker).write_text(text)
    due = time.time() + node0.upload_delay
    wait_until(lambda: all((shared / rel).exists() for rel in ours), what="node 0's own files")
    mount_drain_had_its_chance(node0.status, since=since, due=due, what="upload the tracker before node 1's files")
    assert not (shared / tracker).exists(), "the tracker went before node 1's files"
    [waiting] = node0.status()["nodes"]["waiting_markers"]
    assert all(rel in waiting["waits_for"][0] for rel in theirs), waiting  # the files it waits for, by name
    node1.flush()
    wait_until(lambda: (shared / tracker).exists(), what="the tracker")
    assert all((shared / rel).exists() for rel in theirs)
    assert (shared / tracker).read_text() == text


def test_a_node_given_up_on_holds_the_marker_and_the_next_checkpoint_goes_on(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    node0: Mount = mount_factory("node0", source=f"file://{shared}")
    node1: Mount = mount_factory("node1", source=f"file://{shared}", extra_args=HOLD)
    lost = _node_id(node1)
    (node1.mnt / "step_1").mkdir()
    (node1.mnt / "step_1" / "shard_1.pt").write_bytes(b"1" * 4096)
    (node0.mnt / "step_1").mkdir(exist_ok=True)
    (node0.mnt / "step_1" / "shard_0.pt").write_bytes(b"0" * 4096)
    (node0.mnt / "latest").write_text("step_1")
    node1.kill9()  # lost for good: its cache dir is never mounted again
    wait_until(lambda: bool(node0.status()["nodes"]["waiting_markers"]), what="the waiting marker")
    since = time.time()
    forgot = node0.cli("nodes", str(node0.mnt), "--forget", lost)
    assert forgot.returncode == 0 and f"forgot node {lost}" in forgot.stdout, forgot
    [held] = node0.status()["nodes"]["waiting_markers"]
    assert held["path"] == "latest" and held["held_by"] == [lost]
    flush_all = node0.cli("flush", str(node0.mnt), "--all-nodes", "--timeout", "5")
    assert flush_all.returncode == 3 and f"latest (held: its checkpoint misses the work of {lost}" in flush_all.stderr
    mount_drain_had_its_chance(node0.status, since=since, what="upload the marker of the incomplete checkpoint")
    assert not (shared / "latest").exists(), "a marker of an incomplete checkpoint landed"
    # The job goes on with node 0 (and a new node): the next checkpoint's marker does not wait for the lost one.
    (node0.mnt / "step_2").mkdir()
    (node0.mnt / "step_2" / "shard_0.pt").write_bytes(b"2" * 4096)
    (node0.mnt / "latest").write_text("step_2")
    node0.flush()
    assert (shared / "latest").read_text() == "step_2"
    assert node0.status()["nodes"]["waiting_markers"] == []


def test_a_single_node_pays_one_record_per_quiet_spell_and_leaves_none(
    mount_factory, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    m: Mount = mount_factory("m", extra_args=("--metrics-addr", f"127.0.0.1:{_free_port()}"))
    (m.mnt / "step_1").mkdir()
    for i in range(20):
        (m.mnt / "step_1" / f"shard_{i}").write_bytes(b"x" * 1000)
    (m.mnt / "step_1" / ".metadata").write_bytes(b"m")
    m.flush()
    notes = m.store / ".ckptfs-tmp.notes" / "pending"
    wait_until(lambda: not live_files(notes, skip_temps=False), what="no records")
    status = m.status()["nodes"]
    assert status["cross_node_ordering"] and status["records"] == [] and status["unannounced"] is None
    assert m.umount().returncode == 0
    assert not live_files(notes, skip_temps=False)
    # With it turned off nothing is written at all.
    off: Mount = mount_factory("off", extra_args=("--no-cross-node-ordering",))
    (off.mnt / "f").write_bytes(b"y")
    (off.mnt / "latest").write_text("f")
    off.flush()
    assert not (off.store / ".ckptfs-tmp.notes").exists()
    assert off.status()["nodes"] == {"node": _node_id(off), "cross_node_ordering": False}


def _objects_s3(server: S3Server, bucket: str) -> Callable[[], set[str]]:
    client = server.client()

    def objects() -> set[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run-1/")
        return {o["Key"][len("run-1/"):] for page in pages for o in page.get("Contents", [])
                if "/.ckptfs-tmp." not in "/" + o["Key"]}
    return objects


@pytest.mark.parametrize("store", ["s3", "gs", "az"])
def test_a_marker_waits_for_another_nodes_files_on_every_cloud_store(
    mount_factory, store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    if store == "s3":
        server: S3Server = request.getfixturevalue("seaweedfs_s3")
        bucket_cm = s3_bucket(server)
        bucket = bucket_cm.__enter__()
        request.addfinalizer(lambda: bucket_cm.__exit__(None, None, None))
        source, extra = f"s3://{bucket}/run-1", ("--endpoint-url", server.endpoint)
        objects = _objects_s3(server, bucket)
    else:
        from test_cloud_mount import _source
        source, extra, listing = _source(store, request, monkeypatch)

        def objects() -> set[str]:
            return set(listing())
    node0: Mount = mount_factory("node0", source=source, extra_args=extra)
    node1: Mount = mount_factory("node1", source=source, extra_args=(*extra, *HOLD))
    (node1.mnt / "step_1").mkdir()
    (node1.mnt / "step_1" / "shard_1").write_bytes(b"1" * 10000)
    (node0.mnt / "step_1").mkdir(exist_ok=True)
    (node0.mnt / "step_1" / "shard_0").write_bytes(b"0" * 10000)
    since = time.time()
    (node0.mnt / "step_1" / ".metadata").write_bytes(b"meta")
    due = time.time() + node0.upload_delay
    wait_until(lambda: "step_1/shard_0" in objects(), what="node 0's shard")
    mount_drain_had_its_chance(node0.status, since=since, due=due, what="upload the marker before node 1's shard")
    assert "step_1/.metadata" not in objects()
    nodes = json.loads(node0.cli("nodes", str(node0.mnt), "--json").stdout)
    assert [n["entries"] for n in nodes["nodes"] if n["node"] == _node_id(node1)] == [["step_1"]]
    node1.flush()
    wait_until(lambda: "step_1/.metadata" in objects(), what="the marker")
    assert {"step_1/shard_0", "step_1/shard_1"} <= objects()
