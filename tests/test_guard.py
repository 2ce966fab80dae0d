"""The guard on a mountpoint ckptfs does not serve (ckptfs/mount/guard.py): after a clean unmount, writes into the
bare directory fail with EROFS instead of landing on the disk below. Real mounts only (the tests run as root)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount, ckptfs_cli

from ckptfs.mount import guard

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a guard needs root")


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    yield mountpoint
    guard.remove(mountpoint)
    subprocess.run(["umount", "-q", str(mountpoint)], check=False)


def _assert_erofs(path: Path) -> None:
    with pytest.raises(OSError) as caught:
        open(path, "w")  # noqa: SIM115
    assert caught.value.errno == errno.EROFS, caught.value


def _below(mountpoint: Path) -> list[str]:
    """What is in the directory itself, under whatever is mounted on it (the root disk's side)."""
    guard.remove(mountpoint)
    assert not os.path.ismount(mountpoint)
    return os.listdir(mountpoint)


def _guard_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" - tmpfs {guard.SOURCE} " in line]


# -- the module ---------------------------------------------------------------------------------------------


def test_place_makes_writes_fail_with_erofs_and_says_why(bare: Path) -> None:
    assert not guard.is_guarded(bare)
    assert guard.place(bare)
    assert guard.is_guarded(bare) and os.path.ismount(bare)
    _assert_erofs(bare / "step_1.pt")
    with pytest.raises(OSError) as caught:
        (bare / "step_1").mkdir()
    assert caught.value.errno == errno.EROFS
    readme = (bare / guard.README).read_text()
    assert "ckptfs does not serve this directory" in readme and "EROFS" in readme
    assert f"ckptfs unguard {bare}" in readme and f"umount {bare}" in readme and "ckptfs mount" in readme
    assert os.listdir(bare) == [guard.README]
    assert guard.place(bare)  # already guarded: nothing stacked
    assert len([line for line in _guard_mounts() if f" {bare} " in line]) == 1
    assert guard.guarded_mountpoints(bare.parent) == [bare]

    assert guard.remove(bare)
    assert not guard.is_guarded(bare) and not os.path.ismount(bare)
    assert not guard.remove(bare)  # nothing there any more
    (bare / "x").write_bytes(b"bare again")
    assert os.listdir(bare) == ["x"]


def test_remove_and_place_leave_other_mounts_alone(bare: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "not-a-guard", str(bare)], check=True)
    (bare / "theirs").write_bytes(b"keep me")
    assert not guard.is_guarded(bare)
    assert not guard.remove(bare)
    assert not guard.place(bare)  # never over another mount
    with pytest.raises(guard.CkptfsError, match="is a mount point"):
        guard.place(bare, strict=True)
    assert os.path.ismount(bare) and (bare / "theirs").read_bytes() == b"keep me"
    assert not guard.is_guarded(bare)


def test_a_guard_below_another_mount_is_not_removed(bare: Path) -> None:
    """remove() unmounts only the topmost mount, and only if that one is a guard."""
    assert guard.place(bare)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "on-top", str(bare)], check=True)
    assert not guard.is_guarded(bare)
    assert not guard.remove(bare)
    assert guard.mounted_at(bare) is not None and guard.mounted_at(bare).source == "on-top"  # type: ignore[union-attr]
    subprocess.run(["umount", str(bare)], check=True)
    assert guard.is_guarded(bare)


def test_place_on_a_missing_directory_warns_and_returns_false(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert not guard.place(tmp_path / "missing")
    assert "cannot guard" in caplog.text and "No such file or directory" in caplog.text


def test_mountinfo_paths_with_spaces(tmp_path: Path) -> None:
    spaced = tmp_path / "a dir\twith space"
    spaced.mkdir()
    try:
        assert guard.place(spaced)
        assert guard.is_guarded(spaced)
        assert guard.guarded_mountpoints(tmp_path) == [spaced]
        _assert_erofs(spaced / "f")
    finally:
        assert guard.remove(spaced)
    assert not os.path.ismount(spaced)


# -- the daemon ---------------------------------------------------------------------------------------------


def test_after_ckptfs_umount_writes_fail_and_nothing_lands_below(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory()
    (m.mnt / "step_1.pt").write_bytes(b"a" * 10_000)
    result = m.umount()
    assert result.returncode == 0, result.stderr
    assert guard.is_guarded(m.mnt)
    _assert_erofs(m.mnt / "step_2.pt")
    assert os.listdir(m.mnt) == [guard.README]
    assert m.store_files() == {"step_1.pt": b"a" * 10_000}
    assert _below(m.mnt) == []


def test_after_a_sigterm_drain_writes_fail_and_nothing_lands_below(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=3600)
    (m.mnt / "step_1.pt").write_bytes(b"b" * 10_000)
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    assert guard.is_guarded(m.mnt)
    _assert_erofs(m.mnt / "step_2.pt")
    assert m.store_files() == {"step_1.pt": b"b" * 10_000}
    assert _below(m.mnt) == []


def test_after_an_external_umount_the_daemon_drains_then_guards(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=3600)
    (m.mnt / "f").write_bytes(b"data")
    subprocess.run(["umount", str(m.mnt)], check=True)
    assert m.proc is not None
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    assert guard.is_guarded(m.mnt)
    _assert_erofs(m.mnt / "g")
    assert m.store_files() == {"f": b"data"}


def test_mounting_again_replaces_the_guard(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory()
    (m.mnt / "step_1.pt").write_bytes(b"1")
    assert m.umount().returncode == 0
    assert guard.is_guarded(m.mnt)
    m.start()
    assert not guard.is_guarded(m.mnt)
    assert sorted(os.listdir(m.mnt)) == ["step_1.pt"]  # the mount, not the guard's README
    (m.mnt / "step_2.pt").write_bytes(b"2")
    m.flush()
    assert m.store_files() == {"step_1.pt": b"1", "step_2.pt": b"2"}
    assert m.umount().returncode == 0
    assert guard.is_guarded(m.mnt) and len([line for line in _guard_mounts() if f" {m.mnt} " in line]) == 1
    assert _below(m.mnt) == []


def test_no_guard_mountpoint_leaves_the_bare_directory_writable(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(extra_args=("--no-guard-mountpoint",))
    (m.mnt / "f").write_bytes(b"up")
    assert m.umount().returncode == 0
    assert not os.path.ismount(m.mnt) and not guard.is_guarded(m.mnt)
    (m.mnt / "lands-below").write_bytes(b"on the root disk")  # the old behaviour
    assert os.listdir(m.mnt) == ["lands-below"]
    os.unlink(m.mnt / "lands-below")
    assert m.store_files() == {"f": b"up"}


# -- the command line ---------------------------------------------------------------------------------------


def test_cli_guard_before_the_first_mount_then_mount_and_unguard(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(start=False)
    result = m.cli("guard", str(m.mnt))
    assert result.returncode == 0, result.stderr
    assert "guarded" in result.stdout and guard.is_guarded(m.mnt)
    _assert_erofs(m.mnt / "early-save.pt")
    again = m.cli("guard", str(m.mnt))
    assert again.returncode == 0 and "guarded already" in again.stdout

    m.start()  # `ckptfs mount` takes the guard away by itself
    assert not guard.is_guarded(m.mnt)
    (m.mnt / "f").write_bytes(b"served")
    refused = m.cli("guard", str(m.mnt))
    assert refused.returncode == 1 and not guard.is_guarded(m.mnt)
    assert "is a ckptfs mount" in refused.stderr and "ckptfs umount" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    refused = m.cli("unguard", str(m.mnt))
    assert refused.returncode == 1 and "not a ckptfs guard" in refused.stderr
    assert (m.mnt / "f").read_bytes() == b"served"  # the mount is untouched

    assert m.umount().returncode == 0
    result = m.cli("unguard", str(m.mnt))
    assert result.returncode == 0, result.stderr
    assert "removed the guard" in result.stdout and not os.path.ismount(m.mnt)
    result = m.cli("unguard", str(m.mnt))
    assert result.returncode == 0 and "is not guarded" in result.stdout
    assert os.listdir(m.mnt) == []
    assert m.store_files() == {"f": b"served"}


def test_cli_guard_with_a_config_file(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    config = tmp_path / "run-42.toml"
    config.write_text(f'source = "file://{tmp_path / "store"}"\nmountpoint = "{mountpoint}"\n')
    result = ckptfs_cli("guard", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert guard.is_guarded(mountpoint)
    result = ckptfs_cli("unguard", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(mountpoint)

    config.write_text(config.read_text() + "guard_mountpoint = false\n")
    result = ckptfs_cli("guard", "--config", str(config))
    assert result.returncode == 0 and "left unguarded" in result.stdout
    assert not os.path.ismount(mountpoint)


def test_cli_guard_refuses_other_mounts_and_missing_directories(bare: Path) -> None:
    missing = ckptfs_cli("guard", str(bare / "missing"))
    assert missing.returncode == 1 and "No such file or directory" in missing.stderr
    assert ckptfs_cli("guard").returncode == 2
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "not-a-guard", str(bare)], check=True)
    for command in ("guard", "unguard"):
        result = ckptfs_cli(command, str(bare))
        assert result.returncode == 1, result
        assert "not-a-guard" in result.stderr
    assert guard.mounted_at(bare).source == "not-a-guard"  # type: ignore[union-attr]


def test_no_guard_is_left_behind(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Runs last in this file: the fixtures removed every guard the tests above placed."""
    base = str(tmp_path_factory.getbasetemp())
    assert [line for line in _guard_mounts() if base in line] == []
