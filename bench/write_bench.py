#!/usr/bin/env python3
"""Write-path benchmark: ckptfs mount vs a plain directory on the same disk (DESIGN.md section 7).

Workloads (each run once into a plain directory next to the cache dir and once through a fresh ckptfs mount
of an embedded file:// store, interleaved, the order alternating from one run to the next: local, ckptfs;
ckptfs, local; ...):

  seq       write --seq-size bytes with --write-size os.write() calls from one preallocated buffer, then
            close. Timed from open() to the return of close().
  save      torch.save() of a float32 state dict of about --save-size bytes, built once before any timing.
            Timed around the torch.save() call (it opens, writes and closes the file).
  bufwrite  (opt-in) --seq-size bytes written in --small-write-size pieces through Python's buffered open(),
            whose buffer is the file's st_blksize; shows what st_blksize does to small-write workloads.

For ckptfs, "durable" is the time from the start of the write until `ckptfs flush MNT` returns 0, i.e.
until the file is committed in the store. Every ckptfs run gets a fresh mount, cache dir and store; files
are deleted between runs and each timed run starts with the disk quiet, after the mount: `sync`, then
--pause seconds (--no-sync to skip both), so one run's dirty pages do not slow down the next. Results: a
table on stdout and JSON in bench/results/write_bench.json.

Run from the repo's venv:  python bench/write_bench.py [--runs 3] [--seq-size 2G] [--save-size 1G]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_JSON = BENCH_DIR / "results" / "write_bench.json"
MIB = 1 << 20
GIB = 1 << 30
MAX_TENSOR_BYTES = 128 * MIB
WORKLOADS = ("seq", "save", "bufwrite")
PY_SPY_CANDIDATES = (Path(sys.executable).parent / "py-spy",)


class BenchError(Exception):
    """Something the user has to fix; printed as one line."""


# -- helpers -----------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 2G, 1048576)")
    number, unit = match.groups()
    scale = 1 << (10 * "kmgt".find(unit.lower()) + 10) if unit else 1
    return int(float(number) * scale)


def human(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_cmd(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def machine_info(scratch: Path) -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    found = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(scratch)],
                           capture_output=True, text=True, check=False)
    if found.returncode == 0 and found.stdout.split():
        source, fstype = found.stdout.split()[:2]
        info["disk"] = {"device": source, "fstype": fstype}
        block = subprocess.run(["lsblk", "-dno", "SIZE,ROTA,MODEL", source],
                               capture_output=True, text=True, check=False)
        if block.returncode == 0 and block.stdout.split():
            size, rota, *model = block.stdout.split()
            info["disk"].update(size=size, rotational=rota == "1", model=" ".join(model) or None)
    with contextlib.suppress(ImportError):
        import torch

        info["torch"] = torch.__version__
    return info


# -- workloads ---------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    description: str
    nbytes: int
    run: Callable[[Path], None]


def seq_workload(total: int, write_size: int, rate: float = 0.0) -> Workload:
    """`rate` (bytes per second, 0: as fast as it goes) paces the writes: a slow writer, such as a trainer
    copying tensors out of GPUs, for which uploading while writing pays (--write-rate)."""
    view = memoryview(bytearray(os.urandom(write_size)))  # preallocated once; random, so nothing compresses

    def run(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        started = time.perf_counter()
        try:
            left = total
            while left:
                chunk = view[: min(write_size, left)]
                while chunk:
                    written = os.write(fd, chunk)
                    chunk = chunk[written:]
                    left -= written
                if rate and (ahead := (total - left) / rate - (time.perf_counter() - started)) > 0:
                    time.sleep(ahead)
        finally:
            os.close(fd)

    paced = f" at {human(int(rate))}/s" if rate else ""
    return Workload("seq", f"sequential write {human(total)}, {human(write_size)} writes{paced}", total, run)


def bufwrite_workload(total: int, piece: int) -> Workload:
    data = os.urandom(piece)

    def run(path: Path) -> None:
        with open(path, "wb") as f:  # buffer size = st_blksize of the file
            for _ in range(total // piece):
                f.write(data)

    return Workload("bufwrite", f"buffered open() {human(total)}, {human(piece)} writes", total, run)


def save_workload(total: int) -> Workload:
    import torch

    count = max(1, math.ceil(total / MAX_TENSOR_BYTES))
    numel = total // count // 4
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for i in range(count):
        state[f"layers.{i}.weight"] = torch.rand(numel, generator=generator, dtype=torch.float32)
        state[f"layers.{i}.bias"] = torch.rand(4096, generator=generator, dtype=torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    torch.save({"warmup": torch.zeros(4)}, io.BytesIO())  # first-call imports stay out of the timings

    def run(path: Path) -> None:
        torch.save(state, str(path))

    return Workload("save", f"torch.save {count} float32 tensors, {human(nbytes)}", nbytes, run)


# -- ckptfs mount ------------------------------------------------------------------------------------


@dataclass
class Mount:
    """One fresh ckptfs mount (store, cache dir, mountpoint under `root`), driven through the CLI."""

    root: Path
    env: dict[str, str]
    upload_delay: float
    mount_args: tuple[str, ...] = ()
    store: Path = field(init=False)
    mnt: Path = field(init=False)
    cache: Path = field(init=False)
    pid: int | None = None
    cli_seconds: float = math.nan

    def __post_init__(self) -> None:
        self.store = self.root / "store"
        self.mnt = self.root / "mnt"
        self.cache = self.root / "cache"

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_cmd([sys.executable, "-m", "ckptfs", *args], self.env, timeout)

    def mount(self) -> None:
        for d in (self.store, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
        result = self.cli("mount", "--no-guard-mountpoint",
                          f"file://{self.store}", str(self.mnt), "--cache-dir", str(self.cache),
                          "--daemon", "--upload-delay", str(self.upload_delay), "--metrics-addr", "off",
                          *self.mount_args)
        if result.returncode != 0:
            raise BenchError(f"ckptfs mount failed: {(result.stderr or result.stdout).strip()}")
        started = time.perf_counter()
        status = self.cli("status", str(self.mnt), "--json")
        self.cli_seconds = time.perf_counter() - started
        if status.returncode != 0:
            raise BenchError(f"ckptfs status failed: {status.stderr.strip()}")
        self.pid = int(json.loads(status.stdout)["pid"])

    def flush(self, timeout: float) -> None:
        result = self.cli("flush", str(self.mnt), "--timeout", str(timeout), timeout=timeout + 60)
        if result.returncode != 0:
            raise BenchError(f"ckptfs flush returned {result.returncode}: {result.stderr.strip()}")

    def umount(self) -> None:
        """Drain and unmount; falls back to a lazy unmount and killing the daemon. Never raises."""
        if os.path.ismount(self.mnt):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.cli("umount", str(self.mnt), "--timeout", "120", timeout=180)
        if os.path.ismount(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(self.mnt)], check=False)
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while _alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            self.pid = None

    def remove_data(self) -> None:
        for d in (self.store, self.cache):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is dead too; the daemon is not our child (it detached), so check /proc.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@contextlib.contextmanager
def fresh_mount(root: Path, env: dict[str, str], upload_delay: float, mount_args: tuple[str, ...]) -> Iterator[Mount]:
    mount = Mount(root, env, upload_delay, mount_args)
    mount.remove_data()
    try:
        mount.mount()
        yield mount
    finally:
        mount.umount()
        mount.remove_data()


# -- profiling ---------------------------------------------------------------------------------------


def find_py_spy(explicit: str | None) -> str:
    if explicit:
        return explicit
    found = shutil.which("py-spy")
    if found:
        return found
    for candidate in PY_SPY_CANDIDATES:
        if candidate.exists():
            return str(candidate)
    raise BenchError("py-spy not found; pass --py-spy PATH")


def _pwrite_frame() -> str:
    """py-spy's name for the os.pwrite line of the write path: 'DataPath.write (ckptfs/fs/data_path.py:224)'."""
    import ckptfs.fs.data_path

    source = Path(ckptfs.fs.data_path.__file__).read_text().splitlines()
    in_write = False
    for number, line in enumerate(source, 1):
        if line.strip().startswith("def write("):
            in_write = True
        elif in_write and "os.pwrite(" in line:
            return f"DataPath.write (ckptfs/fs/data_path.py:{number})"
    return "DataPath.write (ckptfs/fs/data_path.py:?)"


def summarize_profile(raw: Path, top: int = 12) -> dict[str, Any]:
    """Stacks from `py-spy record --format raw --idle` -> where the daemon's main thread spends its time.

    The main thread runs trio, pyfuse3 and every request handler; worker threads only copy files to the
    store (idle during a write) and are reported as one busy share."""
    pwrite = _pwrite_frame()
    category: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    main_total = worker_busy = worker_total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if not any(f.startswith("cmd_mount ") for f in frames):
            worker_total += count
            if not _worker_idle(frames[-1]):
                worker_busy += count
            continue
        main_total += count
        category[_categorize(frames, pwrite)] += count
        leaf[frames[-1]] += count
    n = max(main_total, 1)
    return {
        "main_thread_samples": main_total,
        "main_thread_share": {k: round(v / n, 4) for k, v in category.most_common()},
        "main_thread_top_leaf_frames": [(k, round(v / n, 4)) for k, v in leaf.most_common(top)],
        "worker_thread_samples": worker_total,
        "worker_thread_busy_samples": worker_busy,
    }


def _worker_idle(leaf: str) -> bool:
    idle_words = ("_thread_cache.py", "threading.py", "pthread_cond", "futex", "sem_wait")
    return any(word in leaf for word in idle_words)


def _categorize(frames: list[str], pwrite: str) -> str:
    text = ";".join(frames)
    leaf = frames[-1]
    if "EpollIOManager.get_events" in text and ("get_events" in leaf or "epoll_wait" in leaf):
        return "idle: waiting in epoll for the next request"
    if pwrite in frames:
        return "write: os.pwrite into the cache file (kernel copy)"
    if "DataPath.write " in text or "FuseOperations.write " in text:
        return "write: our Python around os.pwrite"
    if "getxattr" in text:
        return "getxattr(security.capability): sent by the kernel before every write(2)"
    if "ckptfs/journal" in text or "sqlite" in text:
        return "journal (SQLite), other requests"
    if "FuseOperations." in text:
        return "other request handlers (our Python)"
    if "fuse_buf_copy" in text or "PyBytes_from_bufvec" in text:
        return "pyfuse3: copy write data into a bytes object"
    if leaf.startswith(("read (libc", "__read")):
        return "pyfuse3: read() of the request from /dev/fuse"
    if leaf.startswith(("writev (libc", "__writev")):
        return "pyfuse3: writev() of the reply to /dev/fuse"
    if "trio/" in leaf or "outcome/" in leaf:
        return "trio: scheduling, locks, wait_readable"
    return "pyfuse3: other request dispatch (Cython)"


# -- the benchmark -----------------------------------------------------------------------------------


@dataclass
class Results:
    local: dict[str, list[float]] = field(default_factory=dict)
    ckptfs: dict[str, list[float]] = field(default_factory=dict)
    durable: dict[str, list[float]] = field(default_factory=dict)
    flush: dict[str, list[float]] = field(default_factory=dict)
    cli_seconds: list[float] = field(default_factory=list)


def timed(workload: Workload, path: Path, sync: bool, pause: float) -> float:
    if sync:
        os.sync()
        time.sleep(pause)
    started = time.perf_counter()
    workload.run(path)
    return time.perf_counter() - started


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def bench(args: argparse.Namespace, work: Path, workloads: list[Workload]) -> tuple[Results, dict[str, Any]]:
    local_dir = work / "local"
    local_dir.mkdir()
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(work / "run"))
    results = Results()

    def local(run: int, w: Workload) -> None:
        target = local_dir / f"{w.name}.bin"
        seconds = timed(w, target, args.sync, args.pause)
        remove(target)
        results.local.setdefault(w.name, []).append(seconds)
        print(f"run {run}/{args.runs} {w.name:<8} local   {seconds:7.2f}s", flush=True)

    def ckptfs(run: int, w: Workload) -> None:
        with fresh_mount(work, env, args.upload_delay, tuple(args.mount_arg)) as mount:
            target = mount.mnt / f"{w.name}.bin"
            seconds = timed(w, target, args.sync, args.pause)
            size = target.stat().st_size
            before_flush = time.perf_counter()
            mount.flush(args.flush_timeout)
            flush = time.perf_counter() - before_flush
            durable = seconds + flush  # the quiet before the run is not part of it
            stored = mount.store / target.name
            if not stored.is_file() or stored.stat().st_size != size:
                raise BenchError(f"{stored} is missing or not {size} bytes after flush")
            results.ckptfs.setdefault(w.name, []).append(seconds)
            results.durable.setdefault(w.name, []).append(durable)
            results.flush.setdefault(w.name, []).append(flush)
            results.cli_seconds.append(mount.cli_seconds)
        print(f"run {run}/{args.runs} {w.name:<8} ckptfs  {seconds:7.2f}s  durable {durable:7.2f}s", flush=True)

    for run in range(1, args.runs + 1):
        for w in workloads:
            # the order alternates: the second way of a pair would always find the first one's leftovers
            for way in (local, ckptfs) if run % 2 else (ckptfs, local):
                way(run, w)

    profile: dict[str, Any] = {}
    if args.profile:
        profile = run_profile(args, work, env, workloads)
    return results, profile


def run_profile(args: argparse.Namespace, work: Path, env: dict[str, str],
                workloads: list[Workload]) -> dict[str, Any]:
    """One extra, untimed ckptfs run of the seq workload with py-spy attached to the daemon."""
    seq = next((w for w in workloads if w.name == "seq"), None)
    if seq is None:
        return {}
    py_spy = find_py_spy(args.py_spy)
    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "daemon_seq.txt"
    with fresh_mount(work, env, args.upload_delay, tuple(args.mount_arg)) as mount:
        assert mount.pid is not None
        argv = [py_spy, "record", "--pid", str(mount.pid), "--rate", str(args.profile_rate),
                "--format", "raw", "--output", str(raw), "--idle"]
        if args.profile_native:
            argv.append("--native")
        spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)  # let py-spy attach
            seconds = timed(seq, mount.mnt / "seq.bin", args.sync, args.pause)
        finally:
            spy.send_signal(signal.SIGINT)
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
        if not raw.exists():
            raise BenchError(f"py-spy wrote no profile: {err.strip()}")
    summary = summarize_profile(raw)
    summary["seq_seconds_under_py_spy"] = round(seconds, 3)
    summary["raw"] = str(raw)
    return summary


def report(args: argparse.Namespace, workloads: list[Workload], results: Results,
           profile: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for w in workloads:
        local = median(results.local[w.name])
        ckptfs = median(results.ckptfs[w.name])
        rows.append({
            "workload": w.name,
            "description": w.description,
            "bytes": w.nbytes,
            "local_median_s": round(local, 3),
            "ckptfs_median_s": round(ckptfs, 3),
            "ratio_ckptfs_over_local": round(ckptfs / local, 3),
            "ckptfs_durable_median_s": round(median(results.durable[w.name]), 3),
            "ckptfs_flush_median_s": round(median(results.flush[w.name]), 3),
            "local_runs_s": [round(x, 3) for x in results.local[w.name]],
            "ckptfs_runs_s": [round(x, 3) for x in results.ckptfs[w.name]],
            "ckptfs_durable_runs_s": [round(x, 3) for x in results.durable[w.name]],
        })
    header = (f"{'workload':<10} {'bytes':>9} {'local (s)':>10} {'ckptfs (s)':>11} {'ckptfs/local':>13} "
              f"{'ckptfs durable (s)':>19}")
    print()
    print(f"medians of {args.runs} interleaved runs; durable = write + `ckptfs flush` returning")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<10} {human(r['bytes']):>9} {r['local_median_s']:>10.2f} "
              f"{r['ckptfs_median_s']:>11.2f} {r['ratio_ckptfs_over_local']:>13.2f} "
              f"{r['ckptfs_durable_median_s']:>19.2f}")
    print(f"(a `ckptfs` CLI round trip, included in durable, takes {median(results.cli_seconds):.2f}s here)")
    if profile:
        print(f"\ndaemon main thread during one extra seq run under py-spy "
              f"({profile['seq_seconds_under_py_spy']}s, {profile['main_thread_samples']} samples; "
              f"raw stacks in {profile['raw']}):")
        for name, share in profile["main_thread_share"].items():
            print(f"  {share:6.1%}  {name}")
        print(f"  worker threads: {profile['worker_thread_busy_samples']} busy samples")
    return {
        "benchmark": "write_bench",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine,
        "settings": {
            "runs": args.runs,
            "seq_size": args.seq_size,
            "write_size": args.write_size,
            "write_rate": args.write_rate,
            "save_size": args.save_size,
            "small_write_size": args.small_write_size,
            "sync_before_each_run": args.sync,
            "pause_after_sync_s": args.pause if args.sync else 0,
            "order": "local, ckptfs in odd runs; ckptfs, local in even ones",
            "upload_delay": args.upload_delay,
            "mount_args": args.mount_arg,
            "scratch_parent": str(args.dir),
        },
        "results": rows,
        "cli_round_trip_median_s": round(median(results.cli_seconds), 3),
        "profile": profile,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per workload (median reported)")
    p.add_argument("--seq-size", type=parse_size, default=2 * GIB, help="bytes of the seq workload (2G)")
    p.add_argument("--write-size", type=parse_size, default=1 * MIB, help="size of each seq write (1M)")
    p.add_argument("--write-rate", type=parse_size, default=0,
                   help="pace the seq workload to this many bytes per second, e.g. 200M (default: unpaced)")
    p.add_argument("--save-size", type=parse_size, default=1 * GIB, help="bytes of the state dict (1G)")
    p.add_argument("--small-write-size", type=parse_size, default=16 * 1024,
                   help="write size of the bufwrite workload (16K)")
    p.add_argument("--workloads", default="seq,save", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent; plain dir, cache dir and store go in a fresh subdir here (/tmp)")
    p.add_argument("--no-sync", dest="sync", action="store_false",
                   help="do not sync and pause before each timed run")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync before each timed run (3)")
    p.add_argument("--upload-delay", type=float, default=2.0, help="ckptfs --upload-delay (2, its default)")
    p.add_argument("--flush-timeout", type=float, default=600)
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for ckptfs mount, e.g. --mount-arg=--no-upload-while-writing (repeatable)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON,
                   help=f"results file ({DEFAULT_JSON.relative_to(REPO)})")
    p.add_argument("--profile", metavar="DIR", help="after the timed runs, profile the daemon with py-spy "
                   "during one extra seq run; raw stacks go to DIR")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C frames too)")
    p.add_argument("--py-spy", help="path of py-spy (default: PATH, then next to python)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.write_size < 1 or args.small_write_size < 1:
        p.error("write sizes must be positive")
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workload_names) - set(WORKLOADS)
    if unknown or not args.workload_names:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    return args


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    built = []
    for name in args.workload_names:
        if name == "seq":
            built.append(seq_workload(args.seq_size, args.write_size, args.write_rate))
        elif name == "save":
            print(f"building a {human(args.save_size)} state dict ...", flush=True)
            built.append(save_workload(args.save_size))
        else:
            built.append(bufwrite_workload(args.seq_size, args.small_write_size))
    return built


def _raise_on_term(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_term)
    args.dir.mkdir(parents=True, exist_ok=True)
    # Room for the biggest workload three times over: plain file, cache file, store copy.
    need = 3 * max(args.seq_size, args.save_size) + GIB
    free = shutil.disk_usage(args.dir).free
    if free < need:
        print(f"write_bench: {args.dir} has {human(free)} free, needs about {human(need)}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="ckptfs-write-bench.", dir=args.dir))
    try:
        machine = machine_info(work)
        workloads = build_workloads(args)
        results, profile = bench(args, work, workloads)
        summary = report(args, workloads, results, profile, machine)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(args.json)
        print(f"\nresults written to {args.json}")
        return 0
    except BenchError as exc:
        print(f"write_bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("write_bench: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        mnt = work / "mnt"
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mnt)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
