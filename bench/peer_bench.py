#!/usr/bin/env python3
"""ckptfs against local disk, rclone and s3fs-fuse on one SeaweedFS S3 server (issue 6).

Systems (each mounts a fresh bucket, with a fresh cache dir, for every workload and run):

  local          a plain directory on the disk of --dir (the physical limit; "durable" = os.sync() returned)
  passthrough_ll libfuse's example daemon mirroring a directory on that disk (bench/passthrough_ll.py: the
                 Debian example built into .build/ on first use): what a FUSE daemon that sends every request
                 to user space costs, the anchor of the small-file target of issue 31; durable as for local
  ckptfs         ckptfs mount s3://BUCKET MNT --endpoint-url ... --cache-dir ... --daemon
  rclone-cached  rclone mount --vfs-cache-mode full --vfs-write-back 1s --transfers 1 (SkyPilot MOUNT_CACHED)
  rclone-cached8 the same with --transfers 8
  rclone-off     rclone mount --vfs-cache-mode off (SkyPilot MOUNT)
  s3fs           s3fs-fuse with use_cache=DIR

Workloads:

  save-1.3b  torch.save of a GPT-shaped fp16 state dict of 1.3B parameters (~2.6 GB)
  save-0.3b  the same with 0.35B parameters (~0.7 GB)
  dcp        torch.distributed.checkpoint.save (FileSystemWriter) of the 1.3B state from 4 processes as
             4 ranks (gloo, one node); each rank holds a quarter of the tensors
  small      2,000 files of 1-64 KiB, each written under a temporary name and renamed into place, then listed
  restore    torch.load of the save-1.3b checkpoint through a fresh mount (new cache dir, new daemon) after
             dropping the page cache; runs right after save-1.3b, on the bucket it wrote

Measured for each (system, workload, run):

  blocking  wall time of the call the training loop waits for (torch.save / dcp.save / the small-file loop /
            torch.load), including close()
  durable   time from the start of the call until every byte is in the bucket, the same definition for every
            system: a listing of the bucket equals exactly the expected keys (the files under the mountpoint,
            relative paths; directory marker keys ending in "/" are ignored) with the expected sizes, and
            every ETag is the same in two consecutive listings (POLL seconds apart). For local disk: until
            os.sync() returns. For ckptfs the time until `ckptfs flush MNT` returns 0 is recorded as well.
  rss       peak RSS (VmHWM) of the FUSE process (ckptfs daemon, rclone, s3fs), read just before unmount
  cpu       CPU seconds (utime+stime, children included) of the FUSE process from mount to the durable
            point, and of the SeaweedFS server over the same span (the object store's share of the work)

Every timed call starts with the disk quiet, after the mount: `sync`, then --pause seconds (for restore:
the page cache dropped, then the pause). The systems take turns in an order that rotates by one place per
run (each system runs its workloads one after the other, restore right after save-1.3b).

Results: bench/results/peer_bench.json (every run), peer_bench.md (medians, ranges, ratios), PNG charts.

Run from the repo's venv (as root, peers installed):  bash scripts/bench-peers.sh [--scale 0.1] [--runs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from passthrough_ll import Anchor, AnchorError, find_anchor, mounted

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
MIB = 1 << 20
GIB = 1 << 30
ACCESS_KEY = SECRET_KEY = "testing"
REGION = "us-east-1"
SYSTEMS = ("local", "passthrough_ll", "ckptfs", "rclone-cached", "rclone-cached8", "rclone-off", "s3fs")
WORKLOADS = ("save-1.3b", "save-0.3b", "dcp", "small", "restore")
POLL = 0.5  # seconds between bucket listings of the durability check
DCP_RANKS = 4


class BenchError(Exception):
    """Something the user has to fix; printed as one `peer_bench: ...` line."""


# -- small helpers -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def venv_bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise BenchError(f"{name} is not installed; run: bash scripts/install.sh test,bench")
    return found


def proc_cpu(pid: int) -> float:
    """utime+stime+cutime+cstime of pid in seconds (children count once they are waited for)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_hwm(pid: int) -> int:
    """Peak resident set size (VmHWM) of pid in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def drop_caches() -> bool:
    """Drop the page cache so a restore reads from the store, not memory. False if not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def human(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def tree(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under root."""
    out: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = path.stat().st_size
    return out


# -- the S3 server -----------------------------------------------------------------------------------------


def client_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION,
               AWS_DEFAULT_REGION=REGION, AWS_EC2_METADATA_DISABLED="true")
    return env


@dataclass
class Weed:
    """`weed mini` on 127.0.0.1 with every port free-picked and telemetry off (shared/emulators.md)."""

    root: Path
    proc: subprocess.Popen[bytes] | None = None
    endpoint: str = ""

    def start(self) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        s3, s3g, m, mg, v, vg, f, fg, a, ag = free_ports(10)
        args = [
            venv_bin("weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            f"-s3.port={s3}", f"-s3.port.grpc={s3g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-master.port={m}", f"-master.port.grpc={mg}", f"-volume.port={v}", f"-volume.port.grpc={vg}",
            f"-filer.port={f}", f"-filer.port.grpc={fg}", f"-admin.port={a}", f"-admin.port.grpc={ag}",
            f"-filer.localSocket={self.root}/filer.sock", f"-s3.localSocket={self.root}/s3.sock",
        ]
        env = client_env()
        env["TMPDIR"] = str(self.root)
        with open(self.root / "weed.log", "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                         start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{s3}"
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"weed exited with {self.proc.returncode}; see {self.root}/weed.log")
            try:
                with socket.create_connection(("127.0.0.1", s3), timeout=1):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"SeaweedFS did not answer on {self.endpoint} within 90 s")
            time.sleep(0.3)

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 10}))

    def new_bucket(self, label: str) -> str:
        name = f"{label}-{secrets.token_hex(4)}"
        client = self.client()
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket=name)
                return name
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def delete_bucket(self, name: str) -> None:
        client = self.client()
        with contextlib.suppress(Exception):
            for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
                for up in page.get("Uploads", []):
                    client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        with contextlib.suppress(Exception):
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)

    def listing(self, bucket: str) -> dict[str, tuple[int, str]]:
        client = self.client()
        out: dict[str, tuple[int, str]] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                if not obj["Key"].endswith("/"):
                    out[obj["Key"]] = (int(obj["Size"]), str(obj.get("ETag", "")))
        return out

    def cpu(self) -> float:
        return proc_cpu(self.proc.pid) if self.proc else math.nan

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


def wait_durable(weed: Weed, bucket: str, expected: dict[str, int], started: float, timeout: float,
                 client_pid: int | None) -> float:
    """Seconds from `started` until the bucket holds exactly `expected` (key -> size) with stable ETags.

    The time recorded is that of the first of the two matching listings: the second one only confirms that
    nothing was still being rewritten."""
    previous: dict[str, tuple[int, str]] | None = None
    first_match = math.nan
    deadline = time.perf_counter() + timeout
    while True:
        now = time.perf_counter()
        listing = weed.listing(bucket)
        sizes = {k: v[0] for k, v in listing.items()}
        if sizes == expected:
            if previous == listing:
                return first_match - started
            if previous is None or math.isnan(first_match):
                first_match = now
            previous = listing
        else:
            previous, first_match = None, math.nan
        if now > deadline:
            missing = sorted(set(expected) - set(sizes))[:3]
            wrong = sorted(k for k in expected if k in sizes and sizes[k] != expected[k])[:3]
            extra = sorted(set(sizes) - set(expected))[:3]
            raise BenchError(f"not durable after {timeout:.0f} s: {len(sizes)}/{len(expected)} keys; "
                             f"missing {missing}, wrong size {wrong}, unexpected {extra}")
        if client_pid is not None and not alive(client_pid):
            raise BenchError("the FUSE process exited before the data was durable")
        time.sleep(POLL)


# -- the systems under test ----------------------------------------------------------------------------------


@dataclass
class Mounted:
    mnt: Path
    pid: int | None  # FUSE process; None for local disk
    cpu0: float = 0.0
    data: Path | None = None  # where the bytes live for a system without a bucket (passthrough_ll's source)


class System:
    name = ""
    s3 = True

    def __init__(self, weed: Weed, work: Path) -> None:
        self.weed = weed
        self.work = work
        self.proc: subprocess.Popen[bytes] | None = None

    def mount(self, bucket: str, tag: str) -> Mounted:
        raise NotImplementedError

    def extra_durable(self, m: Mounted) -> dict[str, float]:
        return {}

    def unmount(self, m: Mounted) -> None:
        if os.path.ismount(m.mnt):
            subprocess.run(["fusermount3", "-u", str(m.mnt)], capture_output=True, check=False)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
            self.proc = None
        if os.path.ismount(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True, check=False)

    def _wait_mounted(self, mnt: Path, log: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.ismount(mnt):
            if self.proc is not None and self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited with {self.proc.returncode}: {tail(log)}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} did not mount within {timeout:.0f} s: {tail(log)}")
            time.sleep(0.1)

    def dirs(self, tag: str) -> tuple[Path, Path]:
        mnt, cache = self.work / f"mnt-{tag}", self.work / f"cache-{tag}"
        shutil.rmtree(cache, ignore_errors=True)
        mnt.mkdir(parents=True, exist_ok=True)
        cache.mkdir(parents=True)
        return mnt, cache


def tail(log: Path, n: int = 400) -> str:
    with contextlib.suppress(OSError):
        return " ".join(log.read_text(errors="replace")[-n:].split())
    return "(no log)"


class Local(System):
    name = "local"
    s3 = False

    def mount(self, bucket: str, tag: str) -> Mounted:
        mnt = self.work / f"local-{tag}"
        shutil.rmtree(mnt, ignore_errors=True)
        mnt.mkdir(parents=True)
        return Mounted(mnt, None)

    def unmount(self, m: Mounted) -> None:
        pass


class Ckptfs(System):
    name = "ckptfs"

    def __init__(self, weed: Weed, work: Path) -> None:
        super().__init__(weed, work)
        self.env = client_env()
        self.env["CKPTFS_RUNTIME_DIR"] = str(work / "ckptfs-run")
        self.log = work / "ckptfs-mount.log"

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ckptfs", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def mount(self, bucket: str, tag: str) -> Mounted:
        mnt, cache = self.dirs(tag)
        result = self.cli("mount", "--no-guard-mountpoint",
                          f"s3://{bucket}", str(mnt), "--endpoint-url", self.weed.endpoint,
                          "--cache-dir", str(cache), "--metrics-addr", "off", "--daemon")
        if result.returncode != 0:
            raise BenchError(f"ckptfs mount failed: {(result.stderr or result.stdout).strip()}")
        status = self.cli("status", str(mnt), "--json")
        if status.returncode != 0:
            raise BenchError(f"ckptfs status failed: {status.stderr.strip()}")
        pid = int(json.loads(status.stdout)["pid"])
        return Mounted(mnt, pid, proc_cpu(pid))

    def flush(self, m: Mounted) -> None:
        result = self.cli("flush", str(m.mnt), "--timeout", "1800", timeout=1900)
        if result.returncode != 0:
            raise BenchError(f"ckptfs flush returned {result.returncode}: {result.stderr.strip()}")

    def unmount(self, m: Mounted) -> None:
        if os.path.ismount(m.mnt):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.cli("umount", str(m.mnt), "--timeout", "300", timeout=360)
        if os.path.ismount(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True, check=False)
        if m.pid is not None:
            deadline = time.monotonic() + 60
            while alive(m.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(m.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGKILL)


class Rclone(System):
    def __init__(self, weed: Weed, work: Path, name: str, flags: list[str]) -> None:
        super().__init__(weed, work)
        self.name = name
        self.flags = flags

    def mount(self, bucket: str, tag: str) -> Mounted:
        mnt, cache = self.dirs(tag)
        env = {k: v for k, v in client_env().items() if k != "AWS_CA_BUNDLE"}  # rclone 1.60 chokes on it
        env.update(RCLONE_CONFIG="/dev/null", RCLONE_CONFIG_PEERS_TYPE="s3", RCLONE_CONFIG_PEERS_PROVIDER="Other",
                   RCLONE_CONFIG_PEERS_ENDPOINT=self.weed.endpoint, RCLONE_CONFIG_PEERS_ACCESS_KEY_ID=ACCESS_KEY,
                   RCLONE_CONFIG_PEERS_SECRET_ACCESS_KEY=SECRET_KEY, RCLONE_CONFIG_PEERS_REGION=REGION,
                   RCLONE_CONFIG_PEERS_FORCE_PATH_STYLE="true")
        log = self.work / f"{self.name}.log"
        args = ["rclone", "mount", f"peers:{bucket}", str(mnt), "--cache-dir", str(cache), *self.flags,
                "--log-level", "NOTICE", "--log-file", str(log)]
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._wait_mounted(mnt, log)
        return Mounted(mnt, self.proc.pid, proc_cpu(self.proc.pid))


RCLONE_CACHED = ["--vfs-cache-mode", "full", "--vfs-write-back", "1s", "--vfs-cache-poll-interval", "10s",
                 "--dir-cache-time", "10s", "--vfs-cache-max-size", "10G", "--vfs-fast-fingerprint"]


class S3fs(System):
    name = "s3fs"

    def mount(self, bucket: str, tag: str) -> Mounted:
        mnt, cache = self.dirs(tag)
        passwd = self.work / "s3fs.passwd"
        passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        passwd.chmod(0o600)
        log = self.work / "s3fs.log"
        args = ["s3fs", bucket, str(mnt), "-f", "-o", f"url={self.weed.endpoint}", "-o", "use_path_request_style",
                "-o", f"endpoint={REGION}", "-o", f"passwd_file={passwd}", "-o", f"use_cache={cache}",
                "-o", "dbglevel=warn"]
        env = {k: v for k, v in client_env().items() if not k.startswith("AWS_")}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_mounted(mnt, log)
        return Mounted(mnt, self.proc.pid, proc_cpu(self.proc.pid))


class PassthroughLL(System):
    """libfuse's passthrough_ll over a directory named after the bucket, so that restore's fresh mount (a new
    daemon) finds what save-1.3b wrote through another."""

    name = "passthrough_ll"
    s3 = False

    def __init__(self, weed: Weed, work: Path, anchor: Anchor) -> None:
        super().__init__(weed, work)
        self.anchor = anchor
        self.held: dict[Path, contextlib.ExitStack] = {}

    def mount(self, bucket: str, tag: str) -> Mounted:
        source, mnt = self.work / f"pll-{bucket}", self.work / f"mnt-{tag}"
        source.mkdir(exist_ok=True)
        mnt.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        pid = stack.enter_context(mounted(self.anchor, source, mnt, self.work / "passthrough_ll.log"))
        self.held[mnt] = stack
        return Mounted(mnt, pid, proc_cpu(pid), data=source)

    def unmount(self, m: Mounted) -> None:
        stack = self.held.pop(m.mnt, None)
        if stack is not None:
            stack.close()


def make_systems(names: list[str], weed: Weed, work: Path, anchor_binary: Path | None) -> list[System]:
    table: dict[str, Callable[[], System]] = {
        "local": lambda: Local(weed, work),
        "passthrough_ll": lambda: PassthroughLL(weed, work, find_anchor(anchor_binary)),
        "ckptfs": lambda: Ckptfs(weed, work),
        "rclone-cached": lambda: Rclone(weed, work, "rclone-cached", [*RCLONE_CACHED, "--transfers", "1"]),
        "rclone-cached8": lambda: Rclone(weed, work, "rclone-cached8", [*RCLONE_CACHED, "--transfers", "8"]),
        "rclone-off": lambda: Rclone(weed, work, "rclone-off", ["--vfs-cache-mode", "off"]),
        "s3fs": lambda: S3fs(weed, work),
    }
    return [table[n]() for n in names]


# -- workloads -----------------------------------------------------------------------------------------------


def gpt_state(params_b: float, scale: float, seed: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """fp16 tensors shaped like a GPT block stack: 1.3B -> d 2048 x 24 layers, 0.35B -> d 1024 x 24 layers,
    vocab 50304 (tied embedding). --scale multiplies the layer count and the vocab. With world > 1 the
    layers are dealt round-robin and rank 0 also holds the embedding: each rank owns distinct keys."""
    import torch

    d = 2048 if params_b > 1 else 1024
    layers = max(1, round(24 * scale))
    vocab = max(64, round(50304 * scale))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def t(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=torch.float32).to(torch.float16)

    state: dict[str, Any] = {}
    if rank == 0:
        state["wte.weight"] = t(vocab, d)
        state["ln_f.weight"] = t(d)
    for i in range(layers):
        if i % world != rank:
            continue
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


def run_small(root: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    blob = os.urandom(64 * 1024)
    d = root / "small"
    d.mkdir()
    for i in range(count):
        size = rng.randint(1024, 64 * 1024)
        tmp = d / f".f{i:05d}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob[:size])
        os.rename(tmp, d / f"f{i:05d}.bin")
    names = os.listdir(d)
    if len(names) != count or any(n.endswith(".tmp") for n in names):
        raise BenchError(f"listing shows {len(names)} entries, expected {count} renamed files")


def run_dcp(root: Path, scale: float, seed: int, timeout: float) -> tuple[float, float]:
    """4 worker processes (gloo on 127.0.0.1) each build their quarter, meet at a barrier, then time
    dcp.save; returns rank 0's time and wall-clock start (dcp.save ends with a collective, so every rank has
    finished). Starting the processes and building the state is not timed."""
    port = free_port()
    out = root.parent / f"dcp-{secrets.token_hex(3)}.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(DCP_RANKS),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(DCP_RANKS):
        args = [sys.executable, __file__, "_dcp_worker", str(root / "dcp"), str(scale), str(seed), str(out)]
        procs.append(subprocess.Popen(args, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    # Return as soon as rank 0 reports (after dcp.save and a barrier), as a trainer would go on training:
    # the workers' teardown is not part of the save and must not delay the durability clock.
    deadline = time.monotonic() + timeout
    while not out.exists() and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    if out.exists():
        time.sleep(0.05)  # rank 0 writes a few bytes; let it finish
        result = json.loads(out.read_text())
        out.unlink()
        REAP.extend(procs)
        return float(result["seconds"]), float(result["start"])
    errors = []
    for rank, p in enumerate(procs):
        try:
            output, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise BenchError(f"DCP rank {rank} did not finish within {timeout:.0f} s") from None
        if p.returncode != 0:
            lines = [ln for ln in output.strip().splitlines() if ln.strip()]
            errors.append(f"rank {rank}: {lines[-1] if lines else p.returncode}")
    raise BenchError("DCP save failed: " + ("; ".join(errors) or "no result from rank 0"))


REAP: list[subprocess.Popen[str]] = []


def reap() -> None:
    """Wait for DCP workers that were left to exit on their own (before the next mount or timing)."""
    while REAP:
        p = REAP.pop()
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


def dcp_worker(path: str, scale: str, seed: str, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=DCP_RANKS)
    state = gpt_state(1.3, float(scale), int(seed), rank, DCP_RANKS)
    dist.barrier()
    start_wall = time.time()
    started = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    seconds = time.perf_counter() - started
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "start": start_wall}))
    dist.destroy_process_group()


# -- the benchmark -------------------------------------------------------------------------------------------


@dataclass
class Sample:
    system: str
    workload: str
    run: int
    ok: bool
    error: str = ""
    bytes: int = 0
    files: int = 0
    blocking_s: float = math.nan
    durable_s: float = math.nan
    flush_s: float = math.nan  # ckptfs only: until `ckptfs flush` returned 0
    rss_bytes: float = math.nan
    cpu_s: float = math.nan
    store_cpu_s: float = math.nan
    dropped_caches: bool | None = None


@dataclass
class Bench:
    args: argparse.Namespace
    weed: Weed
    work: Path
    states: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)

    def log(self, s: Sample) -> None:
        self.samples.append(s)
        if s.ok:
            extra = f" flush {s.flush_s:6.2f}s" if not math.isnan(s.flush_s) else ""
            print(f"  {s.system:<15} {s.workload:<10} run {s.run}: blocking {s.blocking_s:7.2f}s  durable "
                  f"{s.durable_s:7.2f}s{extra}  rss {human(s.rss_bytes) if s.rss_bytes == s.rss_bytes else '-'}"
                  f"  cpu {s.cpu_s:6.1f}s  store cpu {s.store_cpu_s:6.1f}s", flush=True)
        else:
            print(f"  {s.system:<15} {s.workload:<10} run {s.run}: FAILED: {s.error}", flush=True)
        self.save_json()

    def save_json(self) -> None:
        if not self.machine:
            self.machine = machine_info(self.work)
        data = {"args": {k: v for k, v in vars(self.args).items() if k != "func"}, "machine": self.machine,
                "samples": [asdict(s) for s in self.samples]}
        Path(self.args.json).write_text(json.dumps(data, indent=1, default=str))

    def measure(self, system: System, workload: str, run: int, bucket: str,
                call: Callable[[Path], tuple[float, float] | None], nbytes: int) -> tuple[Sample, Mounted | None]:
        """Mount, sync, time `call(mnt)`, wait until durable, read the FUSE process's counters, unmount."""
        s = Sample(system.name, workload, run, ok=False, bytes=nbytes)
        m: Mounted | None = None
        try:
            m = system.mount(bucket, f"{workload}-{run}")
            os.sync()
            time.sleep(self.args.pause)
            store0 = self.weed.cpu()
            started = time.perf_counter()
            inner = call(m.mnt)
            s.blocking_s = time.perf_counter() - started
            if inner is not None:  # (seconds, wall-clock start) measured inside the call, e.g. by DCP rank 0
                s.blocking_s = inner[0]
                started = time.perf_counter() - (time.time() - inner[1])
            expected = tree(m.mnt)
            s.files = len(expected)
            if not system.s3:
                os.sync()
                s.durable_s = time.perf_counter() - started
            else:
                flusher = None
                if isinstance(system, Ckptfs):
                    flusher = subprocess.Popen([sys.executable, "-m", "ckptfs", "flush", str(m.mnt), "--timeout",
                                                str(self.args.durable_timeout)], env=system.env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                s.durable_s = wait_durable(self.weed, bucket, expected, started, self.args.durable_timeout, m.pid)
                if flusher is not None:
                    _, err = flusher.communicate(timeout=self.args.durable_timeout)
                    s.flush_s = time.perf_counter() - started
                    if flusher.returncode != 0:
                        raise BenchError(f"ckptfs flush returned {flusher.returncode}: {err.strip()}")
            s.store_cpu_s = self.weed.cpu() - store0
            if m.pid is not None:
                s.rss_bytes = proc_hwm(m.pid)
                s.cpu_s = proc_cpu(m.pid) - m.cpu0
            s.ok = True
        except Exception as exc:  # a peer failing a workload is a result, not a crash
            s.error = f"{type(exc).__name__}: {exc}"[:500]
            if self.args.verbose:
                traceback.print_exc()
        finally:
            reap()
            if m is not None:
                system.unmount(m)
        return s, m

    def run_all(self, systems: list[System], workloads: list[str]) -> None:
        import torch

        scale = self.args.scale
        for run in range(1, self.args.runs + 1):
            k = (run - 1) % len(systems)  # each system takes each place in turn
            for system in systems[k:] + systems[:k]:
                print(f"run {run}/{self.args.runs} {system.name}", flush=True)
                big_bucket = ""
                big_src: Path | None = None
                big_data: Path | None = None
                for w in workloads:
                    if w == "restore":
                        continue
                    bucket = self.weed.new_bucket(f"{w.replace('.', '')}-{run}")
                    keep = False
                    if w in ("save-1.3b", "save-0.3b"):
                        state = self.states[w]
                        nbytes = state_bytes(state)

                        def call(mnt: Path, state: Any = state) -> None:
                            torch.save(state, str(mnt / "model.pt"))

                        s, m = self.measure(system, w, run, bucket, call, nbytes)
                        if w == "save-1.3b" and "restore" in workloads:
                            keep = True
                            big_bucket = bucket
                            big_src = m.mnt if m is not None else None
                            big_data = m.data if m is not None else None
                    elif w == "dcp":
                        nbytes = self.dcp_bytes

                        def call_dcp(mnt: Path) -> tuple[float, float]:
                            return run_dcp(mnt, scale, self.args.seed, self.args.durable_timeout)

                        s, _ = self.measure(system, w, run, bucket, call_dcp, nbytes)
                    else:
                        files = max(10, round(2000 * min(1.0, scale * 10)))

                        def call_small(mnt: Path, files: int = files, seed: int = self.args.seed + run) -> None:
                            run_small(mnt, files, seed)

                        s, _ = self.measure(system, w, run, bucket, call_small, 0)
                    self.log(s)
                    if not keep:
                        self.weed.delete_bucket(bucket)
                        self.cleanup(big_src, big_data)
                if "restore" in workloads:
                    self.restore(system, run, big_bucket, big_src)
                    if big_bucket:
                        self.weed.delete_bucket(big_bucket)
                    self.cleanup()

    def restore(self, system: System, run: int, bucket: str, src: Path | None) -> None:
        import torch

        prev = next((x for x in reversed(self.samples) if x.system == system.name and x.workload == "save-1.3b"
                     and x.run == run), None)
        if prev is None or not prev.ok or not bucket:
            self.log(Sample(system.name, "restore", run, ok=False,
                            error="no checkpoint to restore: save-1.3b " + (prev.error if prev else "did not run")))
            return
        s = Sample(system.name, "restore", run, ok=False, bytes=prev.bytes, files=1)
        m: Mounted | None = None
        try:
            if isinstance(system, Local):
                assert src is not None
                m = Mounted(src, None)
            else:
                m = system.mount(bucket, f"restore-{run}")
            s.dropped_caches = drop_caches()
            time.sleep(self.args.pause)
            store0 = self.weed.cpu()
            started = time.perf_counter()
            loaded = torch.load(str(m.mnt / "model.pt"), map_location="cpu", weights_only=True)
            s.blocking_s = time.perf_counter() - started
            got = state_bytes(loaded)
            del loaded
            if got != prev.bytes:
                raise BenchError(f"loaded {got} bytes of tensors, saved {prev.bytes}")
            s.store_cpu_s = self.weed.cpu() - store0
            if m.pid is not None:
                s.rss_bytes = proc_hwm(m.pid)
                s.cpu_s = proc_cpu(m.pid) - m.cpu0
            s.ok = True
        except Exception as exc:
            s.error = f"{type(exc).__name__}: {exc}"[:500]
            if self.args.verbose:
                traceback.print_exc()
        finally:
            if m is not None and not isinstance(system, Local):
                system.unmount(m)
        self.log(s)

    def cleanup(self, *keep: Path | None) -> None:
        """Remove mountpoints, cache dirs and local copies but `keep` (keeps the scratch disk small)."""
        for p in self.work.iterdir():
            if p in keep:
                continue
            if p.name.startswith(("cache-", "local-", "pll-")) or (
                    p.name.startswith("mnt-") and not os.path.ismount(p)):
                shutil.rmtree(p, ignore_errors=True)

    @property
    def dcp_bytes(self) -> int:
        return state_bytes(self.states["save-1.3b"]) if "save-1.3b" in self.states else 0


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
        info["disk"] = " ".join(found.stdout.split()[:2])
    versions = {}
    for cmd in (["rclone", "version"], ["s3fs", "--version"], [venv_bin("weed"), "version"]):
        with contextlib.suppress(Exception):
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False).stdout
            versions[Path(cmd[0]).name] = text.strip().splitlines()[0]
    with contextlib.suppress(Exception):
        import torch

        import ckptfs

        versions["torch"] = torch.__version__
        versions["ckptfs"] = getattr(ckptfs, "__version__", "?")
    info["versions"] = versions
    return info


# -- profile (issue item 5) ----------------------------------------------------------------------------------


def profile_ckptfs(bench: Bench, out_dir: Path) -> dict[str, Any]:
    """One extra ckptfs save-1.3b with py-spy attached to the daemon from mount until flush returns."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    system = Ckptfs(bench.weed, bench.work)
    bucket = bench.weed.new_bucket("profile")
    m = system.mount(bucket, "profile")
    raw = out_dir / "peer_bench_ckptfs_profile.txt"
    spy = subprocess.Popen([venv_bin("py-spy"), "record", "-p", str(m.pid), "-o", str(raw), "--format", "raw",
                            "--nonblocking", "--threads", "--idle", "-r", "100"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    try:
        started = time.perf_counter()
        torch.save(bench.states["save-1.3b"], str(m.mnt / "model.pt"))
        save_s = time.perf_counter() - started
        system.flush(m)
        durable_s = time.perf_counter() - started
    finally:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=120)
        system.unmount(m)
        bench.weed.delete_bucket(bucket)
    if not raw.exists():
        raise BenchError(f"py-spy wrote no profile: {err.strip()[-300:]}")
    summary = summarize_profile(raw)
    summary.update(save_s=round(save_s, 2), durable_s=round(durable_s, 2))
    (out_dir / "peer_bench_ckptfs_profile.json").write_text(json.dumps(summary, indent=1))
    return summary


def summarize_profile(raw: Path, top: int = 25) -> dict[str, Any]:
    """Busy samples (not waiting in epoll, a lock or a condition) by thread and by leaf frame."""
    idle_words = ("epoll_wait", "get_events", "_thread_cache.py", "threading.py (wait", "wait (threading",
                  "pthread_cond", "futex", "sem_wait", "select (", "_wait_for_tstate_lock", "poll (",
                  "acquire (")
    threads: Counter[str] = Counter()
    busy_threads: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    frames_incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = frames[0]
        threads[thread] += count
        total += count
        leaf = frames[-1]
        if any(w in leaf for w in idle_words):
            continue
        busy_threads[thread] += count
        leaves[leaf] += count
        for f in set(frames[1:]):
            frames_incl[f] += count
    busy = max(sum(busy_threads.values()), 1)
    return {
        "samples": total,
        "threads": len(threads),
        "busy_samples": sum(busy_threads.values()),
        "busy_by_thread": [(k, v) for k, v in busy_threads.most_common(12)],
        "busy_top_leaf_frames": [(k, round(v / busy, 4)) for k, v in leaves.most_common(top)],
        "busy_top_inclusive_frames": [(k, round(v / busy, 4)) for k, v in frames_incl.most_common(top)],
    }


# -- report ----------------------------------------------------------------------------------------------------


def fmt_s(v: float) -> str:
    return "-" if v != v else (f"{v:.2f} s" if v < 100 else f"{v:.0f} s")


def summarize(samples: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["system"], s["workload"]), []).append(s)
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key, rows in groups.items():
        ok = [r for r in rows if r["ok"]]
        entry: dict[str, Any] = {"runs": len(rows), "ok": len(ok),
                                 "errors": sorted({r["error"] for r in rows if not r["ok"]})}
        for metric in ("blocking_s", "durable_s", "flush_s", "rss_bytes", "cpu_s", "store_cpu_s"):
            vals = [float(r[metric]) for r in ok if r[metric] is not None and r[metric] == r[metric]]
            entry[metric] = (statistics.median(vals), min(vals), max(vals)) if vals else None
        entry["bytes"] = max((r["bytes"] for r in rows), default=0)
        entry["files"] = max((r["files"] for r in rows), default=0)
        out[key] = entry
    return out


def markdown(data: dict[str, Any]) -> str:
    summary = summarize(data["samples"])
    systems = [s for s in SYSTEMS if any(k[0] == s for k in summary)]
    workloads = [w for w in WORKLOADS if any(k[1] == w for k in summary)]
    lines = []
    m = data["machine"]
    a = data["args"]
    lines.append(f"Runs per cell: {a['runs']} (median, [min-max]); scale {a['scale']}. Machine: {m.get('nproc')} "
                 f"vCPU ({m.get('cpu', '?')}), {m.get('ram_gib')} GiB RAM, kernel {m.get('kernel')}, disk "
                 f"{m.get('disk', '?')}; " + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items()) + ".")
    lines.append("")

    def cell(e: dict[str, Any] | None, metric: str, unit: Callable[[float], str] = fmt_s) -> str:
        if e is None:
            return "not run"
        if e["ok"] == 0:
            return "**failed**"
        v = e[metric]
        if v is None:
            return "-"
        text = unit(v[0])
        if e["ok"] > 1:
            text += f" [{unit(v[1]).split()[0]}-{unit(v[2])}]"
        if e["ok"] < e["runs"]:
            text += f" ({e['runs'] - e['ok']}/{e['runs']} failed)"
        return text

    for w in workloads:
        any_e = next(e for k, e in summary.items() if k[1] == w)
        size = human(any_e["bytes"]) if any_e["bytes"] else f"{any_e['files']} files"
        lines.append(f"### {w} ({size})")
        lines.append("")
        lines.append("| system | blocking | durable in bucket | blocking / local | durable / local | durable / ckptfs "
                     "| peak RSS | CPU s (FUSE) | CPU s (S3 server) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        local = summary.get(("local", w))
        ck = summary.get(("ckptfs", w))

        def ratio(e: dict[str, Any], base: dict[str, Any] | None, metric: str) -> str:
            if not e["ok"] or base is None or not base["ok"] or e[metric] is None or base[metric] is None:
                return "-"
            return f"{e[metric][0] / base[metric][0]:.2f}x"

        for sname in systems:
            e = summary.get((sname, w))
            if e is None:
                continue
            rss = cell(e, "rss_bytes", lambda v: human(v))
            lines.append(f"| {sname} | {cell(e, 'blocking_s')} | {cell(e, 'durable_s')} | "
                         f"{ratio(e, local, 'blocking_s')} | {ratio(e, local, 'durable_s')} | "
                         f"{ratio(e, ck, 'blocking_s' if w == 'restore' else 'durable_s')} | "
                         f"{rss if sname != 'local' else '-'} | "
                         f"{cell(e, 'cpu_s') if sname != 'local' else '-'} | "
                         f"{cell(e, 'store_cpu_s') if sname != 'local' else '-'} |")
        if w == "restore":
            lines.append("")
            lines.append("restore: torch.load through a fresh mount (new cache dir, new process) after dropping the "
                         "page cache; the `durable / ckptfs` column compares load times here.")
        if ck and ck.get("flush_s"):
            lines.append("")
            lines.append(f"ckptfs: `ckptfs flush` returned 0 after {fmt_s(ck['flush_s'][0])} (median, from the start "
                         "of the call; includes a CLI start-up of ~0.3 s).")
        anchor = summary.get(("passthrough_ll", w))
        if ck and anchor and ck["ok"] and anchor["ok"] and ck["blocking_s"] and anchor["blocking_s"]:
            lines.append("")
            lines.append(f"ckptfs / passthrough_ll (libfuse's example daemon, the FUSE anchor): blocking "
                         f"{ck['blocking_s'][0] / anchor['blocking_s'][0]:.2f}x")
        fails = [(s, e) for s in systems if (e := summary.get((s, w))) and e["errors"]]
        for sname, e in fails:
            lines.append("")
            lines.append(f"- **{sname} failed** {e['runs'] - e['ok']}/{e['runs']}: " + "; ".join(
                f"`{err}`" for err in e["errors"]))
        lines.append("")
    # Pairwise durable ratios for the headline workload.
    for w in ("save-1.3b",):
        if w not in workloads:
            continue
        ok = [s for s in systems if (e := summary.get((s, w))) and e["ok"]]
        if len(ok) < 2:
            continue
        lines.append(f"### {w}: time to durable, row / column")
        lines.append("")
        lines.append("| | " + " | ".join(ok) + " |")
        lines.append("|---" * (len(ok) + 1) + "|")
        for r in ok:
            rv = summary[(r, w)]["durable_s"][0]
            lines.append(f"| {r} | " + " | ".join(f"{rv / summary[(c, w)]['durable_s'][0]:.2f}" for c in ok) + " |")
        lines.append("")
    return "\n".join(lines)


def charts(data: dict[str, Any], out_prefix: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(data["samples"])
    systems = [s for s in SYSTEMS if any(k[0] == s for k in summary)]
    workloads = [w for w in WORKLOADS if any(k[1] == w for k in summary)]
    paths = []
    for metric, title in (("blocking_s", "Blocking time (the save/load call)"),
                          ("durable_s", "Time until every byte is in the bucket")):
        ws = [w for w in workloads if not (metric == "durable_s" and w == "restore")]
        fig, axes = plt.subplots(1, len(ws), figsize=(3.2 * len(ws) + 1, 4), squeeze=False)
        for ax, w in zip(axes[0], ws, strict=True):
            names, meds, lo, hi, colors, labels = [], [], [], [], [], []
            for s in systems:
                e = summary.get((s, w))
                if e is None:
                    continue
                names.append(s)
                if e["ok"] and e[metric] is not None:
                    med, mn, mx = e[metric]
                    meds.append(med)
                    lo.append(med - mn)
                    hi.append(mx - med)
                    colors.append("#d62728" if s == "ckptfs" else ("#7f7f7f" if s == "local" else "#1f77b4"))
                    labels.append(f"{med:.1f}")
                else:
                    meds.append(0)
                    lo.append(0)
                    hi.append(0)
                    colors.append("#ffffff")
                    labels.append("failed")
            y = range(len(names))
            ax.barh(list(y), meds, xerr=[lo, hi], color=colors, edgecolor="black", linewidth=0.5)
            ax.set_yticks(list(y), names, fontsize=8)
            ax.invert_yaxis()
            ax.set_title(w, fontsize=9)
            ax.set_xlabel("seconds", fontsize=8)
            ends = [v + h for v, h in zip(meds, hi, strict=True)]
            top = max(ends) if ends and max(ends) > 0 else 1
            for yi, (end, lab) in enumerate(zip(ends, labels, strict=True)):
                ax.text(end + top * 0.03, yi, lab, va="center", fontsize=7)  # right of the range bar
            ax.set_xlim(0, top * 1.3)
            ax.tick_params(axis="x", labelsize=7)
        fig.suptitle(f"{title}; median of {data['args']['runs']}, bars = range", fontsize=10)
        fig.tight_layout()
        path = out_prefix.with_name(f"{out_prefix.name}_{metric.removesuffix('_s')}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def report(json_path: Path) -> None:
    data = json.loads(json_path.read_text())
    md = markdown(data)
    md_path = json_path.with_suffix(".md")
    md_path.write_text(md + "\n")
    print(md)
    try:
        paths = charts(data, json_path.with_suffix(""))
    except ImportError:  # the table is the result; the charts need the bench extra
        print(f"wrote {md_path}; no charts: matplotlib is not installed (pip install -e '.[bench]')")
        return
    print(f"wrote {md_path}, " + ", ".join(str(p) for p in paths))


# -- main ------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per system and workload (default 3)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="model size factor: 1 = 2.6 GB and 0.7 GB checkpoints; 0.1 for a quick try")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list from {','.join(SYSTEMS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list from {','.join(WORKLOADS)}")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="scratch parent (the local-disk baseline, caches and SeaweedFS data go here)")
    p.add_argument("--json", type=Path, default=RESULTS / "peer_bench.json")
    p.add_argument("--durable-timeout", type=float, default=1800)
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync before each timed call")
    p.add_argument("--passthrough-ll", type=Path, metavar="PATH",
                   help="a passthrough_ll binary (default: the Debian example, built into .build/passthrough_ll)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="also run one ckptfs save-1.3b under py-spy and write the profile summary to DIR")
    p.add_argument("--report-only", action="store_true", help="rebuild the table and charts from --json")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed workloads")
    args = p.parse_args(argv)
    if args.runs < 1 or args.scale <= 0:
        p.error("--runs must be >= 1 and --scale > 0")
    for name, allowed in (("systems", SYSTEMS), ("workloads", WORKLOADS)):
        items = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"--{name}: unknown {bad or 'empty list'}; choose from {','.join(allowed)}")
        setattr(args, name, items)
    if "restore" in args.workloads and "save-1.3b" not in args.workloads:
        p.error("--workloads: restore loads the save-1.3b checkpoint; add save-1.3b")
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["_dcp_worker"]:
        dcp_worker(*argv[1:5])
        return 0
    args = parse_args(argv)
    if args.report_only:
        report(args.json)
        return 0
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        raise BenchError("needs root or access to /dev/fuse")
    for tool, system in (("rclone", "rclone"), ("s3fs", "s3fs")):
        if any(s.startswith(system) for s in args.systems) and not shutil.which(tool):
            raise BenchError(f"{tool} is not installed; run: apt-get install -y rclone s3fs "
                             "(or scripts/bench-peers.sh), or leave it out with --systems")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ckptfs-peer-bench.", dir=args.dir))
    weed = Weed(work / "weed")
    weed.root.mkdir()
    interrupted = False

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    bench = Bench(args, weed, work)
    try:
        weed.start()
        print(f"SeaweedFS S3 on {weed.endpoint}; scratch {work}", flush=True)
        for w in ("save-1.3b", "save-0.3b"):
            if w in args.workloads or (w == "save-1.3b" and ("dcp" in args.workloads or args.profile)):
                bench.states[w] = gpt_state(1.3 if w == "save-1.3b" else 0.35, args.scale, args.seed)
                print(f"{w}: {len(bench.states[w])} tensors, {human(state_bytes(bench.states[w]))}", flush=True)
        systems = make_systems(args.systems, weed, work, args.passthrough_ll)
        for anchored in systems:
            if isinstance(anchored, PassthroughLL):
                print(f"anchor: {anchored.anchor.origin}", flush=True)
        started = time.monotonic()
        bench.run_all(systems, args.workloads)
        print(f"all runs took {time.monotonic() - started:.0f} s", flush=True)
        if args.profile:
            summary = profile_ckptfs(bench, args.profile)
            print(json.dumps(summary, indent=1))
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        for p in work.iterdir():
            if p.name.startswith("mnt-") and os.path.ismount(p):
                subprocess.run(["fusermount3", "-u", "-z", str(p)], capture_output=True, check=False)
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    if bench.samples:
        report(args.json)
    return 130 if interrupted else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (BenchError, AnchorError) as exc:
        print(f"peer_bench: {exc}", file=sys.stderr)
        sys.exit(1)
