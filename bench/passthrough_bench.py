#!/usr/bin/env python3
"""FUSE passthrough benchmark: ckptfs against the bare directory and libfuse's passthrough_hp, side by side.

Three parts, each run for every `--where` variant (tmpfs: everything on a tmpfs mounted for the run; disk:
everything in a scratch dir under --dir), every timed run preceded by `sync` and a pause of --pause seconds,
the order of the contenders rotating from one repetition to the next (a run right after another would pay
for its writeback). Before every timed write or load an untimed write and delete of as many bytes primes the
VM's memory, right before the timing starts (see prime(); --no-prime to skip):

  fio      The mount's ceiling. fio --ioengine=psync --bs=1M --end_fsync=1 (and fio's default preallocation;
           --fio-fallocate none for plain writes): write --fio-size with 1 job;
           read that file back (its pages still cached: what a program reading a file it just wrote sees);
           write --fio-jobs x --fio-job-size with --fio-jobs jobs, each its own file. Contenders: the bare
           directory; ckptfs (passthrough auto, the default); ckptfs --passthrough off; passthrough_hp
           (kernel passthrough); passthrough_hp --nopassthrough. GB/s (10^9 bytes) and the ratio to bare.
  save     torch.save of a ~--save-size float32 state dict (built once) and `dd if=/dev/zero bs=1M` of
           --dd-size, timed as the program sees them (no fsync), into ckptfs (passthrough on) and into a
           plain directory next to the cache dir. Each output's size and CRC-32 must equal the first one's;
           it is deleted before the next timed run. Median seconds and ckptfs/plain (target <= 1.05).
  restore  torch.load of a ~--restore-size GPT-shaped fp16 checkpoint written through the mount (its bytes
           in the cache, dirty: the drain is held off) against the same checkpoint in a plain directory,
           page caches dropped before each load; every load is compared with the saved tensors. Median
           seconds and ckptfs/plain (target <= 1.1).

Every ckptfs mount is fresh (new cache dir and file:// store on the same filesystem) with the drain held
off: --upload-delay 100000 --small-file-wait 0 --metrics-addr off --min-free 0. Needs root (tmpfs mount,
drop_caches, passthrough), fio (`apt-get install -y fio`), passthrough_hp (libfuse 3.17's example,
scripts/install.sh builds it into /opt/ckptfs-fuse/bin) and the venv's torch. Results: tables on stdout,
JSON in bench/results/passthrough_bench.json and the tables in a .md next to it.

Run from the repo's venv:  python bench/passthrough_bench.py [--where tmpfs|disk|both] [--runs 3] [--only fio]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from write_bench import GIB, MIB, BenchError, Mount, human, machine_info, median, parse_size

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_JSON = BENCH_DIR / "results" / "passthrough_bench.json"
DEFAULT_HP = Path("/opt/ckptfs-fuse/bin/passthrough_hp")
PARTS = ("fio", "save", "restore")
WHERES = ("tmpfs", "disk")
CONTENDERS = ("bare", "ckptfs", "ckptfs-nopt", "hp", "hp-nopt")
LABELS = {
    "bare": "bare dir",
    "ckptfs": "ckptfs (passthrough)",
    "ckptfs-nopt": "ckptfs --passthrough off",
    "hp": "passthrough_hp",
    "hp-nopt": "passthrough_hp --nopassthrough",
    "plain": "plain dir",
}
# The drain held off, so that no upload competes with the timed I/O; no metrics port to collide on.
CKPTFS_ARGS = ("--small-file-wait", "0", "--metrics-addr", "off", "--min-free", "0")
CKPTFS_UPLOAD_DELAY = 100000.0
FIO_COMMON = ("--ioengine=psync", "--bs=1M", "--end_fsync=1", "--group_reporting",
              # a read that finds the pages the write left: the default invalidate=1 would drop them for
              # the bare dir only (fadvise on a FUSE file does not reach the backing file's pages)
              "--invalidate=0")
# fio preallocates each file before it writes (fallocate=native on Linux) unless told not to: what a user
# running fio gets, and what issue 46 measures; --fio-fallocate none gives every contender plain writes.
FIO_FALLOCATE_DEFAULT = "default"
SAVE_TENSOR_BYTES = 128 * MIB
TICKS = os.sysconf("SC_CLK_TCK")


# -- helpers -----------------------------------------------------------------------------------------


def proc_cpu(pid: int | None) -> float:
    """utime + stime of a process, in seconds (nan if there is none or it is gone)."""
    if pid is None:
        return math.nan
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / TICKS


def quiesce(pause: float, drop: bool = False) -> None:
    """Let the disk settle before a timed run: sync, optionally drop the page cache, then pause."""
    os.sync()
    if drop:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    time.sleep(pause)


def clear_dir(d: Path) -> None:
    """Delete what is in d (not d itself)."""
    for child in d.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def mounts_under(root: Path) -> list[Path]:
    """Mountpoints at or below root, deepest first."""
    found: list[Path] = []
    prefix = str(root)
    with open("/proc/self/mounts") as f:
        for line in f:
            point = line.split()[1].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def file_crc(path: Path) -> int:
    """CRC-32 of a file's bytes (ISA-L's, a ckptfs dependency, else zlib's)."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        from zlib import crc32
    crc = 0
    buf = bytearray(8 * MIB)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32(view[:n], crc)
    return crc


def prime(root: Path, nbytes: int) -> None:
    """Write nbytes into the page cache in root and delete them, untimed, right before a timed run (after the
    sync and the pause). On this VM a 2 GiB write that finds no recently freed memory takes up to 4-5x as
    long as one that does (memory the VM gave back to the host, or never touched, is slow to get again), so
    without this whichever contender comes first after a mount, a load or a pause pays. Deleted before
    writeback, the bytes never reach the disk (ext4 drops delayed-allocation pages), so the disk stays quiet;
    a prime with a sync after it made the disk runs slower and noisier (dd 2 GiB: 1.1-1.9 s against
    0.8-1.0 s primed this way and 1.3-2.4 s unprimed, plain dir, alternated)."""
    block = b"\0" * MIB
    path = root / "prime.bin"
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // MIB):
            f.write(block)
    path.unlink()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


# -- contenders --------------------------------------------------------------------------------------


@dataclass
class Target:
    """A directory a workload writes into, and the FUSE daemon behind it (None: a plain directory)."""

    name: str
    dir: Path
    pid: int | None = None
    ckptfs: Mount | None = None

    def status(self) -> dict[str, Any] | None:
        if self.ckptfs is None:
            return None
        result = self.ckptfs.cli("status", str(self.ckptfs.mnt), "--json")
        if result.returncode != 0:
            raise BenchError(f"ckptfs status failed: {(result.stderr or result.stdout).strip()}")
        status: dict[str, Any] = json.loads(result.stdout)
        return status


class Session:
    """The scratch dir, tmpfs, mounts and daemons of one invocation; cleanup() undoes whatever is left."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-passthrough-bench.", dir=args.dir))
        self.env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(self.work / "run"))
        self.mounts: list[Mount] = []
        self.daemons: list[subprocess.Popen[bytes]] = []

    def root(self, where: str) -> Path:
        return self.work / where

    @contextlib.contextmanager
    def variant(self, where: str) -> Iterator[Path]:
        """The directory everything of one --where variant lives in (a fresh tmpfs for "tmpfs")."""
        root = self.root(where)
        root.mkdir()
        if where == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.tmpfs_size},mode=0755",
                            "ckptfs-bench", str(root)], check=True)
        try:
            yield root
        finally:
            if where == "tmpfs":
                subprocess.run(["umount", str(root)], check=False)
            if not mounts_under(root):
                shutil.rmtree(root, ignore_errors=True)

    @contextlib.contextmanager
    def target(self, name: str, root: Path) -> Iterator[Target]:
        if name in ("bare", "plain"):
            d = root / name
            d.mkdir()
            try:
                yield Target(name, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
        elif name in ("ckptfs", "ckptfs-nopt"):
            with self._ckptfs(name, root) as target:
                yield target
        elif name in ("hp", "hp-nopt"):
            with self._passthrough_hp(name, root) as target:
                yield target
        else:
            raise AssertionError(name)

    @contextlib.contextmanager
    def _ckptfs(self, name: str, root: Path) -> Iterator[Target]:
        off = name == "ckptfs-nopt"
        extra = (*CKPTFS_ARGS, *(("--passthrough", "off") if off else ()), *self.args.ckptfs_arg)
        mount = Mount(root / "ckptfs", self.env, CKPTFS_UPLOAD_DELAY, extra)
        mount.remove_data()
        self.mounts.append(mount)
        try:
            mount.mount()
            target = Target(name, mount.mnt, mount.pid, mount)
            status = target.status()
            assert status is not None
            enabled = bool(status["passthrough"]["enabled"])
            if enabled == off:
                raise BenchError(f"{name}: passthrough is {'on' if enabled else 'off'}: "
                                 f"{status['passthrough']['why']}")
            yield target
        finally:
            if os.path.ismount(mount.mnt):
                with contextlib.suppress(OSError):
                    clear_dir(mount.mnt)  # nothing left to drain at unmount
            mount.umount()
            mount.remove_data()
            self.mounts.remove(mount)
            if not os.path.ismount(mount.mnt):
                shutil.rmtree(mount.root, ignore_errors=True)

    @contextlib.contextmanager
    def _passthrough_hp(self, name: str, root: Path) -> Iterator[Target]:
        src, mnt, log = root / "hp-src", root / "hp-mnt", self.work / f"{name}.log"
        src.mkdir()
        mnt.mkdir()
        argv = [str(self.args.passthrough_hp), "--foreground", *(["--nopassthrough"] if name == "hp-nopt" else []),
                *self.args.hp_arg, str(src), str(mnt)]
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.daemons.append(proc)
        try:
            deadline = time.monotonic() + 30
            while not os.path.ismount(mnt):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"passthrough_hp did not mount (exit {proc.poll()}): "
                                     f"{log.read_text(errors='replace')[-2000:].strip()}")
                time.sleep(0.05)
            yield Target(name, mnt, proc.pid)
        finally:
            self._stop_hp(proc, mnt)
            self.daemons.remove(proc)
            if not os.path.ismount(mnt):
                shutil.rmtree(mnt, ignore_errors=True)
                shutil.rmtree(src, ignore_errors=True)

    @staticmethod
    def _stop_hp(proc: subprocess.Popen[bytes], mnt: Path) -> None:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mnt)], check=False)

    def cleanup(self) -> None:
        """Unmount and stop everything this session started, then delete the scratch dir. Never raises."""
        for mount in list(self.mounts):
            with contextlib.suppress(Exception):
                mount.umount()
        for proc in list(self.daemons):
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(timeout=10)
        for point in mounts_under(self.work):
            cmd = ["umount", "-l", str(point)] if point.parent == self.work else \
                ["fusermount3", "-u", "-z", "-q", str(point)]
            subprocess.run(cmd, check=False)
        if mounts_under(self.work):
            print(f"passthrough_bench: {self.work} still has mounts; not deleted", file=sys.stderr)
        else:
            shutil.rmtree(self.work, ignore_errors=True)


# -- measuring ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    where: str
    part: str
    workload: str
    contender: str
    run: int
    position: int  # place of the contender in this repetition's order (0: first)
    seconds: float
    nbytes: int
    gbps: float = math.nan
    daemon_cpu_s: float = math.nan
    passthrough_opens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def check_ckptfs(target: Target, before: dict[str, Any] | None) -> tuple[dict[str, Any] | None, int | None]:
    """Status after a timed run; raise if the daemon recorded errors during it. -> (status, passthrough opens)."""
    after = target.status()
    if after is None or before is None:
        return after, None
    if after["errors"] != before["errors"] or after["internal_errors"] != before["internal_errors"] \
            or after["failing_count"] or after["passthrough"]["refused"] != before["passthrough"]["refused"]:
        raise BenchError(f"ckptfs reported errors during the run: errors {before['errors']} -> {after['errors']}, "
                         f"internal {after['internal_errors']}, failing {after['failing']}, last error "
                         f"{after['last_error']!r}, passthrough refused {after['passthrough']['refused']} "
                         f"(log: {target.ckptfs.cache if target.ckptfs else '?'}/ckptfs.log)")
    return after, int(after["passthrough"]["opens"]) - int(before["passthrough"]["opens"])


def timed(target: Target, pause: float, work: Callable[[], Any], drop: bool = False,
          primer: tuple[Path, int] | None = None) -> tuple[float, float, int | None]:
    """Quiesce, prime (see prime()), then time work(). -> (seconds, daemon CPU seconds, passthrough opens)."""
    before = target.status()  # a CLI round trip: before the quiet, not in it
    quiesce(pause, drop)
    if primer is not None:
        prime(*primer)
    cpu = proc_cpu(target.pid)
    started = time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    cpu = proc_cpu(target.pid) - cpu
    _, opens = check_ckptfs(target, before)
    return seconds, cpu, opens


def rotated(names: list[str], run: int) -> list[str]:
    k = run % len(names)
    return names[k:] + names[:k]


# -- part 1: fio -------------------------------------------------------------------------------------


@dataclass
class FioJob:
    name: str
    label: str
    rw: str
    jobs: int
    size: int  # per job

    @property
    def nbytes(self) -> int:
        return self.jobs * self.size


def fio_jobs(args: argparse.Namespace) -> list[FioJob]:
    return [
        FioJob("write1", f"write {human(args.fio_size)}, 1 job", "write", 1, args.fio_size),
        FioJob("read1", f"read {human(args.fio_size)} just written", "read", 1, args.fio_size),
        FioJob(f"write{args.fio_jobs}", f"write {args.fio_jobs} x {human(args.fio_job_size)}, {args.fio_jobs} jobs",
               "write", args.fio_jobs, args.fio_job_size),
    ]


def run_fio(job: FioJob, d: Path, out: Path, fallocate: str = FIO_FALLOCATE_DEFAULT) -> float:
    """Run one fio job in d; -> fio's own seconds for it (end_fsync included), checking the bytes moved."""
    argv = ["fio", f"--name={job.name}", f"--rw={job.rw}", f"--size={job.size}", f"--numjobs={job.jobs}",
            *FIO_COMMON, "--output-format=json", f"--output={out}"]
    if fallocate != FIO_FALLOCATE_DEFAULT:
        argv.append(f"--fallocate={fallocate}")
    # one job: a fixed file name, so that the read finds what write1 wrote; more: one file per job in d
    argv.append(f"--filename={d / 'fio1.bin'}" if job.jobs == 1 else f"--directory={d}")
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=3600)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        raise BenchError(f"fio {job.name} in {d} exited {result.returncode}: {message}")
    report = json.loads(out.read_text())
    group = report["jobs"][0][job.rw]
    if group["io_bytes"] != job.nbytes:
        raise BenchError(f"fio {job.name} in {d} moved {group['io_bytes']} bytes, not {job.nbytes}")
    return float(group["runtime"]) / 1000


def bench_fio(session: Session, where: str, root: Path, samples: list[Sample]) -> None:
    args = session.args
    jobs = fio_jobs(args)
    out = session.work / "fio.json"
    for run in range(args.runs):
        for position, name in enumerate(rotated(list(args.contenders), run)):
            with session.target(name, root) as target:
                for job in jobs:
                    fio_seconds: list[float] = []

                    def work(job: FioJob = job, target: Target = target, acc: list[float] = fio_seconds) -> None:
                        acc.append(run_fio(job, target.dir, out, args.fio_fallocate))

                    primer = (root, job.nbytes) if args.prime and job.rw == "write" else None
                    wall, cpu, opens = timed(target, args.pause, work, primer=primer)
                    sample = Sample(where, "fio", job.name, name, run + 1, position, fio_seconds[0], job.nbytes,
                                    gbps(job.nbytes, fio_seconds[0]), cpu, opens, {"wall_s": wall})
                    samples.append(sample)
                    print(f"[{where}] run {run + 1}/{args.runs} fio {job.name:<7} {name:<12} "
                          f"{sample.gbps:6.2f} GB/s" + (f"  daemon CPU {cpu:5.2f}s" if target.pid else "")
                          + (f"  passthrough opens {opens}" if opens is not None else ""), flush=True)
                    if job.rw == "read" or job.jobs > 1:
                        clear_dir(target.dir)


# -- part 2: saves -----------------------------------------------------------------------------------


def float32_state(total: int, seed: int = 0) -> dict[str, Any]:
    """float32 tensors of 128 MiB each plus small biases, about `total` bytes (write_bench's save state)."""
    import torch

    count = max(1, math.ceil(total / SAVE_TENSOR_BYTES))
    numel = total // count // 4
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {}
    for i in range(count):
        state[f"layers.{i}.weight"] = torch.rand(numel, generator=gen, dtype=torch.float32)
        state[f"layers.{i}.bias"] = torch.rand(4096, generator=gen, dtype=torch.float32)
    return state


def gpt_state(total: int, seed: int = 1) -> dict[str, Any]:
    """fp16 tensors shaped like peer_bench's 1.3B GPT (d 2048, vocab 50304: 24 layers are 2.44 GiB), with
    as many layers as make about `total` bytes."""
    import torch

    d, vocab = 2048, 50304
    layer_bytes = 2 * (12 * d * d + 13 * d)
    embed_bytes = 2 * vocab * d
    if total < embed_bytes + layer_bytes:
        vocab = max(64, (total - layer_bytes) // (2 * d))
        embed_bytes = 2 * vocab * d
    layers = max(1, round((total - embed_bytes) / layer_bytes))
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float32).to(torch.float16)

    state: dict[str, Any] = {"wte.weight": t(vocab, d), "ln_f.weight": t(d)}
    for i in range(layers):
        p = f"h.{i}."
        state[p + "ln_1.weight"] = t(d)
        state[p + "attn.qkv.weight"] = t(3 * d, d)
        state[p + "attn.qkv.bias"] = t(3 * d)
        state[p + "attn.proj.weight"] = t(d, d)
        state[p + "ln_2.weight"] = t(d)
        state[p + "mlp.fc.weight"] = t(4 * d, d)
        state[p + "mlp.fc.bias"] = t(4 * d)
        state[p + "mlp.proj.weight"] = t(d, 4 * d)
    return state


def state_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def bench_save(session: Session, where: str, root: Path, state: dict[str, Any], samples: list[Sample]) -> None:
    import torch

    args = session.args
    save_bytes = state_bytes(state)
    dd_count = args.dd_size // MIB

    def save(path: Path) -> None:
        torch.save(state, str(path))

    def dd(path: Path) -> None:
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={dd_count}", "status=none"], check=True)

    workloads: list[tuple[str, str, int, Callable[[Path], None]]] = [
        ("torch.save", "save.pt", save_bytes, save),
        ("dd", "dd.bin", dd_count * MIB, dd),
    ]
    expected: dict[str, tuple[int, int]] = {}  # workload -> (size, CRC-32) of its first output
    for run in range(args.runs):
        # The mount first (it is fresh each run; its mount time is not timed), then the plain dir next to its
        # cache dir: root/plain beside root/ckptfs/cache.
        with session.target("ckptfs", root) as mount, session.target("plain", root) as plain:
            targets = {"ckptfs": mount, "plain": plain}
            for workload, file_name, nbytes, call in workloads:
                for position, name in enumerate(rotated(["plain", "ckptfs"], run)):
                    target = targets[name]
                    path = target.dir / file_name
                    seconds, cpu, opens = timed(target, args.pause, partial(call, path),
                                                primer=(root, nbytes) if args.prime else None)
                    # Checked and deleted before the other contender runs: a 2 GiB file left in the page cache
                    # makes the next 2 GiB write here take 4-5x as long (fresh VM memory), plain dir or not.
                    size, crc = path.stat().st_size, file_crc(path)
                    path.unlink()
                    if (size, crc) != expected.setdefault(workload, (size, crc)):
                        raise BenchError(f"{workload}: {path} has {size} bytes, CRC-32 {crc:08x}; the first output "
                                         f"had {expected[workload][0]} bytes, CRC-32 {expected[workload][1]:08x}")
                    samples.append(Sample(where, "save", workload, name, run + 1, position, seconds, nbytes,
                                          gbps(nbytes, seconds), cpu, opens))
                    print(f"[{where}] run {run + 1}/{args.runs} {workload:<10} {name:<7} {seconds:6.2f}s"
                          + (f"  daemon CPU {cpu:5.2f}s  passthrough opens {opens}" if opens is not None else ""),
                          flush=True)


# -- part 3: restore ---------------------------------------------------------------------------------


def same_state(loaded: dict[str, Any], state: dict[str, Any]) -> bool:
    import torch

    return loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def bench_restore(session: Session, where: str, root: Path, state: dict[str, Any], samples: list[Sample],
                  info: dict[str, Any]) -> None:
    import torch

    args = session.args
    nbytes = state_bytes(state)
    with session.target("ckptfs", root) as mount, session.target("plain", root) as plain:
        targets = {"ckptfs": mount, "plain": plain}
        paths = {name: t.dir / "ckpt.pt" for name, t in targets.items()}
        for name in ("ckptfs", "plain"):  # the mount first: the cache then has the most room
            started = time.perf_counter()
            torch.save(state, str(paths[name]))
            info.setdefault(where, {})[f"write_{name}_s"] = round(time.perf_counter() - started, 3)
        status = mount.status()
        assert status is not None
        info[where]["ckptfs_states"] = status["states"]
        info[where]["file_bytes"] = paths["plain"].stat().st_size
        print(f"[{where}] restore: {human(paths['plain'].stat().st_size)} checkpoint written to both; "
              f"in the cache: {status['states']['dirty']['files']} dirty, {status['states']['clean']['files']} clean",
              flush=True)
        for run in range(args.runs):
            for position, name in enumerate(rotated(["plain", "ckptfs"], run)):
                loaded: list[dict[str, Any]] = []

                def work(path: Path = paths[name], acc: list[dict[str, Any]] = loaded) -> None:
                    acc.append(torch.load(str(path), weights_only=True))

                seconds, cpu, opens = timed(targets[name], args.pause, work, drop=True,
                                            primer=(root, nbytes) if args.prime else None)
                if not same_state(loaded[0], state):
                    raise BenchError(f"torch.load of {paths[name]} does not give back the saved tensors")
                loaded.clear()
                samples.append(Sample(where, "restore", "torch.load", name, run + 1, position, seconds, nbytes,
                                      gbps(nbytes, seconds), cpu, opens))
                print(f"[{where}] run {run + 1}/{args.runs} torch.load {name:<7} {seconds:6.2f}s"
                      + (f"  daemon CPU {cpu:5.2f}s  passthrough opens {opens}" if opens is not None else ""),
                      flush=True)


# -- report ------------------------------------------------------------------------------------------


def pick(samples: list[Sample], **match: Any) -> list[Sample]:
    return [s for s in samples if all(getattr(s, k) == v for k, v in match.items())]


def fmt_range(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if values else "-"


def summarize(args: argparse.Namespace, samples: list[Sample]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for where in args.wheres:
        if "fio" in args.parts:
            for job in fio_jobs(args):
                base = median([s.gbps for s in pick(samples, where=where, part="fio", workload=job.name,
                                                    contender="bare")])
                for name in args.contenders:
                    got = pick(samples, where=where, part="fio", workload=job.name, contender=name)
                    if not got:
                        continue
                    value = median([s.gbps for s in got])
                    rows.append({
                        "where": where, "part": "fio", "workload": job.name, "description": job.label,
                        "contender": name, "bytes": job.nbytes, "median_gbps": round(value, 3),
                        "ratio_to_bare": round(ratio(value, base), 3),
                        "runs_gbps": [round(s.gbps, 3) for s in got],
                        "median_daemon_cpu_s": round(median([s.daemon_cpu_s for s in got]), 2),
                        "passthrough_opens": [s.passthrough_opens for s in got],
                    })
        for part, workloads, target in (("save", ("torch.save", "dd"), 1.05), ("restore", ("torch.load",), 1.1)):
            if part not in args.parts:
                continue
            for workload in workloads:
                plain = pick(samples, where=where, part=part, workload=workload, contender="plain")
                ckptfs = pick(samples, where=where, part=part, workload=workload, contender="ckptfs")
                if not plain or not ckptfs:
                    continue
                p, c = median([s.seconds for s in plain]), median([s.seconds for s in ckptfs])
                rows.append({
                    "where": where, "part": part, "workload": workload, "bytes": ckptfs[0].nbytes,
                    "plain_median_s": round(p, 3), "ckptfs_median_s": round(c, 3),
                    "ratio_ckptfs_over_plain": round(ratio(c, p), 3), "target": target,
                    "plain_runs_s": [round(s.seconds, 3) for s in plain],
                    "ckptfs_runs_s": [round(s.seconds, 3) for s in ckptfs],
                    "ckptfs_median_daemon_cpu_s": round(median([s.daemon_cpu_s for s in ckptfs]), 2),
                    "passthrough_opens": [s.passthrough_opens for s in ckptfs],
                })
    return rows


def tables(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """The results as markdown tables (printed to stdout and written to the .md)."""
    out: list[str] = []
    for where in args.wheres:
        fio = [r for r in rows if r["where"] == where and r["part"] == "fio"]
        if fio:
            names = [n for n in args.contenders if any(r["contender"] == n for r in fio)]
            out.append(f"### fio, {where}: GB/s (10^9 bytes/s), median of {args.runs} [range], ratio to the bare dir")
            out.append("")
            out.append("| workload | " + " | ".join(LABELS[n] for n in names) + " |")
            out.append("| --- |" + " ---: |" * len(names))
            for job in fio_jobs(args):
                cells = []
                for n in names:
                    r = next((r for r in fio if r["workload"] == job.name and r["contender"] == n), None)
                    cells.append("-" if r is None else f"{r['median_gbps']:.2f} [{fmt_range(r['runs_gbps'])}] "
                                 f"**{r['ratio_to_bare']:.2f}x**")
                out.append(f"| {job.label} | " + " | ".join(cells) + " |")
            out.append("")
            out.append(f"Daemon CPU seconds per fio run (median), {where}:")
            out.append("")
            fuse = [n for n in names if n != "bare"]
            out.append("| workload | " + " | ".join(LABELS[n] for n in fuse) + " |")
            out.append("| --- |" + " ---: |" * len(fuse))
            for job in fio_jobs(args):
                cells = []
                for n in fuse:
                    r = next((r for r in fio if r["workload"] == job.name and r["contender"] == n), None)
                    cells.append("-" if r is None else f"{r['median_daemon_cpu_s']:.2f}")
                out.append(f"| {job.label} | " + " | ".join(cells) + " |")
            out.append("")
        other = [r for r in rows if r["where"] == where and r["part"] != "fio"]
        if other:
            out.append(f"### saves and restore, {where}: seconds, median of {args.runs} [range]")
            out.append("")
            out.append("| workload | bytes | plain dir | ckptfs | ckptfs / plain | target |")
            out.append("| --- | ---: | ---: | ---: | ---: | ---: |")
            for r in other:
                label = {"torch.save": "torch.save", "dd": "dd bs=1M (no fsync)",
                         "torch.load": "torch.load, page cache dropped"}[r["workload"]]
                verdict = "ok" if r["ratio_ckptfs_over_plain"] <= r["target"] else "over"
                out.append(f"| {label} | {human(r['bytes'])} | {r['plain_median_s']:.2f} "
                           f"[{fmt_range(r['plain_runs_s'])}] | {r['ckptfs_median_s']:.2f} "
                           f"[{fmt_range(r['ckptfs_runs_s'])}] | **{r['ratio_ckptfs_over_plain']:.2f}x** | "
                           f"<= {r['target']} ({verdict}) |")
            out.append("")
    return "\n".join(out)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--where", choices=[*WHERES, "both"], default="both",
                   help="tmpfs: everything on a tmpfs mounted for the run; disk: under --dir (both)")
    p.add_argument("--runs", type=int, default=3, help="repetitions, contenders in rotating order (3)")
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only this part (repeatable; default: fio, save, restore)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"fio contenders, comma-separated, of {', '.join(CONTENDERS)} (all)")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync before each timed run")
    p.add_argument("--no-prime", dest="prime", action="store_false",
                   help="do not write and delete a file of the workload's size before each timed write or load")
    p.add_argument("--fio-size", type=parse_size, default=2 * GIB, help="fio 1-job write and read (2G)")
    p.add_argument("--fio-fallocate", default=FIO_FALLOCATE_DEFAULT,
                   help="fio's --fallocate: default (fio's own: it preallocates), none, native, posix, keep")
    p.add_argument("--fio-jobs", type=int, default=4, help="jobs of the parallel fio write (4)")
    p.add_argument("--fio-job-size", type=parse_size, default=512 * MIB, help="bytes per parallel job (512M)")
    p.add_argument("--save-size", type=parse_size, default=1 * GIB, help="torch.save state dict (1G)")
    p.add_argument("--dd-size", type=parse_size, default=2 * GIB, help="dd bs=1M write (2G)")
    p.add_argument("--restore-size", type=parse_size, default=int(2.44 * GIB), help="checkpoint to load (2.44G)")
    p.add_argument("--tmpfs-size", default="8G", help="size of the tmpfs of --where tmpfs (8G)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent on the disk to measure; the tmpfs is mounted in it too (/tmp)")
    p.add_argument("--passthrough-hp", type=Path, default=DEFAULT_HP, help=f"libfuse's example ({DEFAULT_HP})")
    p.add_argument("--hp-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for passthrough_hp, e.g. --hp-arg=--single (repeatable)")
    p.add_argument("--ckptfs-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every ckptfs mount (repeatable)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results ({DEFAULT_JSON.relative_to(REPO)}); "
                   "the tables go to the same name with .md")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.fio_jobs < 1 or args.fio_size < MIB or args.fio_job_size < MIB or args.dd_size < MIB:
        p.error("fio and dd sizes must be at least 1M, --fio-jobs at least 1")
    args.wheres = list(WHERES) if args.where == "both" else [args.where]
    args.parts = list(dict.fromkeys(args.only)) if args.only else list(PARTS)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = set(args.contenders) - set(CONTENDERS)
    if unknown or not args.contenders:
        p.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(CONTENDERS)}")
    return args


def ckptfs_version() -> dict[str, Any]:
    """The commit the mounts run, and whether ckptfs/ differs from it (the daemon runs the working tree)."""
    def git(*argv: str) -> str:
        result = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=False)
        return result.stdout.strip() if result.returncode == 0 else ""

    return {"commit": git("rev-parse", "--short", "HEAD"), "subject": git("log", "-1", "--format=%s"),
            "ckptfs_dir_modified": bool(git("status", "--porcelain", "--", "ckptfs"))}


def preflight(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise BenchError("run as root (tmpfs mount, drop_caches, FUSE passthrough)")
    if "fio" in args.parts:
        if shutil.which("fio") is None:
            raise BenchError("fio not found: install it with `apt-get install -y fio`")
        if {"hp", "hp-nopt"} & set(args.contenders) and not os.access(args.passthrough_hp, os.X_OK):
            raise BenchError(f"{args.passthrough_hp} not found (libfuse 3.17's example; scripts/install.sh builds "
                             "it), or leave hp,hp-nopt out of --contenders")
    if {"save", "restore"} & set(args.parts):
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            raise BenchError("torch is missing: bash scripts/install.sh bench") from exc
    need = max(args.fio_size, args.fio_jobs * args.fio_job_size, args.dd_size, args.save_size,
               2 * args.restore_size) + 2 * GIB
    if "disk" in args.wheres and (free := shutil.disk_usage(args.dir).free) < need:
        raise BenchError(f"{args.dir} has {human(free)} free, needs about {human(need)}")


def _raise_on_term(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background (ignored)
    try:
        preflight(args)
    except BenchError as exc:
        print(f"passthrough_bench: {exc}", file=sys.stderr)
        return 1
    args.dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    session = Session(args)
    samples: list[Sample] = []
    restore_info: dict[str, Any] = {}
    load: dict[str, list[float]] = {}
    try:
        machine = machine_info(session.work)
        version = ckptfs_version()
        save_state = restore_state = None
        if "save" in args.parts:
            print(f"building a {human(args.save_size)} float32 state dict ...", flush=True)
            save_state = float32_state(args.save_size)
        if "restore" in args.parts:
            print(f"building a {human(args.restore_size)} fp16 GPT-shaped state dict ...", flush=True)
            restore_state = gpt_state(args.restore_size)
        if save_state is not None or restore_state is not None:
            import torch

            torch.save({"warmup": torch.zeros(4)}, io.BytesIO())  # first-call imports stay out of the timings
        for where in args.wheres:
            with session.variant(where) as root:
                for part in args.parts:
                    load[f"{where}/{part}"] = list(os.getloadavg())
                    part_started = time.perf_counter()
                    if part == "fio":
                        bench_fio(session, where, root, samples)
                    elif part == "save":
                        assert save_state is not None
                        bench_save(session, where, root, save_state, samples)
                    else:
                        assert restore_state is not None
                        bench_restore(session, where, root, restore_state, samples, restore_info)
                    print(f"[{where}] {part} took {time.perf_counter() - part_started:.0f}s", flush=True)
        rows = summarize(args, samples)
        text = tables(args, rows)
        duration = time.time() - started
        print()
        print(text)
        print(f"total {duration / 60:.1f} min")
        summary = {
            "benchmark": "passthrough_bench",
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": round(duration, 1),
            "machine": machine,
            "ckptfs": version,
            "settings": {
                "runs": args.runs, "wheres": args.wheres, "parts": args.parts, "contenders": args.contenders,
                "pause_s": args.pause, "prime": args.prime, "fio_size": args.fio_size, "fio_jobs": args.fio_jobs,
                "fio_job_size": args.fio_job_size, "fio_common": list(FIO_COMMON), "save_size": args.save_size,
                "dd_size": args.dd_size, "restore_size": args.restore_size, "tmpfs_size": args.tmpfs_size,
                "scratch_parent": str(args.dir), "ckptfs_args": ["--upload-delay", str(CKPTFS_UPLOAD_DELAY),
                                                                 *CKPTFS_ARGS, *args.ckptfs_arg],
                "passthrough_hp": str(args.passthrough_hp), "hp_args": args.hp_arg,
                "order": "contenders rotate by one place per repetition; sync + pause before every timed run; "
                         "drop_caches before every torch.load; each save's output checked and deleted before "
                         "the next run; unless --no-prime, an untimed write and delete of the workload's size "
                         "(not synced) right before every timed write and load, after the sync and pause",
            },
            "loadavg_at_part_start": load,
            "restore_setup": restore_info,
            "results": rows,
            "samples": [asdict(s) for s in samples],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(args.json)
        md = args.json.with_suffix(".md")
        md.write_text(f"# passthrough_bench, {summary['started_at']}\n\n"
                      f"`python bench/passthrough_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
                      f"({duration / 60:.0f} min; {args.json.name} has every run), ckptfs at {version['commit']} "
                      f"({version['subject']}){', with ckptfs/ modified' if version['ckptfs_dir_modified'] else ''}"
                      f"\n\n{text}\n")
        print(f"\nresults written to {args.json} and {md}")
        return 0
    except BenchError as exc:
        print(f"passthrough_bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("passthrough_bench: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        session.cleanup()


if __name__ == "__main__":
    sys.exit(main())
