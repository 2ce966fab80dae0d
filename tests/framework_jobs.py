"""Training jobs that tests/test_frameworks.py runs in their own processes, because they set up
torch.distributed (one process per rank, like torchrun) and must not leave a process group or a DeepSpeed
engine behind in the test process. Usage: python framework_jobs.py JOB ARGS...; exit 0 means every check
in the job passed. Each job builds its tiny model from code (nothing is downloaded)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_snippets import load_snippet

warnings.filterwarnings("ignore")  # the libraries' deprecation chatter is not what these jobs check


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert set(actual) == set(expected), (what, sorted(actual), sorted(expected))
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), (what, name)


# -- FSDP2 (DTensor shards) with torch.distributed.checkpoint.async_save, 2 ranks on gloo ------------------

def _fsdp_model(seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _leave_process_group() -> None:
    """Meet the other ranks before tearing down: with gloo in torch 2.13, a rank that destroys its group while
    a peer is still in its last collective aborts now and then ("terminate called without an active
    exception", about 1 run in 10 to 40 of fsdp_load on a plain directory; none in 140 runs with the barrier)."""
    dist.barrier()
    dist.destroy_process_group()


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # type: ignore[return-value]


def _load_sharded(model: torch.nn.Module, checkpoint_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state)


def fsdp_save(checkpoint_dir: str, mountpoint: str, reference: str) -> None:
    """Save the sharded state with dcp.async_save, wait with the documented durable_future, load it back
    into a differently initialized model; rank 0 keeps the full state as the reference for a new job."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    model = _fsdp_model(seed=0)
    sharded = get_model_state_dict(model)
    assert all(isinstance(t, DTensor) for t in sharded.values()), "not a sharded state dict"
    expected = _full_state(model)
    future = dcp.async_save(sharded, checkpoint_id=checkpoint_dir)
    load_snippet("dcp").durable_future(future, mountpoint, checkpoint_dir, timeout=120).result()
    dist.barrier()  # every rank's node has its shard in the store
    clone = _fsdp_model(seed=1)
    assert not torch.equal(_full_state(clone)["0.weight"], expected["0.weight"])
    _load_sharded(clone, checkpoint_dir)
    assert_same_tensors(_full_state(clone), expected, "loaded back")
    if dist.get_rank() == 0:
        torch.save(expected, reference)
    _leave_process_group()


def fsdp_load(checkpoint_dir: str, reference: str) -> None:
    dist.init_process_group("gloo")
    model = _fsdp_model(seed=2)
    _load_sharded(model, checkpoint_dir)
    assert_same_tensors(_full_state(model), torch.load(reference, weights_only=True), "fresh node")
    _leave_process_group()


# -- DeepSpeed engine.save_checkpoint / load_checkpoint on CPU (ZeRO stage 2, one rank) ---------------------

def _deepspeed_engine(seed: int):  # type: ignore[no-untyped-def]
    import deepspeed

    # Its shared-memory all-reduce for CPU ranks is C++ that DeepSpeed compiles at its first init in a venv
    # (1-2 minutes of 2 cores, and a lock in ~/.cache/torch_extensions that every venv's tests queue on); these
    # one-rank jobs reduce nothing. Marked incompatible, init takes DeepSpeed's own fallback (gloo), as on a
    # platform without it; the checkpoint files are the same.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _module_state(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def deepspeed_save(save_dir: str, mountpoint: str, reference: str) -> None:
    engine = _deepspeed_engine(seed=0)
    torch.manual_seed(10)
    for step in range(2):
        loss = engine(torch.randn(2, 16)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        load_snippet("deepspeed").save_durable(engine, save_dir, f"global_step{step + 1}", mountpoint, timeout=120)
    expected = _module_state(engine)
    assert Path(save_dir, "latest").read_text() == "global_step2"
    fresh = _deepspeed_engine(seed=1)
    load_path, _ = fresh.load_checkpoint(save_dir)  # follows `latest`
    assert load_path is not None and load_path.endswith("global_step2/mp_rank_00_model_states.pt"), load_path
    assert_same_tensors(_module_state(fresh), expected, "loaded back")
    assert fresh.global_steps == engine.global_steps == 2
    torch.save(expected, reference)


def deepspeed_load(save_dir: str, reference: str) -> None:
    engine = _deepspeed_engine(seed=2)
    load_path, _ = engine.load_checkpoint(save_dir)
    assert load_path is not None and "global_step2" in load_path, load_path
    assert_same_tensors(_module_state(engine), torch.load(reference, weights_only=True), "fresh node")
    assert engine.global_steps == 2


# -- Megatron core dist_checkpointing -------------------------------------------------------------------
# megatron-core 0.16.1 (the newest for Python 3.11) cannot *save* without CUDA: its only sharded save
# strategy (torch_dist) calls torch.cuda.synchronize() in FileSystemWriterAsync.preload_tensors (always
# called with non_blocking=True) and builds a tensor on torch.cuda.current_device() in
# save_state_dict_async_finalize; on a CPU-only torch both raise "Torch not compiled with CUDA enabled".
# So megatron_save writes the same files, with the same names, in the same order, the way
# dist_checkpointing.save writes them (common.pt by rank 0; the torch_dist shards, which are the DCP
# format: __<rank>_<n>.distcp and .metadata; metadata.json by rank 0 after a barrier), and then
# Megatron-LM's tracker latest_checkpointed_iteration.txt. Loading works on CPU, so both loads below are
# megatron's own dist_checkpointing.load and load_common_state_dict.

MEGATRON_ITERATION = 100
MEGATRON_ROWS = 8


def _megatron_shard(rank: int, world: int) -> torch.Tensor:
    full = torch.arange(MEGATRON_ROWS * 4, dtype=torch.float32).reshape(MEGATRON_ROWS, 4)
    rows = MEGATRON_ROWS // world
    return full[rank * rows:(rank + 1) * rows].clone()


def megatron_save(save_dir: str, mountpoint: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checkpoint_dir = os.path.join(save_dir, f"iter_{MEGATRON_ITERATION:07d}")
    os.makedirs(checkpoint_dir, exist_ok=True)
    if rank == 0:
        torch.save({"iteration": MEGATRON_ITERATION, "args": {"hidden": 4}}, os.path.join(checkpoint_dir, "common.pt"))
    mesh = init_device_mesh("cpu", (world,))
    weight = DTensor.from_local(_megatron_shard(rank, world), mesh, [Shard(0)])
    dcp.save({"decoder.weight": weight}, checkpoint_id=checkpoint_dir)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(checkpoint_dir, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(MEGATRON_ITERATION))
        load_snippet("megatron").wait_iteration_durable(save_dir, MEGATRON_ITERATION, mountpoint, timeout=120)
    dist.barrier()
    megatron_load(save_dir, initialized=True)


def megatron_load(save_dir: str, initialized: bool = False) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    if not initialized:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    iteration = int(Path(save_dir, "latest_checkpointed_iteration.txt").read_text())
    checkpoint_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    target = {"decoder.weight": ShardedTensor.from_rank_offsets(
        "decoder.weight", torch.zeros(MEGATRON_ROWS // world, 4), (0, rank, world))}
    loaded = dist_checkpointing.load(target, checkpoint_dir)
    assert torch.equal(loaded["decoder.weight"], _megatron_shard(rank, world)), loaded
    assert loaded["iteration"] == MEGATRON_ITERATION
    assert dist_checkpointing.load_common_state_dict(checkpoint_dir)["args"] == {"hidden": 4}
    _leave_process_group()


JOBS = {
    "fsdp_save": fsdp_save, "fsdp_load": fsdp_load,
    "deepspeed_save": deepspeed_save, "deepspeed_load": deepspeed_load,
    "megatron_save": megatron_save, "megatron_load": megatron_load,
}

if __name__ == "__main__":
    JOBS[sys.argv[1]](*sys.argv[2:])
