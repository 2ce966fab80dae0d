"""Shared fixtures. FUSE tests run the real daemon in a subprocess (one mount per process, like pyfuse3
wants) against a file:// store in the test's tmp dir, and fail if the daemon logged an unexpected
WARNING or ERROR."""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import json
import os
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from ckptfs.cli.launch import _with_malloc_pad
from ckptfs.control import client
from ckptfs.control.client import canonical_mountpoint
from ckptfs.errors import CkptfsError
from ckptfs.mount import guard

REPO = Path(__file__).resolve().parent.parent


def ckptfs_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    if args[:1] == ("mount",) and "--metrics-addr" not in args:
        # Many mounts run at once in the tests: none takes the default metrics port (two test_cli mounts on
        # two workers failed with "Address already in use" so), as Mount.metrics_args.
        args = (*args, "--metrics-addr", "off")
    return subprocess.run(
        [sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True, env=env, timeout=timeout,
    )


# Mount.flush/status/umount call the Python API (control/client.py) in this process instead of starting the CLI for
# each: `ckptfs flush` is that same call behind argv parsing, and a Python start-up of the CLI is about 0.2
# CPU-seconds, a few hundred CPU-seconds in all over the suite. Each mount has a runtime dir of its own, where
# client.runtime_dir() reads the environment: the mount's dir is given to the call through this context
# variable (per thread), else the environment's as before. test_cli runs the CLI itself.
_runtime_of_call: contextvars.ContextVar[Path | None] = contextvars.ContextVar("runtime_of_call", default=None)
_environment_runtime_dir = client.runtime_dir


def _runtime_dir() -> Path:
    return _runtime_of_call.get() or _environment_runtime_dir()


client.runtime_dir = _runtime_dir


def fuse_requests(port: int) -> dict[str, float]:
    """A daemon's FUSE request counts by operation (ckptfs_fuse_requests_total), as its metrics endpoint
    `port` serves them now (they are published every METRICS_INTERVAL)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    counts = {}
    for line in text.splitlines():
        if line.startswith('ckptfs_fuse_requests_total{op="'):
            name, value = line.rsplit(" ", 1)
            counts[name.split('"')[1]] = float(value)
    return counts


def live_files(root: Path, *, skip_temps: bool = True) -> list[Path]:
    """Every file below `root`, walked while a daemon changes it: the store's staging directory comes and goes
    with every upload, and a notes directory with its last note (Path.rglob failed when a directory went
    between the listing of its parent and its own), so what vanishes while it is walked is skipped.
    `skip_temps`: no entry named .ckptfs-tmp.* (the store's temp files, staging and notes)."""
    found = []
    for top, dirnames, filenames in os.walk(root):
        if skip_temps:
            dirnames[:] = [d for d in dirnames if ".ckptfs-tmp." not in d]
        for name in filenames:
            path = Path(top, name)
            if (skip_temps and ".ckptfs-tmp." in name) or path.is_symlink():
                continue
            found.append(path)
    return found


def file_store_objects(root: Path) -> dict[str, bytes]:
    """Every object of a file:// store at `root` (no temp entries), by key, read while the store is live
    (live_files): an object that vanishes before it is read is skipped."""
    out = {}
    for path in live_files(root):
        with contextlib.suppress(FileNotFoundError):
            out[str(path.relative_to(root))] = path.read_bytes()
    return dict(sorted(out.items()))


class Mount:
    """A ckptfs daemon serving `store` on `mnt`, run in the foreground as a child process."""

    def __init__(
        self, root: Path, *, upload_delay: float = 0.1, extra_args: tuple[str, ...] = (), source: str | None = None,
        restarts_for_malloc_pad: bool = False,
    ) -> None:
        self.root = root
        self.store = root / "store"
        self.mnt = root / "mnt"
        self.cache = root / "cache"
        self.log = root / "daemon.log"
        self.runtime = root / "run"
        self.upload_delay = upload_delay
        self.extra_args = extra_args
        # Under the stock pyfuse3 (the second venv of scripts/test.sh) keep_mount is off, said by a WARNING.
        self.allowed_log_words: list[str] = ["keep_mount off: this pyfuse3 is the stock build"]
        self._source = source
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(self.runtime))
        if not restarts_for_malloc_pad:
            # The daemon runs with glibc's malloc pad either way: given it in its environment, it does not start
            # Python a second time to set it (cmd_mount's restart, a quarter of a CPU-second per mount). A test
            # of that restart, or of what a supervisor sees across it, passes restarts_for_malloc_pad=True.
            self.env = dict(_with_malloc_pad(self.env))
        self.store.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)

    @property
    def source(self) -> str:
        return self._source or f"file://{self.store}"

    def start(self, timeout: float = 60) -> None:
        read_fd, write_fd = os.pipe()
        env = dict(self.env, CKPTFS_READY_FD=str(write_fd))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptfs", "mount", self.source, str(self.mnt), "--cache-dir", str(self.cache),
                 "--upload-delay", str(self.upload_delay), "--log-level", "DEBUG", *self.metrics_args(),
                 *self.min_free_args(), *self.extra_args],
                stdout=log, stderr=log, pass_fds=(write_fd,), env=env,
            )
        os.close(write_fd)
        deadline = time.monotonic() + timeout
        with os.fdopen(read_fd, "rb") as ready:
            message = ready.read().decode().strip()
        if message != "ready":
            self.proc.wait(timeout=max(1, deadline - time.monotonic()))
            raise RuntimeError(f"daemon did not start: {message!r}\n{self.log.read_text()}")

    def min_free_args(self) -> tuple[str, ...]:
        # The test machine's disk is shared: whether others left 5% of it free must not change what a
        # test sees (below min_free, files being written spill), unless the test asks for that.
        return () if "--min-free" in self.extra_args else ("--min-free", "0")

    def metrics_args(self) -> tuple[str, ...]:
        # Many mounts run at once in the tests: none takes the default metrics port unless asked to.
        return () if "--metrics-addr" in self.extra_args else ("--metrics-addr", "off")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return ckptfs_cli(*args, env=self.env, timeout=timeout)

    def flush(self, *paths: str, timeout: float = 60) -> None:
        """`ckptfs flush MNT PATHS --timeout T`, in this process."""
        token = _runtime_of_call.set(Path(self.env["CKPTFS_RUNTIME_DIR"]))
        try:
            client.wait_durable(self.mnt, paths, timeout=timeout)
        finally:
            _runtime_of_call.reset(token)

    def status(self) -> dict:  # type: ignore[type-arg]
        """What `ckptfs status --json` prints, in this process."""
        token = _runtime_of_call.set(Path(self.env["CKPTFS_RUNTIME_DIR"]))
        try:
            return {"ok": True, **client.status(self.mnt)}
        finally:
            _runtime_of_call.reset(token)

    def umount(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`ckptfs umount MNT` in this process, its exit code and output as the CLI's. `timeout` bounds the
        wait for the daemon's exit."""
        token = _runtime_of_call.set(Path(self.env["CKPTFS_RUNTIME_DIR"]))
        args = ["ckptfs", "umount", str(self.mnt)]
        try:
            client.unmount(self.mnt)
            result = subprocess.CompletedProcess(
                args, 0, f"ckptfs: {canonical_mountpoint(self.mnt)} drained and unmounted\n", "")
        except CkptfsError as exc:
            result = subprocess.CompletedProcess(args, exc.exit_code, "", f"ckptfs: {exc}\n")
        finally:
            _runtime_of_call.reset(token)
        assert self.proc is not None
        if result.returncode != 0:
            # Nothing told the daemon to exit (no control socket answered, or the call failed): unless it is
            # exiting anyway, it stays; cleanup() stops it with SIGTERM instead of waiting `timeout` for it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
            if self.proc.poll() is None:
                return result
        self.proc.wait(timeout=timeout)
        self.proc = None
        return result

    def holder_socket(self) -> Path:
        """Where the holder of this mount's FUSE connection listens (holder.holder_path, in this runtime dir)."""
        digest = hashlib.sha256(str(canonical_mountpoint(self.mnt)).encode()).hexdigest()[:16]
        return self.runtime / f"{digest}.hold"

    def holder_pid(self) -> int | None:
        """The pid of the process that keeps this mount's FUSE connection (keep_mount), if there is one: the
        peer of its socket (connecting without a request asks nothing of it)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.holder_socket()))
            pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return pid
        except OSError:
            return None
        finally:
            sock.close()

    def kill_holder(self) -> None:
        pid = self.holder_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self.holder_pid() == pid and time.monotonic() < deadline:
                time.sleep(0.02)

    def kill9(self) -> None:
        """The daemon dies and its mount with it (its holder first, so no daemon takes the mount over). It is
        stopped (SIGSTOP) before anything else: what it had done at the call is what it did, however long the
        holder takes to go (before, an upload went on and could finish while the holder was killed)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.kill_holder()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None
        subprocess.run(["fusermount3", "-u", "-z", "-q", str(self.mnt)], check=False)

    def store_files(self) -> dict[str, bytes]:
        """Every regular file in the store (no temp files), by relative path."""
        return file_store_objects(self.store)

    def unexpected_log_lines(self) -> list[str]:
        if not self.log.exists():
            return []
        bad = []
        for line in self.log.read_text(errors="replace").splitlines():
            if (" WARNING " in line or " ERROR " in line or "Traceback" in line) and not any(
                word in line for word in self.allowed_log_words
            ):
                bad.append(line)
        return bad

    def cleanup(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.umount(timeout=60)
        if self.proc is not None:
            self.proc.terminate()  # the daemon's own shutdown: drain what it can, unmount
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.holder_pid() is not None:  # a daemon its holder started serves the mount
            with contextlib.suppress(Exception):
                self.cli("umount", str(self.mnt), timeout=60)
            self.kill_holder()
        guard.remove(self.mnt)  # the daemon guards the mountpoint after a clean unmount
        subprocess.run(["fusermount3", "-u", "-z", "-q", str(self.mnt)], check=False)


def finished_parts(journal: Path) -> int:
    """The most parts any staged upload in this journal has finished (0 before the first is recorded)."""
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT upload_state FROM inodes WHERE upload_state IS NOT NULL").fetchall()
    except sqlite3.OperationalError:
        return 0
    finally:
        db.close()
    return max((len(json.loads(text)["parts"]) for (text,) in rows), default=0)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "serial: runs with no other test beside it when the suite runs in parallel (pytest-xdist): "
        "it asserts a time bound, which the load of other tests would make it miss")
    config.addinivalue_line(
        "markers", "core: a core mount test (mount, save, rename, flush, kill -9 and resume, fresh node, a user who"
        " is not root) that scripts/test.sh runs a second time in .venv-stock, with the stock pyfuse3 of PyPI")


def stock_pyfuse3() -> bool:
    """This venv's pyfuse3 is the stock build (no passthrough, no keep_mount): scripts/test.sh's second pass."""
    import pyfuse3

    return not getattr(pyfuse3, "PASSTHROUGH_BUILD", False)


def _expected_seconds() -> dict[str, float]:
    expected = {}
    for line in (Path(__file__).parent / "durations.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, nodeid = line.split(maxsplit=1)
            expected[nodeid] = float(seconds)
    return expected


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the longest tests (tests/durations.txt) first on every worker. xdist's worksteal
    hands each worker a contiguous share of the collection and later moves tests from the longest queue (by
    count) to an idle worker: a long test late in a share kept its worker busy minutes after the others were
    done. So each share starts with its part of the long tests (longest first, each to the share with the
    least expected time so far), then quick ones in their usual order; the stealing evens out the quick ones.
    Every worker computes the same order (xdist checks that they collected the same)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or len(items) < workers:
        return
    expected = _expected_seconds()
    long_tests = sorted((item for item in items if item.nodeid in expected), key=lambda i: -expected[i.nodeid])
    quick = iter([item for item in items if item.nodeid not in expected])
    sizes = []  # the shares as worksteal deals them out: each idle worker len(pending) // workers left
    left = len(items)
    for worker in range(workers):
        sizes.append(left // (workers - worker))
        left -= sizes[-1]
    shares: list[list[pytest.Item]] = [[] for _ in sizes]
    loads = [0.0] * workers
    for item in long_tests:
        share = min((w for w in range(workers) if len(shares[w]) < sizes[w]), key=lambda w: loads[w])
        shares[share].append(item)
        loads[share] += expected[item.nodeid]
    for share, size in zip(shares, sizes, strict=True):
        share.extend(next(quick) for _ in range(size - len(share)))
    items[:] = [item for share in shares for item in share]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Under pytest-xdist (scripts/test.sh), a test marked serial runs alone: it waits until the tests running
    on the other workers are done, and they wait for it before their next test. Two flock()ed files in the
    run's shared temp dir: every test holds `run` shared, a serial one exclusive; `gate` lets a waiting serial
    test in before tests that come after it (else the workers' shared holds could keep it out for good)."""
    basetemp = item.config.option.basetemp
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        return (yield)
    shared = Path(basetemp).parent  # xdist gives each worker <the run's basetemp>/<worker id>
    serial = item.get_closest_marker("serial") is not None
    with open(shared / ".serial-gate", "a") as gate, open(shared / ".serial-run", "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if serial else fcntl.LOCK_SH)
        finally:
            if not serial:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)
            if serial:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _no_guard_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A daemon that unmounts cleanly leaves a read-only guard (ckptfs/mount/guard.py) on its mountpoint, also when a
    test ran it without the Mount fixture: remove every guard in the tmp dirs, or pytest could not delete them."""
    yield
    for mountpoint in guard.guarded_mountpoints(tmp_path_factory.getbasetemp()):
        guard.remove(mountpoint)


@pytest.fixture
def mount_factory(tmp_path: Path) -> Iterator[type[Mount]]:
    """Build (and start) mounts; all are unmounted at the end and must not have logged surprises."""
    mounts: list[Mount] = []

    def make(name: str = "m", *, start: bool = True, **kwargs: object) -> Mount:
        m = Mount(tmp_path / name, **kwargs)  # type: ignore[arg-type]
        mounts.append(m)
        if start:
            m.start()
        return m

    yield make  # type: ignore[misc]
    problems = []
    for m in mounts:
        m.cleanup()
        problems += m.unexpected_log_lines()
    assert not problems, "daemon logged unexpected warnings/errors:\n" + "\n".join(problems)


@pytest.fixture
def mount(mount_factory) -> Mount:  # type: ignore[no-untyped-def]
    return mount_factory()  # type: ignore[no-any-return]
