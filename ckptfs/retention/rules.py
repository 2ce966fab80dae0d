"""Retention: which top-level checkpoints to delete so that the newest N remain.

A checkpoint is a top-level entry of the mount (a directory such as `global_step1000/` or a file such as
`step_1000.pt`). Kept, always: the newest `keep_last` complete checkpoints; whatever a pointer file names
(DeepSpeed's `latest` holding `global_step1000`, Megatron's `latest_checkpointed_iteration.txt` holding
`1000` for `iter_0001000`); anything matching a keep glob; checkpoints still being written or not yet
uploaded; and the pointer files themselves. "Newest" is by the step number in the name when every
candidate has one (`step_900` < `step_1000`, whatever their mtimes), else by modification time.

This module only decides (`plan`); retention/pruner.py deletes through the mount's namespace, so the journal and
the drain take the deletes to the store like any `rm -r`.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

_STEP = re.compile(r"(\d+)(?!.*\d)")  # the last run of digits in a name


@dataclass(frozen=True)
class Checkpoint:
    name: str
    mtime_ns: int
    complete: bool  # nothing under it open for writing or waiting to be uploaded


@dataclass(frozen=True)
class Plan:
    delete: list[str]
    keep: list[str]
    reasons: dict[str, str]  # name -> why it is kept


def step_of(name: str) -> int | None:
    match = _STEP.search(name)
    return int(match.group(1)) if match else None


def pinned_by_pointers(pointer_texts: dict[str, str], names: list[str]) -> dict[str, str]:
    """name -> the pointer file that names it. A pointer names an entry by its exact name (first line,
    trimmed, a trailing '/' or leading './' ignored) or, if it holds only a number, by that step number."""
    pinned: dict[str, str] = {}
    for pointer, text in pointer_texts.items():
        target = text.strip().splitlines()[0].strip() if text.strip() else ""
        target = target.removeprefix("./").rstrip("/").rsplit("/", 1)[-1]
        if not target:
            continue
        for name in names:
            if name == target or (target.isdigit() and step_of(name) == int(target)):
                pinned.setdefault(name, pointer)
    return pinned


def plan(
    checkpoints: list[Checkpoint], *, keep_last: int, keep_globs: tuple[str, ...] = (),
    pinned: dict[str, str] | None = None,
) -> Plan:
    pinned = pinned or {}
    reasons: dict[str, str] = {}
    candidates = []
    for ckpt in checkpoints:
        glob = next((g for g in keep_globs if fnmatch.fnmatchcase(ckpt.name, g)), None)
        if glob is not None:
            reasons[ckpt.name] = f"matches --keep {glob}"
            continue  # kept outside the count (a "best" model is not one of the last N)
        if ckpt.name in pinned:
            reasons[ckpt.name] = f"named by {pinned[ckpt.name]}"
        elif not ckpt.complete:
            reasons[ckpt.name] = "still being written or uploaded"
        candidates.append(ckpt)
    by_step = all(step_of(c.name) is not None for c in candidates)
    newest_first = sorted(
        (c for c in candidates if c.complete),
        key=lambda c: (step_of(c.name) or 0, c.mtime_ns) if by_step else (c.mtime_ns, 0),
        reverse=True,
    )
    for ckpt in newest_first[:keep_last]:
        reasons.setdefault(ckpt.name, f"one of the newest {keep_last}")
    delete = [c.name for c in newest_first[keep_last:] if c.name not in reasons]
    keep = sorted(reasons)
    return Plan(sorted(delete, key=lambda n: (step_of(n) or 0, n)), keep, reasons)
