"""What the benchmarks share: sizes on the command line, a quiet disk before each timed run, the ways in
rotating order, random source files, the ckptfs CLI, a SeaweedFS S3 server on 127.0.0.1 with the client
environment set, ratios per round, and the JSON report every bench leaves in bench/results/.

The benches put bench/ on sys.path and `from common import ...`; tests/emulators.py starts the servers."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from emulators import CLIENT_ENV, CLIENT_ENV_UNSET, S3Server, start_seaweedfs  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
QUIET_PAUSE = 3.0  # seconds of quiet after sync before each timed run
T = TypeVar("T")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def machine() -> dict[str, Any]:
    """The machine a report was measured on, with its load: the benches run on a shared, noisy machine."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release(),
            "load_average": [round(load, 2) for load in os.getloadavg()]}


def write_report(path: Path, settings: dict[str, Any], results: dict[str, Any], medians: dict[str, float],
                 ratios: dict[str, float], **extra: Any) -> None:
    """The JSON every bench leaves in bench/results/: its settings, the machine, each run, medians, ratios
    (and whatever else the bench adds: `extra`)."""
    report = {**settings, "machine": machine(), "seconds": results, "medians": medians, "ratios": ratios, **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nresults written to {path}")


def quiet_disk(pause: float = QUIET_PAUSE, drop_cache: bool = False) -> None:
    """Start a timed run with the disk quiet: `sync`, so that the previous run's writeback is not paid by this
    one; the page cache dropped if asked (a read that must come from the store, not memory); then a pause."""
    os.sync()
    if drop_cache:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            pass  # not root: a local file may be read from memory; the store's side is a server either way
    time.sleep(pause)


def rotated(ways: list[T], run: int) -> list[T]:
    """The ways in the order of run number `run`: each takes each place in turn (the one right after another
    pays for what that one left behind, and the first one after a pause finds the machine idle)."""
    k = run % len(ways)
    return ways[k:] + ways[:k]


def round_ratios(results: dict[str, list[float]], ours: str, theirs: str) -> list[float]:
    """ours / theirs of each round (the two timed side by side in it): on a noisy machine the ratio of one
    round is steadier than either time, so reports give the median of these, not a ratio of medians."""
    return [a / b for a, b in zip(results.get(ours, []), results.get(theirs, []), strict=False) if b > 0]


def median_ratio(results: dict[str, list[float]], ours: str, theirs: str) -> float | None:
    ratios = round_ratios(results, ours, theirs)
    return statistics.median(ratios) if ratios else None


def make_source(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with open(path, "wb") as f:
        for i in range(size // MIB):
            f.write(i.to_bytes(8, "big") + block[8:])  # every MiB differs: no compression, no dedupe
    os.sync()


def ckptfs(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # From "/": `python -m` puts the current directory before PYTHONPATH, so a bench started inside a
    # checkout would run that checkout's ckptfs as --before's too.
    result = subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True, env=env,
                            timeout=timeout, cwd="/")
    if result.returncode != 0:
        raise SystemExit(f"ckptfs {args[0]} failed: {result.stderr.strip()}")
    return result


def client_env(runtime_dir: Path) -> dict[str, str]:
    """The environment of a ckptfs or SDK subprocess talking to the local server: its credentials, none of the
    caller's AWS profile or endpoint, and a runtime dir of the bench's own."""
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
    env.update(CLIENT_ENV, CKPTFS_RUNTIME_DIR=str(runtime_dir))
    return env


@contextlib.contextmanager
def seaweedfs(root: Path) -> Iterator[S3Server]:
    """A SeaweedFS S3 server under root/seaweedfs, this process's SDK environment pointed at it; stopped, and
    root removed, at the end."""
    server = start_seaweedfs(root / "seaweedfs")
    os.environ.update(CLIENT_ENV)
    for name in CLIENT_ENV_UNSET:
        os.environ.pop(name, None)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
