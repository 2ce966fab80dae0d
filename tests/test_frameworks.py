"""The training libraries people checkpoint with, through real mounts on a file:// store and on an S3 server
(SeaweedFS): Hugging Face transformers (sharded save_pretrained, Trainer with save_total_limit), Lightning
(ModelCheckpoint save_top_k, resume with ckpt_path), torch.distributed.checkpoint (async_save; FSDP2 shards
from a 2-process gloo job), DeepSpeed (save_checkpoint/load_checkpoint and its `latest` file) and Megatron
(dist_checkpointing, Megatron-LM's tracker file).

Each test saves, loads back, waits with the callback or helper that docs/INTEGRATIONS.md documents (loaded
from that page), checks the store holds exactly what the mount shows (so rotated-away checkpoints are gone
from both), and then a fresh node (its own cache dir, same store) loads the same checkpoint and gets
identical tensors. Models are built from code; nothing is downloaded. Distributed jobs run in their own
processes (tests/framework_jobs.py).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Mount, file_store_objects
from doc_snippets import load_snippet, snippet_sources
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401
from rank_server import SERVER, Rank
from test_fuse_ml import assert_same_state, uploaded_order

import ckptfs

JOBS = Path(__file__).resolve().parent / "framework_jobs.py"
# What every job of framework_jobs.py imports (DeepSpeed and megatron-core by the jobs that use them).
JOB_IMPORTS = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
               "torch.distributed.checkpoint.state_dict", "doc_snippets")
PREFIX = "run"  # the S3 store's prefix: keys are run/<path in the mount>


@dataclass
class Cluster:
    """Nodes (mounts) on one store, each with its own cache dir; one runtime dir so that the test process
    (and the jobs it starts) reach every node's control socket through the ckptfs API."""

    kind: str
    source: str
    extra_args: tuple[str, ...]
    make_mount: Callable[..., Mount]
    runtime: Path
    read_store: Callable[[], dict[str, bytes]]
    nodes: list[Mount] = field(default_factory=list)

    def node(self, name: str, *, upload_delay: float = 0.1, mountpoint: Path | None = None) -> Mount:
        """A node mounting the store; `mountpoint` reuses an unmounted node's path (a replacement node)."""
        mount = self.make_mount(name, start=False, source=self.source, extra_args=self.extra_args,
                                upload_delay=upload_delay)
        if mountpoint is not None:
            mount.mnt = mountpoint
        mount.runtime = self.runtime
        mount.env["CKPTFS_RUNTIME_DIR"] = str(self.runtime)
        mount.start()
        self.nodes.append(mount)
        return mount

    def store_files(self, under: str = "") -> dict[str, bytes]:
        """Every object in the store (no directory markers, no staging files), by its path in the mount."""
        prefix = f"{under.strip('/')}/" if under else ""
        return {k: v for k, v in self.read_store().items() if k.startswith(prefix)}


def mount_files(root: Path, under: str = "") -> dict[str, bytes]:
    """Every regular file the mount shows under `under`, by path relative to the mount."""
    base = root / under
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def assert_store_matches_mount(cluster: Cluster, node: Mount, under: str) -> None:
    in_mount = mount_files(node.mnt, under)
    assert in_mount, f"nothing under {under} in the mount"
    in_store = cluster.store_files(under)
    assert sorted(in_store) == sorted(in_mount)
    for key, data in in_mount.items():
        assert in_store[key] == data, key


def _file_store(root: Path) -> Callable[[], dict[str, bytes]]:
    return lambda: file_store_objects(root)


def _s3_store(server: S3Server, bucket: str) -> Callable[[], dict[str, bytes]]:
    client = server.client()

    def read() -> dict[str, bytes]:
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{PREFIX}/"):
            for obj in page.get("Contents", []):
                if not obj["Key"].endswith("/"):  # empty directories persist as zero-byte dir/ objects
                    key = obj["Key"].removeprefix(f"{PREFIX}/")
                    out[key] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        return out
    return read


@pytest.fixture(params=["file", "s3"])
def cluster(request: pytest.FixtureRequest, mount_factory: Callable[..., Mount], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    runtime = tmp_path / "run"
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", str(runtime))
    if request.param == "file":
        store = tmp_path / "shared-store"
        store.mkdir()
        yield Cluster("file", f"file://{store}", (), mount_factory, runtime, _file_store(store))
        return
    server: S3Server = request.getfixturevalue("seaweedfs_s3")
    with s3_bucket(server) as bucket:
        yield Cluster("s3", f"s3://{bucket}/{PREFIX}", ("--endpoint-url", server.endpoint), mount_factory, runtime,
                      _s3_store(server, bucket))


def run_job(job: str, *args: str, world_size: int = 1, timeout: float = 300) -> None:
    """Run framework_jobs.py JOB as `world_size` ranks (what torchrun would start) and check every rank. The
    ranks are forks of the worker's rank server (tests/rank_server.py): torch, DeepSpeed and megatron-core
    imported once, not in every rank of every job."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [
        Rank([str(JOBS), job, *args],
             dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                  LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                  OMP_NUM_THREADS="1"))
        for rank in range(world_size)
    ]
    preload = {"deepspeed": ("deepspeed",), "megatron": ("megatron.core.dist_checkpointing",)}.get(
        job.split("_")[0], ())
    failures = []
    for rank, (code, out) in enumerate(SERVER.run(ranks, preload=(*JOB_IMPORTS, *preload), timeout=timeout)):
        if code != 0:
            failures.append(f"rank {rank} exited {code}:\n{out[-6000:]}")
    assert not failures, "\n".join(failures)


def assert_marker_uploaded_last(node: Mount, marker: str, data_prefix: str, *, other_markers: tuple[str, ...] = ()
                                ) -> None:
    """The (last) upload of a commit marker came after every data file under data_prefix (drain log order).
    Markers do not wait for other markers (docs/SEMANTICS.md, "Commit markers"): those are left out."""
    order = uploaded_order(node)
    data = [i for i, k in enumerate(order) if k.startswith(data_prefix) and k != marker and k not in other_markers]
    assert data and marker in order, order
    assert len(order) - 1 - order[::-1].index(marker) > max(data), order


def test_every_documented_snippet_is_tested() -> None:
    """Each code block docs/INTEGRATIONS.md marks as a snippet is loaded by a test in this file (Orbax's by
    the jobs of test_frameworks_multihost.py)."""
    here = Path(__file__).parent
    source = "".join(path.read_text() for path in (Path(__file__), JOBS, here / "orbax_job.py"))  # orbax: multihost
    for name in snippet_sources():
        assert f'load_snippet("{name}")' in source, f"snippet {name} is not exercised"
    assert set(snippet_sources()) == {"transformers", "lightning", "dcp", "deepspeed", "megatron", "orbax"}


# -- Hugging Face transformers ---------------------------------------------------------------------------

def tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def test_transformers_sharded_save_pretrained(cluster: Cluster) -> None:
    from transformers import LlamaForCausalLM

    node = cluster.node("node0")
    model = tiny_llama(seed=0)
    model.save_pretrained(node.mnt / "hf-model", max_shard_size="20KB")
    names = os.listdir(node.mnt / "hf-model")
    index = json.loads((node.mnt / "hf-model" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 3 and shards <= set(names), names
    assert_same_state(LlamaForCausalLM.from_pretrained(node.mnt / "hf-model").state_dict(), model.state_dict())

    ckptfs.wait_durable(node.mnt, ["hf-model"], timeout=60)
    assert_store_matches_mount(cluster, node, "hf-model")

    fresh = cluster.node("node1")
    assert_same_state(LlamaForCausalLM.from_pretrained(fresh.mnt / "hf-model").state_dict(), model.state_dict())


def test_transformers_trainer_rotation_and_resume(cluster: Cluster) -> None:
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    # An upload delay longer than a training step: a checkpoint is in the store at on_save only because
    # the documented callback waited for it.
    node = cluster.node("node0", upload_delay=1.0)
    wait_durable_callback = load_snippet("transformers").WaitDurableCallback

    class CheckDurableOnSave(TrainerCallback):  # runs after the documented callback
        def __init__(self, store_files: Callable[[str], dict[str, bytes]]) -> None:
            self.store_files = store_files
            self.checked: list[int] = []

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            stored = self.store_files(f"hf-run/checkpoint-{state.global_step}")
            assert f"hf-run/checkpoint-{state.global_step}/model.safetensors" in stored, sorted(stored)
            self.checked.append(state.global_step)

    def trainer(mount: Mount, max_steps: int, check: CheckDurableOnSave) -> Trainer:
        torch.manual_seed(1)
        data = [{"input_ids": torch.randint(0, 128, (8,)), "labels": torch.randint(0, 128, (8,))} for _ in range(8)]
        args = TrainingArguments(
            output_dir=str(mount.mnt / "hf-run"), max_steps=max_steps, save_steps=1, save_total_limit=2,
            per_device_train_batch_size=2, report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
            seed=1,
        )
        return Trainer(model=tiny_llama(seed=0), args=args, train_dataset=data,
                       callbacks=[wait_durable_callback(str(mount.mnt), timeout=60), check])

    check = CheckDurableOnSave(cluster.store_files)
    first = trainer(node, max_steps=4, check=check)
    first.train()
    assert check.checked == [1, 2, 3, 4]
    assert sorted(os.listdir(node.mnt / "hf-run")) == ["checkpoint-3", "checkpoint-4"]
    ckptfs.wait_durable(node.mnt, timeout=60)
    assert {k.split("/")[1] for k in cluster.store_files("hf-run")} == {"checkpoint-3", "checkpoint-4"}
    assert_store_matches_mount(cluster, node, "hf-run")
    trained = first.model.state_dict()
    assert_same_state(LlamaForCausalLM.from_pretrained(node.mnt / "hf-run/checkpoint-4").state_dict(), trained)

    # A fresh node loads the same weights, resumes (optimizer, scheduler, RNG from the mount) and rotates
    # away a checkpoint the first node wrote.
    fresh = cluster.node("node1", upload_delay=1.0)
    assert_same_state(LlamaForCausalLM.from_pretrained(fresh.mnt / "hf-run/checkpoint-4").state_dict(), trained)
    resume_check = CheckDurableOnSave(cluster.store_files)
    resumed = trainer(fresh, max_steps=5, check=resume_check)
    resumed.train(resume_from_checkpoint=str(fresh.mnt / "hf-run/checkpoint-4"))
    assert resumed.state.global_step == 5 and resume_check.checked == [5]
    assert sorted(os.listdir(fresh.mnt / "hf-run")) == ["checkpoint-4", "checkpoint-5"]
    ckptfs.wait_durable(fresh.mnt, timeout=60)
    assert {k.split("/")[1] for k in cluster.store_files("hf-run")} == {"checkpoint-4", "checkpoint-5"}
    assert_store_matches_mount(cluster, fresh, "hf-run")


# -- Lightning ---------------------------------------------------------------------------------------------

def test_lightning_save_top_k_and_resume_on_a_fresh_node(cluster: Cluster) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 4)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    durable_checkpoint_io = load_snippet("lightning").DurableCheckpointIO
    saved_durably: list[str] = []

    class CheckedCheckpointIO(durable_checkpoint_io):  # type: ignore[misc, valid-type]
        def save_checkpoint(self, checkpoint, path, storage_options=None):  # type: ignore[no-untyped-def]
            super().save_checkpoint(checkpoint, path, storage_options)
            relative = os.path.relpath(path, self.mountpoint)
            assert relative in cluster.store_files("lightning"), "returned before the file was in the store"
            saved_durably.append(relative)

    def fit(mount: Mount, max_epochs: int, ckpt_path: str | None = None) -> tuple[L.Trainer, ModelCheckpoint]:
        # monitor "step" (the trainer's own), mode "max": keep the newest K, which the test can name
        checkpoint = ModelCheckpoint(dirpath=mount.mnt / "lightning", save_top_k=2, monitor="step", mode="max",
                                     every_n_train_steps=1, filename="{epoch}-{step}")
        trainer = L.Trainer(max_epochs=max_epochs, callbacks=[checkpoint],
                            plugins=[CheckedCheckpointIO(str(mount.mnt))], logger=False, enable_progress_bar=False,
                            enable_model_summary=False, accelerator="cpu", devices=1, deterministic=True)
        torch.manual_seed(0)
        data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "dataloader does not have many workers", and the like
            trainer.fit(Regressor(), data, ckpt_path=ckpt_path)
        return trainer, checkpoint

    node = cluster.node("node0", upload_delay=0.5)
    _, checkpoint = fit(node, max_epochs=2)
    assert len(saved_durably) == 8  # 2 epochs x 4 steps, each waited for
    kept = sorted(os.listdir(node.mnt / "lightning"))
    assert kept == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt"], kept
    ckptfs.wait_durable(node.mnt, timeout=60)  # the deletes of the 6 older files, too
    assert_store_matches_mount(cluster, node, "lightning")
    best = Path(checkpoint.best_model_path).name
    saved = torch.load(node.mnt / "lightning" / best, weights_only=False)
    assert saved["global_step"] == 8

    # A replacement node mounts the store at the same path (ModelCheckpoint restores its top-k bookkeeping
    # only for the same dirpath), resumes, and rotates away the files the first node wrote.
    assert node.umount().returncode == 0
    fresh = cluster.node("node1", upload_delay=0.5, mountpoint=node.mnt)
    restored = torch.load(fresh.mnt / "lightning" / best, weights_only=False)
    assert_same_state(restored["state_dict"], saved["state_dict"])
    resumed, _ = fit(fresh, max_epochs=3, ckpt_path=str(fresh.mnt / "lightning" / best))
    assert resumed.global_step == 12  # it went on from step 8, not from 0
    # step 7 is rotated away by the new node; step 8 stays because Lightning's top-k bookkeeping inside a
    # checkpoint is taken before that checkpoint itself is added (the same on a local disk)
    assert sorted(os.listdir(fresh.mnt / "lightning")) == [
        "epoch=1-step=8.ckpt", "epoch=2-step=11.ckpt", "epoch=2-step=12.ckpt"]
    ckptfs.wait_durable(fresh.mnt, timeout=60)
    assert_store_matches_mount(cluster, fresh, "lightning")
    fresh.umount()  # before the fixture's cleanup of the first node detaches whatever is mounted on its path


# -- torch.distributed.checkpoint ---------------------------------------------------------------------------

def test_dcp_async_save_then_durable(cluster: Cluster) -> None:
    import torch.distributed.checkpoint as dcp

    node = cluster.node("node0", upload_delay=0.5)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(64, 64).state_dict(), "step": torch.tensor(7)}
    checkpoint_dir = str(node.mnt / "step_7")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        future = dcp.async_save(state, checkpoint_id=checkpoint_dir, no_dist=True)
        durable = load_snippet("dcp").durable_future(future, str(node.mnt), checkpoint_dir, timeout=60)
        durable.result(timeout=120)
        assert {"step_7/.metadata", "step_7/__0_0.distcp"} <= set(cluster.store_files("step_7"))
        assert_store_matches_mount(cluster, node, "step_7")
        assert_marker_uploaded_last(node, "step_7/.metadata", "step_7/")
        for mount in (node, cluster.node("node1")):  # loaded back, and on a fresh node
            target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": torch.tensor(0)}
            dcp.load(target, checkpoint_id=str(mount.mnt / "step_7"), no_dist=True)
            assert_same_state(target["model"], state["model"])
            assert int(target["step"]) == 7


def test_fsdp2_sharded_save_from_two_ranks_loads_in_a_new_job_on_a_fresh_node(cluster: Cluster,
                                                                                tmp_path: Path) -> None:
    node = cluster.node("node0")
    reference = tmp_path / "reference.pt"
    run_job("fsdp_save", str(node.mnt / "fsdp" / "step_1"), str(node.mnt), str(reference), world_size=2)
    assert sorted(cluster.store_files("fsdp")) == ["fsdp/step_1/.metadata", "fsdp/step_1/__0_0.distcp",
                                                   "fsdp/step_1/__1_0.distcp"]
    assert_store_matches_mount(cluster, node, "fsdp")
    assert_marker_uploaded_last(node, "fsdp/step_1/.metadata", "fsdp/step_1/")
    fresh = cluster.node("node1")
    run_job("fsdp_load", str(fresh.mnt / "fsdp" / "step_1"), str(reference), world_size=2)


# -- DeepSpeed ---------------------------------------------------------------------------------------------

def test_deepspeed_save_and_load_checkpoint_with_latest(cluster: Cluster, tmp_path: Path) -> None:
    node = cluster.node("node0")
    reference = tmp_path / "reference.pt"
    run_job("deepspeed_save", str(node.mnt / "ds"), str(node.mnt), str(reference))
    stored = cluster.store_files("ds")
    assert stored["ds/latest"] == b"global_step2"
    for tag in ("global_step1", "global_step2"):
        assert {f"ds/{tag}/mp_rank_00_model_states.pt", f"ds/{tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= set(
            stored), sorted(stored)
    assert_store_matches_mount(cluster, node, "ds")
    # `latest` is a commit marker: each version of it reached the store after the step it names
    order = uploaded_order(node)
    first_latest = order.index("ds/latest")
    assert all(order.index(k) < first_latest for k in stored if k.startswith("ds/global_step1/")), order
    assert_marker_uploaded_last(node, "ds/latest", "ds/global_step")
    fresh = cluster.node("node1")
    run_job("deepspeed_load", str(fresh.mnt / "ds"), str(reference))


# -- Megatron ----------------------------------------------------------------------------------------------

def test_megatron_dist_checkpoint_and_tracker_file(cluster: Cluster) -> None:
    # megatron-core cannot save without CUDA (see framework_jobs.py, "Megatron core dist_checkpointing"):
    # the job writes its files the way dist_checkpointing.save does; both loads are megatron's own.
    node = cluster.node("node0")
    run_job("megatron_save", str(node.mnt / "megatron"), str(node.mnt), world_size=2)
    stored = sorted(cluster.store_files("megatron"))
    assert stored == ["megatron/iter_0000100/.metadata", "megatron/iter_0000100/__0_0.distcp",
                      "megatron/iter_0000100/__1_0.distcp", "megatron/iter_0000100/common.pt",
                      "megatron/iter_0000100/metadata.json", "megatron/latest_checkpointed_iteration.txt"], stored
    assert_store_matches_mount(cluster, node, "megatron")
    # The tracker follows the data files, but not the iteration's .metadata, another marker: in the store
    # it can for a moment name an iteration whose .metadata is still uploading (seen on SeaweedFS).
    assert_marker_uploaded_last(node, "megatron/latest_checkpointed_iteration.txt", "megatron/iter_",
                                other_markers=("megatron/iter_0000100/.metadata",))
    assert_marker_uploaded_last(node, "megatron/iter_0000100/.metadata", "megatron/iter_0000100/__")
    fresh = cluster.node("node1")  # one rank this time: it reads both ranks' shards into the whole tensor
    run_job("megatron_load", str(fresh.mnt / "megatron"), world_size=1)
