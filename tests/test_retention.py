"""Retention: the rules (retention.plan), `ckptfs prune` on a real mount after a realistic run of ten
DeepSpeed-style checkpoints, and keep_last applied automatically after each completed checkpoint."""

from __future__ import annotations

import os
import time

import pytest
from conftest import Mount

from ckptfs.retention.rules import Checkpoint, pinned_by_pointers, plan, step_of


def test_newest_by_step_number_not_by_mtime() -> None:
    checkpoints = [Checkpoint(f"step_{n}", mtime_ns=-n, complete=True) for n in (100, 900, 1000, 50)]
    result = plan(checkpoints, keep_last=2)
    assert result.delete == ["step_50", "step_100"]
    assert set(result.keep) == {"step_900", "step_1000"}


def test_pointers_globs_and_incomplete_checkpoints_are_kept() -> None:
    names = ["global_step100", "global_step200", "global_step300", "global_step400", "best_model", "iter_0000500"]
    checkpoints = [Checkpoint(n, mtime_ns=i, complete=n != "global_step400") for i, n in enumerate(names)]
    pinned = pinned_by_pointers({"latest": "global_step100\n", "latest_checkpointed_iteration.txt": "500"}, names)
    assert pinned == {"global_step100": "latest", "iter_0000500": "latest_checkpointed_iteration.txt"}
    result = plan(checkpoints, keep_last=1, keep_globs=("best*",), pinned=pinned)
    # best_model is kept by its glob outside the count; iter_0000500 is the newest by step (and pinned).
    assert result.delete == ["global_step200", "global_step300"]
    assert "still being written" in result.reasons["global_step400"]
    assert "--keep best*" in result.reasons["best_model"]


def test_step_of() -> None:
    assert step_of("global_step1000") == 1000
    assert step_of("checkpoint-500") == 500
    assert step_of("iter_0001000") == 1000
    assert step_of("model.pt") is None


def _deepspeed_run(mnt: os.PathLike[str], steps: range) -> None:
    """What DeepSpeed's save_checkpoint leaves: a directory per step, then `latest` naming it."""
    for step in steps:
        tag = os.path.join(mnt, f"global_step{step}")
        os.makedirs(tag, exist_ok=True)
        for rank in range(2):
            with open(os.path.join(tag, f"mp_rank_{rank:02d}_model_states.pt"), "wb") as f:
                f.write(os.urandom(4096))
        with open(os.path.join(mnt, "latest"), "w") as f:
            f.write(f"global_step{step}")


def test_prune_after_ten_checkpoints(mount: Mount) -> None:
    _deepspeed_run(mount.mnt, range(100, 1100, 100))
    os.makedirs(mount.mnt / "best_eval")
    (mount.mnt / "best_eval" / "model.pt").write_bytes(b"best")
    mount.flush()

    dry = mount.cli("prune", str(mount.mnt), "--keep-last", "3", "--keep", "best_*", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    would = [line.split()[-1] for line in dry.stdout.splitlines() if line.startswith("would delete")]
    assert would == [f"global_step{s}" for s in range(100, 800, 100)]
    assert len(os.listdir(mount.mnt)) == 12  # nothing deleted by a dry run

    # The pointer names an older step, as after a rollback: it is kept besides the newest three.
    (mount.mnt / "latest").write_text("global_step500")
    mount.flush()
    result = mount.cli("prune", str(mount.mnt), "--keep-last", "3", "--keep", "best_*")
    assert result.returncode == 0, result.stderr
    expected = {"latest", "best_eval", "global_step500", "global_step800", "global_step900", "global_step1000"}
    assert set(os.listdir(mount.mnt)) == expected
    mount.flush()
    assert {p.split("/")[0] for p in mount.store_files()} == expected
    assert sorted(p.name for p in mount.store.iterdir()) == sorted(expected)


def test_pruned_checkpoints_leave_the_kernel_at_once(mount: Mount) -> None:
    """Retention deletes without a FUSE request: the names and listings the kernel held of the deleted
    checkpoints go with them. Failed before: stat still found a pruned file and its directory (the kernel
    keeps names while the root's listing is fresh, and no request reached the daemon)."""
    _deepspeed_run(mount.mnt, range(1, 4))
    mount.flush()
    old = mount.mnt / "global_step1" / "mp_rank_00_model_states.pt"
    assert sorted(os.listdir(mount.mnt)) == ["global_step1", "global_step2", "global_step3", "latest"]
    assert os.stat(old).st_size == 4096
    assert len(os.listdir(old.parent)) == 2
    result = mount.cli("prune", str(mount.mnt), "--keep-last", "1")
    assert result.returncode == 0, result.stderr
    for gone in (old, old.parent, mount.mnt / "global_step2"):
        with pytest.raises(FileNotFoundError):
            os.stat(gone)
    assert sorted(os.listdir(mount.mnt)) == ["global_step3", "latest"]


def test_keep_last_applies_after_each_completed_checkpoint(mount_factory) -> None:  # type: ignore[no-untyped-def]
    mount: Mount = mount_factory(extra_args=("--keep-last", "2"))
    _deepspeed_run(mount.mnt, range(1, 6))
    mount.flush()
    deadline = time.monotonic() + 30
    while sorted(os.listdir(mount.mnt)) != ["global_step4", "global_step5", "latest"]:
        assert time.monotonic() < deadline, os.listdir(mount.mnt)
        time.sleep(0.2)
    mount.flush()
    assert sorted(p.name for p in mount.store.iterdir()) == ["global_step4", "global_step5", "latest"]


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_prune_needs_a_positive_keep_last(mount: Mount, bad: str) -> None:
    result = mount.cli("prune", str(mount.mnt), "--keep-last", bad)
    assert result.returncode == 2 and "--keep-last" in result.stderr
