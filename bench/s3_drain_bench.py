#!/usr/bin/env python3
"""Drain benchmark: time until checkpoints are durable in an S3 bucket through ckptfs, against writing the
same bytes to local disk and uploading them with a tuned boto3 (DESIGN.md section 7, issue 10).

One SeaweedFS S3 server on 127.0.0.1 (started here, as the tests do), random source files on local disk
(nothing compresses or deduplicates). Two workloads, each run --runs times, interleaved:

  one       one file of --size bytes (1 GiB)
  four      four writers at once, --size / 4 bytes each (4 x 256 MiB)

and, for each, two ways:

  ckptfs     a fresh mount of s3://BUCKET/ckptfs-N (fresh cache dir, default options); the files are copied
             into the mount in 1 MiB writes (one thread per file), then `ckptfs flush` waits until every
             object is committed. Reported: write (what a trainer waits for), durable (write + drain), and
             the daemon's peak RSS (VmHWM).
  local+boto3  the same copies to a directory on local disk, then s3transfer's upload_file of each file
             (64 MiB parts, 8 threads per file; the four files in parallel).

Each timed run starts with the disk quiet (`sync`, then a pause of QUIET_PAUSE seconds, after the mount),
the ways taking each place in turn from one run to the next. The ratio that matters is ckptfs durable /
local+boto3: how much later than writing locally and uploading directly a checkpoint written through ckptfs
is safe. Medians; JSON in bench/results/s3_drain_bench.json.

Run from the repo's venv with the test extra installed:  python bench/s3_drain_bench.py [--size 1G]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

# The helpers every bench shares live in common.py; the names stay importable from here as well.
from common import (  # noqa: E402
    CLIENT_ENV,
    CLIENT_ENV_UNSET,
    MIB,
    QUIET_PAUSE,
    S3Server,
    ckptfs,
    make_source,
    parse_size,
    quiet_disk,
    rotated,
    start_seaweedfs,
    write_report,
)

__all__ = ["CLIENT_ENV", "CLIENT_ENV_UNSET", "MIB", "QUIET_PAUSE", "S3Server", "ckptfs", "make_source", "parse_size",
           "quiet_disk", "rotated", "start_seaweedfs", "write_report"]

DEFAULT_JSON = REPO / "bench" / "results" / "s3_drain_bench.json"


def copy_all(sources: list[Path], target_dir: Path) -> None:
    """Copy every source into target_dir at once, one thread each, in 1 MiB writes (as torch.save does)."""

    def one(source: Path) -> None:
        with open(source, "rb") as src, open(target_dir / source.name, "wb") as dst:
            shutil.copyfileobj(src, dst, MIB)

    with ThreadPoolExecutor(len(sources)) as pool:
        list(pool.map(one, sources))


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_ckptfs(
    server: S3Server, bucket: str, sources: list[Path], root: Path, tag: str, checkout: Path | None = None,
    mount_args: tuple[str, ...] = (),
) -> dict[str, float]:
    mnt, cache = root / f"mnt-{tag}", root / f"cache-{tag}"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
    env.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(root / "run"))
    if checkout is not None:  # another version of ckptfs, for a before/after comparison in the same run
        env["PYTHONPATH"] = str(checkout)
    ckptfs("mount", "--no-guard-mountpoint",
           f"s3://{bucket}/ckptfs-{tag}", str(mnt), "--cache-dir", str(cache), "--endpoint-url",
           server.endpoint, "--metrics-addr", "off", "--daemon", *mount_args, env=env)
    try:
        pid = json.loads(ckptfs("status", str(mnt), "--json", env=env).stdout)["pid"]
        quiet_disk()
        started = time.perf_counter()
        copy_all(sources, mnt)
        written = time.perf_counter()
        ckptfs("flush", str(mnt), "--timeout", "900", env=env, timeout=960)
        durable = time.perf_counter()
        rss = peak_rss(pid)
    finally:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                       capture_output=True, timeout=300, check=False, cwd="/")
        shutil.rmtree(cache, ignore_errors=True)
    for source in sources:
        head = server.client().head_object(Bucket=bucket, Key=f"ckptfs-{tag}/{source.name}")
        assert head["ContentLength"] == source.stat().st_size
    return {"write": written - started, "durable": durable - started, "peak_rss_mib": rss / MIB}


def run_local_boto3(server: S3Server, bucket: str, sources: list[Path], root: Path, tag: str) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    local = root / f"local-{tag}"
    local.mkdir()
    client = server.client()
    config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=64 * MIB, max_concurrency=8,
                            use_threads=True)
    try:
        quiet_disk()
        started = time.perf_counter()
        copy_all(sources, local)
        written = time.perf_counter()
        with ThreadPoolExecutor(len(sources)) as pool:
            list(pool.map(lambda s: client.upload_file(str(local / s.name), bucket, f"boto3-{tag}/{s.name}",
                                                       Config=config), sources))
        durable = time.perf_counter()
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return {"write": written - started, "durable": durable - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes per workload (1G)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    p.add_argument("--before", type=Path, help="a checkout of another ckptfs version to run side by side")
    p.add_argument("--variant", metavar="ARGS", help="one more way, side by side: ckptfs mounted with these extra"
                   " arguments (one string, e.g. '--upload-while-writing on')")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptfs-s3-bench.", dir=args.dir))
    server = start_seaweedfs(root / "seaweedfs")
    os.environ.update(CLIENT_ENV)
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    workloads = {"one": 1, "four": 4}
    results: dict[str, list[float]] = {}
    try:
        bucket = "drain-bench"
        server.client().create_bucket(Bucket=bucket)
        sources: dict[str, list[Path]] = {}
        for workload, count in workloads.items():
            (root / workload).mkdir()
            sources[workload] = [root / workload / f"shard-{i}.bin" for i in range(count)]
            for path in sources[workload]:
                make_source(path, args.size // count)
        for run in range(args.runs):
            for workload in workloads:
                ways: list[tuple[str, Any]] = [("local+boto3", run_local_boto3), ("ckptfs", run_ckptfs)]
                if args.before is not None:
                    ways.append(("before", functools.partial(run_ckptfs, checkout=args.before)))
                if args.variant:
                    ways.append(("variant", functools.partial(run_ckptfs, mount_args=tuple(args.variant.split()))))
                # Each way takes each place in turn: the one right after the local copy's writes used to be
                # slower (its writeback) in every run.
                for way, fn in rotated(ways, run):
                    times = fn(server, bucket, sources[workload], root, f"{workload}-{way}-{run}")
                    for name, value in times.items():
                        results.setdefault(f"{workload} {way} {name}", []).append(value)
                    shown = "  ".join(f"{k} {v:7.2f}" for k, v in times.items())
                    print(f"run {run + 1}/{args.runs} {workload:<4} {way:<11} {shown}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs, {args.size / MIB:.0f} MiB per workload to SeaweedFS on"
          " 127.0.0.1 (CPU-bound on this machine: ratios, not absolute times)")
    for name, value in medians.items():
        print(f"  {name:<34} {value:8.2f}")
    ratios = {
        f"{w}: ckptfs durable / local+boto3 durable":
            medians[f"{w} ckptfs durable"] / medians[f"{w} local+boto3 durable"]
        for w in workloads
    } | {
        f"{w}: ckptfs write / local write": medians[f"{w} ckptfs write"] / medians[f"{w} local+boto3 write"]
        for w in workloads
    }
    if args.before is not None:
        ratios |= {f"{w}: before durable / local+boto3 durable":
                   medians[f"{w} before durable"] / medians[f"{w} local+boto3 durable"] for w in workloads}
    if args.variant:
        ratios |= {f"{w}: variant durable / local+boto3 durable":
                   medians[f"{w} variant durable"] / medians[f"{w} local+boto3 durable"] for w in workloads}
    for name, value in ratios.items():
        print(f"  {name:<44} {value:5.2f}x")
    write_report(args.json, {"size_bytes": args.size, "runs": args.runs, "variant": args.variant}, results, medians,
                 ratios)


if __name__ == "__main__":
    main()
