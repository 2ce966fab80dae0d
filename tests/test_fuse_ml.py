"""End-to-end checkpointing through a real ckptfs mount with the libraries people use: torch.save/load (also
mmap=True), torch.distributed.checkpoint, safetensors, numpy, and the write-temp-then-rename idiom.

Each test checks the round trip through the mount and that the store holds exactly the bytes written.
Models and tensors are small so the whole file runs in seconds.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Mount
from safetensors.torch import load_file, save_file


def uploaded_order(m: Mount) -> list[str]:
    """Store keys in the order the drain finished uploading them (from the daemon's DEBUG log)."""
    return re.findall(r" uploaded (\S+) \(\d+ bytes", m.log.read_text())


def small_transformer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(100, 64),
        torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
        torch.nn.Linear(64, 100),
    )
    model.eval()
    return model


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.core
def test_torch_save_load_transformer(mount: Mount) -> None:
    model = small_transformer()
    state = model.state_dict()
    assert len(state) > 10
    path = mount.mnt / "run" / "step-100" / "model.pt"
    path.parent.mkdir(parents=True)
    torch.save(state, path)
    written = path.read_bytes()

    loaded = torch.load(path, weights_only=True)
    assert_same_state(loaded, state)
    mapped = torch.load(path, weights_only=True, mmap=True)
    assert_same_state(mapped, state)
    # the loaded weights drive an identical model
    clone = small_transformer(seed=1)
    clone.load_state_dict(mapped)
    tokens = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        assert torch.equal(clone(tokens), model(tokens))
    del mapped

    mount.flush()
    assert mount.store_files() == {"run/step-100/model.pt": written}
    # the object in the store is a loadable checkpoint on its own (what a fresh node restores)
    assert_same_state(torch.load(mount.store / "run/step-100/model.pt", weights_only=True), state)
    # and through the mount after the upload, still the same
    assert_same_state(torch.load(path, weights_only=True, mmap=True), state)


def test_torch_save_overwrite_and_optimizer(mount: Mount) -> None:
    model = small_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 100, (2, 5))
    path = mount.mnt / "ckpt.pt"
    for step in range(2):
        model.train()
        loss = model(tokens).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, path)
        mount.flush()
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["step"] == 1
    assert_same_state(ckpt["model"], model.state_dict())
    expected_optim = optimizer.state_dict()
    for key, values in expected_optim["state"].items():
        for name, value in values.items():
            assert torch.equal(ckpt["optim"]["state"][key][name], value)
    assert mount.store_files() == {"ckpt.pt": path.read_bytes()}


def test_distributed_checkpoint(mount: Mount) -> None:
    model = small_transformer()
    state = {"model": model.state_dict(), "extra": {"step": torch.tensor(42)}}
    ckpt_dir = mount.mnt / "dcp" / "step-42"
    ckpt_dir.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt_dir)), no_dist=True)
    names = set(os.listdir(ckpt_dir))
    assert ".metadata" in names
    assert any(n.endswith(".distcp") for n in names)

    target = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "extra": {"step": torch.tensor(0)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(ckpt_dir)), no_dist=True)
    assert_same_state(target["model"], state["model"])
    assert int(target["extra"]["step"]) == 42

    mount.flush()
    files = mount.store_files()
    expected = {f"dcp/step-42/{n}": (ckpt_dir / n).read_bytes() for n in names}
    assert files == expected  # .metadata included, no .metadata.tmp or other temp names
    # .metadata is a commit marker: it reached the store after the data it describes
    order = uploaded_order(mount)
    data_keys = [k for k in expected if k.endswith(".distcp")]
    assert order.index("dcp/step-42/.metadata") > max(order.index(k) for k in data_keys), order

    # the store copy is a complete checkpoint on its own
    fresh = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "extra": {"step": torch.tensor(0)},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(fresh, storage_reader=dcp.FileSystemReader(str(mount.store / "dcp" / "step-42")), no_dist=True)
    assert_same_state(fresh["model"], state["model"])


def test_safetensors_round_trip(mount: Mount) -> None:
    tensors = {
        "embed": torch.randn(100, 64),
        "bias": torch.randn(64, dtype=torch.float64),
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    path = mount.mnt / "model.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    loaded = load_file(path)  # safetensors maps the file
    assert_same_state(loaded, tensors)
    mount.flush()
    assert mount.store_files() == {"model.safetensors": path.read_bytes()}
    assert_same_state(load_file(mount.store / "model.safetensors"), tensors)


def test_numpy_save_load(mount: Mount) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "weights.npy": rng.standard_normal((256, 64)).astype(np.float32),
        "counts.npy": np.arange(10_000, dtype=np.int64),
    }
    for name, array in arrays.items():
        np.save(mount.mnt / name, array)
    for name, array in arrays.items():
        np.testing.assert_array_equal(np.load(mount.mnt / name), array)
        mapped = np.load(mount.mnt / name, mmap_mode="r")
        assert isinstance(mapped, np.memmap)
        np.testing.assert_array_equal(mapped, array)
        del mapped
    np.savez(mount.mnt / "bundle.npz", **{k.removesuffix(".npy"): v for k, v in arrays.items()})
    with np.load(mount.mnt / "bundle.npz") as bundle:
        np.testing.assert_array_equal(bundle["weights"], arrays["weights.npy"])
        np.testing.assert_array_equal(bundle["counts"], arrays["counts.npy"])
    mount.flush()
    files = mount.store_files()
    assert set(files) == {"weights.npy", "counts.npy", "bundle.npz"}
    for name in files:
        assert files[name] == (mount.mnt / name).read_bytes()
    np.testing.assert_array_equal(np.load(mount.store / "weights.npy", mmap_mode="r"), arrays["weights.npy"])


def test_numpy_memmap_write(mount: Mount) -> None:
    """np.memmap in r+ mode writes through a shared mapping (FUSE writepage), not write()."""
    path = mount.mnt / "buffer.npy"
    np.save(path, np.zeros((128, 128), dtype=np.float32))
    mm = np.load(path, mmap_mode="r+")
    mm[10, :] = 7.0
    mm[:, 3] = -1.0
    mm.flush()
    del mm
    expected = np.zeros((128, 128), dtype=np.float32)
    expected[10, :] = 7.0
    expected[:, 3] = -1.0
    np.testing.assert_array_equal(np.load(path), expected)
    mount.flush()
    np.testing.assert_array_equal(np.load(mount.store / "buffer.npy"), expected)


def atomic_save(obj: object, final: Path, tmp: Path) -> None:
    """The usual "never leave a torn checkpoint" saver: write a temp file, fsync it, rename it over."""
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize("tmp_naming", ["fixed", "unique"])
@pytest.mark.core
def test_write_temp_then_rename_saver(mount: Mount, tmp_naming: str) -> None:
    final = mount.mnt / "model.pt"
    models = [small_transformer(seed=i).state_dict() for i in range(3)]
    for i, state in enumerate(models):
        tmp = mount.mnt / (f"model.pt.tmp{i}" if tmp_naming == "unique" else "model.pt.tmp")
        atomic_save(state, final, tmp)
        # vary where the drain is when the rename lands: before the temp file's upload, mid-way, after it
        if i == 1:
            mount.flush()
    last = final.read_bytes()
    assert_same_state(torch.load(final, weights_only=True), models[-1])
    assert os.listdir(mount.mnt) == ["model.pt"]
    mount.flush()
    assert mount.store_files() == {"model.pt": last}
    assert sorted(os.listdir(mount.store)) == ["model.pt"]  # no temp names, no leftover staging files
    assert_same_state(torch.load(mount.store / "model.pt", weights_only=True), models[-1])


def test_temp_then_rename_after_temp_is_uploaded(mount: Mount) -> None:
    """The temp file is already in the store when it is renamed: the store must end up with the final
    name only (copy + delete of the temp key), never with both."""
    final = mount.mnt / "model.pt"
    for i in range(3):
        tmp = mount.mnt / "model.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save(small_transformer(seed=i).state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        mount.flush()
        assert "model.pt.tmp" in mount.store_files()
        os.replace(tmp, final)
    mount.flush()
    assert mount.store_files() == {"model.pt": final.read_bytes()}
    assert_same_state(torch.load(mount.store / "model.pt", weights_only=True), small_transformer(seed=2).state_dict())
