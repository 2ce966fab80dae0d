"""Multi-host frameworks that rename a directory every host wrote into (issue 46), each host on a ckptfs node
of its own (its own mount and cache dir over one store):

- Orbax with JAX: two JAX processes on the CPU (jax.distributed over loopback) save one sharded pytree with
  CheckpointManager: the primary makes `1.orbax-checkpoint-tmp/`, both hosts write into it, a barrier, the
  primary renames it to `1/`. Both hosts restore it, then a fresh node does (tests/orbax_job.py).
- Megatron-style with torch.distributed.checkpoint: two gloo ranks write `step_N.tmp/`, a barrier (no
  flush), rank 0 renames it to `step_N` and writes the tracker file while rank 1's node still holds its
  shard back.

The JAX processes are processes of their own (JAX does not take well to fork); the torch ranks are forks of
the worker's rank server (tests/rank_server.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Mount
from emulators import seaweedfs_s3  # noqa: F401
from rank_server import SERVER, Rank
from test_crossnode_fuse import _dcp_load, _store_view
from test_multinode import RANK_IMPORTS, _free_port
from waiting import wait_until

ORBAX_JOB = Path(__file__).resolve().parent / "orbax_job.py"
JOB_TIMEOUT = 300
QUICK_REFRESH = ("--refresh-interval", "0.5")
SLOW_UPLOADS = ("--upload-delay", "2")  # a node whose uploads start late: the rename races them


def _missing_jax() -> str | None:
    for module in ("jax", "jaxlib", "orbax.checkpoint"):
        if importlib.util.find_spec(module) is None:
            return f"{module} cannot be imported (the test extra pins it: scripts/install.sh test)"
    return None


needs_jax = pytest.mark.skipif(_missing_jax() is not None, reason=_missing_jax() or "")


def _jax_jobs(commands: list[list[str]], nodes: list[Mount], logs: Path) -> list[dict[str, object]]:
    """Run `orbax_job.py COMMAND` for each node at once, each a process of its own that reaches its node's
    control socket, and return the JSON line each printed; fail with their output if one fails (the others
    are stopped then: they would wait for it at a barrier) or they are not done within JOB_TIMEOUT."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (command, node) in enumerate(zip(commands, nodes, strict=True)):
        env = dict(os.environ, CKPTFS_RUNTIME_DIR=node.env["CKPTFS_RUNTIME_DIR"], JAX_PLATFORMS="cpu",
                   OMP_NUM_THREADS="1")
        with open(logs / f"job{i}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, str(ORBAX_JOB), *command], stdout=out,
                                          stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outputs = [(logs / f"job{i}.log").read_text(errors="replace") for i in range(len(procs))]
    failed = [i for i, proc in enumerate(procs) if proc.returncode != 0]
    assert not failed, f"jobs {failed} failed, were stopped or ran past {JOB_TIMEOUT} s:\n\n" + "\n\n".join(
        f"job {i}: ...{output[-3000:]}" for i, output in enumerate(outputs))
    return [json.loads(next(line for line in reversed(output.splitlines()) if line.startswith('{"digest"')))
            for output in outputs]


def _step_keys(keys: Callable[[], set[str]], root: str, step: str) -> set[str]:
    """The store's keys below `root`, which must all be in `root/step/` (no tmp dir left): relative to it."""
    found = {k for k in keys() if k.startswith(f"{root}/")}
    below = {k[len(f"{root}/{step}/"):] for k in found if k.startswith(f"{root}/{step}/")}
    assert found == {f"{root}/{step}/{k}" for k in below}, sorted(found)
    return below


def _orbax_save_on_two_nodes_then_a_fresh_one(  # type: ignore[no-untyped-def]
    mount_factory, tmp_path: Path, request: pytest.FixtureRequest, mode: str, *, both: tuple[str, ...] = (),
    host1: tuple[str, ...] = (),
) -> set[str]:
    """Hosts 0 and 1 save step 1 into `ckpt/`, each through its own node (mount arguments `both` and, for
    host 1's, `host1`), then restore it; a fresh node restores it too. The store's keys of step 1."""
    source, extra, keys = _store_view("file", tmp_path, request)
    hosts: list[Mount] = [mount_factory("host0", source=source, extra_args=(*extra, *both)),
                          mount_factory("host1", source=source, extra_args=(*extra, *both, *host1))]
    port = str(_free_port())
    saved = _jax_jobs([["save", str(host.mnt / "ckpt"), str(i), port, mode] for i, host in enumerate(hosts)],
                      hosts, tmp_path / "save")
    for host in hosts:
        host.flush()
    in_step = _step_keys(keys, "ckpt", "1")  # every host's files moved with the rename: nothing at a tmp name
    assert {"_CHECKPOINT_METADATA", "commit_success.txt", "default/_METADATA"} <= in_step, sorted(in_step)
    fresh: Mount = mount_factory("fresh", source=source, extra_args=extra)
    [restored] = _jax_jobs([["restore", str(fresh.mnt / "ckpt")]], [fresh], tmp_path / "restore")
    assert saved[0] == saved[1] == restored and restored["steps"] == [1], (saved, restored)
    return in_step


@needs_jax
def test_orbax_multihost_save_with_the_documented_barrier(
    mount_factory, tmp_path: Path, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    """Orbax as it comes (OCDBT: each host writes `ocdbt.process_N/`, the primary merges them and checks every
    host's ArrayMetadata before the rename) with the barrier of docs/INTEGRATIONS.md. The nodes mount with
    `--refresh-interval 0.5`: Orbax's non-primary host polls for the `array_metadatas/` directory the primary
    makes, and a node sees another node's entries after refresh_interval (else each save waits 30 s)."""
    in_step = _orbax_save_on_two_nodes_then_a_fresh_one(mount_factory, tmp_path, request, "durable-barrier",
                                                         both=QUICK_REFRESH)
    for host in range(2):
        assert f"default/ocdbt.process_{host}/manifest.ocdbt" in in_step, sorted(in_step)
        assert f"default/array_metadatas/process_{host}" in in_step, sorted(in_step)
    assert "default/manifest.ocdbt" in in_step, sorted(in_step)


@needs_jax
def test_orbax_multihost_rename_takes_the_shards_another_node_has_not_uploaded(
    mount_factory, tmp_path: Path, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    """Orbax's own barriers only, nothing of ckptfs in the job, and host 1's node starts its uploads 2 s late:
    the primary's rename of the tmp dir comes right after the barrier, before host 1's shard is in the
    store, and must wait for it (rename_wait) and take it along. Orbax's finalize reads other hosts' files
    when OCDBT and the ArrayMetadata store are on, which only the barrier of docs/INTEGRATIONS.md makes
    work across nodes (test above): both off here, and with them the non-primary host's polling for a
    directory the primary made, so the nodes keep the default refresh_interval (30 s), and the primary's
    view of the tmp dir it made is not refreshed before the rename unless the rename lists it afresh."""
    in_step = _orbax_save_on_two_nodes_then_a_fresh_one(
        mount_factory, tmp_path, request, "plain-barrier", host1=SLOW_UPLOADS)
    # zarr: each host wrote its own chunk of the rows, host 0 the replicated bias and the metadata.
    assert {"default/params/0.0", "default/params/1.0", "default/params/.zarray", "default/bias/0"} <= in_step, \
        sorted(in_step)


MEGATRON_STYLE = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
root, step = sys.argv[1], int(sys.argv[2])
state = {f"rank{rank}.weight": torch.full((1 << 16,), float(step * 10 + rank)), "shared.step": torch.tensor(step)}
dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, f"step_{step}.tmp")))
dist.barrier()
if rank == 0:
    os.rename(os.path.join(root, f"step_{step}.tmp"), os.path.join(root, f"step_{step}"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as tracker:
        tracker.write(str(step))
dist.barrier()
dist.destroy_process_group()
"""
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.mark.parametrize("store", ["file", "s3"])
def test_dcp_save_into_a_tmp_dir_renamed_by_rank_0_while_rank_1s_shard_uploads(
    mount_factory, tmp_path: Path, store: str, request: pytest.FixtureRequest  # type: ignore[no-untyped-def]
) -> None:
    source, extra, keys = _store_view(store, tmp_path, request)
    ranks: list[Mount] = [mount_factory("node0", source=source, extra_args=extra),
                          mount_factory("node1", source=source, extra_args=(*extra, *SLOW_UPLOADS))]
    # The tracker's first appearance in the store, with what was there then (one listing).
    seen_with_tracker: list[set[str]] = []

    def tracker_landed() -> bool:
        now = keys()
        if TRACKER in now:
            seen_with_tracker.append(now)
        return bool(seen_with_tracker)

    port = str(_free_port())
    jobs = [Rank(["-c", MEGATRON_STYLE, str(node.mnt), "3"],
                 dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for rank, node in enumerate(ranks)]
    for code, out in SERVER.run(jobs, preload=RANK_IMPORTS, timeout=JOB_TIMEOUT):
        assert code == 0, out
    wait_until(tracker_landed, timeout=60, what="the tracker file in the store")
    shards = {"step_3/__0_0.distcp", "step_3/__1_0.distcp", "step_3/.metadata"}
    assert shards <= seen_with_tracker[0], sorted(seen_with_tracker[0])  # the tracker came last
    for node in ranks:
        node.flush()
    now = keys()
    assert not {k for k in now if k.startswith("step_3.tmp")}, sorted(now)  # nothing stays under the old name
    assert {k for k in now if not k.endswith("/")} == shards | {TRACKER}, sorted(now)  # (and `step_3/` on S3)
    assert sorted(os.listdir(ranks[0].mnt / "step_3")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    fresh: Mount = mount_factory("fresh", source=source, extra_args=extra)
    assert (fresh.mnt / TRACKER).read_text() == "3"
    loaded = _dcp_load(fresh, "step_3")
    assert int(loaded["shared.step"]) == 3
    assert torch.equal(loaded["rank0.weight"], torch.full((1 << 16,), 30.0))
    assert torch.equal(loaded["rank1.weight"], torch.full((1 << 16,), 31.0))
