#!/usr/bin/env python3
"""Drain benchmark: time until a checkpoint is durable in an S3 bucket through ckptfs, against a tuned
boto3/s3transfer upload of the same bytes to the same server (DESIGN.md section 7, issue 3).

One SeaweedFS S3 server on 127.0.0.1 (started here, as the tests do), one file of --size bytes on local
disk (random blocks, so nothing compresses or deduplicates). Each run, interleaved:

  ckptfs     a fresh mount of s3://BUCKET/ckptfs-N (fresh cache dir, default part size and transfers);
             the file is copied into the mount in 1 MiB writes, then `ckptfs flush` waits until the object
             is committed. Reported: write (the copy returning: what a trainer waits for), drain (from the
             end of the copy to flush returning) and durable (write + drain).
  boto3      s3transfer's upload_file of the same file from local disk, TransferConfig with the same part
             size and as many threads as ckptfs has parts in flight for one file (4), and again with 16.

The ratio that matters is ckptfs durable / boto3: how much later than a direct upload from local disk a
checkpoint written through ckptfs is safe. Medians of --runs; JSON in bench/results/s3_drain_bench.json.

Run from the repo's venv with the test extra installed:  python bench/s3_drain_bench.py [--size 2G]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, S3Server, start_seaweedfs  # noqa: E402

MIB = 1 << 20
DEFAULT_JSON = REPO / "bench" / "results" / "s3_drain_bench.json"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def make_source(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for i in range(size // MIB):
            f.write(i.to_bytes(8, "big") + block[8:])  # every MiB differs: no compression, no dedupe
    os.sync()


def ckptfs(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True, env=env,
                            timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed: {result.stderr.strip()}")
    return result


def run_ckptfs(server: S3Server, bucket: str, source: Path, root: Path, run: int) -> dict[str, float]:
    mnt, cache = root / f"mnt-{run}", root / f"cache-{run}"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
    env.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(root / "run"))
    ckptfs("mount", f"s3://{bucket}/ckptfs-{run}", str(mnt), "--cache-dir", str(cache), "--endpoint-url",
           server.endpoint, "--daemon", env=env)
    try:
        started = time.perf_counter()
        with open(source, "rb") as src, open(mnt / "checkpoint.bin", "wb") as dst:
            shutil.copyfileobj(src, dst, MIB)
        written = time.perf_counter()
        ckptfs("flush", str(mnt), "--timeout", "900", env=env, timeout=960)
        durable = time.perf_counter()
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                       capture_output=True, timeout=300, check=False)
        shutil.rmtree(cache, ignore_errors=True)
    head = server.client().head_object(Bucket=bucket, Key=f"ckptfs-{run}/checkpoint.bin")
    assert head["ContentLength"] == source.stat().st_size
    return {"write": written - started, "drain": durable - written, "durable": durable - started}


def run_boto3(server: S3Server, bucket: str, source: Path, run: int, threads: int, part_size: int) -> float:
    from boto3.s3.transfer import TransferConfig

    client = server.client(max_pool_connections=max(10, threads))
    config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=part_size, max_concurrency=threads,
                            use_threads=True)
    started = time.perf_counter()
    client.upload_file(str(source), bucket, f"boto3-{threads}-{run}/checkpoint.bin", Config=config)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=2 << 30, help="checkpoint size (2G)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--part-size", type=parse_size, default=64 * MIB, help="ckptfs's default part size (64M)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptfs-s3-bench.", dir=args.dir))
    server = start_seaweedfs(root / "seaweedfs")
    os.environ.update(CLIENT_ENV)
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    try:
        bucket = "drain-bench"
        server.client().create_bucket(Bucket=bucket)
        source = root / "checkpoint.bin"
        make_source(source, args.size)
        results: dict[str, list[float]] = {"ckptfs write": [], "ckptfs drain": [], "ckptfs durable": [],
                                           "boto3 4 threads": [], "boto3 16 threads": []}
        for run in range(args.runs):
            for threads in (4, 16):
                seconds = run_boto3(server, bucket, source, run, threads, args.part_size)
                results[f"boto3 {threads} threads"].append(seconds)
                print(f"run {run + 1}/{args.runs} boto3 {threads:>2} threads  {seconds:6.2f}s", flush=True)
            times = run_ckptfs(server, bucket, source, root, run)
            for name, seconds in times.items():
                results[f"ckptfs {name}"].append(seconds)
            print(f"run {run + 1}/{args.runs} ckptfs  write {times['write']:6.2f}s  drain {times['drain']:6.2f}s"
                  f"  durable {times['durable']:6.2f}s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs, {args.size / MIB:.0f} MiB to SeaweedFS on 127.0.0.1")
    for name, value in medians.items():
        print(f"  {name:<18} {value:7.2f}s  ({args.size / MIB / value:6.0f} MiB/s)")
    ratios = {
        "ckptfs durable / boto3 4 threads": medians["ckptfs durable"] / medians["boto3 4 threads"],
        "ckptfs durable / boto3 16 threads": medians["ckptfs durable"] / medians["boto3 16 threads"],
        "ckptfs drain / boto3 4 threads": medians["ckptfs drain"] / medians["boto3 4 threads"],
    }
    for name, value in ratios.items():
        print(f"  {name:<34} {value:5.2f}x")
    report: dict[str, Any] = {
        "size_bytes": args.size, "runs": args.runs, "part_size": args.part_size,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "seconds": results, "medians": medians, "ratios": ratios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nresults written to {args.json}")


if __name__ == "__main__":
    main()
