"""Where ckptfs runs: with the stock pyfuse3 of PyPI (no keep_mount, no passthrough), as a user who is not
root (no guard, no passthrough; a runtime dir, a cache dir and a mount root of the user's own). What is off
turns one feature off with one line saying why, never the mount. The tests marked core run a second time
in .venv-stock (scripts/test.sh), where pyfuse3 is the stock build."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import trio
from conftest import REPO, Mount, stock_pyfuse3

from ckptfs import config
from ckptfs.control import client
from ckptfs.errors import CkptfsError, UsageError
from ckptfs.fs import Filesystem
from ckptfs.journal import ROOT_ID, Journal
from ckptfs.keepmount import keeper
from ckptfs.keepmount.systemd import Notifier
from ckptfs.mount import guard


@pytest.mark.core
def test_what_is_off_is_said_in_one_line_each_in_the_log_and_in_status(mount: Mount) -> None:
    (mount.mnt / "f").write_bytes(b"x")
    mount.flush()
    status = mount.status()
    keep, passthrough, guarded = status["keep_mount"], status["passthrough"], status["guard"]
    for feature in (keep, passthrough, guarded):
        assert feature["why"].startswith("on: " if feature["enabled"] else "off: "), feature
    assert guarded["enabled"]  # root, and guard_mountpoint on by default
    if stock_pyfuse3():
        assert not keep["enabled"] and not passthrough["enabled"]
        assert "stock build" in keep["why"] and "docs/INSTALL.md" in keep["why"]
        assert "stock build" in passthrough["why"] and "docs/INSTALL.md" in passthrough["why"]
    else:
        assert keep["enabled"] and keep["holder_pid"] == mount.holder_pid()
    log = mount.log.read_text()
    assert log.count(f"keep_mount {keep['why']}") == 1
    assert log.count(f"FUSE passthrough {passthrough['why']}") == 1
    assert log.count(f"guard {guarded['why']}") == 1
    human = mount.cli("status", str(mount.mnt))
    assert f"keep mount {keep['why']}" in human.stdout and f"guard      {guarded['why']}" in human.stdout
    assert f"passthrough {passthrough['why']}" in human.stdout


def test_a_pyfuse3_without_the_additions_keeps_no_mount_and_says_how_to_get_it(tmp_path: Path) -> None:
    class StockSession:  # what pyfuse3 3.5.0 of PyPI has of what keep_mount calls
        def close(self, unmount: bool = True) -> None: ...

    kept = keeper.ConnectionKeeper(
        cast(keeper.FuseConnection, StockSession()), cast(Filesystem, None), Notifier(),
        mountpoint=tmp_path / "mnt", cache_root=tmp_path,
        keep_mount=True, guard_mountpoint=True, handle_table=None, held=None, restored=[],
        restart_argv=["mount", "file:///x", str(tmp_path / "mnt")])
    trio.run(kept.start_holder)  # before: AttributeError 'init_request', and the mount failed with it
    assert kept.link is None and not kept.keeps
    assert kept.why.startswith("off: this pyfuse3 is the stock build")
    assert "scripts/build-wheels.sh" in kept.why and "Transport endpoint is not connected" in kept.why


def test_a_held_connection_that_this_pyfuse3_cannot_take_over_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    from ckptfs.keepmount import link as holder_link

    monkeypatch.setattr(holder_link, "inherited", lambda: holder_link.Held(read_end, b"init", None))
    with pytest.raises(CkptfsError, match="stock build, which cannot take a connection over"):
        keeper.find_held_connection(tmp_path / "mnt", object())
    with pytest.raises(OSError):
        os.fstat(read_end)  # the descriptor was let go


def test_the_runtime_dir_of_a_user_who_is_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTFS_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert client.runtime_dir() == Path("/run/ckptfs")
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert client.runtime_dir() == Path("/run/user/1234/ckptfs")  # before: /run/ckptfs, which a user cannot write
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert client.runtime_dir() == Path("/tmp/ckptfs-1234")
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", "/somewhere")
    assert client.runtime_dir() == Path("/somewhere")


def test_a_runtime_dir_in_tmp_that_another_user_made_is_refused(tmp_path: Path) -> None:
    foreign = Path(tempfile.mkdtemp(prefix="ckptfs-", dir="/tmp"))
    try:
        os.chown(foreign, 65534, 65534)  # made by someone else first, to answer in a daemon's place
        with pytest.raises(UsageError, match="is not this user's own"):
            client.ensure_runtime_dir(foreign)
        os.chown(foreign, os.geteuid(), os.getegid())
        os.chmod(foreign, 0o777)
        with pytest.raises(UsageError, match="is not this user's own"):
            client.ensure_runtime_dir(foreign)
        os.chmod(foreign, 0o700)
        client.ensure_runtime_dir(foreign)
    finally:
        foreign.rmdir()
    client.ensure_runtime_dir(tmp_path / "a" / "run")  # elsewhere: made if missing, not judged
    assert stat.S_IMODE((tmp_path / "a" / "run").stat().st_mode) == 0o700


def test_the_cache_dir_of_a_user_who_is_not_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert config.default_cache_dir("file:///b").parent == Path("/var/cache/ckptfs")
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert config.default_cache_dir("file:///b").parent == tmp_path / ".cache" / "ckptfs"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg/cache")
    assert config.default_cache_dir("file:///b").parent == Path("/xdg/cache/ckptfs")


def test_the_mount_root_belongs_to_the_user_who_made_the_journal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 1234)
    monkeypatch.setattr(os, "getgid", lambda: 5678)
    journal = Journal(tmp_path / "journal.db")
    try:
        root = journal.names.get(ROOT_ID)
        assert root is not None
        assert (root.uid, root.gid) == (1234, 5678)  # before: root:root 0755, and the user could create nothing
    finally:
        journal.close()


def test_the_guard_is_off_for_a_daemon_that_is_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    assert guard.availability(True)[0] is True
    assert guard.availability(False) == (False, guard.availability(False)[1])
    assert "guard_mountpoint = false" in guard.availability(False)[1]
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    on, why = guard.availability(True)
    assert not on and why.startswith("off: the daemon is not root") and "disk below" in why


# -- a user who is not root mounts with the defaults ------------------------------------------------------

USER = "nobody"  # in every Debian (base-passwd); fusermount3 needs the uid to have a name


def _reachable_for_others(path: Path) -> Path | None:
    """The first directory above `path` that other users cannot search (its 'x' for others is off)."""
    for parent in reversed(path.parents):
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def _namespace_script(needed: list[Path]) -> str:
    """Shell lines for a private mount namespace in which the user can reach `needed` (the interpreter and
    this checkout): a closed directory above one of them (such as /root, 0700, above pyenv's Python) is
    covered by an open tmpfs that holds only the one entry below it that is needed, bound back."""
    lines = []
    for index, path in enumerate(needed):
        closed = _reachable_for_others(path)
        if closed is None:
            continue
        entry = closed / path.relative_to(closed).parts[0]
        stash = f"/tmp/.ckptfs-ns-{os.getpid()}-{index}"
        lines += [f"mkdir -p {stash}", f"mount --bind {shlex.quote(str(entry))} {stash}",
                  f"mountpoint -q {shlex.quote(str(closed))} && [ -e {shlex.quote(str(entry))} ] ||"
                  f" mount -t tmpfs -o mode=0755 ckptfs-test {shlex.quote(str(closed))}",
                  f"mkdir -p {shlex.quote(str(entry))}", f"mount --bind {stash} {shlex.quote(str(entry))}"]
    return "\n".join(lines)


@pytest.fixture
def fuse_for_everyone() -> Iterator[None]:
    """/dev/fuse readable and writable by every user, as most distributions ship it (0600 on this machine)."""
    before = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", before)


@pytest.mark.core
@pytest.mark.timeout(180)
def test_a_user_who_is_not_root_mounts_writes_flushes_and_unmounts_with_the_defaults(fuse_for_everyone: None) -> None:
    if not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs util-linux's unshare and setpriv")
    user = pwd.getpwnam(USER)
    base = Path(tempfile.mkdtemp(prefix="ckptfs-user-", dir="/tmp"))
    try:
        for name in ("bucket", "mnt", "home", "xdg"):
            (base / name).mkdir()
        os.chmod(base / "xdg", 0o700)
        for path in [base, *base.iterdir()]:
            os.chown(path, user.pw_uid, user.pw_gid)
        ckptfs = [sys.executable, "-m", "ckptfs"]
        mnt = base / "mnt"
        # As the user, with the defaults: no --cache-dir, no CKPTFS_RUNTIME_DIR.
        as_user = f"""
set -e
cd {base}
ckptfs() {{ {shlex.join(ckptfs)} "$@"; }}
ckptfs mount file://{base}/bucket {mnt} --daemon --metrics-addr off
trap 'ckptfs umount {mnt} >/dev/null 2>&1 || fusermount3 -u -z {mnt}' EXIT
stat -c '%u:%g %a' {mnt} > {base}/root-owner
mkdir {mnt}/step_1
{sys.executable} -c 'open("{mnt}/step_1/model.tmp", "wb").write(b"w" * 3_000_000)'
mv {mnt}/step_1/model.tmp {mnt}/step_1/model.pt
echo step_1 > {mnt}/latest
ckptfs flush {mnt} --timeout 60
ckptfs status {mnt} --json > {base}/status.json
ckptfs umount {mnt} > {base}/umount.out
trap - EXIT
"""
        script = f"""
set -e
{_namespace_script([Path(os.path.realpath(sys.executable)), REPO])}
exec setpriv --reuid={user.pw_uid} --regid={user.pw_gid} --clear-groups \\
  env -i PATH=/usr/bin:/bin HOME={base}/home XDG_RUNTIME_DIR={base}/xdg PYTHONPATH={REPO} \\
  bash -c {shlex.quote(as_user)}
"""
        result = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", script],
                                capture_output=True, text=True, timeout=150)
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
        assert (base / "root-owner").read_text().split()[0] == f"{user.pw_uid}:{user.pw_gid}"
        assert (base / "bucket" / "step_1" / "model.pt").read_bytes() == b"w" * 3_000_000
        assert (base / "bucket" / "latest").read_text() == "step_1\n"
        assert not (base / "bucket" / "step_1" / "model.tmp").exists()
        status = json.loads((base / "status.json").read_text())
        assert status["states"]["clean"]["files"] == 2
        assert status["cache_dir"].startswith(f"{base}/home/.cache/ckptfs/")
        assert (base / "xdg" / "ckptfs").is_dir()  # the control socket's dir, under $XDG_RUNTIME_DIR
        assert not status["guard"]["enabled"] and "not root" in status["guard"]["why"]
        assert not status["passthrough"]["enabled"]
        assert status["keep_mount"]["enabled"] != stock_pyfuse3()
        assert "drained and unmounted" in (base / "umount.out").read_text()
    finally:
        subprocess.run(["pkill", "-KILL", "-u", str(user.pw_uid), "-f", f"ckptfs.*{base}"], check=False)
        shutil.rmtree(base, ignore_errors=True)


def test_a_machine_without_fusermount3_gets_one_clear_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from ckptfs.mount import mountpoint

    monkeypatch.setenv("PATH", str(tmp_path))  # no fusermount3 on it
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    with pytest.raises(CkptfsError, match="fusermount3 is not installed: install the fuse3 package"):
        mountpoint.check_fusermount()
    with pytest.raises(CkptfsError, match="fusermount3 is not installed"):  # before: FileNotFoundError, a traceback
        mountpoint._fusermount_unmount(tmp_path)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    mountpoint.check_fusermount()  # root mounts without it
