#!/usr/bin/env python3
"""Small-file benchmark (issues 13 and 31): the pattern of tokenizer files, sharded `save_pretrained` output
and per-rank optimizer shards, through a ckptfs mount against a plain directory on the same disk and
against libfuse's example daemon passthrough_ll (a C FUSE filesystem that, like ckptfs, sends every request
to its daemon: what FUSE itself costs for the same work).

The workload, per run: --dirs directories made, then --files files of 4 to 256 KiB (sizes drawn from
--seed), filled one directory after the other, each written to `.NAME.tmp`, fsync-free, closed and renamed
to `NAME.bin` (the way most savers commit a file), then --deletes of them (a tenth) deleted, spread over
the directories. Checking the tree (listings, the store's objects) comes after the timing. The ways, --runs
times, in an order that rotates each run, each timed run starting with the disk quiet (`sync`, then
--pause seconds, after any mount: a run must not pay for the previous one's writeback):

  local           a fresh directory on the disk of --dir (the baseline)
  passthrough_ll  a fresh directory on that disk mirrored by a fresh passthrough_ll mount (bench/
                  passthrough_ll.py: built from the Debian examples of libfuse3-dev into .build/ on first
                  use, or --passthrough-ll PATH), default options
  pyfuse3-floor   bench/pyfuse3_floor.py over a fresh directory: a minimal pyfuse3 + trio filesystem with
                  ckptfs's FUSE setup (passthrough, noflush, 1 s timeouts) and nothing else (a dict for a
                  namespace, no journal): what Python, trio and pyfuse3 cost per request, the floor of any
                  daemon built like ckptfs
  ckptfs          a fresh mount of file://STORE (fresh cache dir, default options); reported: the workload
                  (what a training job waits for) and durable (the workload plus `ckptfs flush`)
  ckptfs-1node    the same with --no-cross-node-ordering (no pending records): what cross-node ordering of
                  commit markers costs a single node
  before          with --before DIR: `ckptfs` of another checkout (PYTHONPATH=DIR), for a before/after
                  comparison in the same run

Ratios of medians: ckptfs / local, ckptfs / passthrough_ll (issue 31's target: <= 1.5x for the workload)
and passthrough_ll / local (what any FUSE daemon pays). JSON in bench/results/small_files_bench.json.

Run from the repo's venv as root:  python bench/small_files_bench.py [--files 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from passthrough_ll import Anchor, AnchorError, daemon_mounted, find_anchor, mounted  # noqa: E402
from s3_drain_bench import QUIET_PAUSE, ckptfs, quiet_disk, rotated, write_report  # noqa: E402

KIB = 1 << 10
DEFAULT_JSON = REPO / "bench" / "results" / "small_files_bench.json"
WAYS = ("local", "passthrough_ll", "pyfuse3-floor", "ckptfs", "ckptfs-1node")
FLOOR = REPO / "bench" / "pyfuse3_floor.py"


@dataclass(frozen=True)
class Work:
    """One run's workload, drawn before any timing so that every way gets the same files."""

    sizes: list[int]
    dirs: int
    doomed: list[int]  # indexes of the files deleted at the end
    payload: memoryview
    pause: float

    def path(self, root: Path, i: int) -> Path:
        return root / f"d{i * self.dirs // len(self.sizes):02d}" / f"f{i:05d}.bin"

    def expected(self) -> int:
        return len(self.sizes) - len(self.doomed)


def plan(files: int, dirs: int, deletes: int, seed: int, pause: float) -> Work:
    rng = random.Random(seed)
    sizes = [rng.randint(4, 256) * KIB for _ in range(files)]
    step = max(1, files // deletes) if deletes else files + 1
    doomed = list(range(0, files, step))[:deletes]
    return Work(sizes, dirs, doomed, memoryview(os.urandom(256 * KIB)), pause)


def workload(root: Path, work: Work) -> None:
    for d in range(work.dirs):
        os.mkdir(root / f"d{d:02d}")
    for i, size in enumerate(work.sizes):
        final = work.path(root, i)
        temp = final.with_name(f".f{i:05d}.tmp")
        with open(temp, "wb") as f:
            f.write(work.payload[:size])
        os.rename(temp, final)
    for i in work.doomed:
        os.unlink(work.path(root, i))


def check_tree(root: Path, work: Work, what: str) -> None:
    """Every file that should be there is, with no temp name left: read after the timing."""
    names = [name for d in os.listdir(root) for name in os.listdir(root / d)]
    if len(names) != work.expected() or any(n.endswith(".tmp") for n in names):
        raise SystemExit(f"{what} holds {len(names)} entries, not the {work.expected()} renamed files")


def timed(work: Work, target: Path) -> float:
    quiet_disk(work.pause)
    started = time.perf_counter()
    workload(target, work)
    return time.perf_counter() - started


def run_local(root: Path, tag: str, work: Work) -> dict[str, float]:
    target = root / f"local-{tag}"
    target.mkdir()
    try:
        seconds = timed(work, target)
        check_tree(target, work, "the plain directory")
        return {"workload": seconds}
    finally:
        shutil.rmtree(target, ignore_errors=True)


def run_passthrough_ll(root: Path, tag: str, work: Work, anchor: Anchor) -> dict[str, float]:
    source, mnt = root / f"pll-source-{tag}", root / f"pll-mnt-{tag}"
    source.mkdir()
    mnt.mkdir()
    try:
        with mounted(anchor, source, mnt, root / "passthrough_ll.log"):
            seconds = timed(work, mnt)
            check_tree(mnt, work, "the passthrough_ll mount")
        check_tree(source, work, "passthrough_ll's source directory")
        return {"workload": seconds}
    finally:
        shutil.rmtree(source, ignore_errors=True)


def run_floor(root: Path, tag: str, work: Work) -> dict[str, float]:
    source, mnt = root / f"floor-source-{tag}", root / f"floor-mnt-{tag}"
    source.mkdir()
    mnt.mkdir()
    try:
        with daemon_mounted([sys.executable, str(FLOOR), str(source), str(mnt)], mnt, root / "floor.log",
                            "pyfuse3_floor"):
            seconds = timed(work, mnt)
            check_tree(mnt, work, "the pyfuse3-floor mount")
        return {"workload": seconds}
    finally:
        shutil.rmtree(source, ignore_errors=True)


def run_ckptfs(root: Path, tag: str, work: Work, extra: tuple[str, ...] = (),
               checkout: Path | None = None) -> dict[str, float]:
    store, mnt, cache = root / f"store-{tag}", root / f"mnt-{tag}", root / f"cache-{tag}"
    store.mkdir()
    mnt.mkdir()
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(root / "run"))
    if checkout is not None:  # another version of ckptfs, for a before/after comparison in the same run
        env["PYTHONPATH"] = str(checkout)
    ckptfs("mount", "--no-guard-mountpoint",
           f"file://{store}", str(mnt), "--cache-dir", str(cache), "--metrics-addr", "off", "--daemon",
           *extra, env=env)
    try:
        quiet_disk(work.pause)
        started = time.perf_counter()
        workload(mnt, work)
        done = time.perf_counter()
        ckptfs("flush", str(mnt), "--timeout", "600", env=env, timeout=660)
        durable = time.perf_counter()
        check_tree(mnt, work, "the ckptfs mount")
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                       capture_output=True, timeout=300, check=False, cwd="/")
    stored = [p for p in store.rglob("*.bin") if p.is_file()]
    if len(stored) != work.expected():
        raise SystemExit(f"the store holds {len(stored)} files, not {work.expected()}")
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {"workload": done - started, "durable": durable - started}


def ratios_of(medians: dict[str, float]) -> dict[str, float]:
    """Every ratio whose two sides ran; the first names are the ones the issues target."""
    pairs = [
        ("ckptfs workload", "local workload"), ("ckptfs durable", "local workload"),
        ("ckptfs workload", "passthrough_ll workload"), ("ckptfs durable", "passthrough_ll workload"),
        ("passthrough_ll workload", "local workload"),
        ("pyfuse3-floor workload", "passthrough_ll workload"), ("ckptfs workload", "pyfuse3-floor workload"),
        ("ckptfs workload", "ckptfs-1node workload"), ("ckptfs durable", "ckptfs-1node durable"),
        ("ckptfs workload", "before workload"), ("ckptfs durable", "before durable"),
    ]
    return {f"{a} / {b}": medians[a] / medians[b] for a, b in pairs if a in medians and b in medians}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--dirs", type=int, default=20, help="directories the files are spread over (20)")
    p.add_argument("--deletes", type=int, help="files deleted at the end of the workload (a tenth of --files)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--pause", type=float, default=QUIET_PAUSE, help="seconds of quiet after sync before each run")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list from {','.join(WAYS)}")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent: the local baseline, passthrough_ll's source, the store and the cache dir")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--before", type=Path, help="a checkout of another ckptfs version to run side by side")
    p.add_argument("--passthrough-ll", type=Path, metavar="PATH",
                   help="a passthrough_ll binary (default: the Debian example, built into .build/passthrough_ll)")
    args = p.parse_args()
    if args.deletes is None:
        args.deletes = args.files // 10
    chosen = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not chosen or any(w not in WAYS for w in chosen):
        p.error(f"--ways: choose from {','.join(WAYS)}")
    if not 0 < args.dirs <= min(args.files, 100) or not 0 <= args.deletes <= args.files:
        p.error("--dirs must be 1-100 and at most --files; --deletes at most --files")

    ways: list[tuple[str, Callable[[Path, str, Work], dict[str, float]]]] = []
    anchor_origin = None
    for way in chosen:
        if way == "local":
            ways.append((way, run_local))
        elif way == "passthrough_ll":
            try:
                anchor = find_anchor(args.passthrough_ll)
            except AnchorError as exc:
                raise SystemExit(f"small_files_bench: {exc}") from None
            anchor_origin = anchor.origin
            print(f"anchor: {anchor.origin}", flush=True)
            ways.append((way, functools.partial(run_passthrough_ll, anchor=anchor)))
        elif way == "pyfuse3-floor":
            ways.append((way, run_floor))
        elif way == "ckptfs":
            ways.append((way, run_ckptfs))
        else:
            ways.append((way, functools.partial(run_ckptfs, extra=("--no-cross-node-ordering",))))
    if args.before is not None:
        ways.append(("before", functools.partial(run_ckptfs, checkout=args.before)))

    root = Path(tempfile.mkdtemp(prefix="ckptfs-small-bench.", dir=args.dir))
    results: dict[str, list[float]] = {}
    try:
        for run in range(args.runs):
            work = plan(args.files, args.dirs, args.deletes, args.seed + run, args.pause)
            for way, fn in rotated(ways, run):
                times = fn(root, f"{way}-{run}", work)
                for name, value in times.items():
                    results.setdefault(f"{way} {name}", []).append(value)
                shown = "  ".join(f"{k} {v:7.2f}" for k, v in times.items())
                print(f"run {run + 1}/{args.runs} {way:<14} {shown}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    ratios = ratios_of(medians)
    print(f"\nmedians of {args.runs} interleaved runs, {args.files} files of 4-256 KiB in {args.dirs} directories, "
          f"temp + rename, {args.deletes} deleted; sync + {args.pause:g} s before each")
    if anchor_origin:
        print(f"anchor: {anchor_origin}")
    for name, value in medians.items():
        print(f"  {name:<26} {value:8.2f} s  ({value / args.files * 1e3:.2f} ms per file)")
    for name, value in ratios.items():
        print(f"  {name:<48} {value:6.2f}x")
    settings = {"files": args.files, "dirs": args.dirs, "deletes": args.deletes, "runs": args.runs,
                "seed": args.seed, "pause_s": args.pause, "order": "rotating one place per run",
                "passthrough_ll": anchor_origin}
    write_report(args.json, settings, results, medians, ratios)


if __name__ == "__main__":
    main()
