#!/usr/bin/env python3
"""Tree-walk benchmark (issue 31, "big trees"): a fresh node's first walk of a big prefix, and the walk
after it, through a ckptfs mount against the same walk of the store itself.

The tree, built once in the store before any timing: --dirs directories of --files small files each
(100 x 1,000 = 100k by default). The walk is what `find -size`, `du` and a loader's index do: `os.walk`
plus `os.lstat` of every file. Per run, in an order that rotates each run, each timed run starting with the
disk quiet (`sync`, then a pause):

  store     file://: the same walk of the store's own directory; s3: the store's own listing, a plain
            paginated ListObjectsV2 of the prefix with boto3 (1,000 keys a page)
  ckptfs    a fresh mount (fresh cache dir: the node has never seen the tree; mount time not counted):
            first (the first walk: every directory listed from the store) and warm (a second walk of the
            same mount, after the pause; mounted with --refresh-interval 3600, so that it answers from the
            journal however long the first walk took, and the kernel keeps the names and listings it has:
            see docs/SEMANTICS.md, "What the kernel caches")
  before    with --before DIR: `ckptfs` of another checkout (PYTHONPATH=DIR), side by side in the same run

Each walk also reports its CPU seconds: the walker's (`cpu`, its system calls included) and the ckptfs
daemon's (`daemon cpu`), which a shared, busy machine disturbs less than the wall time, and the FUSE
requests it cost the daemon (`requests`, from the mount's metrics endpoint; the warm walk's by operation).

Issue 31's targets for 100k files: first <= 2 s on file://, first <= 2x the store's listing on s3, warm
<= 0.5 s. Medians; JSON in bench/results/tree_walk_bench.json.

Run from the repo's venv as root:  python bench/tree_walk_bench.py [--store s3] [--dirs 100] [--files 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from s3_drain_bench import ckptfs, write_report  # noqa: E402

QUIET_PAUSE = 3.0  # seconds after sync before a timed run
DEFAULT_JSON = REPO / "bench" / "results" / "tree_walk_bench.json"
PREFIX = "tree"  # the S3 prefix the tree lives under


def walk(root: Path) -> int:
    """os.walk plus an lstat of every file: what find -size or du does. Returns the files seen."""
    seen = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            os.lstat(os.path.join(dirpath, name))
            seen += 1
    return seen


def quiet_disk(pause: float) -> None:
    subprocess.run(["sync"], check=False)
    time.sleep(pause)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], int], expected: int, daemon: int | None = None) -> tuple[float, float, float]:
    """Wall seconds, this process's CPU seconds (the walk's system calls included) and the daemon's CPU
    seconds (0 without one) of one walk: on a shared machine the CPU times say more than the wall time."""
    quiet_disk(QUIET_PAUSE)
    daemon_cpu = cpu_seconds(daemon) if daemon is not None else 0.0
    cpu = time.process_time()
    started = time.perf_counter()
    seen = fn()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu
    daemon_cpu = cpu_seconds(daemon) - daemon_cpu if daemon is not None else 0.0
    assert seen == expected, f"saw {seen} files, not {expected}"
    return elapsed, cpu, daemon_cpu


class FileStore:
    name = "file"

    def __init__(self, root: Path) -> None:
        self.dir = root / "store"
        self.dir.mkdir()

    def build(self, dirs: int, files: int) -> None:
        for d in range(dirs):
            folder = self.dir / f"d{d:03d}"
            folder.mkdir()
            for f in range(files):
                (folder / f"f{f:04d}.bin").write_bytes(b"%d" % f)

    def url(self) -> str:
        return f"file://{self.dir}"

    def mount_args(self) -> tuple[str, ...]:
        return ()

    def env(self) -> dict[str, str]:
        return {}

    def own_listing(self) -> int:
        return walk(self.dir)

    def stop(self) -> None:
        return None


class S3Store:
    name = "s3"

    def __init__(self, root: Path) -> None:
        from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, start_seaweedfs

        self.server = start_seaweedfs(root / "seaweedfs")
        self.client_env = dict(CLIENT_ENV)
        self.unset = CLIENT_ENV_UNSET
        self.bucket = self.server.new_bucket()
        self.client = self.server.client(max_pool_connections=32)

    def build(self, dirs: int, files: int) -> None:
        keys = [f"{PREFIX}/d{d:03d}/f{f:04d}.bin" for d in range(dirs) for f in range(files)]

        def put(key: str) -> None:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=key.encode())

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(put, keys))

    def url(self) -> str:
        return f"s3://{self.bucket}/{PREFIX}"

    def mount_args(self) -> tuple[str, ...]:
        return ("--endpoint-url", self.server.endpoint)

    def env(self) -> dict[str, str]:
        return self.client_env

    def own_listing(self) -> int:
        seen = 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=PREFIX + "/"):
            seen += len(page.get("Contents", []))
        return seen

    def stop(self) -> None:
        self.server.stop()


def run_ckptfs(store: Any, root: Path, tag: str, expected: int, checkout: Path | None = None) -> dict[str, float]:
    mnt, cache = root / f"mnt-{tag}", root / f"cache-{tag}"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in getattr(store, "unset", ())}
    env.update(store.env(), CKPTFS_RUNTIME_DIR=str(root / "run"))
    # The checkout to run: this one, or another version for a before/after comparison in the same run.
    # (main() left the current directory: `python -m` puts it before PYTHONPATH on sys.path, so a run
    # started in a checkout would run that one's ckptfs in every way.)
    env["PYTHONPATH"] = str(checkout if checkout is not None else REPO)
    # A refresh interval longer than any run: on a busy machine a first walk can take longer than the
    # default 30 s, and the warm walk would list the directories again instead of answering from the journal.
    port = free_port()
    ckptfs("mount", "--no-guard-mountpoint", store.url(), str(mnt), "--cache-dir", str(cache),
           "--metrics-addr", f"127.0.0.1:{port}", "--refresh-interval", "3600", "--daemon", *store.mount_args(),
           env=env)
    try:
        pid = json.loads(ckptfs("status", str(mnt), "--json", env=env).stdout)["pid"]
        counted = fuse_requests(mnt, port)
        first, first_cpu, first_daemon = timed(lambda: walk(mnt), expected, pid)
        after_first = fuse_requests(mnt, port)
        warm, warm_cpu, warm_daemon = timed(lambda: walk(mnt), expected, pid)
        after_warm = fuse_requests(mnt, port)
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                       capture_output=True, timeout=300, check=False)
        shutil.rmtree(cache, ignore_errors=True)
    return {"first": first, "warm": warm, "first cpu": first_cpu, "warm cpu": warm_cpu,
            "first daemon cpu": first_daemon, "warm daemon cpu": warm_daemon,
            # FUSE requests the walk cost the daemon (less the statfs that marks each count)
            "first requests": sum(after_first.values()) - sum(counted.values()) - 1,
            "warm requests": sum(after_warm.values()) - sum(after_first.values()) - 1,
            **{f"warm {op} requests": after_warm.get(op, 0) - after_first.get(op, 0)
               for op in ("lookup", "getattr", "opendir", "readdir")}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fuse_requests(mnt: Path, port: int) -> dict[str, float]:
    """The daemon's FUSE request counts by operation (its metrics endpoint), once they include everything
    done before this call: a statfs marks the point (the metrics are published every second or so)."""

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        counts = {}
        for line in text.splitlines():
            if line.startswith('ckptfs_fuse_requests_total{op="'):
                name, value = line.rsplit(" ", 1)
                counts[name.split('"')[1]] = float(value)
        return counts

    marker = scrape().get("statfs", 0)
    os.statvfs(mnt)
    deadline = time.monotonic() + 120
    while (counts := scrape()).get("statfs", 0) <= marker:
        if time.monotonic() > deadline:
            raise SystemExit("the daemon's metrics did not count a statfs within 120 s")
        time.sleep(0.2)
    return counts


def run_store(store: Any, root: Path, tag: str, expected: int) -> dict[str, float]:
    listing, cpu, _ = timed(store.own_listing, expected)
    return {"listing": listing, "listing cpu": cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", choices=("file", "s3"), default="file")
    p.add_argument("--dirs", type=int, default=100)
    p.add_argument("--files", type=int, default=1000, help="files per directory")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent: the store (file://), the cache dirs and the mountpoints")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--before", type=Path, help="a checkout of another ckptfs version to run side by side")
    args = p.parse_args()
    args.json = args.json.resolve()  # before the chdir below: a relative path names a place in the caller's directory

    root = Path(tempfile.mkdtemp(prefix="ckptfs-walk-bench.", dir=args.dir))
    os.chdir(root)
    expected = args.dirs * args.files
    results: dict[str, list[float]] = {}
    store: Any = None
    try:
        store = S3Store(root) if args.store == "s3" else FileStore(root)
        started = time.perf_counter()
        store.build(args.dirs, args.files)
        print(f"built {expected} files in {args.dirs} directories ({args.store}) in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        ways: list[tuple[str, Callable[..., dict[str, float]]]] = [("store", run_store), ("ckptfs", run_ckptfs)]
        if args.before is not None:
            ways.append(("before", lambda *a: run_ckptfs(*a, checkout=args.before)))
        for run in range(args.runs):
            for way, fn in ways[run % len(ways):] + ways[:run % len(ways)]:
                times = fn(store, root, f"{way}-{run}", expected)
                for name, value in times.items():
                    results.setdefault(f"{way} {name}", []).append(value)
                shown = "  ".join(f"{k} {v:.3f}" for k, v in times.items())
                print(f"run {run + 1}/{args.runs} {way:<6} {shown}", flush=True)
    finally:
        if store is not None:
            store.stop()
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    ratios = {
        "ckptfs first / store listing": medians["ckptfs first"] / medians["store listing"],
        "ckptfs warm / store listing": medians["ckptfs warm"] / medians["store listing"],
    }
    if args.before is not None:
        for what in ("first", "warm", "first daemon cpu", "warm daemon cpu", "first requests", "warm requests"):
            ratios[f"ckptfs {what} / before {what}"] = medians[f"ckptfs {what}"] / max(medians[f"before {what}"], 1e-9)
    print(f"\nmedians of {args.runs} interleaved runs, {expected} files in {args.dirs} directories, {args.store} store")
    for name, value in medians.items():
        if name.endswith("requests"):
            print(f"  {name:<34} {value:8.0f}    ({value / expected * 1000:.1f} per 1,000 files)")
        else:
            print(f"  {name:<34} {value:8.3f} s  ({value / expected * 1e6:.1f} us per file)")
    for name, value in ratios.items():
        print(f"  {name:<46} {value:7.2f}x")
    write_report(args.json, {"store": args.store, "dirs": args.dirs, "files_per_dir": args.files,
                             "runs": args.runs}, results, medians, ratios)


if __name__ == "__main__":
    main()
