#!/usr/bin/env python3
"""Restore benchmark: a fresh node reads a checkpoint back from an S3 bucket through ckptfs, against a tuned
parallel boto3 download of the same object from the same server (DESIGN.md section 7, issue 4).

SeaweedFS S3 on 127.0.0.1 (started here). Setup: one --size object of random blocks, and a directory of
--files small objects. Each run, interleaved (the order rotating by one place per run), each timed read and
listing starting with the disk quiet (`sync`, the page cache dropped before a read, then a pause):

  ckptfs     a fresh mount (empty cache dir) of the bucket; time until the checkpoint has been read whole
             through the mount (open fetches it with parallel ranged GETs, then 1 MiB reads), and the time
             of `os.listdir` of the 10,000-file directory (the first listing of it: lazy, one directory).
  boto3      s3transfer's download_file of the object to local disk (64 MiB parts, 4 and 16 threads), and
             a paginated list_objects_v2 of the directory.

Medians of --runs, and the median over the rounds of each round's ratio (the ways timed minutes apart in one
round: steadier than a ratio of medians on this shared, noisy machine); JSON in
bench/results/restore_bench.json.

Run from the repo's venv with the test extra installed:  python bench/restore_bench.py [--size 2G]
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
from concurrent.futures import ThreadPoolExecutor
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

DEFAULT_JSON = REPO / "bench" / "results" / "restore_bench.json"
BUCKET = "restore-bench"


def upload(server: S3Server, source: Path, files: int) -> None:
    client = server.client(max_pool_connections=32)
    client.create_bucket(Bucket=BUCKET)
    client.upload_file(str(source), BUCKET, "run/step_1000/model.bin")

    def put(i: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"run/many/file_{i:05d}", Body=b"x" * 64)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, range(files)))


def run_ckptfs(server: S3Server, root: Path, run: int, size: int, files: int) -> dict[str, float]:
    mnt, cache = root / f"mnt-{run}", root / f"cache-{run}"
    mnt.mkdir()
    env = client_env(root / "run")
    ckptfs("mount", "--no-guard-mountpoint",
           f"s3://{BUCKET}/run", str(mnt), "--cache-dir", str(cache), "--endpoint-url", server.endpoint,
           "--metrics-addr", "off", "--daemon", env=env)
    try:
        quiet_disk(drop_cache=True)
        started = time.perf_counter()
        read = 0
        with open(mnt / "step_1000" / "model.bin", "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                read += len(chunk)
        restored = time.perf_counter() - started
        assert read == size, read
        quiet_disk()  # the restore's bytes in the cache dir are written back before the listing's turn
        started = time.perf_counter()
        names = os.listdir(mnt / "many")
        listed = time.perf_counter() - started
        assert len(names) == files, len(names)
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "60"], env=env,
                       capture_output=True, timeout=300, check=False)
        shutil.rmtree(cache, ignore_errors=True)
    return {"restore": restored, "list": listed}


def run_boto3(server: S3Server, root: Path, run: int, size: int, files: int, threads: int) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    client = server.client(max_pool_connections=max(10, threads))
    config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=64 * MIB, max_concurrency=threads)
    target = root / "download.bin"
    quiet_disk(drop_cache=True)
    started = time.perf_counter()
    client.download_file(BUCKET, "run/step_1000/model.bin", str(target), Config=config)
    restored = time.perf_counter() - started
    target.unlink()
    quiet_disk()
    started = time.perf_counter()
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="run/many/", Delimiter="/"):
        count += len(page.get("Contents", []))
    listed = time.perf_counter() - started
    assert count == files, count
    return {"restore": restored, "list": listed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=2 << 30, help="checkpoint size (2G)")
    p.add_argument("--files", type=int, default=10_000, help="files in the directory that is listed (10000)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptfs-restore-bench.", dir=args.dir))
    results: dict[str, list[float]] = {}
    with seaweedfs(root) as server:
        source = root / "checkpoint.bin"
        make_source(source, args.size)
        upload(server, source, args.files)
        source.unlink()
        ways: list[tuple[str, Callable[..., dict[str, float]]]] = [
            ("boto3  4 threads", functools.partial(run_boto3, threads=4)),
            ("boto3 16 threads", functools.partial(run_boto3, threads=16)),
            ("ckptfs", run_ckptfs),
        ]
        for run in range(args.runs):
            for way, fn in rotated(ways, run):
                times = fn(server, root, run, args.size, args.files)
                for name, seconds in times.items():
                    results.setdefault(f"{' '.join(way.split())} {name}", []).append(seconds)
                print(f"run {run + 1}/{args.runs} {way:<16}  restore {times['restore']:6.2f}s"
                      f"  list {times['list']:5.2f}s  load {os.getloadavg()[0]:.1f}", flush=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs: {args.size / MIB:.0f} MiB object, {args.files} files listed;"
          f" {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end (a shared, noisy machine)")
    for name, value in medians.items():
        print(f"  {name:<32} {value:7.2f}s")
    pairs = {
        "ckptfs restore / boto3 4 threads": ("ckptfs restore", "boto3 4 threads restore"),
        "ckptfs restore / boto3 16 threads": ("ckptfs restore", "boto3 16 threads restore"),
        "ckptfs list / boto3 list": ("ckptfs list", "boto3 4 threads list"),
    }
    ratios = {name: median_ratio(results, *pair) or 0.0 for name, pair in pairs.items()}
    per_round = {name: round_ratios(results, *pair) for name, pair in pairs.items()}
    print("median of the rounds' ratios (each round's ratio in brackets):")
    for name, value in ratios.items():
        print(f"  {name:<34} {value:5.2f}x  [{' '.join(f'{r:.2f}' for r in per_round[name])}]")
    write_report(args.json, {"size_bytes": args.size, "files": args.files, "runs": args.runs}, results, medians,
                 ratios, round_ratios=per_round)


if __name__ == "__main__":
    main()
