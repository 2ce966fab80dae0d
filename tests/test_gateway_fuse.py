"""Gateway mode through a real mount, with and without FUSE passthrough: a local process keeps files open for
writing, as an NFS server does, and they reach the store once idle, after an fsync, and for a flush, never
torn; without the option a file open for writing stays out of the store until its close."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import pytest
from conftest import Mount
from test_passthrough import _kernel_has_passthrough
from waiting import wait_until

PASSTHROUGH = [
    pytest.param("auto", id="passthrough", marks=pytest.mark.skipif(
        not getattr(pyfuse3, "PASSTHROUGH_BUILD", False) or not _kernel_has_passthrough(),
        reason="FUSE passthrough needs a root daemon on Linux >= 6.9 and pyfuse3 built by scripts/build-fuse.sh")),
    pytest.param("off", id="no-passthrough"),
]


def gateway(mount_factory: Callable[..., Mount], passthrough: str, idle: float) -> Mount:
    mount = mount_factory(extra_args=("--gateway", "--idle-upload", str(idle), "--passthrough", passthrough))
    assert mount.status()["passthrough"]["enabled"] == (passthrough == "auto")
    return mount


def wait_for_object(mount: Mount, name: str, data: bytes, seconds: float = 15) -> float:
    """Seconds until the store holds `data` at `name`."""
    started = time.monotonic()
    wait_until(lambda: mount.store_files().get(name) == data, timeout=seconds,
               what=f"{name} in the store as written ({len(data)} bytes)")
    return time.monotonic() - started


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_a_file_held_open_is_uploaded_once_idle_and_again_after_a_change(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    mount = gateway(mount_factory, passthrough, 1.0)
    with open(mount.mnt / "shard.pt", "w+b") as f:
        f.write(b"a" * 100_000)
        f.flush()
        assert wait_for_object(mount, "shard.pt", b"a" * 100_000) >= 0.9
        f.seek(0)
        f.write(b"b" * 50_000)  # in place
        f.flush()
        wait_for_object(mount, "shard.pt", b"b" * 50_000 + b"a" * 50_000)
        # Written through a shared mapping, then written back (as msync does).
        mm = mmap.mmap(f.fileno(), 0)
        mm[0:6] = b"mmap!!"
        mm.flush()
        mm.close()
        wait_for_object(mount, "shard.pt", b"mmap!!" + b"b" * 49_994 + b"a" * 50_000)
    mount.flush()
    assert mount.store_files() == {"shard.pt": b"mmap!!" + b"b" * 49_994 + b"a" * 50_000}


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_a_file_written_every_few_tenths_is_not_uploaded_until_it_pauses(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    mount = gateway(mount_factory, passthrough, 1.0)
    data = b""
    with open(mount.mnt / "log.bin", "wb") as f:
        for i in range(15):  # 3 s, a write every 0.2 s
            chunk = bytes([65 + i]) * 4096
            f.write(chunk)
            f.flush()
            data += chunk
            time.sleep(0.2)
            assert "log.bin" not in mount.store_files()
        wait_for_object(mount, "log.bin", data)


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_rewrites_racing_the_uploads_never_show_a_torn_object(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    """The writer rewrites the whole file in place, a different byte each time, at about the idle time, so
    that rewrites land while it is staged; whatever the store shows is always one whole rewrite, and in the
    end the last one."""
    mount = gateway(mount_factory, passthrough, 0.3)
    size = 16 << 20
    seen: list[bytes] = []
    torn: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                data = (mount.store / "big.bin").read_bytes()
            except FileNotFoundError:
                continue
            if not data:
                # The file as open() created it, idle for the idle time when the machine delays the first
                # write that long: a whole version, but only before any rewrite.
                if seen:
                    torn.append("empty after a rewrite")
                continue
            if data[:1] not in seen:
                seen.append(data[:1])
            if len(data) != size or data.count(data[:1]) != size:
                torn.append(f"{len(data)} bytes, not all {data[:1]!r}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with open(mount.mnt / "big.bin", "w+b") as f:
            for i in range(12):
                f.seek(0)
                f.write(bytes([48 + i]) * size)
                f.flush()
                time.sleep(0.3 + 0.2 * (i % 4))
            wait_for_object(mount, "big.bin", bytes([48 + 11]) * size, 30)
    finally:
        stop.set()
        watcher.join()
    assert not torn, torn[:3]
    assert len(seen) >= 2  # it was uploaded while it was rewritten, not only at the end


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_fsync_of_a_file_held_open_uploads_it_once_its_last_write_is_a_second_old(  # type: ignore[no-untyped-def]
    mount_factory, passthrough: str
) -> None:
    mount = gateway(mount_factory, passthrough, 60)
    with open(mount.mnt / "committed.bin", "wb") as f:
        f.write(b"c" * 10_000)
        f.flush()
        time.sleep(0.5)
        assert "committed.bin" not in mount.store_files()
        os.fsync(f.fileno())  # an NFS COMMIT reaches the mount so
        assert wait_for_object(mount, "committed.bin", b"c" * 10_000) < 10


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_flush_returns_while_a_file_is_held_open_with_its_content_in_the_store(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    mount = gateway(mount_factory, passthrough, 60)
    with open(mount.mnt / "open.bin", "wb") as f:
        f.write(b"first")
        f.flush()
        mount.flush(timeout=20)
        assert mount.store_files() == {"open.bin": b"first"}
        f.write(b" and second")
        f.flush()
        mount.flush(timeout=20)
        assert mount.store_files() == {"open.bin": b"first and second"}


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_without_gateway_mode_a_file_held_open_is_not_uploaded(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    mount = mount_factory(extra_args=("--passthrough", passthrough))
    with open(mount.mnt / "open.bin", "wb") as f:
        f.write(b"data")
        f.flush()
        os.fsync(f.fileno())
        result = mount.cli("flush", str(mount.mnt), "--timeout", "2")
        assert result.returncode == 3 and "open.bin" in result.stderr + result.stdout
        assert mount.store_files() == {}
    mount.flush()
    assert mount.store_files() == {"open.bin": b"data"}


def test_the_option_is_in_the_status_and_a_config_file(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = tmp_path / "gw.toml"
    config.write_text("gateway = true\nidle_upload = 0.5\n")
    mount = mount_factory(extra_args=("--config", str(config)))
    assert "gateway True" in mount.log.read_text() and "idle_upload 0.5" in mount.log.read_text()
    with open(mount.mnt / "x", "wb") as f:
        f.write(b"x")
        f.flush()
        wait_for_object(mount, "x", b"x")


@pytest.mark.parametrize("passthrough", PASSTHROUGH)
def test_kill9_after_an_upload_while_open_loses_nothing_written_later(mount_factory, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    """The store got the file while it was open; then it grew, and the daemon died with the file still open.
    The journal never called it clean: the next daemon uploads it as it was last written."""
    mount = gateway(mount_factory, passthrough, 0.3)
    fd = os.open(mount.mnt / "shard.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"1" * 200_000)
        wait_for_object(mount, "shard.pt", b"1" * 200_000)
        os.write(fd, b"2" * 100_000)
        mount.kill9()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    assert mount.store_files()["shard.pt"] in (b"1" * 200_000, b"1" * 200_000 + b"2" * 100_000)  # never torn
    mount.start()
    mount.flush(timeout=60)
    assert mount.store_files() == {"shard.pt": b"1" * 200_000 + b"2" * 100_000}
