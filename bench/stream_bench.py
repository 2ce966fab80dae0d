#!/usr/bin/env python3
"""Streaming-read benchmark: time to the first byte of a remote checkpoint and a sequential restore on a
fresh cache through ckptfs, against boto3's download_file with 8 threads followed by reading the file
(issue 10).

SeaweedFS S3 on 127.0.0.1 (started here), one --size object of random blocks. Each run, interleaved (boto3
first in even runs, ckptfs first in odd ones), each measurement starting with the disk quiet: `sync`, the
page cache dropped, then a pause:

  ckptfs first byte (start)   a fresh mount (empty cache dir): open the file and read 4 KiB at offset 0
  ckptfs first byte (middle)  another fresh mount: open and read 4 KiB in the middle of the file
  ckptfs restore              the first mount: from the open, read the whole file in 1 MiB reads
  boto3 download + read       download_file (8 MiB parts, 8 threads) to local disk, then read the file in
                              1 MiB reads; its first byte is available only after the whole download

Medians of --runs; JSON in bench/results/stream_bench.json.

Run from the repo's venv with the test extra installed:  python bench/stream_bench.py [--size 1G]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, S3Server, start_seaweedfs  # noqa: E402
from s3_drain_bench import MIB, ckptfs, make_source, parse_size, quiet_disk, rotated, write_report  # noqa: E402

DEFAULT_JSON = REPO / "bench" / "results" / "stream_bench.json"
BUCKET = "stream-bench"
KEY = "run/step_1000/model.bin"


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
    env.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(root / "run"))
    return env


def _mount(server: S3Server, root: Path, tag: str) -> tuple[Path, Path]:
    mnt, cache = root / f"mnt-{tag}", root / f"cache-{tag}"
    mnt.mkdir()
    ckptfs("mount", "--no-guard-mountpoint",
           f"s3://{BUCKET}/run", str(mnt), "--cache-dir", str(cache), "--endpoint-url", server.endpoint,
           "--metrics-addr", "off", "--daemon", env=_env(root))
    os.stat(mnt / "step_1000" / "model.bin")  # the listing is not what is measured
    return mnt, cache


def _umount(root: Path, mnt: Path, cache: Path) -> None:
    subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "60"], env=_env(root),
                   capture_output=True, timeout=300, check=False)
    shutil.rmtree(cache, ignore_errors=True)


def _first_byte(path: Path, offset: int) -> float:
    quiet_disk(drop_cache=True)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, 4096, offset)
    finally:
        os.close(fd)
    assert len(data) == 4096
    return time.perf_counter() - started


def _read_whole(path: Path, size: int) -> float:
    started = time.perf_counter()
    read = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(MIB):
            read += len(chunk)
    assert read == size, read
    return time.perf_counter() - started


def run_ckptfs(server: S3Server, root: Path, run: int, size: int) -> dict[str, float]:
    out = {}
    mnt, cache = _mount(server, root, f"{run}-middle")
    try:
        out["first byte (middle)"] = _first_byte(mnt / "step_1000" / "model.bin", size // 2)
    finally:
        _umount(root, mnt, cache)
    mnt, cache = _mount(server, root, f"{run}-start")
    try:
        path = mnt / "step_1000" / "model.bin"
        quiet_disk(drop_cache=True)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            assert len(f.read(4096)) == 4096
            out["first byte (start)"] = time.perf_counter() - started
            read = 4096
            while chunk := f.read(MIB):
                read += len(chunk)
        out["restore"] = time.perf_counter() - started
        assert read == size, read
    finally:
        _umount(root, mnt, cache)
    return out


def run_boto3(server: S3Server, root: Path, size: int, threads: int = 8) -> dict[str, float]:
    from boto3.s3.transfer import TransferConfig

    client = server.client(max_pool_connections=max(10, threads))
    config = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=threads)
    target = root / "download.bin"
    quiet_disk(drop_cache=True)
    started = time.perf_counter()
    client.download_file(BUCKET, KEY, str(target), Config=config)
    downloaded = time.perf_counter() - started
    _read_whole(target, size)
    restored = time.perf_counter() - started
    target.unlink()
    return {"first byte": downloaded, "restore": restored}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="checkpoint size (1G)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptfs-stream-bench.", dir=args.dir))
    server = start_seaweedfs(root / "seaweedfs")
    os.environ.update(CLIENT_ENV)
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    results: dict[str, list[float]] = {}
    try:
        source = root / "checkpoint.bin"
        make_source(source, args.size)
        client = server.client(max_pool_connections=16)
        client.create_bucket(Bucket=BUCKET)
        client.upload_file(str(source), BUCKET, KEY)
        source.unlink()
        for run in range(args.runs):
            times: dict[str, float] = {}
            for way in rotated(["boto3", "ckptfs"], run):
                ran = run_boto3(server, root, args.size) if way == "boto3" else run_ckptfs(server, root, run, args.size)
                times.update({f"{way} {k}": v for k, v in ran.items()})
            for name, seconds in times.items():
                results.setdefault(name, []).append(seconds)
            print(f"run {run + 1}/{args.runs}: " + ", ".join(f"{k} {v:.3f}s" for k, v in times.items()), flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs, {args.size / MIB:.0f} MiB object on SeaweedFS")
    for name, value in medians.items():
        print(f"  {name:<30} {value:8.3f}s")
    ratios = {
        "ckptfs first byte (start) / boto3 first byte": medians["ckptfs first byte (start)"]
        / medians["boto3 first byte"],
        "ckptfs first byte (middle) / boto3 first byte": medians["ckptfs first byte (middle)"]
        / medians["boto3 first byte"],
        "ckptfs restore / boto3 download + read": medians["ckptfs restore"] / medians["boto3 restore"],
    }
    for name, value in ratios.items():
        print(f"  {name:<46} {value:6.3f}x")
    write_report(args.json, {"size_bytes": args.size, "runs": args.runs}, results, medians, ratios)


if __name__ == "__main__":
    main()
