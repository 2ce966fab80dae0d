"""Configuration from CKPTFS_<KEY> environment variables (a container configured by a ConfigMap's envFrom):
every config key, precedence flags > environment > config file > defaults, one clear error naming the
variable, other CKPTFS_ names left alone; and a mount configured by nothing else, restarted by its holder."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Mount, ckptfs_cli

from ckptfs import cli
from ckptfs.cli import arguments
from ckptfs.config import DEFAULT_COMMIT_MARKERS, Config, load_config, load_settings
from ckptfs.control import client
from ckptfs.errors import CkptfsError, UsageError


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No config variable of the machine running the tests may leak into them."""
    for name in list(os.environ):
        if name.startswith("CKPTFS_") and name != "CKPTFS_RUNTIME_DIR":
            monkeypatch.delenv(name)


def _mount_config(*argv: str) -> Config:
    """The Config `ckptfs mount ARGV` would run with, in this process's environment."""
    return arguments.config_from_args(arguments.build_parser().parse_args(["mount", *argv]))


def test_every_kind_of_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env = {
        "CKPTFS_SOURCE": "s3://bucket/run-42",
        "CKPTFS_MOUNTPOINT": str(tmp_path / "mnt"),
        "CKPTFS_CACHE_DIR": str(tmp_path / "cache"),
        "CKPTFS_CACHE_SIZE": "200G",
        "CKPTFS_KEEP_MOUNT": "false",
        "CKPTFS_GATEWAY": "Yes",
        "CKPTFS_GUARD_MOUNTPOINT": "0",
        "CKPTFS_METRICS_ADDR": "0.0.0.0:9477",
        "CKPTFS_COMMIT_MARKERS": "latest, *.done ,COMMITTED,",
        "CKPTFS_KEEP": "best_*",
        "CKPTFS_TRANSFERS": "4",
        "CKPTFS_KEEP_LAST": "3",
        "CKPTFS_UPLOAD_DELAY": "0.5",
        "CKPTFS_PART_SIZE": "128M",
        "CKPTFS_PASSTHROUGH": "false",
        "CKPTFS_UPLOAD_WHILE_WRITING": "auto",
        "CKPTFS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "CKPTFS_LOG_LEVEL": "DEBUG",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = _mount_config()
    assert config.source == "s3://bucket/run-42"
    assert config.mountpoint == tmp_path / "mnt" and config.cache_dir == tmp_path / "cache"
    assert config.cache_size == "200G" and config.part_size == "128M"
    assert config.keep_mount is False and config.gateway is True and config.guard_mountpoint is False
    assert config.metrics_addr == "0.0.0.0:9477"
    assert config.commit_markers == ("latest", "*.done", "COMMITTED")
    assert config.keep == ("best_*",)
    assert config.transfers == 4 and config.keep_last == 3 and config.upload_delay == 0.5
    assert config.passthrough == "off" and config.upload_while_writing == "auto"
    assert config.endpoint_url == "http://127.0.0.1:9000" and config.log_level == "DEBUG"


def test_a_list_can_be_a_toml_array_and_an_empty_one_turns_markers_off() -> None:
    base = {"CKPTFS_SOURCE": "file:///s", "CKPTFS_MOUNTPOINT": "/m"}
    config = load_config(None, {}, {**base, "CKPTFS_COMMIT_MARKERS": '["a,b", "latest"]'})
    assert config.commit_markers == ("a,b", "latest")
    assert load_config(None, {}, {**base, "CKPTFS_COMMIT_MARKERS": "[]"}).commit_markers == ()
    # An empty variable is unset (what a template that renders nothing gives): the default stays.
    assert load_config(None, {}, {**base, "CKPTFS_COMMIT_MARKERS": ""}).commit_markers == DEFAULT_COMMIT_MARKERS
    assert load_config(None, {}, {**base, "CKPTFS_TRANSFERS": " "}).transfers == 8


def test_flags_beat_the_environment_which_beats_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('source = "file:///from-file"\nmountpoint = "/file-mnt"\ntransfers = 2\nupload_delay = 7.0\n'
                    'cache_size = "10G"\n')
    monkeypatch.setenv("CKPTFS_CONFIG", str(toml))
    config = _mount_config()  # the file named by CKPTFS_CONFIG, nothing else
    assert (config.source, config.mountpoint, config.transfers, config.upload_delay, config.cache_size) == (
        "file:///from-file", Path("/file-mnt"), 2, 7.0, "10G")
    assert config.drain_timeout == 300.0  # set nowhere: the default

    monkeypatch.setenv("CKPTFS_TRANSFERS", "3")
    monkeypatch.setenv("CKPTFS_UPLOAD_DELAY", "5")
    monkeypatch.setenv("CKPTFS_MOUNTPOINT", "/env-mnt")
    config = _mount_config("--upload-delay", "1", "file:///from-flag")
    assert config.transfers == 3  # environment over file
    assert config.upload_delay == 1.0 and config.source == "file:///from-flag"  # flags over environment
    assert config.mountpoint == Path("/env-mnt") and config.cache_size == "10G"

    other = tmp_path / "other.toml"
    other.write_text('source = "file:///other"\nmountpoint = "/m"\n')
    assert _mount_config("--config", str(other)).source == "file:///other"  # --config over CKPTFS_CONFIG


def test_names_that_are_not_config_keys_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"CKPTFS_SOURCE": "file:///s", "CKPTFS_MOUNTPOINT": "/m", "CKPTFS_READY_FD": "x",
                        "CKPTFS_TAKEOVER_FD": "y", "CKPTFS_TAKEOVER_INIT": "z", "CKPTFS_MAX_QUICK_RESTARTS": "2",
                        "CKPTFS_FUSE_PREFIX": "/opt", "CKPTFS_DEMO_DIR": "/d", "CKPTFS_TEST_WORKERS": "4",
                        "CKPTFS_NO_SUCH_SETTING": "1", "CKPTFS_": "1", "ckptfs_transfers": "1"}.items():
        monkeypatch.setenv(name, value)
    config = _mount_config()
    assert config == Config(source="file:///s", mountpoint=Path("/m"))


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("CKPTFS_CACHE_SIZE", "lots", "size 'lots'"),
    ("CKPTFS_KEEP_MOUNT", "maybe", "true or false"),
    ("CKPTFS_TRANSFERS", "4.5", "whole number"),
    ("CKPTFS_TRANSFERS", "0", "whole number >= 1"),
    ("CKPTFS_UPLOAD_DELAY", "soon", "number of seconds"),
    ("CKPTFS_PASSTHROUGH", "on", "auto or off"),
    ("CKPTFS_PART_SIZE", "10%", "not a percentage"),
    ("CKPTFS_COMMIT_MARKERS", "[latest", "TOML array"),
])
def test_a_bad_value_is_one_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str, fragment: str,
) -> None:
    monkeypatch.setenv("CKPTFS_SOURCE", "file:///s")
    monkeypatch.setenv("CKPTFS_MOUNTPOINT", "/m")
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as raised:
        _mount_config()
    assert f"environment variable {name}" in str(raised.value) and fragment in str(raised.value)
    assert cli.main(["mount"]) == 2  # as the command line says it: one line, exit 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and name in lines[0] and lines[0].startswith("ckptfs: ")


def test_a_bad_value_in_the_file_names_the_file(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('transfers = "many"\n')
    with pytest.raises(UsageError, match=f"config file {toml}: transfers must be"):
        load_settings(toml, {})


def test_mount_without_arguments_says_where_the_source_can_come_from(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mount"]) == 2
    err = capsys.readouterr().err
    assert "source is missing" in err and "CKPTFS_SOURCE" in err


def test_commands_take_the_mountpoint_from_the_environment(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "CKPTFS_RUNTIME_DIR": str(tmp_path / "run"), "CKPTFS_MOUNTPOINT": str(mnt)}
    for command in ("status", "flush", "refresh", "umount", "restart", "nodes"):
        result = ckptfs_cli(command, env=env)
        assert result.returncode == 1 and f"no ckptfs daemon is serving {mnt}" in result.stderr, result.stderr
    env.pop("CKPTFS_MOUNTPOINT")
    result = ckptfs_cli("status", env=env)
    assert result.returncode == 2 and "status needs a MOUNTPOINT (or CKPTFS_MOUNTPOINT" in result.stderr


def test_umount_and_guard_use_the_configured_drain_timeout_and_guard_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[float | None] = []

    def unmount(mountpoint: Path, timeout: float | None = None) -> None:
        seen.append(timeout)

    monkeypatch.setattr(client, "unmount", unmount)
    monkeypatch.setenv("CKPTFS_MOUNTPOINT", str(tmp_path))
    assert cli.main(["umount"]) == 0 and seen == [None]  # no limit unless configured
    monkeypatch.setenv("CKPTFS_DRAIN_TIMEOUT", "42")
    assert cli.main(["umount"]) == 0 and seen[-1] == 42.0
    assert cli.main(["umount", "--timeout", "7"]) == 0 and seen[-1] == 7.0
    monkeypatch.setenv("CKPTFS_GUARD_MOUNTPOINT", "false")
    assert cli.main(["guard"]) == 0
    assert "left unguarded" in capsys.readouterr().out


class EnvMount(Mount):
    """A daemon started as `ckptfs mount` with no argument: everything from CKPTFS_ variables."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.env.update({
            "CKPTFS_SOURCE": self.source, "CKPTFS_MOUNTPOINT": str(self.mnt), "CKPTFS_CACHE_DIR": str(self.cache),
            "CKPTFS_UPLOAD_DELAY": "0.1", "CKPTFS_LOG_LEVEL": "DEBUG", "CKPTFS_METRICS_ADDR": "off",
            "CKPTFS_MIN_FREE": "0", "CKPTFS_COMMIT_MARKERS": "DONE",
        })

    def start(self, timeout: float = 60) -> None:
        read_fd, write_fd = os.pipe()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "ckptfs", "mount"], stdout=log, stderr=log,
                                         pass_fds=(write_fd,), env=dict(self.env, CKPTFS_READY_FD=str(write_fd)))
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as ready:
            message = ready.read().decode().strip()
        if message != "ready":
            self.proc.wait(timeout=timeout)
            raise RuntimeError(f"daemon did not start: {message!r}\n{self.log.read_text()}")


def test_a_mount_configured_by_the_environment_alone_survives_a_restart_by_its_holder(tmp_path: Path) -> None:
    m = EnvMount(tmp_path / "m")
    m.start()
    try:
        assert m.proc is not None
        first = m.proc.pid
        (m.mnt / "a").write_bytes(b"first")
        assert ckptfs_cli("flush", "--timeout", "30", env=m.env).returncode == 0  # CKPTFS_MOUNTPOINT
        assert m.store_files() == {"a": b"first"}
        status = m.status()
        assert status["cache_dir"] == str(m.cache) and status["keep_mount"]["holder_pid"]

        m.proc.send_signal(signal.SIGKILL)  # the holder starts `ckptfs mount` again, in the same environment
        m.proc.wait()
        m.proc = None
        deadline = time.monotonic() + 60
        pid = first
        while pid == first:
            assert time.monotonic() < deadline, m.log.read_text()[-3000:]
            with contextlib.suppress(CkptfsError):
                pid = int(m.status()["pid"])
            time.sleep(0.1)
        assert m.status()["cache_dir"] == str(m.cache)  # the restarted daemon has the same configuration
        (m.mnt / "DONE").write_bytes(b"marker")
        (m.mnt / "b").write_bytes(b"second")
        umount = ckptfs_cli("umount", env=m.env)
        assert umount.returncode == 0, umount.stderr
        assert m.store_files() == {"a": b"first", "b": b"second", "DONE": b"marker"}
        # the log says which settings it ran with: the environment's
        assert "upload_delay 0.1" in m.log.read_text() and "commit_markers DONE" in m.log.read_text()
    finally:
        m.cleanup()
