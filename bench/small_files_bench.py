#!/usr/bin/env python3
"""Small-file benchmark (issue 13): the pattern of tokenizer files, sharded `save_pretrained` output and
per-rank optimizer shards, through a ckptfs mount against a plain directory on the same disk.

The workload, per run: --files files of 4 to 256 KiB (sizes drawn from --seed), each written to
`.NAME.tmp`, fsync-free, closed and renamed to `NAME.bin` (the way most savers commit a file), then the
directory listed, then every tenth file deleted. Three ways, --runs times, in an order that rotates each
run, each timed run starting with the disk quiet (`sync`, then a pause: a run must not pay for the
previous one's writeback):

  local     a fresh directory on the disk that holds the cache dir (the baseline)
  ckptfs    a fresh mount of file://STORE (fresh cache dir, default options); reported: the workload
            (what a training job waits for) and durable (the workload plus `ckptfs flush`)
  ckptfs-1node  the same with --no-cross-node-ordering (no pending records, no FLUSH per close): what
            cross-node ordering of commit markers costs a single node
  before    with --before DIR: `ckptfs` of another checkout (PYTHONPATH=DIR), for a before/after comparison
            in the same run

The ratio that issue 13 targets is ckptfs workload / local workload (<= 3x). JSON in
bench/results/small_files_bench.json.

Run from the repo's venv as root:  python bench/small_files_bench.py [--files 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from s3_drain_bench import ckptfs, write_report  # noqa: E402

KIB = 1 << 10
QUIET_PAUSE = 3.0  # seconds after sync before a timed run
DEFAULT_JSON = REPO / "bench" / "results" / "small_files_bench.json"


def workload(root: Path, files: int, seed: int) -> None:
    rng = random.Random(seed)
    payload = os.urandom(256 * KIB)
    sizes = [rng.randint(4, 256) * KIB for _ in range(files)]
    for i, size in enumerate(sizes):
        temp = root / f".f{i:05d}.tmp"
        with open(temp, "wb") as f:
            f.write(payload[:size])
        os.rename(temp, root / f"f{i:05d}.bin")
    names = os.listdir(root)
    assert len(names) == files, len(names)
    for i in range(0, files, 10):
        os.unlink(root / f"f{i:05d}.bin")


def run_local(root: Path, tag: str, files: int, seed: int) -> dict[str, float]:
    target = root / f"local-{tag}"
    target.mkdir()
    try:
        quiet_disk(QUIET_PAUSE)
        started = time.perf_counter()
        workload(target, files, seed)
        return {"workload": time.perf_counter() - started}
    finally:
        shutil.rmtree(target, ignore_errors=True)


def quiet_disk(pause: float) -> None:
    subprocess.run(["sync"], check=False)
    time.sleep(pause)


def run_ckptfs(root: Path, tag: str, files: int, seed: int, extra: tuple[str, ...] = (),
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
        quiet_disk(QUIET_PAUSE)
        started = time.perf_counter()
        workload(mnt, files, seed)
        done = time.perf_counter()
        ckptfs("flush", str(mnt), "--timeout", "600", env=env, timeout=660)
        durable = time.perf_counter()
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                       capture_output=True, timeout=300, check=False)
    stored = sorted(p.name for p in store.iterdir())
    expected = files - len(range(0, files, 10))
    assert len(stored) == expected, f"the store holds {len(stored)} files, not {expected}"
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {"workload": done - started, "durable": durable - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent: the local baseline, the store and the cache dir")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--before", type=Path, help="a checkout of another ckptfs version to run side by side")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptfs-small-bench.", dir=args.dir))
    results: dict[str, list[float]] = {}
    try:
        ways: list[tuple[str, Callable[..., dict[str, float]]]] = [
            ("local", run_local), ("ckptfs", run_ckptfs),
            ("ckptfs-1node", lambda *a: run_ckptfs(*a, extra=("--no-cross-node-ordering",))),
        ]
        if args.before is not None:
            ways.append(("before", lambda *a: run_ckptfs(*a, checkout=args.before)))
        for run in range(args.runs):
            for way, fn in ways[run % len(ways):] + ways[:run % len(ways)]:
                times = fn(root, f"{way}-{run}", args.files, args.seed + run)
                for name, value in times.items():
                    results.setdefault(f"{way} {name}", []).append(value)
                shown = "  ".join(f"{k} {v:7.2f}" for k, v in times.items())
                print(f"run {run + 1}/{args.runs} {way:<6} {shown}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    ratios = {
        "ckptfs workload / local workload": medians["ckptfs workload"] / medians["local workload"],
        "ckptfs durable / local workload": medians["ckptfs durable"] / medians["local workload"],
        "ckptfs workload / ckptfs-1node workload": medians["ckptfs workload"] / medians["ckptfs-1node workload"],
        "ckptfs durable / ckptfs-1node durable": medians["ckptfs durable"] / medians["ckptfs-1node durable"],
    }
    if args.before is not None:
        ratios |= {
            "ckptfs workload / before workload": medians["ckptfs workload"] / medians["before workload"],
            "ckptfs durable / before durable": medians["ckptfs durable"] / medians["before durable"],
        }
    print(f"\nmedians of {args.runs} interleaved runs, {args.files} files of 4-256 KiB, temp + rename, 10% deleted")
    for name, value in medians.items():
        print(f"  {name:<26} {value:8.2f} s  ({value / args.files * 1e3:.2f} ms per file)")
    for name, value in ratios.items():
        print(f"  {name:<42} {value:6.2f}x")
    write_report(args.json, {"files": args.files, "runs": args.runs, "seed": args.seed}, results, medians, ratios)


if __name__ == "__main__":
    main()
