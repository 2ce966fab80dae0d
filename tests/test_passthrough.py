"""FUSE passthrough (issue 27). Kernel-free: the rules of when a handle gets a backing file (one per inode,
shared, released after the last handle; never beside cached handles; only for files whose bytes are all
local; writers only while the budget has room) and what the daemon then knows (a writer dirties the file
at open; the accounting follows the file). Through real mounts: the kernel reads and writes the cache
file itself, and everything else keeps its meaning."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import platform
import signal
import socket
import subprocess
import time
from pathlib import Path

import pyfuse3
import pytest
import trio
from conftest import Mount, fuse_requests
from fsharness import GID, UID, Stack, check_consistency, make_stack
from waiting import drain_had_its_chance

from ckptfs.daemon import METRICS_INTERVAL
from ckptfs.fs import PASSTHROUGH_ROOM
from ckptfs.journal import DIRTY, ROOT_ID


class FakeBackingFiles:
    """Records registrations the way the kernel hands out backing ids."""

    def __init__(self) -> None:
        self.next_id = 1
        self.open_ids: set[int] = set()
        self.refuse: OSError | None = None

    def open(self, fd: int) -> int:
        os.fstat(fd)  # a real descriptor
        if self.refuse is not None:
            raise self.refuse
        backing_id, self.next_id = self.next_id, self.next_id + 1
        self.open_ids.add(backing_id)
        return backing_id

    def close(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)


async def _stack(tmp_path: Path, nursery: trio.Nursery, **kwargs: object) -> tuple[Stack, FakeBackingFiles]:
    stack = make_stack(tmp_path, **kwargs)  # type: ignore[arg-type]
    await nursery.start(stack.drain.run)
    backing = FakeBackingFiles()
    stack.fs.backing = backing
    return stack, backing


def _kernel_writes(path: str, data: bytes) -> None:
    """What a passthrough write does: the kernel writes the cache file, the daemon hears nothing."""
    with open(path, "r+b") as f:
        f.write(data)


async def test_one_backing_file_per_inode_shared_by_its_handles_and_released_after_the_last(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack, backing = await _stack(tmp_path, nursery)
    ino = stack.write_file("f", b"data")
    opens = stack.fs.passthrough_opens
    first = await stack.fs.open(ino, os.O_RDONLY)
    second = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.backing_of(first) == stack.fs.backing_of(second) != 0
    assert backing.open_ids == {stack.fs.backing_of(first)}
    stack.fs.release(first)
    assert backing.open_ids  # the second handle still uses it
    stack.fs.release(second)
    assert not backing.open_ids
    assert stack.fs.passthrough_opens == opens + 2
    check_consistency(stack)


async def test_a_writer_dirties_the_file_at_open_and_its_size_is_read_from_the_file(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack, backing = await _stack(tmp_path, nursery)
    ino = stack.write_file("f", b"old")
    await stack.flush()
    assert stack.journal.names.get(ino).state == "clean"  # type: ignore[union-attr]
    fh = await stack.fs.open(ino, os.O_WRONLY)
    assert stack.fs.backing_of(fh)
    inode = stack.journal.names.get(ino)
    assert inode is not None and inode.state == DIRTY and inode.closed_at is None
    assert stack.fs.caching(fh) == (False, False)  # never direct_io beside passthrough: it would win
    # The kernel writes the cache file itself: the daemon sees nothing of it...
    _kernel_writes(stack.cache.data_path(ino), b"new content written by the kernel")
    before = stack.cache.used
    stack.cache.remeasure_all()  # ...until the evictor's next round measures the file
    assert stack.cache.used - before == len(b"new content written by the kernel") - 3
    stack.fs.release(fh)
    assert not backing.open_ids
    await stack.flush()
    assert stack.store_files() == {"f": b"new content written by the kernel"}
    assert stack.journal.names.get(ino).size == 33  # type: ignore[union-attr]
    check_consistency(stack)


async def test_create_gets_passthrough_and_a_release_without_writes_still_uploads(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack, _ = await _stack(tmp_path, nursery)
    fh, _ = stack.fs.create(ROOT_ID, b"new", 0o644, os.O_WRONLY, UID, GID)
    assert stack.fs.backing_of(fh)
    stack.fs.release(fh)
    await stack.flush()
    assert stack.store_files() == {"new": b""}


async def test_no_passthrough_beside_cached_handles_nor_for_writers_without_room(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack, backing = await _stack(tmp_path, nursery, cache_size=PASSTHROUGH_ROOM + (64 << 20))
    ino = stack.write_file("f", b"x" * 1000)
    stack.fs.backing = None  # an open from before passthrough was turned on: a cached handle
    cached = await stack.fs.open(ino, os.O_RDWR)
    stack.fs.backing = backing
    beside = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.backing_of(beside) == 0  # the kernel would refuse it (ETXTBSY)
    stack.fs.release(beside)
    stack.fs.release(cached)
    reader = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.backing_of(reader)
    stack.fs.release(reader)
    # Room below PASSTHROUGH_ROOM: writes must be able to wait for the drain, so they come to the daemon.
    stack.cache.used += 128 << 20
    writer = await stack.fs.open(ino, os.O_WRONLY)
    assert stack.fs.backing_of(writer) == 0 and stack.fs.caching(writer) == (True, False)
    stack.fs.release(writer)
    reader = await stack.fs.open(ino, os.O_RDONLY)  # reads need no room
    assert stack.fs.backing_of(reader)
    stack.fs.release(reader)
    stack.cache.used -= 128 << 20


async def test_a_refused_registration_falls_back_to_the_daemon(tmp_path: Path, nursery: trio.Nursery) -> None:
    stack, backing = await _stack(tmp_path, nursery)
    ino = stack.write_file("f", b"abc")
    backing.refuse = OSError(errno.EPERM, "Operation not permitted")
    fh = await stack.fs.open(ino, os.O_RDONLY)
    assert stack.fs.backing_of(fh) == 0
    assert await stack.fs.read(fh, 0, 10) == b"abc"
    stack.fs.release(fh)
    assert stack.fs.passthrough_errors == 1


async def test_a_full_cache_never_seals_a_file_written_through_passthrough(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    stack, _ = await _stack(tmp_path, nursery)
    await nursery.start(stack.drain.run)
    fh, attr = stack.fs.create(ROOT_ID, b"big", 0o644, os.O_WRONLY, UID, GID)
    assert stack.fs.backing_of(fh)
    _kernel_writes(stack.cache.data_path(attr.ino), os.urandom(1 << 20) * 100)
    stack.cache.remeasure_all()
    since = time.time()
    stack.drain.set_pressure(True)
    await drain_had_its_chance(stack.drain, since=since, what="seal or free the file under pressure")
    entry = stack.cache.files[attr.ino]
    assert entry.sealed == 0 and entry.freed == 0
    stack.drain.set_pressure(False)
    stack.fs.release(fh)
    await stack.flush()
    assert len(stack.store_files()["big"]) == 100 << 20


# -- through the kernel -------------------------------------------------------------------------------------

def _kernel_has_passthrough() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 9) and os.geteuid() == 0


needs_passthrough = pytest.mark.skipif(
    not getattr(pyfuse3, "PASSTHROUGH_BUILD", False) or not _kernel_has_passthrough(),
    reason="FUSE passthrough needs a root daemon on Linux >= 6.9 and pyfuse3 built by scripts/build-fuse.sh",
)


def _daemon_requests(port: int, op: str) -> float:
    """How many `op` requests the daemon answered (its metrics: ckptfs_fuse_requests_total)."""
    time.sleep(METRICS_INTERVAL * 1.5)
    return fuse_requests(port).get(op, 0.0)


@needs_passthrough
def test_the_kernel_writes_and_reads_cached_files_itself(mount_factory) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mount = mount_factory(extra_args=("--metrics-addr", f"127.0.0.1:{port}"))
    status = mount.status()["passthrough"]
    assert status["enabled"], status
    assert "FUSE passthrough on" in mount.log.read_text()
    data = os.urandom(8 << 20)
    (mount.mnt / "f").write_bytes(data)
    with open(mount.mnt / "f", "rb") as f:
        assert f.read() == data
    assert _daemon_requests(port, "write") == 0
    assert _daemon_requests(port, "read") == 0
    status = mount.status()
    assert status["passthrough"]["opens"] >= 2
    assert status["passthrough"]["files_open"] == 0
    mount.flush()
    assert mount.store_files() == {"f": data}
    # The daemon measured what it never saw: size in the journal, the file in the budget.
    assert status["cache"]["used_bytes"] >= len(data)
    assert os.stat(mount.mnt / "f").st_size == len(data)


@needs_passthrough
def test_posix_semantics_hold_with_passthrough(mount: Mount) -> None:
    path = mount.mnt / "g"
    with open(path, "wb") as f:
        f.write(b"a" * 100)
        f.flush()
        assert os.fstat(f.fileno()).st_size == 100  # size seen while open
        os.fsync(f.fileno())
        f.seek(1000)
        f.write(b"end")
    assert path.stat().st_size == 1003
    os.truncate(path, 50)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        mm[0:5] = b"mmap!"
        mm.flush()
        mm.close()
    with open(path, "ab") as f:
        f.write(b"appended")
    os.rename(path, mount.mnt / "h")
    expected = b"mmap!" + b"a" * 45 + b"appended"
    assert (mount.mnt / "h").read_bytes() == expected
    # An open for writing that writes nothing still dirties the file (the daemon cannot tell).
    mount.flush()
    assert mount.store_files() == {"h": expected}
    assert os.getxattr(mount.mnt / "h", "user.ckptfs.state") == b"clean"
    open(mount.mnt / "h", "r+b").close()
    assert os.getxattr(mount.mnt / "h", "user.ckptfs.state") == b"dirty"
    mount.flush()
    assert mount.store_files() == {"h": expected}


@needs_passthrough
def test_off_by_option_and_said_so(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m = mount_factory(extra_args=("--passthrough", "off"))
    status = m.status()["passthrough"]
    assert not status["enabled"] and "passthrough = off" in status["why"]
    (m.mnt / "f").write_bytes(b"x" * 4096)
    assert (m.mnt / "f").read_bytes() == b"x" * 4096
    assert m.status()["passthrough"]["opens"] == 0


@needs_passthrough
def test_a_small_budget_keeps_writes_on_the_daemon_and_back_pressure_holds(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m = mount_factory(extra_args=("--cache-size", "256M"))
    assert m.status()["passthrough"]["enabled"]
    data = os.urandom(1 << 20) * 40
    (m.mnt / "f").write_bytes(data)  # 256 MiB has less room than PASSTHROUGH_ROOM: through the daemon
    assert m.status()["passthrough"]["opens"] == 0
    assert (m.mnt / "f").read_bytes() == data  # a reader of a local file: passthrough
    assert m.status()["passthrough"]["opens"] == 1
    m.flush()
    assert m.store_files() == {"f": data}


@needs_passthrough
def test_a_remote_file_is_read_through_the_daemon_and_a_copy_in_the_cache_through_the_kernel(
    mount_factory,  # type: ignore[no-untyped-def]
) -> None:
    writer = mount_factory("writer")
    data = os.urandom(3 << 20)
    (writer.mnt / "f").write_bytes(data)
    writer.flush()
    writer.umount()
    reader = mount_factory("reader", source=writer.source)
    assert (reader.mnt / "f").read_bytes() == data  # fetched: through the daemon
    assert reader.status()["passthrough"]["opens"] == 0
    assert (reader.mnt / "f").read_bytes() == data  # now whole in the cache: through the kernel
    assert reader.status()["passthrough"]["opens"] == 1


@needs_passthrough
def test_dd_and_torch_save_through_passthrough(mount: Mount) -> None:
    subprocess.run(["dd", "if=/dev/urandom", f"of={mount.mnt / 'dd.bin'}", "bs=1M", "count=16", "status=none",
                    "conv=fsync"], check=True)
    torch = pytest.importorskip("torch")
    state = {"w": torch.randn(256, 256)}
    torch.save(state, mount.mnt / "ckpt.pt")
    loaded = torch.load(mount.mnt / "ckpt.pt")
    assert torch.equal(loaded["w"], state["w"])
    mount.flush()
    assert mount.store_files()["dd.bin"] == (mount.mnt / "dd.bin").read_bytes()
    assert mount.status()["passthrough"]["opens"] >= 3


@needs_passthrough
def test_stopping_with_a_passthrough_file_open_loses_nothing(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The handles still open at unmount are closed after the FUSE connection (and its backing files) went."""
    m: Mount = mount_factory(upload_delay=3600, extra_args=("--drain-timeout", "2"))
    m.allowed_log_words.append("not yet durable")
    f = open(m.mnt / "open.pt", "wb")  # noqa: SIM115  # held open across the stop
    f.write(b"o" * 100_000)
    f.flush()
    assert m.status()["passthrough"]["files_open"] == 1
    assert m.proc is not None
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(timeout=60) == 3  # the file open for writing is pending: not drained
    m.proc = None
    with contextlib.suppress(OSError):
        f.close()  # the mount is gone
    assert "Traceback" not in m.log.read_text()
    m.start()
    m.flush()
    assert m.store_files() == {"open.pt": b"o" * 100_000}


@needs_passthrough
def test_a_writer_shares_the_backing_file_a_reader_registered(mount: Mount) -> None:
    (mount.mnt / "f").write_bytes(b"0" * 10)
    with open(mount.mnt / "f", "rb") as reader:  # registers the backing file through a read-only handle
        with open(mount.mnt / "f", "r+b") as writer:
            writer.write(b"written")
        assert reader.read() == b"written000"
    assert mount.status()["passthrough"]["files_open"] == 0
    mount.flush()
    assert mount.store_files() == {"f": b"written000"}


@needs_passthrough
def test_writes_drop_setuid_and_cost_the_daemon_no_request_each(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """With FUSE_CAP_HANDLE_KILLPRIV_V2 the daemon drops setuid/setgid itself, and the kernel no longer asks
    it for security.capability before every write (2048 requests for a 2 GiB dd before)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    m = mount_factory(extra_args=("--metrics-addr", f"127.0.0.1:{port}"))
    path = m.mnt / "s"
    path.write_bytes(b"0")
    os.chmod(path, 0o6755)
    with open(path, "r+b") as f:
        f.write(b"1")
    assert path.stat().st_mode & 0o7777 == 0o755
    os.chmod(path, 0o6755)
    os.chown(path, 1000, 1000)
    assert path.stat().st_mode & 0o7777 == 0o755
    before = _daemon_requests(port, "getxattr")
    with open(m.mnt / "big", "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
    assert _daemon_requests(port, "getxattr") - before <= 2
    m.flush()
    assert m.store_files()["s"] == b"1"
