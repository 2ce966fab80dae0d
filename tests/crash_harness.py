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
else": writes wait or get ENOSPC, nothing closed is lost, the journal survives).

    python -m tests.crash_harness --rounds 100 --seed 7 --store file
    python -m tests.crash_harness --rounds 30 --seed 7 --store seaweedfs --faults
    python -m tests.crash_harness --seed 7 --store file --round 17 --rounds 1      # replay round 17

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
import os
import random
import re
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
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

from ckptfs.drain import BURST_QUIET  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
MARKER = "latest"
MARKER_PREFIX = b"ckpt-marker "
TEMP_PREFIX = ".ckptfs-tmp."
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
        failures: list[str] = []
        next_index = 0
        partial: dict[int, int] = {}
        lines = log_path.read_text().splitlines()
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
        in_flight = plan[next_index] if next_index < len(plan) else None
        if in_flight is not None and next_index in partial:  # a short write already in the mount, in part
            in_flight = dict(in_flight, already=partial[next_index])
        return in_flight, failures


def describe(op: Op) -> str:
    if op["op"] == "rename":
        return f"rename {op['src']} -> {op['dst']}"
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


def read_mount(root: Path) -> Tree:
    files: dict[str, bytes] = {}
    dirs: set[str] = set()
    for top, dirnames, filenames in os.walk(root):
        rel_top = os.path.relpath(top, root)
        for d in dirnames:
            dirs.add(os.path.normpath(os.path.join(rel_top, d)))
        for name in filenames:
            rel = os.path.normpath(os.path.join(rel_top, name))
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


class StoreView(Protocol):
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
        for name in sorted(os.listdir(staging)) if staging.is_dir() else []:
            tree.temps.append(f"{staging.name}/{name}")
            with contextlib.suppress(OSError):
                if os.path.samefile(staging / name, self.root / urllib.parse.unquote(name.split(".", 2)[-1])):
                    tree.linked_temps.append(f"{staging.name}/{name}")
        for top, dirnames, filenames in os.walk(self.root):
            rel_top = os.path.relpath(top, self.root)
            dirnames[:] = [d for d in dirnames if d != staging.name]
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


class S3Store:
    def __init__(self, server: Any, bucket: str, prefix: str, endpoint: str) -> None:
        self.client = server.client()
        self.bucket = bucket
        self.prefix = prefix
        self.source = f"s3://{bucket}/{prefix}"
        self.daemon_args = ("--endpoint-url", endpoint)

    def snapshot(self) -> Tree:
        tree = Tree({}, set())
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self.prefix):]
                if TEMP_PREFIX in rel:
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


def check_store_matches(store: Tree, mount: Tree, leftovers: list[str]) -> None:
    if store.temps:
        raise RoundFailed(f"store after flush: temp objects left: {sorted(store.temps)[:5]}")
    problem = first_difference(store, mount.files, mount.dirs, "store after flush")  # type: ignore[arg-type]
    if problem:
        raise RoundFailed(problem)
    if leftovers:
        raise RoundFailed(f"store after flush: multipart uploads left behind: {leftovers[:5]}")


def check_journal_against_store(journal_path: Path, store: Tree) -> None:
    """The journal, read-only, against the store itself (not the cache): after a flush every linked inode is
    in the store at its own key ('clean', or 'remote' when the cache holds none or only part of it: evicted,
    imported, or read by chunks), and the object there has the journal's size (and crc32, where it keeps one)."""
    db = sqlite3.connect(f"file:{journal_path}?mode=ro", uri=True, timeout=10)
    try:
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise RoundFailed("journal: quick_check failed")
        rows = db.execute("SELECT path, kind, state, remote_key, size, checksum FROM inodes "
                          "WHERE path IS NOT NULL AND id != 1").fetchall()
        deletes = db.execute("SELECT key FROM pending_deletes").fetchall()
    finally:
        db.close()
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
    journal_paths = {r[0] for r in rows}
    for path in sorted((set(store.files) | store.dirs) - journal_paths):
        raise RoundFailed(f"journal after flush: the store holds {path}, the journal does not know it")


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


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.seed: int = args.seed
        self.store_kind: str = args.store
        self.workdir = Path(args.workdir or f"/tmp/ckptfs-crash-{self.seed}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.server: Any = None
        self.bucket = ""
        self.proxy: Any = None
        self.live: list[Mount] = []
        self.tmpfs: list[Path] = []

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

    def reap(self) -> None:
        """Kill every daemon this round started (by its own pid) and undo its mounts."""
        for m in self.live:
            if m.proc is not None:
                m.proc.kill()
                m.proc.wait()
                m.proc = None
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(m.mnt)], check=False)
        self.live.clear()
        for path in self.tmpfs:
            subprocess.run(["umount", "-l", str(path)], check=False)
        self.tmpfs.clear()

    def choose(self, rng: random.Random) -> RoundConfig:
        kills = ["workload", "workload", "workload", "drain", "drain", "fetch"]
        if self.store_kind == "seaweedfs" and not self.args.full_cache:
            kills.append("spill")
        kill = rng.choice(kills)
        faults = sorted(rng.sample(FAULT_KINDS, rng.randint(1, 2))) if self.args.faults else []
        return RoundConfig(
            kill=kill, upload_delay=rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]),
            prephase=rng.choice(["none", "none", "same-cache", "fresh-cache", "fresh-cache"]),
            kill_at=0, kill_sleep=rng.uniform(0, 0.03), faults=faults, full_cache=self.args.full_cache,
            filler_mib=rng.choice([0, 8, 16]) if self.args.full_cache else 0,
            # `mv step_100 step_100.bak` on a fresh node lists nothing first; `rm -r` lists: both, by turns
            unlisted_dir_ops=(rng.random() < 0.5) or self.args.unlisted_dir_ops,  # drawn either way: replays
            part_size=rng.choice(["64M", "1M", "2M"]), upload_while_writing=rng.choice(["off", "auto", "on"]),
            passthrough=self.args.passthrough or rng.choice(["auto", "off"]),
        )

    def new_store(self, index: int) -> StoreView:
        if self.store_kind == "file":
            return FileStore(self.workdir / f"round-{index}" / "store")
        endpoint = self.proxy.endpoint if self.proxy is not None else self.server.endpoint
        prefix = f"{S3_PREFIX_ROOT}-{self.seed}-{index}-{secrets.token_hex(3)}/"
        return S3Store(self.server, self.bucket, prefix, endpoint)

    def mount(self, root: Path, store: StoreView, cfg: RoundConfig, *extra: str) -> Mount:
        args = [*store.daemon_args, *extra]
        if cfg.full_cache:
            args += ["--dirty-wait", "3"]
        m = Mount(root, upload_delay=cfg.upload_delay, source=store.source, extra_args=tuple(args))
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
        process to start, which keeps rounds short."""
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

    def run_writer(self, plan: list[Op], dir_: Path, mnt: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
        plan_path = dir_ / f"{name}.plan.json"
        log_path = dir_ / f"{name}.log.jsonl"
        plan_path.write_text(json.dumps(plan))
        log_path.touch()
        proc = subprocess.Popen([sys.executable, str(TESTS / "crash_writer.py"), str(plan_path), str(log_path),
                                 str(mnt)], stderr=open(dir_ / f"{name}.stderr", "wb"))  # noqa: SIM115
        return proc, log_path

    def round(self, index: int) -> RoundResult:
        started = time.monotonic()
        rng = random.Random(f"{self.seed}:{index}")
        cfg = self.choose(rng)
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
            if result.ok and "Traceback" in text:
                line = next(x for x in text.splitlines() if "Traceback" in x)
                result.ok, result.message = False, f"{log.parent.name}: daemon logged a traceback: {line[:200]}"
        if result.ok and not self.args.keep:
            shutil.rmtree(round_dir, ignore_errors=True)
        result.seconds = time.monotonic() - started
        return result

    def _round(self, index: int, rng: random.Random, cfg: RoundConfig, round_dir: Path, result: RoundResult) -> None:
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
            extra = ("--cache-size", "24M", "--part-size", "5M", "--min-free", "0")
        if self.proxy is not None:
            self.proxy.set_rules(*fault_rules(cfg.faults))
        rules = list(self.proxy.rules) if self.proxy is not None else []
        injected_before = dict(self.proxy.injected) if self.proxy is not None else {}
        round_started = time.monotonic()

        if cfg.prephase != "none":  # an earlier life of the job: the store already holds checkpoints
            pre = PlanBuilder(rng, f"{index}a", names, dirs, scale, cfg.unlisted_dir_ops)
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
        plan_builder = PlanBuilder(rng, f"{index}b", names, dirs, scale, cfg.unlisted_dir_ops)
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

        m = self.mount(node, store, cfg, *extra)
        filler = m.cache.parent / "filler" if cfg.full_cache else None
        if filler is not None and cfg.filler_mib:
            filler.write_bytes(bytes(cfg.filler_mib * MiB))
        proc, log = self.run_writer(plan, round_dir, m.mnt, "main")
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
        if killed_node is not None:
            check_kill_point(store.snapshot(), model, in_flight)
            if filler is not None:
                filler.unlink(missing_ok=True)
            killed_node.start()
        elif filler is not None:
            filler.unlink(missing_ok=True)
        final, problem = match_in_flight(read_mount(m.mnt), model, in_flight)
        if problem:
            raise RoundFailed(problem)
        model = final
        m.flush(timeout=300)
        mount_tree = read_mount(m.mnt)
        stored = store.snapshot()
        check_store_matches(stored, mount_tree, store.leftover_uploads())
        check_journal_against_store(m.cache / "journal.db", stored)
        if self.proxy is not None:
            result.fired = {k: v - injected_before.get(k, 0) for k, v in self.proxy.injected.items()
                            if v > injected_before.get(k, 0)}
            sure = [r for r in rules if r.count == 1]
            silent = [r.action for r in sure if r.fired == 0]
            # A round killed before its first write may never PUT anything: nothing to inject into.
            puts = sum(1 for at, line, _ in self.proxy.log if at >= round_started and line.startswith("PUT "))
            if silent and puts >= len(sure):
                raise RoundFailed(f"faults {silent} never fired (proxy saw {self.proxy.requests} requests)")
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


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))


EIO_ANSWERED = re.compile(r"failed: (\[EIO\]|\[Errno 5\])|answering EIO")


def describe_round(index: int, r: RoundResult) -> str:
    cfg = r.config
    assert cfg is not None
    verdict = "ok  " if r.ok else "KNOWN" if r.known else "FAIL"
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
        kills[r.config.kill] = kills.get(r.config.kill, 0) + 1
    emit(f"summary: {len(results)} rounds, {len(results) - len(failed) - len(known)} ok, {len(failed)} failed, "
         f"{len(known)} known bugs; store={args.store}"
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
    args = parser.parse_args(argv)
    if args.faults and args.store != "seaweedfs":
        parser.error("--faults needs --store seaweedfs (the fault proxy speaks HTTP)")
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
