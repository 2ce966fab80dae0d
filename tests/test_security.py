"""What a mount keeps to itself: the cache dir is private (0700 directories, 0600 files, whatever the
umask), the control socket serves only root and the mount's owner, and credentials never reach the log,
`ckptfs status`, the metrics page or the journal."""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators import S3Server, free_ports, moto_s3, s3_bucket  # noqa: F401

from ckptfs import cli


def _private(root: Path) -> list[str]:
    """Paths under `root` (and root) that a user other than the owner could read, list or enter."""
    exposed = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_IMODE(mode) & 0o077:
            exposed.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return exposed


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_cache_dir_and_every_file_in_it_are_private_even_with_umask_0(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shared = tmp_path / "shared"
    shared.mkdir()
    with _umask(0):  # the daemons inherit it: nothing they make may rely on the umask
        writer = mount_factory("writer", source=f"file://{shared}")
        reader = mount_factory("reader", source=f"file://{shared}")
    (writer.mnt / "d").mkdir()
    (writer.mnt / "d" / "weights.bin").write_bytes(os.urandom(1 << 20))
    writer.flush()
    assert (reader.mnt / "d" / "weights.bin").read_bytes() == (writer.mnt / "d" / "weights.bin").read_bytes()
    for node in (writer, reader):
        files = [p for p in node.cache.rglob("*") if p.is_file()]
        assert any(p.name.startswith("journal.db") for p in files) and len(files) >= 3, files
        assert _private(node.cache) == []


def _run_cli_as(user: str, *args: str, env: dict[str, str]) -> tuple[int, str]:
    """`ckptfs ARGS` in a forked child that dropped to `user` (the venv's interpreter lives under /root,
    which other users cannot execute, so the CLI runs in a fork of this process)."""
    entry = pwd.getpwnam(user)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            os.dup2(write_fd, 2)
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - pytest replaced sys.stderr
            os.setgroups([])
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            os.environ.clear()
            os.environ.update(env)
            code = cli.main(list(args))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as err:
        stderr = err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stderr


@pytest.fixture
def open_runtime_dir() -> Iterator[Path]:
    """A runtime dir outside pytest's 0700 tmp dir, so that other users can reach it when a test allows."""
    path = Path(tempfile.mkdtemp(prefix="ckptfs-run-"))
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def test_control_socket_refuses_other_users(mount_factory, open_runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    # (no holder: the runtime dir fixture removes the sockets before the mount's teardown would unmount it)
    node = mount_factory(start=False, extra_args=("--no-keep-mount",))
    node.env["CKPTFS_RUNTIME_DIR"] = str(open_runtime_dir)
    node.start()
    node.allowed_log_words.append("control socket: refused a request from uid")
    env = {"CKPTFS_RUNTIME_DIR": str(open_runtime_dir), "PATH": "/usr/bin:/bin"}
    (sock,) = open_runtime_dir.iterdir()
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    # Layer 1, file permissions: the socket is the daemon user's alone.
    open_runtime_dir.chmod(0o755)
    code, err = _run_cli_as("nobody", "status", str(node.mnt), env=env)
    assert code == 1 and "permission denied" in err, err
    # Layer 2, the daemon's own check: with the socket made reachable, the daemon refuses the caller.
    sock.chmod(0o666)
    for command in (["status", str(node.mnt), "--json"], ["flush", str(node.mnt)], ["umount", str(node.mnt)]):
        code, err = _run_cli_as("nobody", *command, env=env)
        assert code == 1 and "permission denied" in err and "only root and uid 0" in err, (command, err)
    assert "refused a request from uid 65534" in node.log.read_text()
    # Root still may, and the mount is unharmed.
    (node.mnt / "f").write_bytes(b"x")
    node.flush()
    assert node.status()["states"]
    assert node.umount().returncode == 0  # while its control socket is there (the runtime dir goes first)


def test_the_holder_socket_is_the_mount_owners_alone(mount_factory, open_runtime_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """keep_mount's holder hands out the FUSE connection: its socket is 0600 like the control socket (the
    holder also checks the caller's uid, as the daemon does)."""
    node = mount_factory(start=False)
    node.env["CKPTFS_RUNTIME_DIR"] = str(open_runtime_dir)
    node.runtime = open_runtime_dir
    node.start()
    (holder,) = [p for p in open_runtime_dir.iterdir() if p.suffix == ".hold"]
    assert stat.S_IMODE(holder.stat().st_mode) == 0o600
    node.umount()


ACCESS_KEY = "AKIAZZLEAKCANARY7Q2X"
SECRET_KEY = "SecretCanary/q9W+xYz8kLmNoP3rStUvWx4yZaBcDe"
URL_SECRET = "UrlPasswordCanary5T7"


def test_credentials_never_reach_log_status_metrics_or_journal(mount_factory, moto_s3: S3Server) -> None:  # type: ignore[no-untyped-def]
    """moto accepts any key pair: the daemon runs with a distinctive one (from the environment, as the
    SDK's chain reads it) and a password in the endpoint URL's user part, does some work including a
    failing upload, and nothing it wrote or serves contains any of the three."""
    (metrics_port,) = free_ports(1)
    with s3_bucket(moto_s3) as bucket:
        node = mount_factory(
            start=False, source=f"s3://{bucket}/run",
            extra_args=(
                "--endpoint-url", moto_s3.endpoint.replace("http://", f"http://ckptuser:{URL_SECRET}@"),
                "--metrics-addr", f"127.0.0.1:{metrics_port}",
            ),
        )
        node.env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        node.start()
        node.allowed_log_words += [
            "user:password part of the endpoint URL is ignored", "NoSuchBucket", "does not exist", "upload of",
            "failed", "retry",
        ]
        (node.mnt / "step_1").mkdir()
        (node.mnt / "step_1" / "model.pt").write_bytes(os.urandom(300_000))
        node.flush()
        # An error: the bucket goes away under the mount; the next upload fails until it is back.
        moto_s3.empty_bucket(bucket)
        (node.mnt / "step_1" / "optim.pt").write_bytes(os.urandom(1000))
        deadline = time.monotonic() + 30
        while not node.status().get("last_error") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert node.status().get("last_error"), "the failing upload must have been seen"
        moto_s3.client().create_bucket(Bucket=bucket)
        node.flush(timeout=120)
        status = node.cli("status", str(node.mnt), "--json").stdout + node.cli("status", str(node.mnt)).stdout
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        assert "ckptfs_" in metrics and '"states"' in status
        assert node.umount().returncode == 0
        journal = b"".join(p.read_bytes() for p in node.cache.iterdir() if p.name.startswith("journal.db"))
        for secret in (ACCESS_KEY, SECRET_KEY, SECRET_KEY.split("/")[0], URL_SECRET):
            assert secret not in node.log.read_text()
            assert secret not in status
            assert secret not in metrics
            assert secret.encode() not in journal


def test_a_password_in_an_unreachable_endpoint_url_is_not_repeated(tmp_path: Path) -> None:
    """The error a mount gives when the endpoint cannot be reached names the endpoint, without its user
    part (botocore would repeat it in every error)."""
    from conftest import ckptfs_cli

    (tmp_path / "mnt").mkdir()
    (port,) = free_ports(1)  # nothing listens there
    env = dict(os.environ, AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b", CKPTFS_RUNTIME_DIR=str(tmp_path / "run"))
    result = ckptfs_cli(
        "mount", "s3://bucket/prefix", str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "cache"),
        "--metrics-addr", "off", "--endpoint-url", f"http://ckptuser:{URL_SECRET}@127.0.0.1:{port}", env=env,
    )
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr, result.stderr
    assert URL_SECRET not in result.stdout + result.stderr
