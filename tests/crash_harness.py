"""The randomized crash-and-fault harness (issue 12, "Nothing lost, ever").

Each round, from its own seed: a plan of checkpoint-like filesystem operations (step directories of shards
of random sizes, temp file + fsync + rename over existing files, direct writes, appends, truncates,
overwrites, deletes, file and directory renames, removal of old steps, a `latest` commit marker written
last) is run by a child process (tests/crash_writer.py) through a real ckptfs mount; it logs each
operation, fsynced, only after it returned. At a random moment the daemon gets SIGKILL (mid-workload,
mid-drain, mid-spill, or a fresh node mid-fetch) and is restarted on the same cache dir. Then, on a model
replayed from the writer's log:

  1. at the kill point (daemon dead): every object at a final name in the store is a version some file had
     when it was closed (no torn object), and if `latest` is in the store, every file closed before that
     marker was written is there with the bytes it had then (unless the workload changed it afterwards);
  2. after the restart the mount holds the model exactly (the operation in flight applied or not; a write
     in flight may have reached the mount up to any point);
  3. after `ckptfs flush` the store holds exactly the mount's files, bytes and directories (no temp name,
     no deleted file back, no leftover multipart upload), and the journal (read read-only) agrees with the
     store: every inode clean at its own key with its size (and checksum where it is a plain crc32);
  4. a fresh node (new cache dir) on the same store sees the same tree and bytes.

Options add store faults (tests/faultproxy.py in front of SeaweedFS; each round checks that the faults it
chose fired) and a full cache filesystem (a small tmpfs under the cache dir, partly filled by "someone
else": writes wait or get ENOSPC, nothing closed is lost, the journal survives). `--nodes N` (2 or 3) runs
N daemons on one store instead, each writing its shards of every step, with the harness as the job's
barrier before node 0 writes the step's commit marker, and kills of any node: a check that polls the store
all along says that no marker is ever there before the files any node closed before the barrier (see the
comment above MULTI_MARKERS, and docs/design/crash-harness.md).

    python -m tests.crash_harness --rounds 100 --seed 7 --store file
    python -m tests.crash_harness --rounds 30 --seed 7 --store seaweedfs --faults
    python -m tests.crash_harness --seed 7 --store file --round 17 --rounds 1      # replay round 17
    python -m tests.crash_harness --rounds 20 --seed 7 --store file --nodes 2
    python -m tests.crash_harness --rounds 20 --seed 7 --store file --preempt

`--preempt` (issue 44): every step ends with a commit marker of its own (`step/COMMITTED`, before the
`latest` pointer), and at a random moment of the workload `ckptfs preempt --deadline D --no-wait` reorders
the drain (the newest complete step first; a step's marker then waits for its own step only) before the
kill: at the kill point, no step marker is in the store without every file its step had closed before it
(nothing published over a hole), and the checks after the restart say nothing was lost.

One line per round, then a summary. The workload, the kill mode and the kill point (an operation index)
are functions of the seed and the round index; only the exact instant within the kill window depends on
timing. A failing round prints the replay command and the first difference, and keeps its directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # `python -m tests.crash_harness` from the repo: the helpers import flat
    sys.path.insert(0, str(TESTS))

from conftest import Mount  # noqa: E402
from crash_writer import EXIT_MOUNT_GONE, data_for  # noqa: E402

from ckptfs.control.client import canonical_mountpoint  # noqa: E402
from ckptfs.drain import BURST_QUIET  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
# The cache budget of rounds that kill while a file larger than it is written (spill rounds).
SPILL_CACHE_SIZE = 24 * MiB
MARKER = "latest"
MARKER_PREFIX = b"ckpt-marker "
STEP_MARKER = "COMMITTED"  # --preempt: a step's own commit marker (one of the default commit_markers)
PREEMPT_UPLOAD_LIMIT = "8M"  # --preempt: the workload's daemon uploads at most this fast (until the notice)
TEMP_PREFIX = ".ckptfs-tmp."
NOTES_DIR = f"{TEMP_PREFIX}notes"  # the stores' bookkeeping notes (pending records of cross-node ordering)
WRITE_CHUNK = 1 * MiB  # one plan op per chunk: a kill lands between chunks as often as inside one
KEEP_STEPS = 2
S3_PREFIX_ROOT = "crash"

Op = dict[str, Any]


class RoundFailed(Exception):
    """A checked invariant does not hold; the message is the first difference."""


class KnownBug(RoundFailed):
    """A failure with the exact signature of an open bug that has its xfail(strict=True) regression test:
    reported as such, and not counted as a new failure (unless --strict)."""

    def __init__(self, test: str, message: str) -> None:
        super().__init__(f"{message} [known bug: tests/test_crash_harness.py::{test}]")
        self.test = test


def digest(data: bytes | bytearray) -> str:
    return hashlib.sha1(data).hexdigest()


# -- the workload ---------------------------------------------------------------------------------------


class PlanBuilder:
    """Generates a plan from a seeded RNG, tracking the namespace it creates so that every operation is
    valid when the previous ones succeeded (paths exist, directories are empty before rmdir, no open file
    is renamed or deleted)."""

    def __init__(self, rng: random.Random, tag: str, files: dict[str, int], dirs: set[str],
                 size_scale: str = "small", unlisted_dir_ops: bool = False) -> None:
        self.rng = rng
        # False: list a tree before removing it (as shutil.rmtree does) or renaming it (as a job that looks
        # at a checkpoint before archiving it does). True: rmdir and rename without listing first, which
        # hits two open bugs on a fresh node (test_fresh_node_rmdir_of_a_never_listed_directory_..., and
        # test_fresh_node_rename_of_a_never_listed_directory_keeps_its_files in test_crash_harness.py).
        self.unlisted_dir_ops = unlisted_dir_ops
        self.tag = tag
        self.files = files  # path -> size
        self.dirs = dirs
        self.size_scale = size_scale
        self.ops: list[Op] = []
        self.markers = 0
        # Gateway rounds: half the files stay open a moment after their last write, as an NFS server keeps
        # them, so that the drain uploads them while open (drawn only then: other rounds replay unchanged).
        self.hold_open = False
        self.step_markers = False  # --preempt: each step gets a commit marker of its own (STEP_MARKER)
        # The cache budget of the round: a file above it cannot be opened for writing without O_TRUNC, nor
        # truncated above 0, once its data left the cache (EFBIG: docs/SEMANTICS.md, "What needs the whole
        # content waits for it"). Spill rounds set it; mutate() then renames such a file instead.
        self.cache_budget = math.inf

    # sizes: mostly small so rounds are fast; now and then a large one
    def size(self) -> int:
        roll = self.rng.random()
        if self.size_scale == "full-cache":
            return self.rng.choice([self.rng.randint(0, 64 * KiB), self.rng.randint(4 * MiB, 14 * MiB)])
        if roll < 0.08:
            return 0
        if roll < 0.70:
            return self.rng.randint(1, 64 * KiB)
        if roll < 0.96:
            return self.rng.randint(64 * KiB, 2 * MiB)
        # Up to 40 MiB: with the small part sizes some rounds draw, files above 17 MiB upload while they are
        # written (one part past the 16 MiB spill lookahead).
        return self.rng.randint(4 * MiB, 40 * MiB)

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def write_chunks(self, path: str, offset: int, size: int) -> None:
        # Half the large writes are slow, as a trainer's are: the drain then sees the file open and growing
        # (upload while writing) instead of closed a few milliseconds after its first byte.
        pause = 0.03 if size > 16 * MiB and self.rng.random() < 0.5 else 0.0
        done = 0
        while done < size or (size == 0 and done == 0):
            n = min(WRITE_CHUNK, size - done)
            if n == 0:
                break
            op: Op = {"op": "write", "path": path, "offset": offset + done, "seed": self.rng.getrandbits(48),
                      "size": n}
            if pause:
                op["pause"] = pause
            self.add(op)
            done += n

    def write_file(self, path: str, size: int, *, style: str | None = None) -> None:
        """Create or replace `path` with `size` new bytes: directly, or through a temp file renamed over it."""
        style = style or self.rng.choice(["direct", "direct", "direct_fsync", "temp_rename"])
        target = path
        if style == "temp_rename":
            parent, _, name = path.rpartition("/")
            target = f"{parent}/.{name}.tmp" if parent else f".{name}.tmp"
        self.add({"op": "open", "path": target, "trunc": True})
        self.write_chunks(target, 0, size)
        if style != "direct":
            self.add({"op": "fsync", "path": target})
        if self.hold_open and self.ops and self.rng.random() < 0.5:
            self.ops[-1]["pause"] = self.rng.uniform(0.1, 0.4)
        self.add({"op": "close", "path": target})
        if style == "temp_rename":
            self.add({"op": "rename", "src": target, "dst": path})
        self.files[path] = size

    def mutate(self) -> None:
        """One change to an existing closed file (never the marker: it is written last, on purpose)."""
        candidates = sorted(p for p in self.files if p != MARKER)
        if not candidates:
            return
        path = self.rng.choice(candidates)
        kind = self.rng.choice(["append", "truncate", "overwrite", "unlink", "rename", "rename_over"])
        size = self.files[path]
        if kind in ("append", "truncate", "overwrite") and size > self.cache_budget:
            kind = "rename"  # it needs the whole content in the cache, which cannot hold it
        if kind == "append":
            n = self.rng.randint(1, 256 * KiB)
            self.add({"op": "open", "path": path, "trunc": False})
            self.write_chunks(path, size, n)
            self.add({"op": "close", "path": path})
            self.files[path] = size + n
        elif kind == "truncate":
            new = self.rng.choice([0, size // 2, size + self.rng.randint(1, 100 * KiB)])
            self.add({"op": "truncate", "path": path, "size": new})
            self.files[path] = new
        elif kind == "overwrite":
            offset = self.rng.randint(0, size)
            n = self.rng.randint(1, 128 * KiB)
            self.add({"op": "open", "path": path, "trunc": False})
            self.write_chunks(path, offset, n)
            self.add({"op": "close", "path": path})
            self.files[path] = max(size, offset + n)
        elif kind == "unlink":
            self.add({"op": "unlink", "path": path})
            del self.files[path]
        elif kind == "rename":
            parent, _, name = path.rpartition("/")
            dst = f"{parent}/{name}.moved" if parent else f"{name}.moved"
            if dst in self.files or dst in self.dirs:
                return
            self.add({"op": "rename", "src": path, "dst": dst})
            self.files[dst] = self.files.pop(path)
        else:  # rename over another existing file
            others = [p for p in candidates if p != path]
            if not others:
                return
            dst = self.rng.choice(others)
            self.add({"op": "rename", "src": path, "dst": dst})
            self.files[dst] = self.files.pop(path)

    def list_tree(self, top: str) -> None:
        if not self.unlisted_dir_ops:
            for d in sorted(d for d in self.dirs if d == top or d.startswith(top + "/")):
                self.add({"op": "listdir", "path": d})

    def remove_tree(self, top: str) -> None:
        self.list_tree(top)
        for path in sorted((p for p in self.files if p.startswith(top + "/")), reverse=True):
            self.add({"op": "unlink", "path": path})
            del self.files[path]
        for d in sorted((d for d in self.dirs if d == top or d.startswith(top + "/")), key=len, reverse=True):
            self.add({"op": "rmdir", "path": d})
            self.dirs.discard(d)

    def rename_tree(self, src: str, dst: str) -> None:
        self.list_tree(src)
        self.add({"op": "rename", "src": src, "dst": dst})
        for path in [p for p in self.files if p.startswith(src + "/")]:
            self.files[dst + path[len(src):]] = self.files.pop(path)
        for d in [d for d in self.dirs if d == src or d.startswith(src + "/")]:
            self.dirs.discard(d)
            self.dirs.add(dst + d[len(src):])

    def mkdir(self, path: str) -> None:
        self.add({"op": "mkdir", "path": path})
        self.dirs.add(path)

    def steps(self) -> list[str]:
        return sorted(d for d in self.dirs if d.startswith("step_") and "/" not in d)

    def checkpoint(self, step_no: int, *, big_file: int = 0) -> None:
        """One checkpoint, the way trainers write them, ending with the commit marker."""
        step = f"step_{step_no:05d}"
        staged = self.rng.random() < 0.3 and step not in self.dirs  # Orbax style: a temp dir renamed at the end
        top = f"{step}.tmp-{self.tag}" if staged else step
        if top not in self.dirs:
            self.mkdir(top)
        sub = None
        if self.rng.random() < 0.3:
            sub = f"{top}/optim"
            if sub not in self.dirs:
                self.mkdir(sub)
        for i in range(self.rng.randint(1, 4)):
            where = sub if sub and self.rng.random() < 0.5 else top
            self.write_file(f"{where}/shard-{i}.bin", self.size())
        if big_file:
            self.write_file(f"{top}/big.bin", big_file, style="direct")
        if self.rng.random() < 0.4:  # a file that every checkpoint replaces: temp + fsync + rename over it
            self.write_file("model.pt", self.size(), style="temp_rename")
        for _ in range(self.rng.randint(0, 3)):
            self.mutate()
        if self.step_markers:
            self.markers += 1
            self.write_step_marker(f"{top}/{STEP_MARKER}",
                                   MARKER_PREFIX + f"{step} {self.tag}:{self.markers} step\n".encode())
        if staged:
            if step in self.dirs:
                self.remove_tree(step)
            self.rename_tree(top, step)
        old = self.steps()[:-KEEP_STEPS]
        for victim in old:
            if self.rng.random() < 0.5 and f"archive/{victim}" not in self.dirs:
                if "archive" not in self.dirs:
                    self.mkdir("archive")
                self.rename_tree(victim, f"archive/{victim}")
            else:
                self.remove_tree(victim)
        self.markers += 1
        content = MARKER_PREFIX + f"{step} {self.tag}:{self.markers}\n".encode()
        self.write_marker(content)

    def write_step_marker(self, path: str, content: bytes) -> None:
        """A step's own commit marker, written in place (DCP's .metadata, a COMMITTED file)."""
        self.add({"op": "open", "path": path, "trunc": True})
        self.add({"op": "write_bytes", "path": path, "offset": 0, "hex": content.hex()})
        self.add({"op": "close", "path": path})
        self.files[path] = len(content)

    def write_marker(self, content: bytes) -> None:
        # The marker's bytes are fixed, not random: they name the checkpoint. Encoded as a write op of a
        # special seed (-1) that the writer cannot produce, so the plan stays JSON and the model exact.
        style = self.rng.choice(["direct", "temp_rename"])
        target = MARKER if style == "direct" else ".latest.tmp"
        self.add({"op": "open", "path": target, "trunc": True})
        self.add({"op": "write_bytes", "path": target, "offset": 0, "hex": content.hex()})
        self.add({"op": "fsync", "path": target})
        self.add({"op": "close", "path": target})
        if style == "temp_rename":
            self.add({"op": "rename", "src": target, "dst": MARKER})
        self.files[MARKER] = len(content)


def op_data(op: Op) -> bytes:
    if op["op"] == "write_bytes":
        return bytes.fromhex(op["hex"])
    return data_for(op["seed"], op["size"])


# -- the model --------------------------------------------------------------------------------------------


@dataclass
class MarkerSnapshot:
    position: int  # index in the applied-operation list at which the marker's content was closed
    files: dict[str, str]  # path -> digest of every closed file at that moment


@dataclass
class Model:
    """What the mount must hold, replayed from the writer's log."""

    files: dict[str, bytearray] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    open_paths: set[str] = field(default_factory=set)
    versions: set[str] = field(default_factory=lambda: {digest(b"")})  # every content a closed file had
    markers: dict[str, MarkerSnapshot] = field(default_factory=dict)  # marker digest -> snapshot
    applied: list[Op] = field(default_factory=list)

    def copy(self) -> Model:
        return dataclasses.replace(
            self, files={p: bytearray(d) for p, d in self.files.items()}, dirs=set(self.dirs),
            open_paths=set(self.open_paths), versions=set(self.versions), markers=dict(self.markers),
            applied=list(self.applied),
        )

    def apply(self, op: Op, upto: int | None = None) -> None:
        kind = op["op"]
        if kind == "mkdir":
            self.dirs.add(op["path"])
        elif kind == "rmdir":
            self.dirs.discard(op["path"])
        elif kind == "open":
            self.open_paths.add(op["path"])
            if op["trunc"] or op["path"] not in self.files:
                self.files[op["path"]] = bytearray()
        elif kind in ("write", "write_bytes"):
            data = op_data(op)[:upto] if upto is not None else op_data(op)
            content = self.files[op["path"]]
            end = op["offset"] + len(data)
            if len(content) < end:
                content.extend(bytes(end - len(content)))
            content[op["offset"]:end] = data
        elif kind == "close":
            self.open_paths.discard(op["path"])
            content = self.files[op["path"]]
            self.versions.add(digest(content))
            if content.startswith(MARKER_PREFIX):
                closed = {p: digest(d) for p, d in self.files.items() if p not in self.open_paths}
                self.markers[digest(content)] = MarkerSnapshot(len(self.applied), closed)
        elif kind == "truncate":
            content = self.files[op["path"]]
            if op["size"] <= len(content):
                del content[op["size"]:]
            else:
                content.extend(bytes(op["size"] - len(content)))
            if op["path"] not in self.open_paths:
                self.versions.add(digest(content))
        elif kind == "unlink":
            del self.files[op["path"]]
        elif kind == "rename":
            self._rename(op["src"], op["dst"])
        self.applied.append(op)

    def _rename(self, src: str, dst: str) -> None:
        if src in self.files:
            self.files[dst] = self.files.pop(src)
            return
        self.dirs.discard(dst)  # an empty directory replaced by the rename
        for path in [p for p in self.files if p.startswith(src + "/")]:
            self.files[dst + path[len(src):]] = self.files.pop(path)
        for d in [d for d in self.dirs if d == src or d.startswith(src + "/")]:
            self.dirs.discard(d)
            self.dirs.add(dst + d[len(src):])

    def apply_log(self, plan: list[Op], log_path: Path, *, eio_at_kill: bool = False) -> tuple[Op | None, list[str]]:
        """Replay the writer's log. Returns the operation in flight when the log ends (None if the writer
        finished) and the failed operations, as text. eio_at_kill: the last entry, if it is an EIO, is the
        kernel's answer to a request the killed daemon never answered: in flight, not a failure. So is one
        followed only by closes: close(2) returns 0 on a dead mount (the release is never answered either)."""
        cursor = LogCursor()
        failures = self.apply_lines(plan, log_path.read_text().splitlines(), cursor, eio_at_kill=eio_at_kill)
        return cursor.in_flight(plan), failures

    def apply_lines(self, plan: list[Op], lines: list[str], cursor: LogCursor, *,
                    eio_at_kill: bool = False) -> list[str]:
        """Apply log lines (all of a log, or the next ones: `cursor` says where the plan is) and return the
        failed operations, as text (see apply_log)."""
        failures: list[str] = []
        next_index = cursor.next_index
        partial = cursor.partial
        closes_after = 0  # entries at the end of the log that are successful closes
        for line in reversed(lines):
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if "err" not in entry and "upto" not in entry and plan[entry["i"]]["op"] == "close":
                    closes_after += 1
                    continue
            break
        for n, line in enumerate(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                break  # a torn last line cannot be: the writer fsyncs whole lines; stop at it anyway
            index = entry["i"]
            op = plan[index]
            if eio_at_kill and n == len(lines) - 1 - closes_after and entry.get("err") == errno.EIO:
                if entry.get("upto"):
                    partial[index] = entry["upto"]
                break
            if "err" in entry:
                failures.append(f"op #{index} {describe(op)} failed: {errno.errorcode.get(entry['err'], entry['err'])}")
                if op["op"] in ("write", "write_bytes") and entry.get("upto"):
                    self.apply(op, upto=entry["upto"])
                elif op["op"] == "close":
                    self.open_paths.discard(op["path"])
                next_index = index + 1
            elif "upto" in entry:
                partial[index] = entry["upto"]
            else:
                self.apply(op)
                next_index = index + 1
        cursor.next_index = next_index
        return failures


@dataclass
class LogCursor:
    """How far a writer's log has been applied to a model."""

    next_index: int = 0  # the first operation not applied yet
    partial: dict[int, int] = field(default_factory=dict)  # short writes: op index -> bytes in the mount

    def in_flight(self, plan: list[Op]) -> Op | None:
        in_flight = plan[self.next_index] if self.next_index < len(plan) else None
        if in_flight is not None and self.next_index in self.partial:  # a short write in the mount, in part
            in_flight = dict(in_flight, already=self.partial[self.next_index])
        return in_flight


def describe(op: Op) -> str:
    if op["op"] == "rename":
        return f"rename {op['src']} -> {op['dst']}"
    if op["op"] == "wait":
        return f"wait for {Path(op['file']).name}"
    extra = ""
    if op["op"] in ("write", "write_bytes"):
        extra = f" offset={op['offset']} size={op.get('size', len(op.get('hex', '')) // 2)}"
    elif op["op"] == "truncate":
        extra = f" size={op['size']}"
    return f"{op['op']} {op['path']}{extra}"


# -- trees and their differences --------------------------------------------------------------------------


@dataclass
class Tree:
    files: dict[str, bytes]
    dirs: set[str]
    temps: list[str] = field(default_factory=list)
    # file:// only: temps that are hard links of the object at their final name (see KnownBug uses)
    linked_temps: list[str] = field(default_factory=list)
    # notes below .ckptfs-tmp.notes/ (names relative to it): bookkeeping, not objects (pending/<node>/<gen>)
    notes: list[str] = field(default_factory=list)


def read_mount(root: Path, keep: Callable[[str], bool] | None = None) -> Tree:
    """The tree under `root`, with the bytes of every file (of those `keep` accepts: other nodes' files are
    not read through a node's mount, which would fetch them)."""
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    for top, dirnames, filenames in os.walk(root):
        rel_top = os.path.relpath(top, root)
        for d in dirnames:
            dirs.add(os.path.normpath(os.path.join(rel_top, d)))
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_top, name))
            if keep is not None and not keep(rel):
                continue
            with open(os.path.join(top, name), "rb") as f:
                files[rel] = f.read()
    return Tree(files, dirs)


def first_difference(actual: Tree, files: dict[str, bytes | bytearray], dirs: set[str], what: str) -> str | None:
    for path in sorted(set(files) | set(actual.files)):
        if path not in actual.files:
            return f"{what}: file {path} is missing ({len(files[path])} bytes expected)"
        if path not in files:
            return f"{what}: file {path} should not exist (it has {len(actual.files[path])} bytes)"
        got, want = actual.files[path], files[path]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return f"{what}: file {path} differs: {len(got)} bytes, expected {len(want)}; first difference at byte {at}"
    for d in sorted(set(dirs) ^ actual.dirs):
        return f"{what}: directory {d} " + ("is missing" if d in dirs else "should not exist")
    return None


def match_in_flight(actual: Tree, before: Model, in_flight: Op | None) -> tuple[Model, str | None]:
    """The model the mount matches: before the operation in flight, after it, or (a write) part of it."""
    problem = first_difference(actual, before.files, before.dirs, "mount after restart")  # type: ignore[arg-type]
    if problem is None or in_flight is None:
        return before, problem
    after = before.copy()
    after.apply(in_flight)
    if first_difference(actual, after.files, after.dirs, "mount") is None:  # type: ignore[arg-type]
        return after, None
    if in_flight["op"] in ("write", "write_bytes"):
        path, data, offset = in_flight["path"], op_data(in_flight), in_flight["offset"]
        got = actual.files.get(path, b"")[offset:offset + len(data)]
        reached = next((i for i, (a, b) in enumerate(zip(got, data, strict=False)) if a != b), len(got))
        partial = before.copy()
        partial.apply(in_flight, upto=reached)
        if first_difference(actual, partial.files, partial.dirs, "mount") is None:  # type: ignore[arg-type]
            return partial, None
    return before, f"{problem} (the operation in flight was: {describe(in_flight)})"


# -- stores --------------------------------------------------------------------------------------------------


class ObjectReader(Protocol):
    """Cheap reads for the continuous check of multi-node rounds: a token changes when an object is replaced."""

    def listing(self) -> dict[str, Any]: ...
    def fetch(self, path: str) -> tuple[Any, bytes] | None: ...


class StoreView(ObjectReader, Protocol):
    source: str
    daemon_args: tuple[str, ...]

    def snapshot(self) -> Tree: ...
    def leftover_uploads(self) -> list[str]: ...


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.source = f"file://{root}"
        self.daemon_args: tuple[str, ...] = ()

    def snapshot(self) -> Tree:
        tree = Tree({}, set())
        staging = self.root / f"{TEMP_PREFIX}staging"  # LocalStore's temp files: <owner>.<token>.<quoted key>
        notes = self.root / NOTES_DIR
        for top, _, filenames in os.walk(notes):
            tree.notes += sorted(os.path.relpath(os.path.join(top, n), notes) for n in filenames
                                 if not n.startswith(TEMP_PREFIX))
        for name in sorted(os.listdir(staging)) if staging.is_dir() else []:
            tree.temps.append(f"{staging.name}/{name}")
            with contextlib.suppress(OSError):
                if os.path.samefile(staging / name, self.root / urllib.parse.unquote(name.split(".", 2)[-1])):
                    tree.linked_temps.append(f"{staging.name}/{name}")
        for top, dirnames, filenames in os.walk(self.root):
            rel_top = os.path.relpath(top, self.root)
            dirnames[:] = [d for d in dirnames if d not in (staging.name, NOTES_DIR)]
            for d in dirnames:
                tree.dirs.add(os.path.normpath(os.path.join(rel_top, d)))
            for name in filenames:
                rel = os.path.normpath(os.path.join(rel_top, name))
                if name.startswith(TEMP_PREFIX):
                    tree.temps.append(rel)
                    continue
                with contextlib.suppress(FileNotFoundError), open(os.path.join(top, name), "rb") as f:
                    tree.files[rel] = f.read()
        return tree

    def leftover_uploads(self) -> list[str]:
        return []

    def listing(self) -> dict[str, Any]:
        """Every object at a final name (no temp, no note), with a token of its version."""
        out: dict[str, Any] = {}
        for top, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if not d.startswith(TEMP_PREFIX)]
            rel_top = os.path.relpath(top, self.root)
            for name in filenames:
                if name.startswith(TEMP_PREFIX):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.lstat(os.path.join(top, name))
                    out[os.path.normpath(os.path.join(rel_top, name))] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    def fetch(self, path: str) -> tuple[Any, bytes] | None:
        try:
            fd = os.open(self.root / path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)  # the version read, even if another replaced the name since it was listed
            return (st.st_ino, st.st_size, st.st_mtime_ns), f.read()


class S3Store:
    def __init__(self, server: Any, bucket: str, prefix: str, endpoint: str) -> None:
        self.client = server.client()
        self.bucket = bucket
        self.prefix = prefix
        self.source = f"s3://{bucket}/{prefix}"
        self.daemon_args: tuple[str, ...] = ("--endpoint-url", endpoint)

    def snapshot(self) -> Tree:
        tree = Tree({}, set())
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self.prefix):]
                if rel.startswith(NOTES_DIR + "/"):
                    tree.notes.append(rel[len(NOTES_DIR) + 1:])
                elif TEMP_PREFIX in rel:
                    tree.temps.append(rel)
                elif rel.endswith("/"):
                    tree.dirs.add(rel.rstrip("/"))
                else:
                    with contextlib.suppress(self.client.exceptions.NoSuchKey):
                        tree.files[rel] = self.client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read()
        return tree

    def leftover_uploads(self) -> list[str]:
        answer = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix)
        return [u["Key"] for u in answer.get("Uploads", [])]

    def listing(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self.prefix):]
                if TEMP_PREFIX not in rel and not rel.endswith("/"):
                    out[rel] = (obj["ETag"], obj["Size"])
        return out

    def fetch(self, path: str) -> tuple[Any, bytes] | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self.prefix + path)
        except self.client.exceptions.NoSuchKey:
            return None
        return (answer["ETag"], answer["ContentLength"]), answer["Body"].read()


# -- invariants --------------------------------------------------------------------------------------------


def check_kill_point(store: Tree, model: Model, in_flight: Op | None) -> None:
    """With the daemon dead: no torn object, and a marker in the store never points at missing data."""
    versions = set(model.versions)
    if in_flight is not None and in_flight["op"] in ("close", "truncate"):
        # The daemon may have done it (and uploaded the result) though the writer never heard back.
        after = model.copy()
        after.apply(in_flight)
        versions |= after.versions
    for path, data in sorted(store.files.items()):
        if digest(data) not in versions:
            raise RoundFailed(f"kill point: store object {path} ({len(data)} bytes) is no version any file had "
                              "when it was closed (a torn or stale object)")
    if MARKER not in store.files:
        return
    snapshot = model.markers.get(digest(store.files[MARKER]))
    if snapshot is None:
        raise RoundFailed(f"kill point: the store's {MARKER} ({store.files[MARKER][:60]!r}) was never closed")
    later = model.applied[snapshot.position + 1:] + ([in_flight] if in_flight else [])
    touched: list[str] = []
    for op in later:
        if op["op"] in ("listdir", "read", "fsync"):
            continue  # they change nothing
        touched += [op[k] for k in ("path", "src", "dst") if k in op]
    for path, want in sorted(snapshot.files.items()):
        if path == MARKER or any(path == t or path.startswith(t + "/") for t in touched):
            continue
        if path not in store.files:
            raise RoundFailed(f"kill point: {MARKER} ({store.files[MARKER].strip().decode()}) is in the store but "
                              f"{path}, closed before it (op #{snapshot.position}), is not")
        if digest(store.files[path]) != want:
            raise RoundFailed(f"kill point: {MARKER} ({store.files[MARKER].strip().decode()}) is in the store but "
                              f"{path} holds other bytes than it had when the marker was written")


def touched_after(model: Model, position: int, in_flight: Op | None) -> list[str]:
    """The paths the operations after `position` (and the one in flight) changed."""
    touched: list[str] = []
    for op in model.applied[position + 1:] + ([in_flight] if in_flight else []):
        if op["op"] not in ("listdir", "read", "fsync"):
            touched += [op[k] for k in ("path", "src", "dst") if k in op]
    return touched


def check_step_markers(store: Tree, model: Model, in_flight: Op | None) -> None:
    """--preempt, with the daemon dead: every step marker in the store (STEP_MARKER) has every file its step
    had closed before it there with those bytes: no step is published over a hole, in whatever order a
    preemption notice made the drain go. (A step renamed since is not checked: its paths then were others.)"""
    for path, data in sorted(store.files.items()):
        if not path.endswith("/" + STEP_MARKER):
            continue
        snapshot = model.markers.get(digest(data))
        if snapshot is None:
            continue  # changed since by the workload (mutate): no longer a marker's content
        step = path.rsplit("/", 1)[0]
        if snapshot.files.get(path) != digest(data):
            continue  # written under another name (a staged dir renamed after)
        touched = touched_after(model, snapshot.position, in_flight)
        for file_path, want in sorted(snapshot.files.items()):
            if not file_path.startswith(step + "/") or file_path == path:
                continue
            if any(file_path == t or file_path.startswith(t + "/") or t.startswith(file_path + "/") for t in touched):
                continue
            if file_path not in store.files:
                raise RoundFailed(f"kill point: {path} is in the store but {file_path}, closed before it (op "
                                  f"#{snapshot.position}), is not: a step published over a hole")
            if digest(store.files[file_path]) != want:
                raise RoundFailed(f"kill point: {path} is in the store but {file_path} holds other bytes than it "
                                  "had when the marker was written")


def check_store_matches(store: Tree, mount: Tree, leftovers: list[str]) -> None:
    if store.temps:
        raise RoundFailed(f"store after flush: temp objects left: {sorted(store.temps)[:5]}")
    problem = first_difference(store, mount.files, mount.dirs, "store after flush")  # type: ignore[arg-type]
    if problem:
        raise RoundFailed(problem)
    if leftovers:
        raise RoundFailed(f"store after flush: multipart uploads left behind: {leftovers[:5]}")


def flush_and_check(m: Mount, store: StoreView, check_faults: Callable[[], None]) -> None:
    """Check 3: after `ckptfs flush` the store holds exactly the mount's tree, no leftover upload, and the
    journal agrees with it; the round's faults fired as planned."""
    m.flush(timeout=300)
    mount_tree = read_mount(m.mnt)
    stored = store.snapshot()
    check_store_matches(stored, mount_tree, store.leftover_uploads())
    check_journal_against_store(m.cache / "journal.db", stored)
    check_faults()


def check_journal_against_store(journal_path: Path, store: Tree, only: set[str] | None = None) -> None:
    """The journal, read-only, against the store itself (not the cache): after a flush every linked inode is
    in the store at its own key ('clean', or 'remote' when the cache holds none or only part of it: evicted,
    imported, or read by chunks), and the object there has the journal's size (and crc32, where it keeps one).
    `only`: the paths this node wrote (multi-node rounds: what it imported from others' listings may be
    stale until its next refresh, and the store holds much it never saw)."""
    db = sqlite3.connect(f"file:{journal_path}?mode=ro", uri=True, timeout=10)
    try:
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise RoundFailed("journal: quick_check failed")
        rows = db.execute("SELECT path, kind, state, remote_key, size, checksum FROM inodes "
                          "WHERE path IS NOT NULL AND id != 1").fetchall()
        deletes = db.execute("SELECT key FROM pending_deletes").fetchall()
    finally:
        db.close()
    if only is not None:
        rows = [r for r in rows if r[0] in only]
    for path, kind, state, remote_key, size, checksum in sorted(rows):
        key = path + "/" if kind == "dir" else path
        if state not in ("clean", "remote") or remote_key != key:
            raise RoundFailed(f"journal after flush: {path} is {state} at key {remote_key!r}, "
                              f"expected clean or remote at {key!r}")
        if kind == "dir":
            if path not in store.dirs:
                raise RoundFailed(f"journal after flush: directory {path} is clean but not in the store")
            continue
        if path not in store.files:
            raise RoundFailed(f"journal after flush: {path} is clean but not in the store")
        if len(store.files[path]) != size:
            raise RoundFailed(f"journal after flush: {path} has {size} bytes in the journal, "
                              f"{len(store.files[path])} in the store")
        if checksum and checksum.startswith("crc32:") and checksum != f"crc32:{zlib.crc32(store.files[path]):08x}":
            raise RoundFailed(f"journal after flush: {path}: the journal's {checksum} is not the store object's")
    if deletes:
        raise RoundFailed(f"journal after flush: pending deletes left: {[d[0] for d in deletes][:5]}")
    if only is not None:
        return
    journal_paths = {r[0] for r in rows}
    for path in sorted((set(store.files) | store.dirs) - journal_paths):
        raise RoundFailed(f"journal after flush: the store holds {path}, the journal does not know it")


# -- several nodes (--nodes N) --------------------------------------------------------------------------------
#
# N daemons mount one store, each with its own cache dir. Node n writes its shards of each step
# (step_K/shard_<n>_<i>, some through temp + rename, some changed again before the barrier) and sometimes
# model_<n>.pt (temp + rename over it, every few steps: a file replaced after a barrier). The harness is the
# job's barrier: once every node's writer has logged its last operation of step K (its closes returned),
# it creates the file the writers' "wait" op waits for, and node 0 writes the step's commit marker
# (step_K/.metadata, the top-level `latest`, or both; directly or through a temp renamed over it). Other
# nodes wait at the barrier too (lockstep) or go on with the next step at once, as a trainer does after an
# asynchronous save. SIGKILLs hit any node at any moment; a killed node restarts on its cache dir and its
# writer starts its step again (from the barrier, if it had got there). The check, run every POLL_STORE s
# while the round runs, at each kill and at the end: a marker in the store means that every file closed on
# any node before the barrier of its step is there with the bytes it had then, unless an operation after
# the barrier (or one in flight) changed, moved or removed it.
#
# Orbax rounds (a share of the rounds, ORBAX_SHARE, or every round with --orbax) write some steps the way
# Orbax's multi-host save does: one node (the maker, drawn) makes `step_K.orbax-checkpoint-tmp-<tag>/`, the
# others wait until it shows in their mounts (`ckptfs refresh`, or the daemon's refresh_interval: drawn per
# node), every node writes its shards into it, the nodes other than node 0 flush them before the barrier or
# not (drawn per step), and after the barrier node 0 (the primary) renames the tmp dir to `step_K` and writes
# the markers into it. The rename waits for the other nodes' pending records that name the tmp dir
# (rename_wait), then lists it from the store, so every shard closed before the barrier moves with it: the
# check maps the tmp dir's paths to the final ones, and after the last flush nothing may be left under the
# tmp name. The daemons' --rename-wait (ORBAX_RENAME_WAIT) is far above anything a round can make a node's
# work wait (a node is dead at most 1.5 s, upload delays are at most 2 s, files at most 12 MiB), so a
# rename that went on without a node's work (logged, RENAME_WENT_ON) fails the round.

MULTI_MARKERS = ("latest", ".metadata", "commit_success.txt")
MULTI_DELAYS = (0.0, 0.1, 0.3, 1.0, 2.0)  # each node's --upload-delay: the race is between unequal nodes
POLL_STORE = 0.03
MULTI_ROUND_LIMIT = 300.0
ORBAX_SHARE = 0.4  # of the multi-node rounds (drawn from the seed and the round's index apart from the rest)
ORBAX_STEP_SHARE = 0.7  # of an Orbax round's steps (at least one)
ORBAX_RENAME_WAIT = 120.0
ORBAX_REFRESH_INTERVAL = 0.5  # the --refresh-interval of nodes that find the tmp dir without `ckptfs refresh`
RENAME_WENT_ON = "while other nodes still have work pending in"  # the renaming node's WARNING past rename_wait


def is_marker_path(path: str) -> bool:
    return path.rpartition("/")[2] in MULTI_MARKERS


def multi_size(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.1:
        return 0
    if roll < 0.75:
        return rng.randint(1, 64 * KiB)
    if roll < 0.97:
        return rng.randint(64 * KiB, 2 * MiB)
    return rng.randint(4 * MiB, 12 * MiB)


@dataclass
class Segment:
    """One node's part of one step: ops[:arrive] before the barrier (the node has arrived once they all
    returned), then the wait for the barrier (node 0, and every node in lockstep rounds), then node 0's
    markers. A segment can be run again from its start (before the barrier) or from `arrive`: it only
    writes what it creates itself (with O_TRUNC), pwrites at fixed offsets, and renames what it made."""

    step: int
    ops: list[Op]
    arrive: int


@dataclass
class OrbaxStep:
    """A step written as Orbax's multi-host save writes one (see the comment above MULTI_MARKERS)."""

    tmp: str  # step_K.orbax-checkpoint-tmp-<tag>: every node's shards go here
    final: str  # step_K: node 0 renames the tmp dir to it after the barrier
    maker: int  # the node that makes the tmp dir (the others find it)
    flushed: bool  # the other nodes than node 0 flush their shards before the barrier
    rename: Op  # node 0's rename (the very op of its segment: found by identity in its model's log)

    def label(self) -> str:
        return f"n{self.maker}{'f' if self.flushed else ''}"


@dataclass
class MultiPlan:
    steps: int
    segments: list[list[Segment]]  # node -> step -> segment
    markers: dict[str, int]  # digest of a marker's content -> its step
    owned: list[set[str]]  # node -> every file path its plan names (tmp dirs' files also under the final name)
    orbax: dict[int, OrbaxStep] = field(default_factory=dict)  # step -> how it is written, for Orbax steps


def step_name(step: int) -> str:
    return f"step_{step + 1:05d}"


def moved_path(path: str, src: str, dst: str) -> str:
    """`path` after a rename of the directory `src` to `dst`."""
    return dst + path[len(src):] if path == src or path.startswith(src + "/") else path


def build_multi_plan(rng: random.Random, nodes: int, tag: str, barriers: Path, lockstep: bool,
                     find_refresh: list[bool] | None = None) -> MultiPlan:
    """find_refresh (Orbax rounds): per node, whether its writer runs `ckptfs refresh` to find a tmp dir
    another node made (else its daemon's refresh_interval shows it). None: a round without Orbax steps,
    drawn exactly as before they existed."""
    steps = rng.randint(2, 4)
    segments: list[list[Segment]] = [[] for _ in range(nodes)]
    markers: dict[str, int] = {}
    orbax: dict[int, OrbaxStep] = {}
    for k in range(steps):
        step = step_name(k)
        staged = None
        if find_refresh is not None and (rng.random() < ORBAX_STEP_SHARE or (k == steps - 1 and not orbax)):
            tmp = f"{step}.orbax-checkpoint-tmp-{tag}"
            staged = orbax[k] = OrbaxStep(tmp, step, rng.randrange(nodes), rng.random() < 0.5,
                                          {"op": "rename", "src": tmp, "dst": step, "orbax": k})
        for n in range(nodes):
            b = PlanBuilder(rng, tag, {}, set())
            where = step
            if staged is None:
                b.add({"op": "mkdir", "path": step, "exist_ok": True})  # every node makes it; one of them first
            elif n == staged.maker:
                where = staged.tmp
                b.add({"op": "mkdir", "path": where, "exist_ok": True})  # exist_ok: the segment may run again
            else:
                where = staged.tmp
                assert find_refresh is not None
                b.add({"op": "find_dir", "path": where, "refresh": find_refresh[n]})
            made = []
            for i in range(rng.randint(1, 3)):
                made.append(f"{where}/shard_{n}_{i}")
                b.write_file(made[-1], multi_size(rng))
            for _ in range(rng.choice([0, 0, 1, 2])):
                change_own_shard(b, made)
            if rng.random() < 0.4:
                b.write_file(f"model_{n}.pt", multi_size(rng), style="temp_rename")
            if staged is not None and staged.flushed and n != 0:
                b.add({"op": "flush", "path": staged.tmp})
            arrive = len(b.ops)
            if n == 0 or lockstep:
                b.add({"op": "wait", "file": str(barriers / f"go-{k}")})
            if n == 0:
                if staged is not None:
                    b.add(staged.rename)
                    kind = rng.choice(["commit_success", "latest", "both"])
                    first = f"{step}/commit_success.txt"
                else:
                    kind = rng.choice(["metadata", "latest", "both"])
                    first = f"{step}/.metadata"
                names = [first] if kind != "latest" else []
                names += ["latest"] if kind in ("latest", "both") else []
                for path in names:
                    content = MARKER_PREFIX + f"{step} {tag}:{k} {path}\n".encode()
                    markers[digest(content)] = k
                    parent, _, name = path.rpartition("/")
                    target = path if rng.random() < 0.5 else f"{parent}/.{name.lstrip('.')}.tmp".lstrip("/")
                    b.add({"op": "open", "path": target, "trunc": True})
                    b.add({"op": "write_bytes", "path": target, "offset": 0, "hex": content.hex()})
                    b.add({"op": "fsync", "path": target})
                    b.add({"op": "close", "path": target})
                    if target != path:
                        b.add({"op": "rename", "src": target, "dst": path})
            segments[n].append(Segment(k, b.ops, arrive))
    owned = [{op[key] for seg in segs for op in seg.ops if op["op"] not in ("mkdir", "wait", "find_dir", "flush")
              and "orbax" not in op for key in ("path", "src", "dst") if key in op} for segs in segments]
    for o in orbax.values():
        for paths in owned:
            paths |= {moved_path(p, o.tmp, o.final) for p in paths}
    return MultiPlan(steps, segments, markers, owned, orbax)


def change_own_shard(b: PlanBuilder, made: list[str]) -> None:
    """One more change to a shard this segment wrote (so that running the segment again is valid)."""
    if not made:
        return
    path = b.rng.choice(made)
    size = b.files[path]
    kind = b.rng.choice(["append", "overwrite", "truncate", "rename", "unlink", "rewrite"])
    if kind in ("append", "overwrite"):
        offset = size if kind == "append" else b.rng.randint(0, size)
        n = b.rng.randint(1, 128 * KiB)
        b.add({"op": "open", "path": path, "trunc": False})
        b.write_chunks(path, offset, n)
        b.add({"op": "close", "path": path})
        b.files[path] = max(size, offset + n)
    elif kind == "truncate":
        new = b.rng.choice([0, size // 2, size + b.rng.randint(1, 100 * KiB)])
        b.add({"op": "truncate", "path": path, "size": new})
        b.files[path] = new
    elif kind == "rename":
        dst = f"{path}.moved"
        if dst in made:
            return
        b.add({"op": "rename", "src": path, "dst": dst})
        b.files[dst] = b.files.pop(path)
        made[made.index(path)] = dst
    elif kind == "unlink":
        b.add({"op": "unlink", "path": path})
        del b.files[path]
        made.remove(path)
    else:
        b.write_file(path, multi_size(b.rng), style="temp_rename")


@dataclass
class KillPlan:
    kind: str  # "ops": once the writers logged `at` operations in all; "barrier": once step `at`'s barrier
    # opened (node 0 writes the marker then, and the marker waits; in an Orbax step it renames the tmp dir
    # first, and the rename waits); "renamed": once node 0 logged the rename of Orbax step `at`; "drain":
    # after every writer finished
    node: int
    at: int
    sleep: float  # seconds after the trigger
    restart_after: float  # seconds the node stays dead (others go on; a marker must wait for its records)

    def label(self) -> str:
        where = {"ops": f"ops{self.at}", "barrier": f"barrier{self.at + 1}", "renamed": f"renamed{self.at + 1}",
                 "drain": "drain"}[self.kind]
        return f"{where}@n{self.node}"


def draw_kills(rng: random.Random, delays: list[float], plan: MultiPlan) -> list[KillPlan]:
    total = sum(len(seg.ops) for segs in plan.segments for seg in segs)
    kills = []
    # Orbax rounds: a barrier kill lands while node 0's rename waits for the others' records (or on the
    # other node it waits for); a "renamed" kill 0 to 50 ms after node 0's rename returned (its moves and
    # its markers under way). Other rounds draw exactly as before these existed.
    kinds = ["ops", "ops", "barrier", "barrier", "drain"] + (["renamed", "renamed"] if plan.orbax else [])
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        at = (rng.randint(1, total) if kind == "ops" else rng.randrange(plan.steps) if kind == "barrier"
              else rng.choice(sorted(plan.orbax)) if kind == "renamed" else 0)
        sleep = (rng.uniform(0, 0.03) if kind == "ops" else rng.uniform(0, 0.2 + max(delays)) if kind == "barrier"
                 else rng.uniform(0, 0.05) if kind == "renamed" else rng.uniform(0, max(delays) + BURST_QUIET + 0.3))
        kills.append(KillPlan(kind, rng.randrange(len(delays)), at, sleep, rng.uniform(0, 1.5)))
    order = {"ops": lambda k: k.at / total * plan.steps, "barrier": lambda k: k.at + 0.5,
             "renamed": lambda k: k.at + 0.7, "drain": lambda k: math.inf}
    return sorted(kills, key=lambda k: order[k.kind](k))


@dataclass
class NodeRun:
    """One writer process of a node: its plan (segments from some point on) and how far its log got."""

    plan: list[Op]
    where: list[tuple[int, int]]  # per op: (step, index in the segment)
    arrivals: list[tuple[int, int]]  # (plan index, step): the node arrives at the step's barrier there
    proc: subprocess.Popen[bytes]
    log: Path
    cursor: LogCursor = field(default_factory=LogCursor)
    read: int = 0  # bytes of the log consumed
    killed: bool = False
    # killed: the log from its first error on, read once the writer is gone (an EIO may be the kernel's
    # answer to the request in flight, see Model.apply_log); what returned before it is applied at once
    held: list[str] = field(default_factory=list)

    def new_lines(self) -> list[str]:
        with open(self.log, "rb") as f:
            f.seek(self.read)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.read += end
        return data[:end].decode().splitlines()


@dataclass
class NodeState:
    index: int
    model: Model
    mount: Mount | None = None
    arrived: dict[int, int] = field(default_factory=dict)  # step -> len(model.applied) at its barrier
    closed_at_arrival: dict[int, dict[str, str]] = field(default_factory=dict)  # step -> path -> digest
    run: NodeRun | None = None
    runs: int = 0
    done: bool = False  # the node's whole workload returned
    dead: bool = False
    awaiting_writer: bool = False  # killed: its writer has not seen the dead mount yet
    killed_at: float = 0.0
    restart_at: float = 0.0
    in_flight: list[Op] = field(default_factory=list)  # killed: the op that may or may not have been applied
    resume: tuple[int, int] | None = None  # killed: (step, index in the segment) its writer starts again at
    log_start: int = 0  # size of daemon.log when the daemon last started

    def unapplied(self) -> list[Op]:
        """Operations that may have changed the store but are not in the model (yet)."""
        if self.run is not None:
            rest = self.run.plan[self.run.cursor.next_index:]
            return rest if self.run.killed else rest[:1]  # killed: any of the rest may have been under way
        return self.in_flight

    def arrive(self) -> None:
        run = self.run
        assert run is not None
        while run.arrivals and run.cursor.next_index >= run.arrivals[0][0]:
            _, step = run.arrivals.pop(0)
            if step not in self.arrived:
                self.arrived[step] = len(self.model.applied)
                self.closed_at_arrival[step] = {p: digest(d) for p, d in self.model.files.items()
                                                if p not in self.model.open_paths}


def settled_view(view: Tree, model: Model, unsettled: list[str]) -> Tree:
    """`view` with what it shows below the `unsettled` directories replaced by what the model has there."""
    def under(path: str) -> bool:
        return any(path == d or path.startswith(d + "/") for d in unsettled)

    return Tree({**{p: d for p, d in view.files.items() if not under(p)},
                 **{p: bytes(d) for p, d in model.files.items() if under(p)}},
                {d for d in view.dirs if not under(d)} | {d for d in model.dirs if under(d)})


def own_view(tree: Tree, owned: set[str], dirs: set[str]) -> Tree:
    """What of a node's mount its own model speaks for: the files it writes, and of the directories those
    it made (the others' show up in its listings when they do)."""
    return Tree({p: d for p, d in tree.files.items() if p in owned}, tree.dirs & dirs)


class CrossNodeCheck:
    """No commit marker in the store before every file closed on any node before the barrier of its step is
    there with the bytes it had when closed, unless an operation after the barrier (or in flight) changed,
    moved or removed it. With `full`: also no torn object (every object is a version a file had closed)."""

    def __init__(self, markers: dict[str, int]) -> None:
        self.markers = markers  # digest of a marker's content -> step
        self.required: dict[int, dict[str, tuple[int, str]]] = {}  # step -> path -> (node, digest)
        self._digests: dict[tuple[str, Any], str] = {}
        self.polls = 0
        self.marker_polls = 0  # polls that found a marker in the store (and checked what it commits)
        self.held_polls = 0  # polls while node 0's newest closed marker was not in the store yet

    def open_barrier(self, step: int, nodes: list[NodeState], moved: Callable[[str], str] = lambda p: p) -> None:
        """`moved`: where a path closed before the barrier is when the step's marker can be in the store (an
        Orbax step's tmp dir is renamed before its marker is written; an earlier one's, before this barrier)."""
        self.required[step] = {moved(path): (ns.index, want) for ns in nodes
                               for path, want in ns.closed_at_arrival[step].items() if not is_marker_path(path)}

    def _digest(self, store: ObjectReader, path: str, token: Any) -> str | None:
        if (path, token) in self._digests:
            return self._digests[(path, token)]
        got = store.fetch(path)
        if got is None:
            return None
        self._digests[(path, got[0])] = value = digest(got[1])
        return value

    def check(self, store: ObjectReader, nodes: list[NodeState], refresh: Callable[[], None], *,
              full: bool = False, what: str = "store") -> None:
        self.polls += 1
        found: dict[str, bytes] = {}
        for path in sorted(store.listing()):
            if is_marker_path(path) and (marker := store.fetch(path)) is not None:
                found[path] = marker[1]
        in_store = {self.markers.get(digest(data)) for data in found.values()}
        closed = [self.markers[d] for d in nodes[0].model.versions if d in self.markers]
        if closed and max(closed) not in in_store:
            self.held_polls += 1
        if not found and not full:
            return
        self.marker_polls += bool(found)
        listing = store.listing()  # after the markers were read: what they commit must be there by now
        wanted = set(listing) if full else {p for data in found.values()
                                            for p in self.required.get(self.markers.get(digest(data), -1), {})}
        have = {p: self._digest(store, p, listing[p]) if p in listing else None for p in sorted(wanted)}
        refresh()  # whatever changed those objects before they were read is in the models now, or in flight
        versions = set().union(*(ns.model.versions for ns in nodes))
        for path, data in sorted(found.items()):
            text = data.strip().decode(errors="replace")[:80]
            step = self.markers.get(digest(data))
            if step is None:
                if digest(data) in versions:
                    continue  # a marker file a kill cut short (its writer starts it again): no commit
                raise RoundFailed(f"{what}: {path} holds {data[:60]!r}, which no node closed")
            if step not in self.required:
                raise RoundFailed(f"{what}: {path} ({text}) is in the store before the barrier of its step opened")
            touched = {ns.index: touched_paths(ns.model.applied[ns.arrived[step]:] + ns.unapplied()) for ns in nodes}
            for req, (node, want) in sorted(self.required[step].items()):
                if any(req == t or req.startswith(t + "/") for t in touched[node]):
                    continue
                if have.get(req) is None:
                    raise RoundFailed(f"{what}: {path} ({text}) is in the store but {req}, closed on node {node} "
                                      f"before the barrier of {step_name(step)}, is not")
                if have[req] != want:
                    raise RoundFailed(f"{what}: {path} ({text}) is in the store but {req} holds other bytes than "
                                      f"it had when node {node} closed it before the barrier of {step_name(step)}")
        if full:
            for ns in nodes:
                pending = ns.unapplied()
                if any(op["op"] in ("close", "truncate") for op in pending):
                    after = ns.model.copy()
                    with contextlib.suppress(KeyError, IndexError):
                        for op in pending:
                            after.apply(op)
                    versions |= after.versions
            for path, got in sorted(have.items()):
                if got is not None and got not in versions:
                    raise RoundFailed(f"{what}: store object {path} is no version any file had when it was closed "
                                      "(a torn or stale object)")


def touched_paths(ops: list[Op]) -> set[str]:
    """The paths these operations may have changed. Not an Orbax step's rename of its tmp dir: the check
    wants the shards at their final names once the marker is in (the marker comes after the rename)."""
    return {op[k] for op in ops if op["op"] not in ("listdir", "read", "fsync", "wait", "mkdir", "find_dir", "flush")
            and "orbax" not in op for k in ("path", "src", "dst") if k in op}


class MultiNodeRound:
    """One round of --nodes N (see the comment above MULTI_MARKERS)."""

    def __init__(self, harness: Harness, cfg: RoundConfig, plan: MultiPlan, store: StoreView, round_dir: Path,
                 result: RoundResult) -> None:
        self.harness = harness
        self.cfg = cfg
        self.plan = plan
        self.store = store
        self.round_dir = round_dir
        self.result = result
        self.barriers = round_dir / "barriers"
        self.opened: dict[int, float] = {}
        self.check = CrossNodeCheck(plan.markers)
        self.renamed: set[int] = set()  # Orbax steps whose tmp dir node 0 has renamed (in its model)
        extra: tuple[str, ...] = ("--part-size", cfg.part_size, "--upload-while-writing", cfg.upload_while_writing,
                                  "--passthrough", cfg.passthrough)
        if harness.args.no_cross_node_ordering:  # the harness's own test: its check must fail then
            extra += ("--no-cross-node-ordering",)
        if plan.orbax:
            extra += ("--rename-wait", f"{ORBAX_RENAME_WAIT:g}")
        self.nodes = []
        for n in range(cfg.nodes):
            own: tuple[str, ...] = ()
            if plan.orbax and not cfg.find_refresh[n]:
                own = ("--refresh-interval", f"{ORBAX_REFRESH_INTERVAL:g}")
            m = harness.mount(round_dir / f"node-{n}", store, cfg, *extra, *own, upload_delay=cfg.delays[n])
            self.nodes.append(NodeState(n, Model(), m))

    def moved(self, path: str, upto: int | None = None) -> str:
        """Where `path` is once node 0 renamed the tmp dirs of the Orbax steps (up to step `upto`)."""
        for k, o in self.plan.orbax.items():
            if upto is None or k <= upto:
                path = moved_path(path, o.tmp, o.final)
        return path

    def sync_renames(self) -> None:
        """Once node 0's model has an Orbax step's rename, the other nodes' files in the tmp dir are at the
        final name too (in the store: the rename moved them), and the maker's tmp dir is the final dir."""
        node0 = self.nodes[0]
        for k, o in self.plan.orbax.items():
            if k not in self.renamed and any(op is o.rename for op in node0.model.applied):
                self.renamed.add(k)
                # from the barrier to the harness's reading of the rename in node 0's log (10 ms polls)
                self.result.renames.append(time.monotonic() - self.opened[k])
                for ns in self.nodes[1:]:
                    ns.model._rename(o.tmp, o.final)

    def unsettled(self) -> list[str]:
        """Directories whose view on the nodes other than node 0 the harness does not know between the barrier
        of an Orbax step and the end: its tmp dir and final dir, as the node last listed them (the rename
        moved them in the store; a node sees that after its next listing of the top)."""
        return [d for k, o in self.plan.orbax.items() if k in self.opened for d in (o.tmp, o.final)]

    def poll(self) -> None:
        for ns in self.nodes:
            self.poll_node(ns)

    def poll_node(self, ns: NodeState) -> None:
        """Apply what the node's writer logged since: its model, and its arrivals at barriers. A killed
        node's writer may be waiting at a barrier that needs its arrival, so its log is read too, up to
        its first error."""
        run = ns.run
        if run is None:
            return
        for line in run.new_lines():
            if run.killed and (run.held or '"err"' in line):
                run.held.append(line)
                continue
            failures = ns.model.apply_lines(run.plan, [line], run.cursor)
            if failures:
                raise RoundFailed(f"node {ns.index}: writer: {failures[0]}")
            ns.arrive()
        self.sync_renames()

    def start_run(self, ns: NodeState, step: int, offset: int) -> None:
        plan: list[Op] = []
        where: list[tuple[int, int]] = []
        arrivals: list[tuple[int, int]] = []
        for seg in self.plan.segments[ns.index][step:]:
            first = offset if seg.step == step else 0
            for j in range(first, len(seg.ops)):
                if j == seg.arrive:
                    arrivals.append((len(plan), seg.step))
                plan.append(seg.ops[j])
                where.append((seg.step, j))
            if seg.arrive == len(seg.ops) and first <= seg.arrive:
                arrivals.append((len(plan), seg.step))
        mount = ns.mount
        assert mount is not None
        proc, log = self.harness.run_writer(plan, self.round_dir, mount.mnt, f"node{ns.index}-run{ns.runs}",
                                            env=mount.env)
        ns.runs += 1
        ns.run = NodeRun(plan, where, arrivals, proc, log)
        ns.arrive()

    def open_barriers(self) -> None:
        for k in range(self.plan.steps):
            if k not in self.opened and all(k in ns.arrived for ns in self.nodes):
                # what the marker commits, fixed before it can exist (at the names it has by then)
                self.check.open_barrier(k, self.nodes, lambda p, k=k: self.moved(p, upto=k))  # type: ignore[misc]
                (self.barriers / f"go-{k}").touch()
                self.opened[k] = time.monotonic()

    def watch(self) -> None:
        """Writers that finished (all of their plan, or a failure) and daemons that died by themselves."""
        for ns in self.nodes:
            mount = ns.mount
            assert mount is not None
            if not ns.dead and mount.proc is not None and mount.proc.poll() is not None:
                raise RoundFailed(f"node {ns.index}: the daemon exited {mount.proc.returncode} by itself")
            run = ns.run
            if run is None or run.killed or run.proc.poll() is None:
                continue
            self.poll_node(ns)
            if run.proc.returncode != 0 or run.cursor.next_index < len(run.plan):
                stderr = (self.round_dir / f"node{ns.index}-run{ns.runs - 1}.stderr").read_text()[-300:]
                raise RoundFailed(f"node {ns.index}: writer exited {run.proc.returncode} at op "
                                  f"{run.cursor.next_index} of {len(run.plan)}: {stderr}")
            ns.run = None
            ns.done = True

    def triggered(self, kill: KillPlan) -> bool:
        if kill.kind == "ops":
            return sum(len(ns.model.applied) for ns in self.nodes) >= kill.at
        if kill.kind == "barrier":
            return kill.at in self.opened
        if kill.kind == "renamed":
            return kill.at in self.renamed
        return all(ns.done for ns in self.nodes)

    def kill(self, ns: NodeState, kill: KillPlan) -> None:
        mount = ns.mount
        assert mount is not None and mount.proc is not None
        mount.proc.send_signal(signal.SIGKILL)
        mount.proc.wait(timeout=30)
        mount.proc = None
        ns.dead = ns.awaiting_writer = True
        ns.killed_at = time.monotonic()
        ns.restart_at = ns.killed_at + kill.restart_after
        if ns.run is not None:
            ns.run.killed = True
        self.result.kills_done.append(kill.label())

    def revive(self, ns: NodeState) -> None:
        """A killed node: once its writer saw the dead mount, read the rest of its log and check the store
        (the kill point); once its time is up, restart it on its cache dir and start its writer again."""
        mount = ns.mount
        assert mount is not None
        now = time.monotonic()
        if ns.awaiting_writer:
            run = ns.run
            if run is not None:
                if run.proc.poll() is None and self.plan.orbax and self.waits_at_barrier(ns):
                    # Orbax rounds: a writer waiting at a barrier (outside the mount) would see its dead mount
                    # only once the barrier opened, and that may need the others to find a tmp dir this node
                    # made and had not uploaded: it goes, as its trainer would with the node, and its run
                    # starts again at the barrier after the restart.
                    run.proc.kill()
                    run.proc.wait()
                    run.proc.returncode = EXIT_MOUNT_GONE
                if run.proc.poll() is None:
                    if now > ns.killed_at + 60:
                        raise RoundFailed(f"node {ns.index}: the writer hung on the dead mount")
                    return
                code = run.proc.returncode
                if code not in (0, EXIT_MOUNT_GONE):
                    raise RoundFailed(f"node {ns.index}: writer exited {code} after the kill")
                with open(mount.log, "rb") as f:
                    f.seek(ns.log_start)
                    answered = EIO_ANSWERED.search(f.read().decode(errors="replace"))
                self.poll_node(ns)
                failures = ns.model.apply_lines(run.plan, run.held, run.cursor,
                                                eio_at_kill=code == EXIT_MOUNT_GONE and not answered)
                if failures:
                    raise RoundFailed(f"node {ns.index}: writer: {failures[0]}")
                run.killed = False
                ns.arrive()
                in_flight = run.cursor.in_flight(run.plan)
                ns.in_flight = [in_flight] if in_flight is not None else []
                if run.cursor.next_index < len(run.plan):
                    step, j = run.where[run.cursor.next_index]
                    arrive = self.plan.segments[ns.index][step].arrive
                    ns.resume = (step, arrive if j >= arrive else 0)
                else:
                    ns.done = True  # the writer had finished before the kill
                ns.run = None
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mount.mnt)], check=False)
            ns.awaiting_writer = False
            self.check.check(self.store, self.nodes, self.poll, full=True, what=f"kill point (node {ns.index})")
        if now < ns.restart_at:
            return
        ns.log_start = mount.log.stat().st_size
        mount.start()
        ns.dead = False
        in_flight = ns.in_flight[0] if ns.in_flight else None
        if in_flight is not None and "orbax" in in_flight:
            self.result.rename_kills += 1  # node 0 killed in its rename (its wait, mostly)
        dirs = ns.model.dirs | ({in_flight["path"]} if in_flight is not None and in_flight["op"] == "mkdir" else set())
        owned = self.plan.owned[ns.index]
        view = own_view(read_mount(mount.mnt, owned.__contains__), owned, dirs)
        if ns.index != 0:
            view = settled_view(view, ns.model, self.unsettled())
        final, problem = match_in_flight(view, ns.model, in_flight)
        if problem:
            raise RoundFailed(f"node {ns.index}: {problem}")
        if ns.index == 0 and ns.resume is not None and ns.resume[0] in self.plan.orbax:
            # The rename is done (logged, or in flight and in the mount): the writer goes on after it (the tmp
            # dir is gone, a rename of it again would fail)
            step = ns.resume[0]
            rename = self.plan.orbax[step].rename
            if any(op is rename for op in final.applied):
                ops = self.plan.segments[0][step].ops
                ns.resume = (step, max(ns.resume[1], next(j for j, op in enumerate(ops) if op is rename) + 1))
        for path in final.open_paths:  # their descriptors died with the writer: what they hold is closed now
            final.versions.add(digest(final.files[path]))
        final.open_paths.clear()
        ns.model = final
        ns.in_flight = []
        self.sync_renames()
        if ns.resume is not None:
            self.start_run(ns, *ns.resume)
            ns.resume = None

    def waits_at_barrier(self, ns: NodeState) -> bool:
        """Is the node's writer waiting for a barrier that has not opened (every operation before it logged)?"""
        run = ns.run
        assert run is not None
        self.poll_node(ns)
        if run.held or run.cursor.next_index >= len(run.plan) or run.cursor.partial:
            return False
        op = run.plan[run.cursor.next_index]
        return op["op"] == "wait" and not Path(op["file"]).exists()

    def progress(self) -> str:
        return "; ".join(f"node {ns.index}: {'dead' if ns.dead else 'done' if ns.done else 'running'} "
                         f"at op {ns.run.cursor.next_index if ns.run else '-'}, arrived {sorted(ns.arrived)}"
                         for ns in self.nodes) + f"; barriers opened {sorted(self.opened)}"

    def run(self) -> None:
        for ns in self.nodes:
            self.start_run(ns, 0, 0)
        kills = list(self.cfg.kill_plan)
        fire_at: float | None = None
        deadline = time.monotonic() + MULTI_ROUND_LIMIT
        next_check = 0.0
        while True:
            now = time.monotonic()
            if now > deadline:
                raise RoundFailed(f"round stuck: {self.progress()}")
            self.poll()
            self.open_barriers()
            self.watch()
            for ns in self.nodes:
                if ns.dead:
                    self.revive(ns)
            if now >= next_check:
                self.check.check(self.store, self.nodes, self.poll)
                next_check = now + POLL_STORE
            if any(ns.dead for ns in self.nodes):
                pass
            elif kills:
                if fire_at is None and self.triggered(kills[0]):
                    fire_at = now + kills[0].sleep
                if fire_at is not None and now >= fire_at:
                    kill = kills.pop(0)
                    self.kill(self.nodes[kill.node], kill)
                    fire_at = None
            elif all(ns.done for ns in self.nodes):
                break
            time.sleep(0.01)
        self.finish()

    def flush(self, m: Mount, *args: str) -> None:
        """`ckptfs flush MNT ARGS`, the store polled by the check meanwhile (the last markers land now)."""
        with subprocess.Popen([sys.executable, "-m", "ckptfs", "flush", str(m.mnt), "--timeout", "240", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=m.env) as proc:
            deadline = time.monotonic() + 270
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RoundFailed(f"ckptfs flush {m.mnt} {' '.join(args)} did not return")
                self.check.check(self.store, self.nodes, self.poll)
                time.sleep(POLL_STORE)
            _, err = proc.communicate()
        if proc.returncode != 0:
            raise RoundFailed(f"ckptfs flush {m.root.name} {' '.join(args)} exited {proc.returncode}: "
                              f"{err.strip()[-300:]}")

    def finish(self) -> None:
        """Every node alive and its workload done: flush them all, then the end checks."""
        mounts = [ns.mount for ns in self.nodes]
        for m in [*mounts[1:], mounts[0]]:
            assert m is not None
            self.flush(m)
        assert mounts[0] is not None
        if not self.harness.args.no_cross_node_ordering:
            self.flush(mounts[0], "--all-nodes")
        self.check.check(self.store, self.nodes, self.poll, full=True, what="after flush")
        files = {p: bytes(d) for ns in self.nodes for p, d in ns.model.files.items()}
        dirs = set().union(*(ns.model.dirs for ns in self.nodes))
        if self.plan.orbax:
            assert mounts[0] is not None
            went_on = [line for line in log_tail(mounts[0].log, 0).decode(errors="replace").splitlines()
                       if RENAME_WENT_ON in line]
            if went_on:
                raise RoundFailed("node 0 renamed a tmp dir past rename_wait, which the harness's bound "
                                  f"({ORBAX_RENAME_WAIT:g} s) makes impossible: {went_on[0][-400:]}")
            for m in mounts:  # each node sees the renamed steps once it lists the top again
                assert m is not None
                refreshed = m.cli("refresh", str(m.mnt))
                if refreshed.returncode != 0:
                    raise RoundFailed(f"ckptfs refresh {m.root.name} exited {refreshed.returncode}: "
                                      f"{refreshed.stderr.strip()[-300:]}")
        for ns, m in zip(self.nodes, mounts, strict=True):
            assert m is not None
            owned = self.plan.owned[ns.index]
            view = own_view(read_mount(m.mnt, owned.__contains__), owned, ns.model.dirs)
            problem = first_difference(view, ns.model.files, ns.model.dirs, f"node {ns.index} after flush")  # type: ignore[arg-type]
            if problem:
                raise RoundFailed(problem)
        stored = self.store.snapshot()
        check_store_matches(stored, Tree(files, dirs), self.store.leftover_uploads())
        for ns, m in zip(self.nodes, mounts, strict=True):
            assert m is not None
            check_journal_against_store(m.cache / "journal.db", stored, only=self.plan.owned[ns.index] | ns.model.dirs)
        for ns, m in zip(self.nodes, mounts, strict=True):
            assert m is not None
            self.harness.stop(m, f"node {ns.index}")
        left = [n for n in self.store.snapshot().notes if n.startswith("pending/")]
        if left:
            raise RoundFailed(f"store after every node stopped cleanly: pending records left: {left[:4]}")
        fresh = self.harness.mount(self.round_dir / "node-fresh", self.store, self.cfg)
        problem = first_difference(read_mount(fresh.mnt), files, dirs, "fresh node")  # type: ignore[arg-type]
        if problem:
            raise RoundFailed(problem)
        self.harness.stop(fresh, "fresh node")


# -- one round ----------------------------------------------------------------------------------------------


@dataclass
class RoundConfig:
    kill: str  # "workload", "drain", "spill" or "fetch"
    upload_delay: float
    prephase: str  # "none", "same-cache" (restart of the node that wrote the store) or "fresh-cache"
    kill_at: int  # for kill mid-workload: the log length at which to kill
    kill_sleep: float
    faults: list[str]
    full_cache: bool
    filler_mib: int
    unlisted_dir_ops: bool = False  # rmdir and rename of directories without listing them first
    # --part-size of the daemons: a small one makes shards of more than 17 MiB upload while they are written
    # (early spills, on stores that complete a staged upload at any key: file://)
    part_size: str = "64M"
    upload_while_writing: str = "off"  # "on": SeaweedFS rounds stage at a hidden key and copy at close
    # --passthrough of the daemons: "auto" lets the kernel write and read cached files itself (where it can)
    passthrough: str = "auto"
    # --nodes N: N daemons on one store (the kill plan replaces kill/kill_at/upload_delay)
    nodes: int = 1
    delays: list[float] = field(default_factory=list)  # each node's --upload-delay
    lockstep: bool = False  # every node waits at the barrier (else only node 0, which writes the marker)
    steps: int = 0
    # Orbax rounds: some steps written into a tmp dir that node 0 renames after the barrier; per node, how
    # it finds a tmp dir another node made (`ckptfs refresh`, or else its --refresh-interval)
    orbax: bool = False
    find_refresh: list[bool] = field(default_factory=list)
    orbax_steps: str = ""  # for the round's line: step:maker(f: flushed before the barrier), ...
    kill_plan: list[KillPlan] = field(default_factory=list)
    # --keep-mount: the daemons run with keep_mount, and a kill leaves the mount to the holder's next daemon
    # (no detach, no restart by the harness). Workload/spill kills: the op indices (kill_at first) and the
    # pause after each; drain and fetch kills: the pause before each (after the writer finished, or after
    # the previous daemon took over; after the reader started).
    keep_mount: bool = False
    # --preempt: seconds after the workload starts at which `ckptfs preempt` is sent, and its deadline
    preempt_after: float | None = None
    preempt_deadline: float = 0.0
    # and whether it keeps the daemons' upload cap (PREEMPT_UPLOAD_LIMIT: uploads slow enough that the kill
    # lands while a step's files and its marker are in flight)
    preempt_keep_limits: bool = False
    kill_ats: list[int] = field(default_factory=list)
    kill_sleeps: list[float] = field(default_factory=list)


@dataclass
class RoundResult:
    ok: bool
    message: str
    seconds: float
    config: RoundConfig | None = None
    ops_done: int = 0
    ops_planned: int = 0
    bytes_written: int = 0
    errors: list[str] = field(default_factory=list)
    fired: dict[str, int] = field(default_factory=dict)
    known: str = ""  # the regression test of the known bug this round hit
    waits: int = 0  # back-pressure episodes the daemons logged ("cache full ...")
    spills: int = 0  # files uploaded while they were written
    kills_done: list[str] = field(default_factory=list)  # multi-node rounds: the kills that happened
    polls: int = 0  # multi-node rounds: store polls of the cross-node check
    marker_polls: int = 0  # ... that found a marker in the store (and checked what it commits)
    held_polls: int = 0  # ... while node 0's newest closed marker was not in the store yet
    renames: list[float] = field(default_factory=list)  # Orbax rounds: seconds from each barrier to its rename
    rename_kills: int = 0  # Orbax rounds: kills of node 0 while its rename was in flight
    # --keep-mount: kill-point checks made while the killed daemon was dead (a check the holder's next
    # daemon may have raced, started before it ended, is not counted and not trusted)
    kill_point_checks: int = 0


CASCADE_ERRNOS = ("ENOSPC", "ENOENT", "EBADF", "ENOTEMPTY", "EEXIST", "ENOTDIR", "EISDIR")
FAULT_KINDS = ("storm503", "resets", "lost", "stalls", "internal500")


def fault_rules(kinds: list[str]) -> list[Any]:
    """One rule sure to fire per kind (on one of the round's first PUTs: those rules come first), then
    the dice."""
    from faultproxy import Rule

    sure, dice = [], []
    for kind in kinds:
        if kind == "storm503":
            sure.append(Rule("slowdown", match=r"^PUT ", count=1))
            dice.append(Rule("slowdown", fraction=0.4))
        elif kind == "resets":
            sure.append(Rule("reset", match=r"^PUT ", count=1))
            dice += [Rule("reset", fraction=0.08), Rule("reset_mid", match=r"^(?!POST \S+\?uploads )", fraction=0.08)]
        elif kind == "lost":
            sure.append(Rule("lost_response", match=r"^PUT ", count=1))
            dice.append(Rule("lost_response", match=r"^(PUT|POST \S+\?uploadId=|DELETE) ", fraction=0.2))
        elif kind == "stalls":
            sure.append(Rule("stall", match=r"^PUT ", count=1, seconds=0.5))
            dice.append(Rule("stall", fraction=0.15, seconds=0.4))
        elif kind == "internal500":
            sure.append(Rule("internal", match=r"^PUT ", count=1))
            dice.append(Rule("internal", fraction=0.2))
    return sure + dice


def phase_builder(cfg: RoundConfig, rng: random.Random, label: str, names: dict[str, int], dirs: set[str],
                  scale: str, *, gateway: bool) -> PlanBuilder:
    """The builder of one phase's plan (the earlier life's, then the workload's). A spill round's mounts have
    a 24 MiB cache in both phases, so neither plan may append to, overwrite or truncate a file larger than
    that (seed 4701 round 3: the earlier life truncated the 30 MB shard it had spilled: EFBIG, as documented,
    taken for a lost write; 76f0c57 had set the budget for the workload's plan only)."""
    builder = PlanBuilder(rng, label, names, dirs, scale, cfg.unlisted_dir_ops)
    builder.hold_open = gateway
    builder.step_markers = cfg.preempt_after is not None
    if cfg.kill == "spill":
        builder.cache_budget = SPILL_CACHE_SIZE
    return builder


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.store_kind: str = args.store
        self.workdir = Path(args.workdir or f"/tmp/ckptfs-crash-{self.seed}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server: Any = None
        self.preempter: threading.Thread | None = None  # --preempt: the round's `ckptfs preempt` call
        self.bucket = ""
        self.proxy: Any = None
        self.live: list[Mount] = []
        self.tmpfs: list[Path] = []
        # Every mount's control and holder sockets, in one short directory: under pytest's tmp_path a round's
        # node-fresh/run/<hash>.holder is longer than an AF_UNIX path may be, and a daemon then fails to
        # start even with --no-keep-mount (an open bug: test_a_mount_starts_where_only_the_holder_socket_
        # path_is_too_long in test_crash_harness.py). The sockets are named after the mountpoint.
        self.runtime = Path(tempfile.mkdtemp(prefix="ckptfs-crash-run-"))
        self.writers: list[subprocess.Popen[bytes]] = []

    # server lifetime: once per run, reused by every round
    def __enter__(self) -> Harness:
        if self.store_kind == "seaweedfs":
            from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, start_seaweedfs

            os.environ.update(CLIENT_ENV)
            for name in CLIENT_ENV_UNSET:
                os.environ.pop(name, None)
            server_dir = self.workdir / "seaweedfs"
            shutil.rmtree(server_dir, ignore_errors=True)
            self.server = start_seaweedfs(server_dir)
            self.bucket = self.server.new_bucket()
            if self.args.faults:
                from faultproxy import FaultProxy

                self.proxy = FaultProxy(self.server.endpoint, seed=self.seed).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.reap()
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.runtime, ignore_errors=True)

    def reap(self) -> None:
        """Kill every daemon this round started (by its own pid) and undo its mounts."""
        for w in self.writers:  # a writer waiting at a barrier that will not open now
            if w.poll() is None:
                w.kill()
                w.wait()
        self.writers.clear()
        for m in self.live:
            # keep_mount: the holder first (so that it starts no daemon any more), then the daemons it
            # started (its children: the one serving, or one still starting), all by pid
            holder = m.holder_pid()
            started = holder_children(holder) if holder is not None else []
            if holder is not None:
                m.kill_holder()
            for pid in started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if m.proc is not None:
                m.proc.kill()
                m.proc.wait()
                m.proc = None
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(m.mnt)], check=False)
        self.live.clear()
        for path in self.tmpfs:
            subprocess.run(["umount", "-l", str(path)], check=False)
        self.tmpfs.clear()

    def preempt_later(self, m: Mount, after: float, deadline: float, keep_limits: bool) -> None:
        """`ckptfs preempt --no-wait` `after` seconds from now, in a thread (the daemon may be dead by then:
        the call fails, which is fine)."""
        def send() -> None:
            time.sleep(after)
            m.cli("preempt", str(m.mnt), "--deadline", f"{deadline}s", "--no-wait",
                  *(["--keep-limits"] if keep_limits else []), timeout=30)

        self.preempter = threading.Thread(target=send, daemon=True)
        self.preempter.start()

    def choose(self, rng: random.Random, index: int) -> RoundConfig:
        if self.args.nodes > 1:
            return self.choose_multi(rng, index)
        kills = ["workload", "workload", "workload", "drain", "drain", "fetch"]
        if self.store_kind == "seaweedfs" and not self.args.full_cache:
            kills.append("spill")
        kill = rng.choice(kills)
        preempt = random.Random(f"{self.seed}:{index}:preempt")
        faults = sorted(rng.sample(FAULT_KINDS, rng.randint(1, 2))) if self.args.faults else []
        return RoundConfig(
            kill=kill, upload_delay=rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]),
            prephase=rng.choice(["none", "none", "same-cache", "fresh-cache", "fresh-cache"]),
            kill_at=0, kill_sleep=rng.uniform(0, 0.03), faults=faults, full_cache=self.args.full_cache,
            filler_mib=rng.choice([0, 8, 16]) if self.args.full_cache else 0,
            # `mv step_100 step_100.bak` on a fresh node lists nothing first; `rm -r` lists: both, by turns
            unlisted_dir_ops=(rng.random() < 0.5) or self.args.unlisted_dir_ops,  # drawn either way: replays
            part_size=rng.choice(["64M", "1M", "2M"]), upload_while_writing=rng.choice(["off", "auto", "on"]),
            passthrough=self.args.passthrough or rng.choice(["auto", "off"]), keep_mount=self.args.keep_mount,
            # Drawn apart from the round's RNG, so that rounds without --preempt draw (and replay) as before
            preempt_after=preempt.uniform(0, 0.6) if self.args.preempt else None,
            preempt_deadline=preempt.choice([0.5, 2.0, 10.0]), preempt_keep_limits=preempt.random() < 0.7,
        )

    def choose_multi(self, rng: random.Random, index: int) -> RoundConfig:
        delays = [rng.choice(MULTI_DELAYS) for _ in range(self.args.nodes)]
        # Whether the round has Orbax steps: from the seed and the index, apart from the round's RNG, so that
        # the rounds without them draw (and replay) exactly as before they existed
        orbax = self.args.orbax or random.Random(f"{self.seed}:{index}:orbax").random() < ORBAX_SHARE
        return RoundConfig(
            kill="", upload_delay=max(delays), prephase="none", kill_at=0, kill_sleep=0.0, faults=[],
            full_cache=False, filler_mib=0, part_size=rng.choice(["64M", "1M", "2M"]),
            upload_while_writing=rng.choice(["off", "auto", "on"]),
            passthrough=self.args.passthrough or rng.choice(["auto", "off"]),
            nodes=self.args.nodes, delays=delays, lockstep=rng.random() < 0.5, orbax=orbax,
        )

    def new_store(self, index: int) -> StoreView:
        if self.store_kind == "file":
            return FileStore(self.workdir / f"round-{index}" / "store")
        endpoint = self.proxy.endpoint if self.proxy is not None else self.server.endpoint
        prefix = f"{S3_PREFIX_ROOT}-{self.seed}-{index}-{secrets.token_hex(3)}/"
        return S3Store(self.server, self.bucket, prefix, endpoint)

    def mount(self, root: Path, store: StoreView, cfg: RoundConfig, *extra: str,
              upload_delay: float | None = None) -> Mount:
        # Rounds end in an unmount and their directories are removed: no guard left on a mountpoint there.
        args = [*store.daemon_args, *extra, "--no-guard-mountpoint"]
        if not self.args.keep_mount:
            # The harness's kills test recovery from a dead daemon: the mount dies with it (ENOTCONN), is
            # detached, and a daemon the harness restarts on the same cache dir recovers. That is still what
            # happens without a holder (keep_mount off, or a holder that gave up). With keep_mount on, the
            # holder would start a daemon behind the harness's back; --keep-mount tests that path instead.
            args.append("--no-keep-mount")
        if cfg.full_cache:
            args += ["--dirty-wait", "3"]
        if self.args.gateway:
            # Files open for writing are uploaded once idle for 0.1 s: shards mid-write reach the store
            # while the kills land.
            args += ["--gateway", "--idle-upload", "0.1"]
        delay = cfg.upload_delay if upload_delay is None else upload_delay
        m = Mount(root, upload_delay=delay, source=store.source, extra_args=tuple(args))
        m.runtime = self.runtime
        m.env["CKPTFS_RUNTIME_DIR"] = str(self.runtime)
        if cfg.full_cache and not m.cache.exists():
            # A small filesystem of its own under the cache dir, partly filled by someone else.
            fs_root = root / "cachefs"
            fs_root.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m,mode=0700", "tmpfs", str(fs_root)], check=True)
            self.tmpfs.append(fs_root)
            m.cache = fs_root / "cache"
        elif cfg.full_cache:
            m.cache = root / "cachefs" / "cache"
        self.live.append(m)
        m.start()
        return m

    def kill9(self, m: Mount, client: subprocess.Popen[bytes] | None) -> int:
        """SIGKILL the daemon, let its client see the dead mount (ENOTCONN) and exit, and only then detach
        the mount: detached first, the client's next call would land in the bare mountpoint directory."""
        assert m.proc is not None
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(timeout=30)
        m.proc = None
        code = 0
        if client is not None:
            try:
                code = client.wait(timeout=60)
            except subprocess.TimeoutExpired:
                client.kill()
                raise RoundFailed("the writer hung on the dead mount") from None
        subprocess.run(["fusermount3", "-u", "-z", "-q", str(m.mnt)], check=False)
        return code

    def stop(self, m: Mount, what: str) -> None:
        """SIGTERM, as systemd stops the daemon: drain (with drain_timeout), unmount, exit 0. No CLI
        process to start, which keeps rounds short. (--keep-mount: a daemon the holder started is not our
        child, so `ckptfs umount` stops it, and the holder must exit with the mount.)"""
        if self.args.keep_mount:
            self.stop_kept(m, what)
            return
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        try:
            code = m.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise RoundFailed(f"{what}: the daemon did not stop on SIGTERM") from None
        m.proc = None
        self.live.remove(m)
        if code != 0:
            raise RoundFailed(f"{what}: the daemon exited {code} on SIGTERM")

    def stop_kept(self, m: Mount, what: str) -> None:
        """--keep-mount: `ckptfs umount` (drain, unmount; the daemon serving may be one the holder started),
        then the daemon and the holder must be gone."""
        pid = status_pid(m)
        result = m.cli("umount", str(m.mnt), "--timeout", "240", timeout=300)
        if result.returncode != 0:
            raise RoundFailed(f"{what}: ckptfs umount exited {result.returncode}: {result.stderr.strip()[-300:]}")
        if m.proc is not None:
            code = m.proc.wait(timeout=60)
            m.proc = None
            if code != 0:
                raise RoundFailed(f"{what}: the daemon exited {code} after ckptfs umount")
        deadline = time.monotonic() + 30
        while (pid is not None and not process_gone(pid)) or m.holder_pid() is not None:
            if time.monotonic() > deadline:
                raise RoundFailed(f"{what}: after ckptfs umount, daemon pid {pid} or holder pid {m.holder_pid()}"
                                  " is still there")
            time.sleep(0.05)
        if os.path.ismount(m.mnt):
            raise RoundFailed(f"{what}: still mounted after ckptfs umount")
        self.live.remove(m)

    def run_writer(self, plan: list[Op], dir_: Path, mnt: Path, name: str,
                   env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        plan_path = dir_ / f"{name}.plan.json"
        log_path = dir_ / f"{name}.log.jsonl"
        plan_path.write_text(json.dumps(plan))
        log_path.touch()
        proc = subprocess.Popen([sys.executable, str(TESTS / "crash_writer.py"), str(plan_path), str(log_path),
                                 str(mnt)], stderr=open(dir_ / f"{name}.stderr", "wb"), env=env)  # noqa: SIM115
        self.writers.append(proc)
        return proc, log_path

    def round(self, index: int) -> RoundResult:
        started = time.monotonic()
        rng = random.Random(f"{self.seed}:{index}")
        cfg = self.choose(rng, index)
        result = RoundResult(False, "", 0.0, cfg)
        round_dir = self.workdir / f"round-{index}"
        shutil.rmtree(round_dir, ignore_errors=True)
        round_dir.mkdir(parents=True)
        try:
            self._round(index, rng, cfg, round_dir, result)
            result.ok = True
        except KnownBug as exc:
            result.message, result.known = str(exc), exc.test
        except RoundFailed as exc:
            result.message = str(exc)
        except Exception as exc:  # a daemon that would not start, a flush that failed: the round fails
            result.message = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        finally:
            if self.proxy is not None:
                self.proxy.heal()
            self.reap()
        for log in round_dir.rglob("daemon.log"):
            text = log.read_text(errors="replace")
            result.waits += text.count("writes wait for the drain")
            result.spills += text.count("started while it was written")
            blocks = tracebacks(text)
            if result.ok and blocks:
                head, last = blocks[0][0][:160], blocks[0][1].splitlines()[-1][:160]
                result.ok, result.message = False, f"{log.parent.name}: daemon logged a traceback: {head} ... {last}"
                known = {known_traceback(block) for _, block in blocks}
                if len(known) == 1 and None not in known:
                    result.known = known.pop() or ""
                    result.message += f" [known bug: tests/test_crash_harness.py::{result.known}]"
        if result.ok and not self.args.keep:
            shutil.rmtree(round_dir, ignore_errors=True)
        result.seconds = time.monotonic() - started
        return result

    def _multi_round(self, index: int, rng: random.Random, cfg: RoundConfig, round_dir: Path,
                     result: RoundResult) -> None:
        store = self.new_store(index)
        (round_dir / "barriers").mkdir()
        if cfg.orbax:
            cfg.find_refresh = [rng.random() < 0.5 for _ in range(cfg.nodes)]
        plan = build_multi_plan(rng, cfg.nodes, str(index), round_dir / "barriers", cfg.lockstep,
                                cfg.find_refresh if cfg.orbax else None)
        cfg.steps = plan.steps
        cfg.orbax_steps = ",".join(f"{k + 1}:{o.label()}" for k, o in sorted(plan.orbax.items()))
        cfg.kill_plan = draw_kills(rng, cfg.delays, plan)
        cfg.kill = "+".join(k.kind for k in cfg.kill_plan)
        ops = [op for segs in plan.segments for seg in segs for op in seg.ops]
        result.ops_planned = len(ops)
        result.bytes_written = sum(op.get("size", 0) for op in ops)
        multi = MultiNodeRound(self, cfg, plan, store, round_dir, result)
        try:
            multi.run()
        finally:
            result.ops_done = sum(len(ns.model.applied) for ns in multi.nodes)
            result.polls, result.marker_polls = multi.check.polls, multi.check.marker_polls
            result.held_polls = multi.check.held_polls

    def _round(self, index: int, rng: random.Random, cfg: RoundConfig, round_dir: Path, result: RoundResult) -> None:
        if cfg.nodes > 1:
            self._multi_round(index, rng, cfg, round_dir, result)
            return
        store = self.new_store(index)
        names: dict[str, int] = {}
        dirs: set[str] = set()
        scale = "full-cache" if cfg.full_cache else "small"
        model = Model()
        step_no = 0
        node = round_dir / "node-a"
        extra: tuple[str, ...] = ("--part-size", cfg.part_size, "--upload-while-writing", cfg.upload_while_writing,
                                  "--passthrough", cfg.passthrough)
        if cfg.kill == "spill":
            extra = ("--cache-size", str(SPILL_CACHE_SIZE), "--part-size", "5M", "--min-free", "0")
        if self.proxy is not None:
            self.proxy.set_rules(*fault_rules(cfg.faults))
        rules = list(self.proxy.rules) if self.proxy is not None else []
        injected_before = dict(self.proxy.injected) if self.proxy is not None else {}
        round_started = time.monotonic()

        def check_faults() -> None:
            if self.proxy is None:
                return
            result.fired = {k: v - injected_before.get(k, 0) for k, v in self.proxy.injected.items()
                            if v > injected_before.get(k, 0)}
            sure = [r for r in rules if r.count == 1]
            silent = [r.action for r in sure if r.fired == 0]
            # A round killed before its first write may never PUT anything: nothing to inject into.
            puts = sum(1 for at, line, _ in self.proxy.log if at >= round_started and line.startswith("PUT "))
            if silent and puts >= len(sure):
                raise RoundFailed(f"faults {silent} never fired (proxy saw {self.proxy.requests} requests)")

        if cfg.prephase != "none":  # an earlier life of the job: the store already holds checkpoints
            pre = phase_builder(cfg, rng, f"{index}a", names, dirs, scale, gateway=self.args.gateway)
            for _ in range(rng.randint(1, 2)):
                step_no += 1
                pre.checkpoint(step_no)
            m = self.mount(node, store, cfg, *extra)
            proc, log = self.run_writer(pre.ops, round_dir, m.mnt, "pre")
            if proc.wait(timeout=300) != 0:
                raise RoundFailed(f"pre-phase writer exited {proc.returncode}")
            in_flight, failures = model.apply_log(pre.ops, log)
            if in_flight is not None or (failures and not cfg.full_cache):
                raise RoundFailed(f"pre-phase: {failures[:1] or ['writer stopped early']}")
            self.stop(m, "pre-phase")  # SIGTERM drains everything before it unmounts
            if cfg.prephase == "fresh-cache":
                node = round_dir / "node-b"

        pre_ops = len(model.applied)
        plan_builder = phase_builder(cfg, rng, f"{index}b", names, dirs, scale, gateway=self.args.gateway)
        if cfg.prephase != "none":  # renames, deletes and changes of files already in the store
            for _ in range(rng.randint(1, 3)):
                plan_builder.mutate()
        big = rng.randint(36 * MiB, 44 * MiB) if cfg.kill == "spill" else 0
        n_steps = rng.randint(1, 3)
        for n in range(n_steps):
            step_no += 1
            plan_builder.checkpoint(step_no, big_file=big if n == n_steps - 1 else 0)
            if cfg.full_cache and rng.random() < 0.5:
                plan_builder.write_file(f"step_{step_no:05d}/extra.bin", rng.randint(8 * MiB, 16 * MiB))
        plan = plan_builder.ops
        result.ops_planned = len(plan)
        result.bytes_written = sum(op.get("size", 0) for op in plan)
        if cfg.kill == "spill":
            chunks = [i for i, op in enumerate(plan) if op.get("path", "").endswith("/big.bin") and op["op"] == "write"]
            cfg.kill_at = rng.choice(chunks[20:] or chunks)
        else:
            cfg.kill_at = rng.randint(0, len(plan))
        if cfg.keep_mount:  # 1 to 3 kills; each waits for the takeover of the one before
            if cfg.kill in ("workload", "spill"):
                more = [rng.choice(chunks) if cfg.kill == "spill" else rng.randint(0, len(plan))
                        for _ in range(rng.randint(0, 2))]
                cfg.kill_ats = sorted([cfg.kill_at, *more])
                cfg.kill_sleeps = [rng.uniform(0, 0.03) for _ in cfg.kill_ats]
            elif cfg.kill == "drain":
                cfg.kill_sleeps = [rng.uniform(0, cfg.upload_delay + BURST_QUIET + 0.3)
                                   for _ in range(rng.randint(1, 3))]
            else:
                cfg.kill_sleeps = [rng.uniform(0, 0.4) for _ in range(rng.randint(1, 2))]

        if cfg.preempt_after is not None:
            extra = (*extra, "--upload-limit", PREEMPT_UPLOAD_LIMIT)
        m = self.mount(node, store, cfg, *extra)
        if cfg.keep_mount:
            self._kept_round(rng, cfg, store, model, plan, m, round_dir, result, check_faults)
            return
        filler = m.cache.parent / "filler" if cfg.full_cache else None
        if filler is not None and cfg.filler_mib:
            filler.write_bytes(bytes(cfg.filler_mib * MiB))
        proc, log = self.run_writer(plan, round_dir, m.mnt, "main")
        if cfg.preempt_after is not None:
            self.preempt_later(m, cfg.preempt_after, cfg.preempt_deadline, cfg.preempt_keep_limits)
        killed_node: Mount | None = None
        if cfg.kill in ("workload", "spill"):
            deadline = time.monotonic() + 300
            while proc.poll() is None and count_lines(log) < cfg.kill_at:
                if time.monotonic() > deadline:
                    raise RoundFailed(f"writer stuck at op {count_lines(log)} of {len(plan)}")
                time.sleep(0.003)
            time.sleep(cfg.kill_sleep)
            code = self.kill9(m, proc)
            killed_node = m
        else:
            code = proc.wait(timeout=300)
            if code != 0:
                raise RoundFailed(f"writer exited {code}")
            if cfg.kill == "drain":
                # Small files wait for the end of the writer's burst too (BURST_QUIET) before they upload.
                time.sleep(rng.uniform(0, cfg.upload_delay + BURST_QUIET + 0.3))
                self.kill9(m, None)
                killed_node = m
        if code not in (0, EXIT_MOUNT_GONE):
            raise RoundFailed(f"writer exited {code}: {(round_dir / 'main.stderr').read_text()[-300:]}")
        # Linux answers EIO (not ECONNABORTED) to a write in flight when the daemon dies; the daemon logs
        # every EIO it answers itself, so an EIO it has no record of is the kernel's.
        eio_at_kill = (killed_node is not None and code == EXIT_MOUNT_GONE
                       and not EIO_ANSWERED.search(killed_node.log.read_text(errors="replace")))
        in_flight, failures = model.apply_log(plan, log, eio_at_kill=eio_at_kill)
        result.ops_done = len(model.applied) - pre_ops
        result.errors = failures
        bad = failures
        if cfg.full_cache and failures and "ENOSPC" in failures[0]:
            # After an ENOSPC the plan's later steps on what was not created fail in turn, as they would
            # for a trainer that ignored the error; anything else (EIO first of all) is a failure.
            bad = [f for f in failures if not any(e in f for e in CASCADE_ERRNOS)]
        if bad:
            raise RoundFailed(f"writer: {bad[0]}")
        if self.preempter is not None:
            self.preempter.join(timeout=60)
        if killed_node is not None:
            stored = store.snapshot()
            check_kill_point(stored, model, in_flight)
            check_step_markers(stored, model, in_flight)
            if filler is not None:
                filler.unlink(missing_ok=True)
            killed_node.start()
        elif filler is not None:
            filler.unlink(missing_ok=True)
        final, problem = match_in_flight(read_mount(m.mnt), model, in_flight)
        if problem:
            raise RoundFailed(problem)
        model = final
        flush_and_check(m, store, check_faults)
        self.stop(m, "after flush")

        # A fresh node on the same store; in "fetch" rounds it is killed while reading and restarted.
        fresh = self.mount(round_dir / "node-fresh", store, dataclasses.replace(cfg, full_cache=False))
        if cfg.kill == "fetch":
            reads = [{"op": "read", "path": p} for p in sorted(model.files)]
            rng.shuffle(reads)
            reader, _ = self.run_writer(reads, round_dir, fresh.mnt, "reader")
            time.sleep(rng.uniform(0, 0.4))
            self.kill9(fresh, reader)
            fresh.start()
        problem = first_difference(read_mount(fresh.mnt), model.files, model.dirs, "fresh node")  # type: ignore[arg-type]
        if problem:
            raise RoundFailed(problem)
        self.stop(fresh, "fresh node")
        if cfg.kill == "fetch":
            check_store_matches(store.snapshot(), Tree({p: bytes(d) for p, d in model.files.items()}, model.dirs), [])

    def _kept_round(self, rng: random.Random, cfg: RoundConfig, store: StoreView, model: Model, plan: list[Op],
                    m: Mount, round_dir: Path, result: RoundResult, check_faults: Callable[[], None]) -> None:
        """--keep-mount: the workload goes on across kills of its daemon; the holder's next daemon takes the
        mount over each time. The writer must see no error at all."""
        pre_ops = len(model.applied)
        takeovers = Takeovers(m, result)

        def kill_point() -> None:  # the daemon is dead: the store is quiet; read it before the writer's log
            stored = store.snapshot()
            failure = logged_failure(plan, log)
            if failure:
                writer_failed(m, failure, "no error may reach it across a takeover")
            now = model.copy()
            in_flight, _ = now.apply_log(plan, log)
            result.ops_done = len(now.applied) - pre_ops
            check_kill_point(stored, now, in_flight)

        proc, log = self.run_writer(plan, round_dir, m.mnt, "main")
        if cfg.kill in ("workload", "spill"):
            for n, (at, pause) in enumerate(zip(cfg.kill_ats, cfg.kill_sleeps, strict=True)):
                deadline = time.monotonic() + 300
                while proc.poll() is None and count_lines(log) < at:
                    if time.monotonic() > deadline:
                        raise RoundFailed(f"writer stuck at op {count_lines(log)} of {len(plan)}")
                    time.sleep(0.003)
                time.sleep(pause)
                takeovers.kill(f"{cfg.kill}{n}@op{count_lines(log)}", kill_point)
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise RoundFailed(f"writer stuck at op {count_lines(log)} of {len(plan)} after"
                              f" {takeovers.kills} takeovers") from None
        if code != 0:
            raise RoundFailed(f"writer exited {code}{' (it saw a dead mount)' if code == EXIT_MOUNT_GONE else ''}"
                              f" across {takeovers.kills} takeovers: {(round_dir / 'main.stderr').read_text()[-300:]}")
        if cfg.kill == "drain":
            for n, pause in enumerate(cfg.kill_sleeps):
                time.sleep(pause)
                takeovers.kill(f"drain{n}", kill_point)
        # (the first failure is the round's: the model cannot follow a writer that carried on after one)
        failure = logged_failure(plan, log)
        if failure:
            writer_failed(m, failure, f"across {takeovers.kills} takeovers")
        in_flight, _ = model.apply_log(plan, log)
        result.ops_done = len(model.applied) - pre_ops
        if in_flight is not None:
            raise RoundFailed(f"writer exited 0 before {describe(in_flight)}")
        # No operation in doubt: none failed, so the mount holds the model exactly.
        problem = first_difference(read_mount(m.mnt), model.files, model.dirs,  # type: ignore[arg-type]
                                   f"mount after {takeovers.kills} takeovers")
        if problem:
            raise RoundFailed(problem)
        flush_and_check(m, store, check_faults)
        takeovers.verify_log()
        self.stop(m, "after flush")

        # A fresh node on the same store; in "fetch" rounds its daemon is killed while a reader reads every
        # file (remote ones: a fetch in flight across the takeover), and the reader must see no error.
        fresh = self.mount(round_dir / "node-fresh", store, cfg)
        fresh_takeovers = Takeovers(fresh, result)
        if cfg.kill == "fetch":
            reads = [{"op": "read", "path": p} for p in sorted(model.files)]
            rng.shuffle(reads)
            reader, reader_log = self.run_writer(reads, round_dir, fresh.mnt, "reader")
            want = Tree({p: bytes(d) for p, d in model.files.items()}, model.dirs)

            def unchanged() -> None:  # a reader never changes the store: at the kill it holds the model exactly
                check_store_matches(store.snapshot(), want, [])

            for n, pause in enumerate(cfg.kill_sleeps):
                time.sleep(pause)
                fresh_takeovers.kill(f"fetch{n}", unchanged)
            try:
                code = reader.wait(timeout=300)
            except subprocess.TimeoutExpired:
                raise RoundFailed(f"reader stuck after {fresh_takeovers.kills} takeovers") from None
            _, failures = Model().apply_log(reads, reader_log)
            if code != 0 or failures:
                raise RoundFailed(f"reader exited {code} across {fresh_takeovers.kills} takeovers"
                                  f"{': ' + failures[0] if failures else ''}")
        problem = first_difference(read_mount(fresh.mnt), model.files, model.dirs, "fresh node")  # type: ignore[arg-type]
        if problem:
            raise RoundFailed(problem)
        fresh_takeovers.verify_log()
        self.stop(fresh, "fresh node")
        if cfg.kill == "fetch":
            check_store_matches(store.snapshot(), Tree({p: bytes(d) for p, d in model.files.items()}, model.dirs), [])


# -- --keep-mount: kills the holder's next daemon takes over -------------------------------------------------

TAKEOVER_WAIT = 60.0  # seconds after a kill within which a new daemon must answer `status`
HOLDER_STARTS = b"starting a daemon to take the connection over"  # the holder's log line (keepmount/holder.py)
DAEMON_DIED = re.compile(r"holder of \S+: daemon pid \d+ died")
TOOK_OVER = "took over the FUSE connection of"


def logged_failure(plan: list[Op], log: Path) -> str | None:
    """The writer's first failed operation, as Model.apply_lines words it (None: none failed)."""
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if "err" in entry:
                name = errno.errorcode.get(entry["err"], entry["err"])
                return f"op #{entry['i']} {describe(plan[entry['i']])} failed: {name}"
    return None


def writer_failed(m: Mount, failure: str, context: str) -> None:
    """Raise the round's failure for the writer's first failed operation. (A request the killed daemon had
    done but not answered, sent again and done again, was a known bug here until the daemon that takes
    over answered it from what the one before did: test_a_request_done_but_not_answered_at_the_kill_...)"""
    raise RoundFailed(f"writer: {failure} ({context})")


def holder_children(pid: int) -> list[int]:
    """The daemons a holder started (its child processes), by pid."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def process_gone(pid: int) -> bool:
    """The process exited (gone, or a zombie its parent has not reaped yet: none of its threads runs)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def status_pid(m: Mount) -> int | None:
    """The pid of the daemon that answers `ckptfs status --json` on m (the same request on its control
    socket, without starting a CLI process per poll), or None if none answers."""
    name = hashlib.sha256(str(canonical_mountpoint(m.mnt)).encode()).hexdigest()[:16]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(str(m.runtime / f"{name}.sock"))
        sock.sendall(json.dumps({"op": "status"}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
        reply = json.loads(buf)
    except (OSError, ValueError):
        return None
    finally:
        sock.close()
    return int(reply["pid"]) if reply.get("ok") and isinstance(reply.get("pid"), int) else None


def log_tail(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


class Takeovers:
    """--keep-mount: SIGKILL the daemon serving a mount and let the holder's next daemon take the mount
    over; the harness neither detaches nor restarts anything, and the clients' requests just wait."""

    def __init__(self, m: Mount, result: RoundResult) -> None:
        self.m = m
        self.result = result
        self.kills = 0

    def kill(self, label: str, check: Callable[[], None] | None = None) -> None:
        """Kill the daemon now; while it is dead (the holder waits RESTART_DELAY before it starts the next),
        run `check` (the kill-point invariants: the store is quiet); then wait until a new daemon answers."""
        m = self.m
        pid = status_pid(m)
        if pid is None:
            raise RoundFailed(f"{label}: no daemon answers status on {m.root.name} before the kill")
        offset = m.log.stat().st_size
        if m.proc is not None and m.proc.pid == pid:  # the first daemon is the harness's child
            m.proc.kill()
            m.proc.wait(timeout=30)
            m.proc = None
        else:  # one the holder started (the holder reaps it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while not process_gone(pid):
                if time.monotonic() > deadline:
                    raise RoundFailed(f"{label}: daemon pid {pid} did not die of SIGKILL")
                time.sleep(0.002)
        self.kills += 1
        self.result.kills_done.append(label)
        if check is not None:
            try:
                check()
                failure = None
            except RoundFailed as exc:
                failure = exc
            # A check that ended after the holder started the next daemon may have seen that daemon's
            # recovery change the store: not trusted either way (counted as not made).
            if HOLDER_STARTS not in log_tail(m.log, offset):
                if failure is not None:
                    failure.args = (f"{label}, daemon dead: {failure}",)  # a KnownBug stays one
                    raise failure
                self.result.kill_point_checks += 1
        deadline = time.monotonic() + TAKEOVER_WAIT
        while True:
            new = status_pid(m)
            if new is not None and new != pid:
                return
            if time.monotonic() > deadline:
                raise RoundFailed(f"{label}: no daemon took the mount over within {TAKEOVER_WAIT:.0f} s after the"
                                  f" kill of pid {pid} (holder pid {m.holder_pid()})")
            time.sleep(0.05)

    def verify_log(self) -> None:
        """Every daemon that died was killed by the harness, and each kill was followed by a takeover."""
        text = self.m.log.read_text(errors="replace")
        died, took_over = len(DAEMON_DIED.findall(text)), text.count(TOOK_OVER)
        if died != self.kills or took_over != self.kills:
            raise RoundFailed(f"{self.m.root.name}: {self.kills} kills, but the holder saw {died} daemons die and"
                              f" {took_over} took the mount over (a daemon died by itself, or one failed to start)")


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))


def tracebacks(text: str) -> list[tuple[str, str]]:
    """The tracebacks in a daemon log: (the log line before it, the traceback's lines)."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            end = i + 1
            while end < len(lines) and (lines[end].startswith(" ") or lines[end].startswith("~")):
                end += 1
            found.append((lines[i - 1] if i else "", "\n".join(lines[i:end + 1])))
    return found


# Daemon tracebacks with the exact signature of an open bug that has its xfail(strict=True) test in
# test_crash_harness.py: regex (searched in the traceback's lines) -> that test's name. None open today.
KNOWN_TRACEBACKS: dict[str, str] = {}


def known_traceback(block: str) -> str | None:
    return next((test for pattern, test in KNOWN_TRACEBACKS.items() if re.search(pattern, block)), None)


EIO_ANSWERED = re.compile(r"failed: (\[EIO\]|\[Errno 5\])|answering EIO")


def describe_round(index: int, r: RoundResult) -> str:
    cfg = r.config
    assert cfg is not None
    verdict = "ok  " if r.ok else "KNOWN" if r.known else "FAIL"
    if cfg.nodes > 1:
        return "  ".join([
            f"round {index:4d}", verdict, f"nodes={cfg.nodes}", f"steps={cfg.steps}",
            "lockstep" if cfg.lockstep else "async   ", "delays=" + "/".join(f"{d:g}" for d in cfg.delays),
            *([f"orbax={cfg.orbax_steps} find=" + "".join("r" if r else "i" for r in cfg.find_refresh)]
              if cfg.orbax else []),
            "kills=" + ",".join(k.label() for k in cfg.kill_plan) + f" ({len(r.kills_done)} done)",
            f"ops={r.ops_done}/{r.ops_planned}", f"bytes={r.bytes_written / MiB:.1f}MiB",
            f"polls={r.polls} with-marker={r.marker_polls} marker-held={r.held_polls}",
            *([f"renames={'/'.join(f'{t:.1f}' for t in r.renames)}s killed-in-rename={r.rename_kills}"]
              if cfg.orbax else []), f"{r.seconds:.1f}s"])
    parts = [f"round {index:4d}", verdict, f"kill={cfg.kill:8s}", f"pre={cfg.prephase:11s}",
             f"delay={cfg.upload_delay:<4}", f"ops={r.ops_done}/{r.ops_planned}",
             f"bytes={r.bytes_written / MiB:.1f}MiB", f"{r.seconds:.1f}s"]
    if cfg.unlisted_dir_ops:
        parts.append("unlisted")
    if cfg.faults:
        parts.append("faults=" + ",".join(cfg.faults) + " fired=" + ",".join(f"{k}:{v}" for k, v in r.fired.items()))
    if cfg.full_cache:
        parts.append(f"filler={cfg.filler_mib}MiB enospc={sum('ENOSPC' in e for e in r.errors)} waits={r.waits}")
    if cfg.kill == "spill" or r.spills:
        parts.append(f"spilled_files={r.spills}")
    if cfg.keep_mount:
        parts.append(f"takeovers={','.join(r.kills_done) or '-'} kill-point-checks={r.kill_point_checks}")
    return "  ".join(parts)


def run(args: argparse.Namespace, emit: Callable[[str], None] = print) -> list[RoundResult]:
    results = []
    with Harness(args) as harness:
        for index in range(args.round, args.round + args.rounds):
            r = harness.round(index)
            results.append(r)
            emit(describe_round(index, r))
            if not r.ok:
                flags = " --faults" if args.faults else ""
                flags += " --full-cache" if args.full_cache else ""
                flags += " --unlisted-dir-ops" if args.unlisted_dir_ops else ""
                flags += f" --nodes {args.nodes}" if args.nodes > 1 else ""
                flags += " --orbax" if args.orbax else ""
                flags += f" --passthrough {args.passthrough}" if args.passthrough else ""
                flags += " --no-cross-node-ordering" if args.no_cross_node_ordering else ""
                flags += " --keep-mount" if args.keep_mount else ""
                flags += " --gateway" if args.gateway else ""
                emit(f"  first difference: {r.message}")
                emit(f"  replay: python -m tests.crash_harness --seed {args.seed} --store {args.store}{flags} "
                     f"--round {index} --rounds 1 --keep   (kept: {harness.workdir / f'round-{index}'})")
                if args.stop_on_failure:
                    break
    failed = [r for r in results if not r.ok and not r.known]
    known = [r for r in results if r.known]
    seconds = [r.seconds for r in results]
    kills: dict[str, int] = {}
    for r in results:
        assert r.config is not None
        for kind in r.config.kill.split("+"):
            kills[kind] = kills.get(kind, 0) + 1
    emit(f"summary: {len(results)} rounds, {len(results) - len(failed) - len(known)} ok, {len(failed)} failed, "
         f"{len(known)} known bugs; store={args.store}{f' nodes={args.nodes}' if args.nodes > 1 else ''}"
         f"{' faults' if args.faults else ''}{' full-cache' if args.full_cache else ''} seed={args.seed}; "
         f"kills {kills}; {sum(seconds):.0f}s total, {sum(seconds) / max(1, len(seconds)):.1f}s/round, "
         f"max {max(seconds, default=0):.1f}s")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.crash_harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(3), "big"))
    parser.add_argument("--round", type=int, default=0, help="index of the first round (replay: --rounds 1)")
    parser.add_argument("--store", choices=["file", "seaweedfs"], default="file")
    parser.add_argument("--faults", action="store_true", help="store faults through the fault proxy (seaweedfs)")
    parser.add_argument("--full-cache", action="store_true", help="a 40 MiB tmpfs cache, partly filled by others")
    parser.add_argument("--workdir", help="default /tmp/ckptfs-crash-SEED")
    parser.add_argument("--keep", action="store_true", help="keep the directories of rounds that passed")
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("--strict", action="store_true", help="rounds that hit a known bug fail the run too")
    parser.add_argument("--passthrough", choices=["auto", "off"],
                        help="the daemons' --passthrough (without it, drawn per round from the seed)")
    parser.add_argument("--unlisted-dir-ops", action="store_true",
                        help="every round removes and renames directories without listing them first "
                        "(without it, half the rounds do, drawn from the seed)")
    parser.add_argument("--nodes", type=int, choices=[1, 2, 3], default=1,
                        help="daemons on one store, each with its own cache dir: the cross-node order of commit "
                        "markers (a marker never lands before the files closed on any node before the barrier)")
    parser.add_argument("--orbax", action="store_true",
                        help="with --nodes: every round has Orbax steps (one node makes a tmp dir, every node writes "
                        "into it, node 0 renames it after the barrier; without it, a share of the rounds, drawn)")
    parser.add_argument("--no-cross-node-ordering", action="store_true",
                        help="with --nodes: run the daemons without cross-node ordering, to see the check fail")
    parser.add_argument("--gateway", action="store_true",
                        help="the daemons run in gateway mode (--gateway --idle-upload 0.1): files still open for "
                        "writing are uploaded once idle, and again when they change")
    parser.add_argument("--preempt", action="store_true",
                        help="each step gets a commit marker of its own and, at a random moment of the workload, "
                        "`ckptfs preempt` reorders the drain before the kill: no step marker is ever in the store "
                        "before the files of its step, nothing is lost")
    parser.add_argument("--keep-mount", action="store_true",
                        help="the daemons run with keep_mount: each kill (1 to 3 a round) leaves the mount to the "
                        "daemon the holder starts next, the workload goes on and must see no error (without it, "
                        "every mount has --no-keep-mount and a kill leaves a dead mount the harness restarts)")
    args = parser.parse_args(argv)
    if args.preempt and (args.keep_mount or args.nodes > 1):
        parser.error("--preempt does not combine with --keep-mount or --nodes (yet): their rounds have writers of"
                     " their own; run it on its own (with --store, --faults, --full-cache as you like)")
    if args.keep_mount and (args.nodes > 1 or args.full_cache):
        parser.error("--keep-mount does not combine with --nodes or --full-cache (yet): their writers expect "
                     "dead mounts (restarted steps) or errors (ENOSPC), a takeover lets them see neither")
    if args.faults and args.store != "seaweedfs":
        parser.error("--faults needs --store seaweedfs (the fault proxy speaks HTTP)")
    if args.orbax and args.nodes < 2:
        parser.error("--orbax needs --nodes 2 or 3")
    if args.nodes > 1 and (args.faults or args.full_cache):
        parser.error("--nodes does not combine with --faults or --full-cache (yet)")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that a SIGTERM, like Ctrl-C, kills this run's daemons and undoes its mounts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    results = run(args)
    return 0 if all(r.ok or (r.known and not args.strict) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
