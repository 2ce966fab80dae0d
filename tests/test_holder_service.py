"""The node's holder service (`ckptfs holder`), on one host: what the Kubernetes holder DaemonSet does for the
daemon's pods (tests/test_kubernetes_rollout.py runs the same under podman, from the manifests). The daemon
hands its FUSE connection to the service instead of starting a holder of its own; SIGTERM with
keep_mount_on_stop leaves the mount to it; the next daemon takes it over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount, stock_pyfuse3
from waiting import wait_until

pytestmark = pytest.mark.skipif(stock_pyfuse3(), reason="keep_mount needs the patched pyfuse3")


class Service:
    """`ckptfs holder` in the foreground, serving the runtime dir `runtime`."""

    def __init__(self, runtime: Path, log: Path, *args: str) -> None:
        self.runtime = runtime
        self.log = log
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(self.runtime))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "holder", *self.args], env=env, stdout=log,
                                         stderr=log)
        wait_until(lambda: (self.runtime / "holder.sock").exists(), what="the holder service's socket", timeout=20)

    def stop(self, how: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.send_signal(how)
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def node(mount_factory, tmp_path: Path) -> Iterator[tuple[Mount, Service]]:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(start=False, extra_args=("--keep-mount-on-stop",))
    m.runtime.mkdir(mode=0o700)
    service = Service(m.runtime, tmp_path / "holder.log")
    service.start()
    try:
        yield m, service
    finally:
        m.cleanup()  # the daemon unmounts first: a service that went before it would make it say so
        service.stop()


def _keep(m: Mount) -> dict:  # type: ignore[type-arg]
    return m.status()["keep_mount"]  # type: ignore[no-any-return]


def test_sigterm_drains_then_leaves_the_mount_to_the_service_and_the_next_daemon_takes_it_over(
    node: tuple[Mount, Service],
) -> None:
    m, service = node
    m.start()
    keep = _keep(m)
    assert keep["enabled"] and "holder service" in keep["why"], keep
    holder = keep["holder_pid"]
    errors: list[str] = []
    written: list[int] = []

    def write() -> None:  # a job appending to a file it keeps open across the daemon's replacement
        with open(m.mnt / "log.txt", "w") as f:
            for i in range(60):
                try:
                    f.write(f"line {i}\n")
                    f.flush()
                    written.append(i)
                except OSError as exc:
                    errors.append(repr(exc))
                time.sleep(0.05)

    writer = threading.Thread(target=write)
    writer.start()
    (m.mnt / "closed.bin").write_bytes(b"c" * 100_000)  # closed before the SIGTERM: drained before leaving
    time.sleep(0.5)
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    log = m.log.read_text()
    assert "SIGTERM: draining for up to" in log and "drained; leaving the mount" in log, log
    assert (m.store / "closed.bin").read_bytes() == b"c" * 100_000
    assert guard_free(m.mnt)  # still the FUSE mount, no guard: nothing unmounted it
    m.start()  # the next daemon (the DaemonSet's next pod)
    writer.join(timeout=60)
    assert errors == [] and len(written) == 60
    keep = _keep(m)
    assert keep["took_over"] and keep["enabled"] and keep["holder_pid"] == holder, keep
    m.flush()
    assert (m.store / "log.txt").read_text() == "".join(f"line {i}\n" for i in range(60))
    assert "holder of" in service.log.read_text()


def guard_free(mnt: Path) -> bool:
    from ckptfs.mount import guard

    top = guard.mounted_at(mnt)
    return top is not None and top.fstype == "fuse.ckptfs"


def test_a_daemon_hands_its_connection_to_the_next_service_when_its_holder_goes(node: tuple[Mount, Service]) -> None:
    """The holder's pod replaced while a daemon serves: the daemon keeps serving, and the mount outlives it
    again as soon as a new service listens."""
    m, service = node
    m.start()
    (m.mnt / "a").write_bytes(b"a")
    service.stop()
    wait_until(lambda: not _keep(m)["enabled"], what="keep_mount off once the service went", timeout=20)
    assert "holder service went away" in _keep(m)["why"]
    (m.mnt / "b").write_bytes(b"b")  # the daemon serves on
    service.start()
    wait_until(lambda: _keep(m)["enabled"], what="the connection handed to the new service", timeout=20)
    m.allowed_log_words.append("keep_mount off: the node's holder service went away")
    assert m.proc is not None
    m.proc.send_signal(signal.SIGKILL)  # the daemon's pod OOM-killed: the new service's holder keeps the mount
    m.proc.wait(timeout=30)
    m.proc = None
    m.start()  # takes over from the new service's holder: the files are there, nothing was unmounted
    assert _keep(m)["took_over"]
    assert (m.mnt / "a").read_bytes() == b"a" and (m.mnt / "b").read_bytes() == b"b"


def test_a_daemon_that_starts_before_the_service_waits_for_it(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(start=False, extra_args=("--keep-mount-on-stop",))
    m.runtime.mkdir(mode=0o700)
    m.start()
    keep = _keep(m)
    assert not keep["enabled"] and "waiting for the node's holder service" in keep["why"], keep
    assert m.holder_pid() is None  # no holder of its own: it would die with the daemon's pod
    m.allowed_log_words.append("keep_mount off: waiting for the node's holder service")
    service = Service(m.runtime, tmp_path / "holder.log")
    service.start()
    try:
        wait_until(lambda: _keep(m)["enabled"], what="the connection handed to the service", timeout=20)
    finally:
        m.cleanup()
        service.stop()


def test_a_holder_of_the_service_that_stops_while_no_daemon_serves_detaches_the_mount(
    node: tuple[Mount, Service],
) -> None:
    m, service = node
    m.start()
    (m.mnt / "x").write_bytes(b"x")
    m.flush()
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)  # leaves the mount to the service's holder
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    service.stop()  # uninstall: nothing serves the mount any more, nobody would start a daemon
    wait_until(lambda: not guard_free(m.mnt), what="the mount detached", timeout=20)
    assert "detaching the mount" in service.log.read_text()


def test_a_service_that_goes_while_the_daemon_drains_to_leave_makes_it_unmount_instead(
    node: tuple[Mount, Service],
) -> None:
    """Leaving the connection to a holder that is gone would abort it (ENOTCONN for the job): unmount."""
    m, service = node
    m.start()
    m.allowed_log_words += ["holder service went away"]
    with open(m.mnt / "open.bin", "wb") as f:  # the drain waits for its close
        f.write(b"o" * 1000)
        f.flush()
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: draining for up to" in m.log.read_text(),
                   what="the drain before leaving", timeout=20)
        service.stop()
        wait_until(lambda: "holder service went away" in m.log.read_text(),
                   what="the daemon to see its holder go", timeout=20)
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    assert "unmounting" in m.log.read_text() and (m.store / "open.bin").read_bytes() == b"o" * 1000
    from ckptfs.mount import guard

    top = guard.mounted_at(m.mnt)
    assert top is not None and top.is_guard, top  # unmounted and guarded, not a stale mount at ENOTCONN


def test_the_service_guards_a_mountpoint_until_the_daemon_mounts_it(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A node's boot: the holder starts before the daemon, and a job started meanwhile must not write onto
    the disk below the mountpoint (which the daemon would then refuse as not empty)."""
    from ckptfs.mount import guard

    m: Mount = mount_factory(start=False, extra_args=("--keep-mount-on-stop",))
    m.runtime.mkdir(mode=0o700)
    m.mnt.rmdir()  # a new node's hostPath: the mountpoint is not there yet
    service = Service(m.runtime, tmp_path / "holder.log", "--guard", str(m.mnt))
    service.start()
    try:
        top = guard.mounted_at(m.mnt)
        assert top is not None and top.is_guard, top
        with pytest.raises(OSError, match="Read-only file system"):
            (m.mnt / "early.pt").write_bytes(b"x")
        m.start()  # the daemon replaces the guard and hands its connection to the service
        top = guard.mounted_at(m.mnt)
        assert top is not None and top.fstype == "fuse.ckptfs", top
        wait_until(lambda: _keep(m)["enabled"], what="the connection handed to the service", timeout=20)
        (m.mnt / "f").write_bytes(b"f")
    finally:
        m.cleanup()
        service.stop()
