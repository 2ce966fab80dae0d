#!/usr/bin/env python3
"""Preemption benchmark (issue 44): a store throttled to a known rate (the upload cap, kept under the notice)
and three complete steps dirty that together need about 3x the deadline; then SIGTERM, two ways, side by side:

  preempt    `--preempt-on-sigterm DEADLINE --preemption-keep-limits`: SIGTERM is a preemption notice (the
             newest complete step first, its shards then its marker; the stop bounded by the deadline).
  drain      today's SIGTERM: `--drain-timeout DEADLINE`, the queue drained in the order it became work.

Each run: a fresh mount of s3://BUCKET/preempt-N on SeaweedFS (127.0.0.1, started here as the tests do) with
`--upload-limit CAP --upload-delay 3600` (nothing leaves before the stop: the steps are all dirty), three
steps `step_1..3/` of two shards each plus a `.metadata` commit marker, every step FRACTION x DEADLINE x CAP
bytes; `sync` and a pause; SIGTERM; wait for the daemon to exit. Reported per run: which steps are durable
(both shards at their keys) and published (the marker too), how long the stop took, and for `preempt` the
report's own account. The order of the two ways alternates run by run.

The question of the issue's target: is the newest complete step durable and published at the deadline when
its bytes fit in deadline x rate? The answer does not depend on the scale: at 30 s and the same FRACTION,
each step is 30 x CAP x FRACTION bytes and the same arithmetic holds (the run here uses 10 s to stay quick;
`--deadline 30` runs it at that scale).

Run from the repo's venv with the test extra installed:  python bench/preempt_bench.py [--cap 8M --deadline 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from caps_bench import Mounted, quiet_disk  # noqa: E402
from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, S3Server, start_seaweedfs  # noqa: E402

from ckptfs.config import parse_rate  # noqa: E402
from ckptfs.control import client  # noqa: E402
from ckptfs.notices.preempter import REPORT_NAME  # noqa: E402

MIB = 1 << 20
STEPS = ("step_1", "step_2", "step_3")
DEFAULT_JSON = REPO / "bench" / "results" / "preempt_bench.json"


def write_shard(path: Path, size: int, tag: int) -> None:
    block = bytearray(os.urandom(MIB))
    with open(path, "wb") as f:
        for i in range(size // MIB):
            block[:16] = tag.to_bytes(8, "big") + i.to_bytes(8, "big")  # every MiB differs
            f.write(block)


def keys(server: S3Server, bucket: str, prefix: str) -> dict[str, int]:
    s3 = server.client()
    found: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            found[obj["Key"][len(prefix) + 1:]] = obj["Size"]
    return found


def wait_exit(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise SystemExit(f"daemon {pid} still runs {timeout:.0f} s after SIGTERM")


def one_run(server: S3Server, bucket: str, root: Path, tag: str, way: str, cap: str, deadline: float,
            step_bytes: int, pause: float) -> dict[str, Any]:
    stop_args = (("--preempt-on-sigterm", str(deadline), "--preemption-keep-limits") if way == "preempt"
                 else ("--drain-timeout", str(deadline)))
    m = Mounted(server, bucket, tag, root, tag, "--upload-limit", cap, "--upload-delay", "3600", *stop_args)
    try:
        for n, step in enumerate(STEPS):
            (m.mnt / step).mkdir()
            for shard in range(2):
                write_shard(m.mnt / step / f"shard{shard}", step_bytes // 2, n * 2 + shard)
            (m.mnt / step / ".metadata").write_text(f"{step} complete\n")
        pid = client.status(m.mnt)["pid"]
        quiet_disk(pause)
        started = time.perf_counter()
        os.kill(pid, signal.SIGTERM)
        wait_exit(pid, deadline + 120)
        stop_seconds = time.perf_counter() - started
        stored = keys(server, bucket, tag)
        report_path = m.cache / REPORT_NAME
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    finally:
        shutil.rmtree(m.cache, ignore_errors=True)
    durable = [s for s in STEPS if all(stored.get(f"{s}/shard{i}") == step_bytes // 2 for i in range(2))]
    published = [s for s in durable if f"{s}/.metadata" in stored]
    return {"way": way, "stop_seconds": stop_seconds, "durable": durable, "published": published,
            "newest_published": STEPS[-1] in published,
            "uploaded_bytes": sum(size for key, size in stored.items() if "/shard" in key),
            "report": None if report is None else {"durable": report["durable"], "not_durable": report["not_durable"],
                                                   "seconds": report["seconds"]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", default="8M", help="the upload cap: the store's known rate (8M: 8 MiB/s)")
    p.add_argument("--deadline", type=float, default=10.0, help="seconds the notice leaves (SIGTERM to exit)")
    p.add_argument("--fraction", type=float, default=0.9,
                   help="each step's bytes as a share of deadline x cap (three steps: 3 x this x the deadline)")
    p.add_argument("--runs", type=int, default=2, help="runs of each way")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync before each SIGTERM")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    cap = parse_rate(args.cap, "--cap")
    if cap is None:
        raise SystemExit("--cap must be a rate, not off")
    step_bytes = int(cap * args.deadline * args.fraction) // (2 * MIB) * 2 * MIB

    root = Path(tempfile.mkdtemp(prefix="ckptfs-preempt-bench.", dir=args.dir))
    os.environ.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(root / "run"))
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    server = start_seaweedfs(root / "seaweedfs")
    results: list[dict[str, Any]] = []
    try:
        bucket = f"preempt-{os.getpid()}"
        server.client().create_bucket(Bucket=bucket)
        print(f"cap {cap / MIB:.1f} MiB/s, deadline {args.deadline:.0f} s, three steps of {step_bytes / MIB:.0f} MiB"
              f" ({3 * step_bytes / cap / args.deadline:.2f}x the deadline at the cap); the machine is shared"
              " (other sessions run): times are noisy")
        for run in range(args.runs):
            ways = ["preempt", "drain"] if run % 2 == 0 else ["drain", "preempt"]
            for way in ways:
                r = one_run(server, bucket, root, f"{way}-{run}", way, args.cap, args.deadline, step_bytes,
                            args.pause)
                results.append(r)
                print(f"run {run} {way:<8} stop {r['stop_seconds']:5.1f} s  durable {','.join(r['durable']) or '-':<22}"
                      f" published {','.join(r['published']) or '-':<22} newest published: {r['newest_published']}"
                      f"  shard bytes up {r['uploaded_bytes'] / MIB:.0f} MiB")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    for way in ("preempt", "drain"):
        mine = [r for r in results if r["way"] == way]
        print(f"{way:<8} newest step published in {sum(r['newest_published'] for r in mine)}/{len(mine)} runs;"
              f" any step published in {sum(bool(r['published']) for r in mine)}/{len(mine)};"
              f" stop {min(r['stop_seconds'] for r in mine):.1f}-{max(r['stop_seconds'] for r in mine):.1f} s")
    report = {
        "cap_bytes_per_second": cap, "deadline": args.deadline, "fraction": args.fraction, "step_bytes": step_bytes,
        "runs": args.runs, "pause": args.pause,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
        "taken_at": time.strftime("%Y-%m-%d %H:%M"), "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
