"""Bad input gets one clear line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import Mount, ckptfs_cli

from ckptfs.cli.launch import MALLOC_TUNABLE, _restart_with_malloc_pad, _with_malloc_pad
from ckptfs.errors import UsageError
from ckptfs.mount import guard
from ckptfs.mount.mountpoint import read_ahead_path


def _one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ckptfs:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    d = {name: tmp_path / name for name in ("store", "mnt", "cache", "run")}
    d["store"].mkdir()
    d["mnt"].mkdir()
    return d


def _mount(dirs: dict[str, Path], *args: str, source: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"CKPTFS_RUNTIME_DIR": str(dirs["run"]), "PATH": "/usr/bin:/bin"}
    import os

    env = dict(os.environ, **env)
    return ckptfs_cli("mount", source or f"file://{dirs['store']}", str(dirs["mnt"]),
                      "--cache-dir", str(dirs["cache"]), *args, env=env, timeout=60)


def test_unknown_scheme(dirs: dict[str, Path]) -> None:
    result = _mount(dirs, source="ftp://host/x")
    _one_line_error(result, "unsupported store URL", "file:///DIR")
    assert result.returncode == 2


def test_relative_file_url(dirs: dict[str, Path]) -> None:
    _one_line_error(_mount(dirs, source="file://relative/dir"), "absolute path")


def test_missing_store_directory(dirs: dict[str, Path]) -> None:
    _one_line_error(_mount(dirs, source=f"file://{dirs['store']}/nope"), "does not exist", "mkdir -p")


def test_mountpoint_missing(dirs: dict[str, Path]) -> None:
    dirs["mnt"].rmdir()
    _one_line_error(_mount(dirs), "mountpoint", "does not exist")


def test_mountpoint_not_empty(dirs: dict[str, Path]) -> None:
    (dirs["mnt"] / "stray").write_text("x")
    _one_line_error(_mount(dirs), "not empty")


def test_cache_dir_not_writable(dirs: dict[str, Path], tmp_path: Path) -> None:
    readonly = tmp_path / "ro"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], check=True)
    try:
        dirs["cache"] = readonly / "cache"
        _one_line_error(_mount(dirs), "cache dir", "--cache-dir")
        _one_line_error(_mount(dirs, "--daemon"), "cache dir", "--cache-dir")
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


def test_bad_size_and_config(dirs: dict[str, Path], tmp_path: Path) -> None:
    _one_line_error(_mount(dirs, "--cache-size", "lots"), "size 'lots'")
    config = tmp_path / "c.toml"
    config.write_text('upload_dealy = 3\n')
    _one_line_error(_mount(dirs, "--config", str(config)), "unknown key", "upload_dealy")
    config.write_text('this is not toml')
    _one_line_error(_mount(dirs, "--config", str(config)), "not valid TOML")


def test_cache_dir_locked_by_another_daemon(mount: Mount, tmp_path: Path) -> None:
    other = tmp_path / "other-mnt"
    other.mkdir()
    for extra in ((), ("--daemon",)):
        result = mount.cli("mount", mount.source, str(other), "--cache-dir", str(mount.cache), *extra)
        _one_line_error(result, "in use by another ckptfs daemon")


def test_cache_dir_of_another_source(mount: Mount, tmp_path: Path) -> None:
    assert mount.umount().returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = mount.cli("mount", f"file://{elsewhere}", str(mount.mnt), "--cache-dir", str(mount.cache))
    _one_line_error(result, "holds data of", "another --cache-dir")


def test_status_flush_umount_without_daemon(dirs: dict[str, Path]) -> None:
    import os

    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(dirs["run"]))
    for args in (("status", str(dirs["mnt"])), ("flush", str(dirs["mnt"])), ("umount", str(dirs["mnt"]))):
        _one_line_error(ckptfs_cli(*args, env=env), "no ckptfs daemon is serving")


@pytest.mark.core
def test_daemon_mode_status_flush_umount(dirs: dict[str, Path]) -> None:
    import os

    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(dirs["run"]))
    result = _mount(dirs, "--daemon", "--upload-delay", "0")
    assert result.returncode == 0, result.stderr
    assert "mounted on" in result.stdout
    try:
        (dirs["mnt"] / "f").write_bytes(b"abc")
        flush = ckptfs_cli("flush", str(dirs["mnt"]), str(dirs["mnt"] / "f"), "--timeout", "30", env=env)
        assert flush.returncode == 0, flush.stderr
        assert (dirs["store"] / "f").read_bytes() == b"abc"
        status = json.loads(ckptfs_cli("status", str(dirs["mnt"]), "--json", env=env).stdout)
        assert status["states"]["clean"] == {"files": 1, "bytes": 3}
        assert status["queue"]["uploads"] == 0 and status["last_error"] is None
        (dirs["mnt"] / "f").rename(dirs["mnt"] / "g")
        assert ckptfs_cli("flush", str(dirs["mnt"]), "--timeout", "30", env=env).returncode == 0
        status = json.loads(ckptfs_cli("status", str(dirs["mnt"]), "--json", env=env).stdout)
        assert status["uploaded"]["moves"] == 1 and status["uploaded"]["deletes"] >= 1
        human = ckptfs_cli("status", str(dirs["mnt"]), env=env)
        assert human.returncode == 0 and "clean" in human.stdout
        outside = ckptfs_cli("flush", str(dirs["mnt"]), "/etc/passwd", env=env)
        _one_line_error(outside, "is not inside")
    finally:
        umount = ckptfs_cli("umount", str(dirs["mnt"]), env=env)
    assert umount.returncode == 0, umount.stderr
    assert guard.is_guarded(dirs["mnt"])  # unmounted, and the bare directory guarded
    # ... and umount's last line says so: why, what it does to an rm -rf, and how to lift it
    last = umount.stdout.strip().splitlines()[-1]
    assert "read-only guard now covers" in last and "EBUSY" in last and f"ckptfs unguard {dirs['mnt']}" in last
    assert "EBUSY" in (dirs["mnt"] / guard.README).read_text()


def test_umount_returns_once_the_daemon_let_go_of_its_cache_dir_and_metrics_port(dirs: dict[str, Path]) -> None:
    """`ckptfs umount && ckptfs mount` (a restart script, a systemd ExecStop/ExecStart) must not find the
    cache dir locked or the metrics port taken by the daemon that is still exiting (CI saw the port taken)."""
    import fcntl
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(dirs["run"]))
    for _ in range(3):
        result = _mount(dirs, "--daemon", "--metrics-addr", f"127.0.0.1:{port}")
        assert result.returncode == 0, result.stderr
        (dirs["mnt"] / "f").write_bytes(b"abc")
        umount = ckptfs_cli("umount", str(dirs["mnt"]), env=env)
        assert umount.returncode == 0, umount.stderr
        with socket.socket() as s:  # what the next daemon's metrics server does first
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
        fd = os.open(dirs["cache"] / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the next daemon's cache lock does
        finally:
            os.close(fd)
    assert (dirs["store"] / "f").read_bytes() == b"abc"


def test_flush_timeout_exit_code(mount: Mount) -> None:
    handle = open(mount.mnt / "held-open", "wb")  # noqa: SIM115
    handle.write(b"x")
    handle.flush()
    result = mount.cli("flush", str(mount.mnt), "--timeout", "0.5")
    assert result.returncode == 3
    assert "held-open" in result.stderr
    handle.close()
    mount.flush()


@pytest.mark.core
def test_sigterm_drains_then_unmounts(mount_factory) -> None:  # type: ignore[no-untyped-def]
    import signal

    m: Mount = mount_factory(upload_delay=3600)  # nothing would upload on its own for an hour
    (m.mnt / "step_5.pt").write_bytes(b"w" * 100_000)
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    assert m.store_files() == {"step_5.pt": b"w" * 100_000}
    assert guard.is_guarded(m.mnt)  # unmounted, and the bare directory guarded


@pytest.mark.serial  # a second SIGTERM ends the daemon within 4 s
@pytest.mark.parametrize("signals", [1, 2], ids=["one-signal", "second-signal"])
def test_sigterm_with_a_store_refusing_writes_exits_3_and_loses_nothing(
    mount_factory, signals: int  # type: ignore[no-untyped-def]
) -> None:
    """The drain cannot finish (the store is read-only): SIGTERM waits out drain_timeout, unmounts and exits 3;
    a second SIGTERM exits at once. Either way the file uploads at the next start of the same cache dir."""
    import signal
    import time

    m: Mount = mount_factory(upload_delay=3600, extra_args=("--drain-timeout", "5"))
    m.allowed_log_words += ["failed and will be retried", "not yet durable", "second signal", "Read-only"]
    subprocess.run(["mount", "--bind", str(m.store), str(m.store)], check=True)
    subprocess.run(["mount", "-o", "remount,ro,bind", str(m.store)], check=True)
    try:
        (m.mnt / "step_9.pt").write_bytes(b"s" * 50_000)
        assert m.proc is not None
        started = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(0.5)
            m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(timeout=90) == 3
        elapsed = time.monotonic() - started
        assert (elapsed < 4) if signals == 2 else (elapsed >= 4.9), elapsed
        m.proc = None
        assert guard.is_guarded(m.mnt)  # unmounted, and the bare directory guarded
    finally:
        subprocess.run(["umount", str(m.store)], check=True)
    assert m.store_files() == {}
    m.start()
    m.flush()
    assert m.store_files() == {"step_9.pt": b"s" * 50_000}


def test_external_unmount_drains_before_exit(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=3600)
    (m.mnt / "f").write_bytes(b"data")
    subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True)
    assert m.proc is not None
    assert m.proc.wait(timeout=60) == 0
    m.proc = None
    assert m.store_files() == {"f": b"data"}


def test_large_writes_fault_in_no_fresh_pages(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The daemon runs with a pad kept at the top of glibc's heap (cli.MALLOC_TUNABLE), the same process
    the supervisor started. Without it every 1 MiB write request faulted in 256 fresh zeroed pages: half of
    the daemon's CPU for a large write (bench/results/HISTORY.md, "Where the time goes")."""
    # the drain stays away: only the FUSE requests allocate; the daemon restarts itself to set the pad
    m = mount_factory(upload_delay=3600, restarts_for_malloc_pad=True)
    pid = m.proc.pid
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert any(e.startswith(b"GLIBC_TUNABLES=") and MALLOC_TUNABLE.encode() in e for e in environ)

    def minor_faults() -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])

    block = os.urandom(1 << 20)
    with open(m.mnt / "warm.bin", "wb", buffering=0) as f:  # the heap grows to its working size once
        for _ in range(8):
            f.write(block)
    before = minor_faults()
    with open(m.mnt / "big.bin", "wb", buffering=0) as f:
        for _ in range(64):
            f.write(block)
    faults = minor_faults() - before
    assert faults < 64 * 16, f"{faults} minor faults for 64 MiB written (about 256 per MiB without the pad)"
    assert (m.mnt / "big.bin").read_bytes() == block * 64


def _read_ahead_kb(mnt: Path) -> int:
    return int(Path(read_ahead_path(os.stat(mnt).st_dev)).read_text())


def test_the_mount_reads_ahead_in_large_requests(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """With the kernel's FUSE read-ahead (128 KiB) a sequential read of 1 GiB from the cache was 8,000
    requests and up to 4 s of daemon CPU; the daemon raises it (read_ahead, default 4 MiB: 1 MiB requests)
    unless told to keep the kernel's."""
    default = mount_factory("default")
    assert _read_ahead_kb(default.mnt) == 4096
    chosen = mount_factory("chosen", extra_args=("--read-ahead", "1M"))
    assert _read_ahead_kb(chosen.mnt) == 1024
    kept = mount_factory("kept", extra_args=("--read-ahead", "0"))
    assert _read_ahead_kb(kept.mnt) < 1024
    data = os.urandom(3 << 20)
    (default.mnt / "f").write_bytes(data)
    assert (default.mnt / "f").read_bytes() == data


def test_the_malloc_pad_joins_the_operators_tunables_and_yields_to_theirs() -> None:
    setting = f"{MALLOC_TUNABLE}={16 << 20}"
    assert _with_malloc_pad({})["GLIBC_TUNABLES"] == setting
    merged = _with_malloc_pad({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert merged["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{setting}"
    theirs = {"GLIBC_TUNABLES": f"{MALLOC_TUNABLE}=0"}
    assert _with_malloc_pad(theirs) is theirs


@pytest.mark.parametrize("executable", ["", None])
def test_an_embedded_interpreter_runs_on_without_the_malloc_pad(
    monkeypatch: pytest.MonkeyPatch, executable: str | None
) -> None:
    import sys

    restarts: list[str] = []
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "executable", executable)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: restarts.append(path))
    _restart_with_malloc_pad()
    assert restarts == []


def test_the_daemon_restarts_itself_once_with_the_malloc_pad(monkeypatch: pytest.MonkeyPatch) -> None:
    restarts: list[dict[str, str]] = []
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(os, "execve", lambda path, argv, env: restarts.append(env))
    _restart_with_malloc_pad()
    assert [env["GLIBC_TUNABLES"] for env in restarts] == [f"{MALLOC_TUNABLE}={16 << 20}"]
    monkeypatch.setenv("GLIBC_TUNABLES", restarts[0]["GLIBC_TUNABLES"])
    _restart_with_malloc_pad()  # the restarted process: already padded
    assert len(restarts) == 1


def test_cache_dir_and_files_are_private(dirs: dict[str, Path]) -> None:
    import os
    import stat

    result = _mount(dirs, "--daemon")
    assert result.returncode == 0, result.stderr
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(dirs["run"]))
    try:
        (dirs["mnt"] / "f").write_bytes(b"secret")
        for path in [dirs["cache"], *dirs["cache"].rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
    finally:
        assert ckptfs_cli("umount", str(dirs["mnt"]), env=env).returncode == 0


def test_daemon_true_in_config_file_detaches_once(dirs: dict[str, Path], tmp_path: Path) -> None:
    import os

    config = tmp_path / "node.toml"
    config.write_text(f'source = "file://{dirs["store"]}"\nmountpoint = "{dirs["mnt"]}"\ndaemon = true\n')
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(dirs["run"]))
    result = ckptfs_cli("mount", "--config", str(config), "--cache-dir", str(dirs["cache"]), env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert ckptfs_cli("umount", str(dirs["mnt"]), env=env).returncode == 0


def test_repeated_log_messages_are_rate_limited() -> None:
    import logging
    import time

    from ckptfs.cli.logs import RepeatFilter

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    handler.addFilter(RepeatFilter(burst=5, window=0.2))
    logger = logging.getLogger("ckptfs.test-repeat")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for i in range(20):
            logger.error("upload of %s failed: AccessDenied", f"file-{i}")
        logger.error("something else")
        assert len(records) == 6
        time.sleep(0.25)
        logger.error("upload of %s failed: AccessDenied", "file-20")
        assert records[-1] == "upload of file-20 failed: AccessDenied (and 15 more like it in the last minute)"
    finally:
        logger.removeHandler(handler)


def test_a_reply_nobody_waits_for_any_more_is_not_logged_as_an_error() -> None:
    """`fusermount -u` right after a close: the kernel refuses the RELEASE's late reply with ENOENT, and
    pyfuse3 logs that as an ERROR (seen in test_external_unmount_drains_before_exit). Other failed replies
    stay errors."""
    import logging

    from ckptfs.cli.logs import AnswerNobodyWaitsFor

    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("pyfuse3.test-replies")
    logger.propagate = False
    handler = Collect()
    logger.addHandler(handler)
    logger.addFilter(AnswerNobodyWaitsFor())
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.INFO)
    try:
        logger.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        logger.error("fuse_write(): fuse_reply_* failed with %s", os.strerror(errno.EIO))
        assert [(r.levelname, r.getMessage()) for r in records] == [
            ("ERROR", "fuse_write(): fuse_reply_* failed with Input/output error")]
    finally:
        logging.getLogger().setLevel(root_level)
        logger.removeHandler(handler)


def test_effective_configuration_is_logged_without_credentials(tmp_path: Path) -> None:
    from ckptfs.config import load_config

    config = load_config(None, {"source": "s3://b/p", "mountpoint": tmp_path,
                                "endpoint_url": "http://user:secret@127.0.0.1:9000"})
    line = config.effective(tmp_path / "cache")
    assert "secret" not in line and "user" not in line
    assert "endpoint_url http://127.0.0.1:9000" in line and "cache_size 80%" in line and "transfers 8" in line


def test_upload_while_writing_takes_auto_on_off_and_booleans(tmp_path: Path) -> None:
    from ckptfs.config import load_config

    base = {"source": "s3://b/p", "mountpoint": tmp_path}
    assert load_config(None, base).upload_while_writing == "off"
    for given, mode in ((True, "on"), (False, "off"), ("On", "on"), ("auto", "auto")):
        assert load_config(None, {**base, "upload_while_writing": given}).upload_while_writing == mode
    with pytest.raises(UsageError, match="auto, on or off"):
        load_config(None, {**base, "upload_while_writing": "sometimes"})


def test_a_journal_of_another_schema_is_one_clear_error(dirs: dict[str, Path]) -> None:
    import sqlite3

    dirs["cache"].mkdir(parents=True)
    db = sqlite3.connect(dirs["cache"] / "journal.db")
    db.executescript("CREATE TABLE inodes (id INTEGER PRIMARY KEY); PRAGMA user_version = 1;")
    db.close()
    result = _mount(dirs)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("ckptfs:")]
    assert len(lines) == 1 and "--cache-dir" in lines[0] and "Traceback" not in result.stderr, result.stderr
