#!/usr/bin/env python3
"""The floor of a Python downloader (issue 44): is the prefetch's distance to s5cmd ckptfs's, or Python's?

The same 4 GiB checkpoint as prefetch_bench.py (8 objects on a SeaweedFS server on 127.0.0.1) is brought into a
fresh directory by a bare loop without ckptfs: 64 MiB ranged GETs with boto3, each body read by http.client's
readinto into one 64 KiB buffer (as the daemon's whole-file fetch reads it), its CRC32 computed, and pwrite at
its offset. The loop runs in threads of one process, or in processes (forkserver) each with threads, so that the
GIL's share shows. Beside it in the same rounds, in an order that rotates each round, each timed run starting
with the disk quiet: s5cmd's `cp` and `ckptfs prefetch` with a given number of ranges in flight.

Ways (--ways, comma separated): `s5cmd`, `PxT` (P processes of T threads; 1x16 is one process of 16 threads),
`ckptfs:N` (a fresh mount, `--parts-in-flight N`). Medians; JSON in bench/results/download_floor.json.

Run from the repo's venv as root:  python bench/download_floor.py [--runs 3] [--ways s5cmd,1x16,4x4,ckptfs:16]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import prefetch_bench as pb  # noqa: E402
from common import ckptfs, quiet_disk, seaweedfs, write_report  # noqa: E402

from ckptfs.checksums import crc32  # noqa: E402

GIB = 1 << 30
RANGE = 64 << 20
PIECE = 64 << 10
DEFAULT_JSON = REPO / "bench" / "results" / "download_floor.json"

Task = tuple[str, str, str, str, int, int]  # endpoint, bucket, key, path, offset, length
_client: Any = None  # one per process


def _fetch(task: Task) -> int:
    """One ranged GET into its file; the range's CRC32."""
    global _client
    endpoint, bucket, key, path, offset, length = task
    if _client is None:
        import boto3
        import botocore.config

        _client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                               config=botocore.config.Config(max_pool_connections=32))
    body = _client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")["Body"]
    response = body._raw_stream._fp  # http.client's response, as the daemon reads it (backends/s3wire.py)
    view = memoryview(bytearray(PIECE))
    crc, position = 0, offset
    fd = os.open(path, os.O_WRONLY)
    try:
        while got := response.readinto(view):
            crc = crc32(view[:got], crc)
            os.pwrite(fd, view[:got], position)
            position += got
    finally:
        os.close(fd)
    body._raw_stream.release_conn()
    if position != offset + length:
        raise SystemExit(f"{key}: {position - offset} of {length} bytes at {offset}")
    return crc


def _in_threads(tasks: list[Task], threads: int) -> list[int]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(_fetch, tasks))


def python_loop(tasks: list[Task], processes: int, threads: int) -> None:
    if processes == 1:
        _in_threads(tasks, threads)
        return
    shares = [tasks[i::processes] for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("forkserver")) as pool:
        list(pool.map(_in_threads, shares, [threads] * processes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--size", type=float, default=4.0, help="GiB in all, over 8 objects (4)")
    p.add_argument("--ways", default="s5cmd,1x16,1x4,4x4,ckptfs:16,ckptfs:4")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    size = int(args.size * GIB)
    ways = args.ways.split(",")
    root = Path(tempfile.mkdtemp(prefix="download-floor.", dir=args.dir))
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    try:
        with seaweedfs(root) as server:
            pb.upload(server, root, size, 8, 1 << 20)
            peers = pb.Ways(server, root, size)
            os.environ.update(peers.env)  # the store's credentials, for the loop's processes too
            listed = server.client().list_objects_v2(Bucket=pb.BUCKET, Prefix=f"{pb.STEP}/")["Contents"]
            for run in range(args.runs):
                for way in ways[run % len(ways):] + ways[:run % len(ways)]:
                    seconds[way].append(_timed(way, run, server, peers, root, listed))
                    print(f"run {run + 1}/{args.runs} {way:10s} {seconds[way][-1]:6.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {way: statistics.median(values) for way, values in seconds.items()}
    ratios = {f"{way} / s5cmd": median / medians["s5cmd"] for way, median in medians.items()
              if "s5cmd" in medians and way != "s5cmd"}
    print(f"\nmedians of {args.runs} rounds, {args.size:g} GiB over 8 objects")
    for way, median in medians.items():
        ratio = f"  {ratios[f'{way} / s5cmd']:.2f}x s5cmd" if f"{way} / s5cmd" in ratios else ""
        print(f"  {way:10s} {median:6.2f} s{ratio}")
    write_report(args.json, {"size": size, "runs": args.runs, "ways": ways}, seconds, medians, ratios)


def _timed(way: str, run: int, server: Any, peers: Any, root: Path, listed: list[dict[str, Any]]) -> float:
    if way == "s5cmd":
        return float(peers.prefetch_s5cmd(run))
    if way.startswith("ckptfs:"):
        mnt, cache = root / f"mnt-{run}-{way[7:]}", root / f"cache-{run}-{way[7:]}"
        mnt.mkdir()
        ckptfs("mount", "--no-guard-mountpoint", f"s3://{pb.BUCKET}/run", str(mnt), "--cache-dir", str(cache),
               "--endpoint-url", server.endpoint, "--metrics-addr", "off", "--daemon", "--parts-in-flight",
               way[7:], env=peers.env)
        try:
            quiet_disk()
            started = time.perf_counter()
            ckptfs("prefetch", str(mnt), "step_1000", "--wait", env=peers.env)
            return time.perf_counter() - started
        finally:
            peers._unmount(mnt, cache, peers.env)
    processes, threads = (int(n) for n in way.split("x"))
    target = root / f"loop-{run}"
    target.mkdir()
    try:
        tasks: list[Task] = []
        for obj in listed:
            path = str(target / obj["Key"].rsplit("/", 1)[1])
            with open(path, "wb") as f:
                f.truncate(obj["Size"])
            tasks += [(server.endpoint, pb.BUCKET, obj["Key"], path, offset, min(RANGE, obj["Size"] - offset))
                      for offset in range(0, obj["Size"], RANGE)]
        quiet_disk()
        started = time.perf_counter()
        python_loop(tasks, processes, threads)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(target)


if __name__ == "__main__":
    main()
