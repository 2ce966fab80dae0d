"""The JAX processes of tests/test_frameworks_multihost.py, each a process of its own (JAX does not take well
to fork). `python orbax_job.py save DIR PROCESS_ID PORT MODE` is one of the two hosts of a JAX job on the
CPU (jax.distributed over 127.0.0.1:PORT): it saves step 1 of a sharded pytree with Orbax's
CheckpointManager into DIR (a directory in its own node's mount), then, after a barrier, restores it.
`python orbax_job.py restore DIR` is one process on a fresh node that restores the latest step. Each prints
one JSON line, {"digest": ..., "steps": [...]}, the digest of what it restored, and exits 0 only if that
is exactly what was saved.

MODE: `durable-barrier`, Orbax as it comes (OCDBT, ArrayMetadata validation) with the barrier of
docs/INTEGRATIONS.md (each host's files durable before it, a refresh after it); `plain-barrier`, Orbax's
own barriers and nothing of ckptfs, with the two features whose finalize reads other hosts' files turned
off (OCDBT's per-host manifests merged by the primary, the ArrayMetadata store it validates), so that all
that stands between the hosts' files and the final step is the primary's rename of the tmp dir."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_snippets import load_snippet

warnings.filterwarnings("ignore")  # the libraries' deprecation chatter is not what these jobs check

ROWS, COLS = 64, 4096  # 1 MiB of float32, rows split between the two hosts


def expected() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(46)
    return {"params": rng.standard_normal((ROWS, COLS), dtype=np.float32),  # sharded: half on each host
            "bias": rng.standard_normal((COLS,), dtype=np.float32)}  # replicated on both hosts


def check(restored: dict[str, np.ndarray]) -> str:
    want = expected()
    assert sorted(restored) == sorted(want), sorted(restored)
    digest = hashlib.sha256()
    for name in sorted(want):
        value = np.ascontiguousarray(restored[name])
        assert value.dtype == want[name].dtype and np.array_equal(value, want[name]), name
        digest.update(name.encode() + str(value.dtype).encode() + value.tobytes())
    return digest.hexdigest()


def save_and_restore(directory: str, process_id: int, port: int, mode: str) -> dict[str, Any]:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.process_count() == 2 and len(jax.devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("hosts",))
    by_row, replicated = NamedSharding(mesh, PartitionSpec("hosts")), NamedSharding(mesh, PartitionSpec())
    want = expected()
    tree = {"params": jax.make_array_from_callback(want["params"].shape, by_row, lambda i: want["params"][i]),
            "bias": jax.make_array_from_callback(want["bias"].shape, replicated, lambda i: want["bias"][i])}
    barrier = load_snippet("orbax").ckptfs_barrier(os.path.dirname(directory))
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    if mode == "durable-barrier":
        options.async_options = ocp.AsyncOptions(barrier_sync_fn=barrier)
        handler = ocp.StandardCheckpointHandler()
    else:
        assert mode == "plain-barrier", mode
        # An ArrayHandler without an ArrayMetadata store (resolved when the handler is made, so first).
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(), override=True)
        handler = ocp.StandardCheckpointHandler(use_ocdbt=False)
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handler)
    manager.save(1, args=ocp.args.StandardSave(tree))  # every host writes, the primary renames the tmp dir
    manager.wait_until_finished()
    # As the job restarted later would: every host sees the store as it is now.
    barrier(key="before_restore", timeout_ms=120_000)
    manager.reload()
    steps = manager.all_steps()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    restored = manager.restore(1, args=ocp.args.StandardRestore(abstract))
    manager.close()
    gathered = {name: np.asarray(multihost_utils.process_allgather(value, tiled=True))
                for name, value in restored.items()}
    return {"digest": check(gathered), "steps": list(steps)}


def restore_fresh(directory: str) -> dict[str, Any]:
    import orbax.checkpoint as ocp
    from jax.sharding import SingleDeviceSharding

    manager = ocp.CheckpointManager(directory)
    steps = manager.all_steps()
    one_device = SingleDeviceSharding(jax.devices()[0])
    target = {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=one_device)
              for name, value in expected().items()}
    restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
    manager.close()
    return {"digest": check({name: np.asarray(value) for name, value in restored.items()}), "steps": list(steps)}


if __name__ == "__main__":
    if sys.argv[1] == "save":
        result = save_and_restore(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        result = restore_fresh(sys.argv[2])
    print(json.dumps(result), flush=True)
