"""A ckptfs mount exported over NFSv4 by a real server (nfs-ganesha, VFS backend) to a real client (libnfs):
what a gateway needs from the mount (uploads of files the server holds open are another module's). One
ckptfs daemon (file:// store) and one ganesha per module; each test works in a directory of its own. Skipped
only where ganesha or libnfs is not installed (CI installs both with scripts/install.sh test)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount
from nfs import Ganesha, missing
from nfsclient import Client, NfsError

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

CHUNK = 2048  # bytes a write in the tests that write through a handle piece by piece


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mount, Ganesha]]:
    root = tmp_path_factory.mktemp("nfs")
    mount = Mount(root / "m")
    mount.start()
    server = Ganesha(root / "ganesha", mount.mnt)
    try:
        server.start()
        yield mount, server
    finally:
        # ganesha first: it holds files of the mount open, which an unmount would wait for.
        server.stop()
        mount.cleanup()
    problems = mount.unexpected_log_lines()
    assert not problems, "daemon logged unexpected warnings/errors:\n" + "\n".join(problems)


@pytest.fixture
def client(served: tuple[Mount, Ganesha]) -> Iterator[Client]:
    with served[1].client() as c:
        yield c


@pytest.fixture
def folder(client: Client, request: pytest.FixtureRequest) -> str:
    name = request.node.name.replace("[", "-").replace("]", "")
    client.mkdir(name)
    return name


def write(client: Client, path: str, data: bytes, *, fsync: bool = False) -> None:
    client.write_file(path, data, fsync=fsync)


def test_create_write_read_back(served: tuple[Mount, Ganesha], client: Client, folder: str) -> None:
    mount, _ = served
    data = os.urandom(300_000)
    write(client, f"{folder}/shard.bin", data)
    assert client.read_file(f"{folder}/shard.bin") == data
    assert (mount.mnt / folder / "shard.bin").read_bytes() == data
    assert client.stat(f"{folder}/shard.bin").size == len(data)


def test_temp_fsync_rename_over_an_existing_name(served: tuple[Mount, Ganesha], client: Client, folder: str) -> None:
    mount, _ = served
    write(client, f"{folder}/latest", b"step-1")
    write(client, f"{folder}/latest.tmp", b"step-2", fsync=True)
    client.rename(f"{folder}/latest.tmp", f"{folder}/latest")
    assert client.read_file(f"{folder}/latest") == b"step-2"
    assert sorted(client.listdir(folder)) == ["latest"]
    assert (mount.mnt / folder / "latest").read_bytes() == b"step-2"


def test_mkdir_readdir_stat_show_sane_times(client: Client, folder: str) -> None:
    before = time.time() - 5
    client.mkdir(f"{folder}/step-1")
    write(client, f"{folder}/step-1/a.bin", b"a" * 5000)
    write(client, f"{folder}/b.bin", b"")
    for path in (folder, f"{folder}/step-1", f"{folder}/step-1/a.bin", f"{folder}/b.bin"):
        assert before < client.stat(path).mtime < time.time() + 5, path
    entries = client.listdir(folder)
    assert sorted(entries) == ["b.bin", "step-1"]
    assert all(before < e.mtime < time.time() + 5 for e in entries.values()), entries
    assert client.listdir(f"{folder}/step-1")["a.bin"].size == 5000


def test_an_exclusive_create_shows_its_verifier_as_times_until_the_first_write(client: Client, folder: str) -> None:
    """The issue's "mtime in the year 2105": an NFSv4 EXCLUSIVE4 create (libnfs: O_CREAT without O_TRUNC)
    stores the client's verifier in the new file's times, on any filesystem. The first write sets mtime."""
    with client.create(f"{folder}/exclusive.bin", flags=os.O_WRONLY | os.O_CREAT) as f:
        assert abs(f.fstat().mtime - time.time()) > 3600  # the verifier, not a time
        f.pwrite(b"x", 0)
        assert abs(f.fstat().mtime - time.time()) < 60
    assert abs(client.stat(f"{folder}/exclusive.bin").mtime - time.time()) < 60


def forget_kernel_inodes() -> None:
    """The kernel drops its unused dentries and inodes and sends FORGET for them: an NFS server's handles of
    them then reach ckptfs as lookups of "." (and of ".." for a directory's parent) by inode number."""
    Path("/proc/sys/vm/drop_caches").write_text("2\n")


def test_handles_of_inodes_the_kernel_forgot(served: tuple[Mount, Ganesha], client: Client, folder: str) -> None:
    """A client's handle of a file outlives the kernel's inode of it. ganesha holds the files it serves I/O
    for open, which pins their inodes, until it restarts: then a client's handle is all that is left, and
    ganesha opens it with open_by_handle_at on the mount (the kernel asks ckptfs for "." of the inode)."""
    mount, server = served
    (mount.mnt / folder / "sub").mkdir()
    (mount.mnt / folder / "sub" / "f.bin").write_bytes(b"local")
    (mount.mnt / folder / "other.bin").write_bytes(b"other")
    with client.open(f"{folder}/sub/f.bin") as held:
        assert held.pread(100, 0) == b"local"
        handle = held.handle()
    server.restart()
    forget_kernel_inodes()
    with server.client() as again, again.open(f"{folder}/other.bin") as f:
        f.send_handle(handle)
        assert f.fstat().size == 5
        assert again.stat(f"{folder}/sub").nlink == 2
        assert sorted(again.listdir(f"{folder}/sub")) == ["f.bin"]


def test_restart_under_a_connected_client_keeps_its_handles(served: tuple[Mount, Ganesha], client: Client,
                                                             folder: str) -> None:
    """`ckptfs restart` (keep_mount): the FUSE connection, and with it every file ganesha holds open and every
    handle a client holds, goes to the new daemon. The client writes on through the handle it had."""
    mount, _ = served
    with client.create(f"{folder}/shard.bin") as f:
        f.pwrite(b"a" * CHUNK, 0)
        result = mount.cli("restart", str(mount.mnt))
        assert result.returncode == 0, result.stderr
        f.pwrite(b"b" * CHUNK, CHUNK)
        f.fsync()
        assert f.fstat().size == 2 * CHUNK
        assert f.pread(2 * CHUNK, 0) == b"a" * CHUNK + b"b" * CHUNK
    write(client, f"{folder}/after.bin", b"after")
    assert sorted(client.listdir(folder)) == ["after.bin", "shard.bin"]
    assert (mount.mnt / folder / "shard.bin").read_bytes() == b"a" * CHUNK + b"b" * CHUNK
    assert mount.status()["keep_mount"]["took_over"] is True


def test_a_new_mount_under_a_running_ganesha_needs_a_ganesha_restart(tmp_path: Path) -> None:
    """What a client sees when the daemon ends without keep_mount's holder (the mount goes) and a new daemon
    mounts again under a running ganesha: ganesha keeps its file descriptors of the old mount, whose FUSE
    connection is gone (ENOTCONN), and answers every request, a new client's mount too, with
    NFS4ERR_SERVERFAULT ("Default case mapping Transport endpoint is not connected" in its log). A restart of
    ganesha serves the new mount; handles from before it are stale: ganesha 4.3 puts the mount's device number
    in them (FUSE reports no f_fsid), and a new mount has another one."""
    mount = Mount(tmp_path / "m")
    mount.start()
    server = Ganesha(tmp_path / "ganesha", mount.mnt)
    try:
        server.start()
        with server.client() as c:
            write(c, "kept.bin", b"kept")
            with c.open("kept.bin") as f:
                handle = f.handle()
            mount.kill9()
            mount.start()
            with pytest.raises(NfsError, match="NFS4ERR_SERVERFAULT"):
                c.stat("kept.bin")
        with pytest.raises(NfsError, match="NFS4ERR_SERVERFAULT"):
            server.client()
        assert "Transport endpoint is not connected" in server.log_text()
        server.restart()
        with server.client() as c:
            assert c.read_file("kept.bin") == b"kept"
            write(c, "new.bin", b"new")
            with c.open("new.bin") as f:
                f.send_handle(handle)
                with pytest.raises(NfsError, match="NFS4ERR_STALE"):
                    f.fstat()
    finally:
        server.stop()
        mount.cleanup()


def test_a_daemon_killed_under_a_connected_client_is_taken_over(served: tuple[Mount, Ganesha], client: Client,
                                                                 folder: str) -> None:
    """kill -9 of the daemon with keep_mount: the holder starts the next one, which takes the connection over;
    ganesha's requests wait meanwhile, and the client writes on through its handle."""
    mount, _ = served
    mount.allowed_log_words += ["died; the mount stays"]
    with client.create(f"{folder}/shard.bin") as f:
        f.pwrite(b"a" * CHUNK, 0)
        os.kill(mount.status()["pid"], signal.SIGKILL)
        f.pwrite(b"b" * CHUNK, CHUNK)
        f.fsync()
        assert f.pread(2 * CHUNK, 0) == b"a" * CHUNK + b"b" * CHUNK
    write(client, f"{folder}/after.bin", b"after")
    assert client.read_file(f"{folder}/after.bin") == b"after"
    assert (mount.mnt / folder / "shard.bin").read_bytes() == b"a" * CHUNK + b"b" * CHUNK


def test_libnfs_utils_copy_list_and_read(served: tuple[Mount, Ganesha], folder: str) -> None:
    """The command-line client of the issue (nfs-cp, nfs-ls, nfs-cat from libnfs-utils) on a file it can copy
    (libnfs 4.0's WRITE limit: see tests/nfsclient.py)."""
    mount, server = served
    source = mount.root / "source.bin"
    source.write_bytes(os.urandom(3000))

    def url(path: str) -> str:
        return f"nfs://127.0.0.1/export/{path}?version=4&nfsport={server.port}"

    def run(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("nfs-cp", str(source), url(f"{folder}/copied.bin"))
    assert (mount.mnt / folder / "copied.bin").read_bytes() == source.read_bytes()
    assert "copied.bin" in run("nfs-ls", url(folder))
    done = subprocess.run(["nfs-cat", url(f"{folder}/copied.bin")], capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout == source.read_bytes()


def test_the_bench_over_a_plain_directory(tmp_path: Path) -> None:
    """The same server and client over a plain directory: what the tests above expect of ckptfs is what a
    local filesystem gives (the bench itself is sound)."""
    (tmp_path / "plain").mkdir()
    server = Ganesha(tmp_path / "ganesha", tmp_path / "plain")
    try:
        server.start()
        with server.client() as c:
            c.mkdir("d")
            write(c, "d/latest.tmp", b"x" * 10_000, fsync=True)
            c.rename("d/latest.tmp", "d/latest")
            assert c.read_file("d/latest") == b"x" * 10_000
            assert sorted(c.listdir("d")) == ["latest"]
            assert abs(c.stat("d").mtime - time.time()) < 60
        assert (tmp_path / "plain" / "d" / "latest").read_bytes() == b"x" * 10_000
    finally:
        server.stop()
