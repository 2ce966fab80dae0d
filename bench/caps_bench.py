#!/usr/bin/env python3
"""Bandwidth caps benchmark (issue 44): the rate a capped upload and a capped download reach over about 30 s,
against the cap (the issue's target: within 5 %), on SeaweedFS on 127.0.0.1 (started here, as the tests do).

Each run, with the disk quiet first (`sync`, then a pause of --pause seconds, after the mount):

  upload     a fresh mount of s3://BUCKET/caps-N with --upload-limit CAP; one file of CAP x --seconds bytes
             written into it (random, 1 MiB writes), then `ckptfs flush`. Reported: the rate from the close
             to durable (size / time), and the steady rate of the drain (a straight line fitted to the
             bytes uploaded, as `ckptfs status` counts them every 0.25 s, between the first and the last
             part).
  download   a fresh mount (empty cache dir) with --download-limit CAP reads that file whole (1 MiB reads):
             size / time (the page cache dropped first where the bench runs as root).
  uncapped   (--reference) the same upload without a cap, once: what the store takes without one, so that
             the capped numbers show the cap, not the store.

The tests (tests/test_caps.py) check the same within 15 % over 6-8 s; this is the tighter measurement, run by
hand on a quiet machine. JSON in bench/results/caps_bench.json.

Run from the repo's venv with the test extra installed:  python bench/caps_bench.py [--cap 16M --seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, S3Server, start_seaweedfs  # noqa: E402
from s3_drain_bench import ckptfs  # noqa: E402  (the CLI from "/": see there)

from ckptfs.config import parse_rate  # noqa: E402
from ckptfs.control import client  # noqa: E402

MIB = 1 << 20
DEFAULT_JSON = REPO / "bench" / "results" / "caps_bench.json"


def quiet_disk(pause: float, drop_cache: bool = False) -> None:
    """`sync`, the page cache dropped if asked (a read that must come from the store), then a pause."""
    os.sync()
    if drop_cache:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            pass  # not root: the store's side is a server either way
    time.sleep(pause)


class Mounted:
    """A daemon of this checkout serving s3://BUCKET/PREFIX on a fresh mountpoint and cache dir."""

    def __init__(self, server: S3Server, bucket: str, prefix: str, root: Path, tag: str, *args: str) -> None:
        self.mnt, self.cache = root / f"mnt-{tag}", root / f"cache-{tag}"
        self.mnt.mkdir()
        self.env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
        self.env.update(CLIENT_ENV, PYTHONPATH=str(REPO))
        ckptfs("mount", "--no-guard-mountpoint", f"s3://{bucket}/{prefix}", str(self.mnt), "--cache-dir",
               str(self.cache), "--endpoint-url", server.endpoint, "--metrics-addr", "off", "--daemon", *args,
               env=self.env)

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(self.mnt), "--timeout", "300"], env=self.env,
                       capture_output=True, timeout=600, check=False, cwd="/")
        shutil.rmtree(self.cache, ignore_errors=True)


def slope(samples: list[tuple[float, int]]) -> float:
    """Least-squares bytes per second of (time, bytes) samples."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_b = sum(b for _, b in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    return sum((t - mean_t) * (b - mean_b) for t, b in samples) / var if var else 0.0


def write_file(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for i in range(size // MIB):
            f.write(i.to_bytes(8, "big") + block[8:])  # every MiB differs


def upload(server: S3Server, bucket: str, root: Path, tag: str, size: int, cap: str | None,
           pause: float) -> dict[str, Any]:
    m = Mounted(server, bucket, tag, root, tag, *(("--upload-limit", cap) if cap else ()))
    try:
        quiet_disk(pause)
        write_file(m.mnt / "model.pt", size)
        closed = time.perf_counter()
        samples: list[tuple[float, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append((time.perf_counter() - closed, client.status(m.mnt)["transfers"]["bytes_up"]))
                done.wait(0.25)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            client.wait_durable(m.mnt, timeout=900)
        finally:
            durable = time.perf_counter()
            done.set()
            sampler.join()
    finally:
        m.close()
    # Steady state: from the first finished part to the last one before the end (a part is counted when it
    # is finished, so the samples are a staircase: fit it where it climbs).
    moving = [(t, b) for t, b in samples if 0 < b < size]
    return {"seconds": durable - closed, "rate": size / (durable - closed),
            "steady_rate": slope(moving) if len(moving) > 2 else None}


def download(server: S3Server, bucket: str, root: Path, tag: str, prefix: str, size: int, cap: str,
             pause: float) -> dict[str, Any]:
    m = Mounted(server, bucket, prefix, root, tag, "--download-limit", cap)
    try:
        quiet_disk(pause, drop_cache=True)
        started = time.perf_counter()
        got = 0
        with open(m.mnt / "model.pt", "rb", buffering=0) as f:
            while chunk := f.read(MIB):
                got += len(chunk)
        seconds = time.perf_counter() - started
    finally:
        m.close()
    assert got == size, (got, size)
    return {"seconds": seconds, "rate": got / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", default="16M", help="the cap, up and down (16M: 16 MiB/s)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each transfer should take at the cap")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync before each timed run")
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the uncapped upload")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    cap = parse_rate(args.cap, "--cap")
    if cap is None:
        raise SystemExit("--cap must be a rate, not off")
    size = int(cap * args.seconds) // MIB * MIB

    root = Path(tempfile.mkdtemp(prefix="ckptfs-caps-bench.", dir=args.dir))
    os.environ.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(root / "run"))  # client.status/wait_durable in here
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    server = start_seaweedfs(root / "seaweedfs")
    results: dict[str, Any] = {"upload": [], "download": []}
    try:
        bucket = f"caps-{os.getpid()}"
        server.client().create_bucket(Bucket=bucket)
        print(f"cap {cap / MIB:.1f} MiB/s, {size / MIB:.0f} MiB per transfer ({args.seconds:.0f} s at the cap)")
        if args.reference:
            reference = upload(server, bucket, root, "uncapped", size, None, args.pause)
            results["uncapped"] = reference
            print(f"uncapped upload   {reference['rate'] / MIB:8.1f} MiB/s ({reference['seconds']:.1f} s)")
        for run in range(args.runs):
            up = upload(server, bucket, root, f"up-{run}", size, args.cap, args.pause)
            results["upload"].append(up)
            steady = up["steady_rate"]
            print(f"run {run}: upload   {up['rate'] / MIB:8.2f} MiB/s to durable ({up['rate'] / cap - 1:+.1%} of the"
                  f" cap, {up['seconds']:.1f} s)"
                  + (f"; steady {steady / MIB:.2f} MiB/s ({steady / cap - 1:+.1%})" if steady else ""))
            down = download(server, bucket, root, f"down-{run}", f"up-{run}", size, args.cap, args.pause)
            results["download"].append(down)
            print(f"run {run}: download {down['rate'] / MIB:8.2f} MiB/s ({down['rate'] / cap - 1:+.1%} of the cap,"
                  f" {down['seconds']:.1f} s)")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "cap_bytes_per_second": cap, "seconds": args.seconds, "size": size, "runs": args.runs, "pause": args.pause,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "taken_at": time.strftime("%Y-%m-%d %H:%M"), "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
