"""Running under systemd: the unit file passes `systemd-analyze verify`, and the daemon speaks sd_notify
(READY=1 only once the mount answers, STATUS= lines, STOPPING=1) to a $NOTIFY_SOCKET, path or abstract."""

from __future__ import annotations

import array
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, Mount

from ckptfs.mount import guard

UNIT = REPO / "systemd" / "ckptfs@.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    ckptfs_bin = Path(sys.executable).parent / "ckptfs"
    assert ckptfs_bin.exists()
    # An instance of the template, with ExecStart pointing at this checkout's ckptfs (verify checks it exists).
    unit = tmp_path / "ckptfs@test.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/ckptfs", str(ckptfs_bin)))
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                            timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if "ckptfs@test" in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_example_config_is_a_valid_config(tmp_path: Path) -> None:
    from ckptfs.config import load_config

    config = load_config(REPO / "systemd" / "ckptfs.example.toml", {})
    assert config.source == "s3://my-bucket/run-42" and str(config.mountpoint) == "/checkpoints"


class NotifyListener:
    """A datagram socket standing in for systemd's notify socket; collects what the daemon sends."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.mounted_when_ready: bool | None = None
        self.mnt: Path | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if fields.get("READY") == "1" and self.mnt is not None:
                self.mounted_when_ready = os.path.ismount(self.mnt)
            self.messages.append((time.monotonic(), fields))

    def wait_for(self, key: str, timeout: float = 30) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, fields in self.messages:
                if key in fields:
                    return fields
            time.sleep(0.05)
        raise AssertionError(f"no {key}= message; got {self.messages}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_daemon_notifies_ready_only_once_mounted_then_status_and_stopping(
    mount_factory, tmp_path: Path, abstract: bool  # type: ignore[no-untyped-def]
) -> None:
    address = f"@ckptfs-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else str(tmp_path / "notify.sock")
    listener = NotifyListener(address)
    try:
        mount: Mount = mount_factory(start=False, restarts_for_malloc_pad=True)
        listener.mnt = mount.mnt
        mount.env["NOTIFY_SOCKET"] = address
        mount.start()
        ready = listener.wait_for("READY")
        assert listener.mounted_when_ready is True
        assert "mounted" in ready.get("STATUS", ""), ready
        (mount.mnt / "ckpt.bin").write_bytes(b"x" * 1000)
        # A STATUS= line every few seconds while it runs.
        deadline = time.monotonic() + 15
        while len([m for m in listener.messages if "STATUS" in m[1]]) < 2:
            assert time.monotonic() < deadline, listener.messages
            time.sleep(0.1)
        assert mount.umount().returncode == 0
        stopping = listener.wait_for("STOPPING")
        assert "draining" in stopping.get("STATUS", ""), stopping
    finally:
        listener.close()


class FdStore(NotifyListener):
    """The notify socket and, as systemd's file descriptor store, the descriptors sent with FDSTORE=1."""

    def __init__(self, address: str) -> None:
        self.stored: dict[str, int] = {}
        super().__init__(address)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(65536, socket.CMSG_SPACE(16))
            except TimeoutError:
                continue
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            fds = [fd for level, kind, payload in ancillary if level == socket.SOL_SOCKET
                   and kind == socket.SCM_RIGHTS for fd in array.array("i", payload)]
            if fields.get("FDSTORE") == "1":
                self.stored[fields["FDNAME"]] = fds[0]
            elif fields.get("FDSTOREREMOVE") == "1":
                os.close(self.stored.pop(fields["FDNAME"]))
            self.messages.append((time.monotonic(), fields))


def test_the_unit_s_fd_store_keeps_the_mount_for_the_daemon_restart_starts(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """keep_mount under systemd: the daemon stores its FUSE connection and INIT request with FDSTORE=1 (no
    holder: it would die with the unit). Killed, the next daemon gets them as Restart= passes them
    (LISTEN_FDS from fd 3, LISTEN_FDNAMES, LISTEN_PID) and takes the mount over: a file open for writing
    carries on. A clean unmount takes them out of the store (FDSTOREREMOVE=1). Here a socket stands in for
    systemd, which does not run in this container; the unit file has FileDescriptorStoreMax=2."""
    store = FdStore(str(tmp_path / "notify.sock"))
    try:
        m: Mount = mount_factory(start=False, restarts_for_malloc_pad=True)
        m.env["NOTIFY_SOCKET"] = store.address
        m.start()
        store.wait_for("READY")
        deadline = time.monotonic() + 10
        while len(store.stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(store.stored) == {"ckptfs-fuse", "ckptfs-init"}
        assert m.holder_pid() is None
        with open(m.mnt / "ckpt.bin", "wb") as f:
            f.write(b"1" * 1000)
            f.flush()
            assert m.proc is not None
            m.proc.kill()
            m.proc.wait()
            fuse_fd, init_fd = store.stored["ckptfs-fuse"], store.stored["ckptfs-init"]
            env = dict(m.env, LISTEN_FDS="2", LISTEN_FDNAMES="ckptfs-fuse:ckptfs-init", FUSE_FD=str(fuse_fd),
                       INIT_FD=str(init_fd))
            with open(m.log, "ab") as log:
                m.proc = subprocess.Popen(
                    ["bash", "-c", 'exec 3<&"$FUSE_FD" 4<&"$INIT_FD"; unset FUSE_FD INIT_FD; LISTEN_PID=$$ exec "$@"',
                     "bash", sys.executable, "-m", "ckptfs", "mount", m.source, str(m.mnt), "--cache-dir",
                     str(m.cache), "--metrics-addr", "off", "--min-free", "0", "--log-level", "DEBUG"],
                    env=env, pass_fds=(fuse_fd, init_fd), stdout=log, stderr=log)
            f.write(b"2" * 1000)  # (a passthrough write does not even wait for the new daemon)
        deadline = time.monotonic() + 60
        while m.cli("status", str(m.mnt)).returncode != 0:
            assert time.monotonic() < deadline, m.log.read_text()[-3000:]
            time.sleep(0.1)
        assert m.status()["keep_mount"]["systemd_keeps"] is True
        assert m.status()["keep_mount"]["handles_taken_over"] == 1
        m.flush()
        assert m.store_files() == {"ckpt.bin": b"1" * 1000 + b"2" * 1000}
        assert m.umount().returncode == 0
        deadline = time.monotonic() + 10
        while store.stored and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.stored == {}
        assert guard.is_guarded(m.mnt)  # unmounted, and the bare directory guarded
    finally:
        store.close()
