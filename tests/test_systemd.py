"""Running under systemd: the unit file passes `systemd-analyze verify`, and the daemon speaks sd_notify
(READY=1 only once the mount answers, STATUS= lines, STOPPING=1) to a $NOTIFY_SOCKET, path or abstract."""

from __future__ import annotations

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
        mount: Mount = mount_factory(start=False)
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
