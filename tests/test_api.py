"""The Python API (`import ckptfs`) through a real mount: wait_durable returns only once the objects are in
the store and raises NotDurableError on timeout; status, errors with the CLI's messages; and importing
ckptfs loads no FUSE, trio or cloud SDK module."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount

import ckptfs
from ckptfs.mount import guard


@pytest.fixture
def api_mount(mount_factory, monkeypatch: pytest.MonkeyPatch) -> Mount:  # type: ignore[no-untyped-def]
    """A mount whose uploads start 30 s after close unless someone waits for them: anything in the store
    right after wait_durable is there because of it."""
    mount: Mount = mount_factory(upload_delay=30)
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", str(mount.runtime))
    return mount


def test_import_ckptfs_loads_no_fuse_trio_or_cloud_sdk() -> None:
    probe = ("import sys, ckptfs; ckptfs.wait_durable; ckptfs.status;"
             " print(sorted(m for m in ('pyfuse3', 'trio', 'boto3', 'botocore', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    # and the probe can see such an import: the daemon side does load trio
    loaded = subprocess.run([sys.executable, "-c", "import sys, ckptfs.control.server; print('trio' in sys.modules)"],
                            capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "True"


def test_no_module_of_the_package_hides_an_api_function() -> None:
    """A submodule named like an API function (ckptfs/status.py, say) replaces ckptfs.status once anything
    imports it: in a process that loads the daemon's modules (the suite, a tool embedding ckptfs),
    ckptfs.status() became "module object is not callable"."""
    probe = ("import importlib, pkgutil, ckptfs\n"
             "for module in pkgutil.walk_packages(ckptfs.__path__, 'ckptfs.'):\n"
             "    if module.name != 'ckptfs.__main__':\n"
             "        importlib.import_module(module.name)\n"
             "print(sorted(n for n in ckptfs.__all__ if n[0].islower() and not callable(getattr(ckptfs, n))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_wait_durable_returns_once_the_objects_are_in_the_store(api_mount: Mount) -> None:
    step = api_mount.mnt / "step_100"
    step.mkdir()
    (step / "model.pt").write_bytes(b"m" * 100_000)
    (step / "optim.pt").write_bytes(b"o" * 1000)
    (api_mount.mnt / "other.pt").write_bytes(b"x")
    assert api_mount.store_files() == {}  # the upload delay holds them back
    ckptfs.wait_durable(api_mount.mnt, ["step_100"], timeout=60)
    stored = api_mount.store_files()  # (a flush may also start uploads it does not wait for)
    assert stored["step_100/model.pt"] == b"m" * 100_000 and stored["step_100/optim.pt"] == b"o" * 1000
    # an absolute path inside the mount, and the mountpoint given as a string
    ckptfs.wait_durable(str(api_mount.mnt), [api_mount.mnt / "other.pt"], timeout=60)
    assert api_mount.store_files()["other.pt"] == b"x"
    status = ckptfs.status(api_mount.mnt)
    assert status["states"]["clean"] == {"files": 3, "bytes": 101_001}
    assert status["queue"]["uploads"] == 0 and status["last_error"] is None
    assert status["mountpoint"] == str(api_mount.mnt)


def test_wait_durable_without_paths_waits_for_everything(api_mount: Mount) -> None:
    for i in range(3):
        (api_mount.mnt / f"f{i}").write_bytes(bytes([i]) * 10)
    ckptfs.wait_durable(api_mount.mnt, timeout=60)
    assert api_mount.store_files() == {f"f{i}": bytes([i]) * 10 for i in range(3)}


def test_wait_durable_times_out_with_the_pending_paths(api_mount: Mount) -> None:
    with open(api_mount.mnt / "held-open.pt", "wb") as handle:  # open for writing: pending until closed
        handle.write(b"x")
        handle.flush()
        with pytest.raises(ckptfs.NotDurableError) as caught:
            ckptfs.wait_durable(api_mount.mnt, timeout=0.5)
    error = caught.value
    assert isinstance(error, TimeoutError) and isinstance(error, ckptfs.CkptfsError)
    assert error.remaining_count == 1 and error.remaining == ["held-open.pt"]
    assert str(error) == "not durable after 0.5s: 1 entries pending, e.g. held-open.pt"  # the CLI's words
    assert error.exit_code == 3
    ckptfs.wait_durable(api_mount.mnt, timeout=60)
    assert api_mount.store_files() == {"held-open.pt": b"x"}


def test_errors_carry_the_cli_messages(api_mount: Mount, tmp_path: Path) -> None:
    with pytest.raises(ckptfs.UsageError, match="is not inside"):
        ckptfs.wait_durable(api_mount.mnt, ["/etc/passwd"], timeout=1)
    with pytest.raises(ckptfs.UsageError, match="at least 1"):
        ckptfs.prune(api_mount.mnt, keep_last=0)
    unmounted = tmp_path / "nothing-here"
    for call in (lambda: ckptfs.status(unmounted), lambda: ckptfs.wait_durable(unmounted, timeout=1)):
        with pytest.raises(ckptfs.NoDaemonError, match="no ckptfs daemon is serving"):
            call()
    cli = api_mount.cli("status", str(unmounted))
    assert cli.returncode == 1 and "no ckptfs daemon is serving" in cli.stderr


def test_a_call_waits_for_the_control_socket_of_a_mounted_mountpoint(api_mount: Mount) -> None:
    """A daemon taking a kept mount over serves the kernel a moment before its control socket is up: a call
    then waits for the socket instead of failing with NoDaemonError (it failed so at once before; the
    socket's absence is played here by moving it away for a second). A mount whose socket never comes gets
    a message that says so, after the wait."""
    sock = ckptfs.control.client.socket_path(api_mount.mnt)
    away = sock.with_name("away.sock")
    sock.rename(away)
    back = threading.Timer(1.0, away.rename, (sock,))
    back.start()
    try:
        started = time.monotonic()
        assert ckptfs.status(api_mount.mnt)["mountpoint"] == str(api_mount.mnt)
        assert time.monotonic() - started >= 0.9
    finally:
        back.join()
    sock.rename(away)
    try:
        with pytest.raises(ckptfs.NoDaemonError, match="it is mounted, but nothing answered"):
            ckptfs.control.client.call(api_mount.mnt, {"op": "status"}, socket_wait=0.3)
    finally:
        away.rename(sock)


def test_prune_and_unmount(api_mount: Mount) -> None:
    for step in (100, 200, 300):
        (api_mount.mnt / f"step_{step}").mkdir()
        (api_mount.mnt / f"step_{step}" / "model.pt").write_bytes(b"w")
    ckptfs.wait_durable(api_mount.mnt, timeout=60)
    planned = ckptfs.prune(api_mount.mnt, keep_last=2, dry_run=True)
    assert planned.deleted == ["step_100"] and set(planned.kept) == {"step_200", "step_300"}
    assert (api_mount.mnt / "step_100").exists()
    assert ckptfs.prune(api_mount.mnt, keep_last=2).deleted == ["step_100"]
    ckptfs.unmount(api_mount.mnt, timeout=60)
    assert guard.is_guarded(api_mount.mnt)  # unmounted, and the bare directory guarded
    assert api_mount.proc is not None
    api_mount.proc.wait(timeout=30)
    api_mount.proc = None
    assert sorted(api_mount.store_files()) == ["step_200/model.pt", "step_300/model.pt"]
