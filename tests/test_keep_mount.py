"""The mount outlives its daemon (keep_mount, keepmount/holder.py): a daemon killed with kill -9 is started again by
the holder of its FUSE connection and takes it over; the job's requests wait instead of failing.

The kill loop's size follows $CKPTFS_KEEP_MOUNT_KILLS and $CKPTFS_KEEP_MOUNT_FILE_MIB (the suite's default
is small; the issue's run: 50 kills, 1024 MiB files)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import Mount
from rank_server import SERVER, Rank
from waiting import mount_drain_had_its_chance

from ckptfs.errors import CkptfsError
from ckptfs.mount import guard

KILLS = int(os.environ.get("CKPTFS_KEEP_MOUNT_KILLS", "6"))
FILE_MIB = int(os.environ.get("CKPTFS_KEEP_MOUNT_FILE_MIB", "48"))
# Names used again after this many files (0: never), so that a long run fits the disk, as a rotating save does
ROTATE = int(os.environ.get("CKPTFS_KEEP_MOUNT_ROTATE", "0"))
TAKEOVER_LOG_WORDS = ["died; the mount stays"]

WRITER = r'''
import hashlib, os, subprocess, sys, torch
mnt, source, stop, report, mib = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
rotate = int(sys.argv[6])
i = 0
with open(report, "a") as out:
    while not os.path.exists(stop):
        n = i % rotate if rotate else i
        if i % 2 == 0:  # dd, as a shell script would copy a checkpoint in
            name = f"dd_{n}.bin"
            subprocess.run(["dd", f"if={source}", f"of={mnt}/{name}", "bs=1M", "status=none"], check=True)
        else:  # torch.save, as a training loop saves one
            name = f"step_{n}.pt"
            torch.manual_seed(i)
            torch.save({"step": i, "w": torch.randn(mib * 1024 * 256)}, f"{mnt}/{name}")
        out.write(name + "\n")
        out.flush()
        i += 1
'''


def _daemon_pid(m: Mount, not_pid: int | None, timeout: float = 60) -> int:
    """The pid of the daemon serving `m` once it is not `not_pid` (the one just killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(CkptfsError):  # none yet, or one not answering yet
            pid = int(m.status()["pid"])
            if pid != not_pid:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no daemon took the mount over within {timeout} s:\n{m.log.read_text()[-3000:]}")


def _kill(m: Mount, pid: int) -> None:
    if m.proc is not None and m.proc.pid == pid:  # the first daemon is ours to reap
        m.proc.kill()
        m.proc.wait()
        m.proc = None
        return
    os.kill(pid, signal.SIGKILL)  # one the holder started (the holder reaps it)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _check_saved(m: Mount, names: list[str], source: Path) -> None:
    import torch

    expected_dd = hashlib.sha256(source.read_bytes()).hexdigest()
    stored = m.store_files()
    for name in names:
        data = (m.mnt / name).read_bytes()
        assert stored.get(name) == data, f"{name}: the store's copy differs from the mount's"
        if name.startswith("dd_"):
            assert hashlib.sha256(data).hexdigest() == expected_dd, name
        else:
            state = torch.load(m.mnt / name)
            torch.manual_seed(state["step"])
            assert torch.equal(state["w"], torch.randn(FILE_MIB * 1024 * 256)), name


@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_a_writer_never_sees_the_daemon_die(mount_factory, tmp_path: Path, passthrough: str) -> None:  # type: ignore[no-untyped-def]
    """dd and torch.save in a loop while the daemon is killed with kill -9 at random moments: the writer
    gets no error, and every file it finished reads back identical and reaches the store. With passthrough
    off every write goes through the daemon, so kills land mid-write and the kernel sends those again."""
    m = mount_factory(start=False, extra_args=("--passthrough", passthrough))
    # Every daemon here dies within seconds of taking over, on purpose: the holder must not take it for a
    # crash loop and give up.
    m.env["CKPTFS_MAX_QUICK_RESTARTS"] = str(KILLS + 10)
    m.start()
    m.allowed_log_words += TAKEOVER_LOG_WORDS
    if ROTATE:  # a name saved again while its last version is uploaded: that upload is redone
        m.allowed_log_words.append("the file changed while it was being uploaded")
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(FILE_MIB << 20))
    script, stop, report = tmp_path / "writer.py", tmp_path / "stop", tmp_path / "written"
    script.write_text(WRITER)
    # A fork of the worker's rank server (tests/rank_server.py), which imported torch once, run from a thread
    # while this one kills daemons.
    finished: list[tuple[int, str]] = []
    writer = threading.Thread(target=lambda: finished.extend(SERVER.run(
        [Rank([str(script), str(m.mnt), str(source), str(stop), str(report), str(FILE_MIB), str(ROTATE)],
              dict(os.environ))], preload=("torch",), timeout=900)))
    writer.start()
    rng = random.Random(int(os.environ.get("CKPTFS_KEEP_MOUNT_SEED", "29")))
    assert m.proc is not None
    pid = m.proc.pid
    try:
        # The kills start once the writer is at work: its import of torch alone took 11-16 s on a loaded
        # machine, longer than all the kills, and it then finished no file while they ran.
        deadline = time.monotonic() + 300
        while not (report.exists() and report.read_text()):
            assert time.monotonic() < deadline and writer.is_alive(), f"the writer finished no file: {finished}"
            time.sleep(0.1)
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.05, 1.5))
            assert writer.is_alive(), finished
            _kill(m, pid)
            pid = _daemon_pid(m, pid)
    finally:
        stop.touch()
        writer.join(900)
    [(code, output)] = finished
    assert code == 0, output
    assert output == "", output
    names = sorted(set(report.read_text().split()))
    assert len(names) >= 2
    m.flush(timeout=300)
    _check_saved(m, names, source)
    result = m.cli("umount", str(m.mnt))
    assert result.returncode == 0, result.stderr
    assert guard.is_guarded(m.mnt)  # unmounted, and the bare directory guarded
    assert m.holder_pid() is None


def test_an_unlinked_open_file_and_a_file_being_written_survive_a_takeover(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The kernel's handles are taken over: an open-unlink-fchmod sequence (as a POSIX suite does) keeps
    working across the kill, and a file open for writing is uploaded only once it is closed (the store
    never shows a torn object)."""
    m = mount_factory()
    m.allowed_log_words += TAKEOVER_LOG_WORDS
    gone = os.open(m.mnt / "gone", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(gone, b"abc")
    os.unlink(m.mnt / "gone")
    with open(m.mnt / "big.bin", "wb") as big:
        big.write(b"1" * (3 << 20))
        big.flush()
        assert m.proc is not None
        first = m.proc.pid
        since = time.time()
        _kill(m, first)
        pid = _daemon_pid(m, first)
        due = time.time() + m.upload_delay
        os.fchmod(gone, 0o600)
        assert os.pwrite(gone, b"def", 3) == 3
        assert os.pread(gone, 6, 0) == b"abcdef"
        assert os.fstat(gone).st_mode & 0o777 == 0o600
        # The new daemon's drain scanned after the takeover and has nothing due: a closed file would be in.
        mount_drain_had_its_chance(m.status, since=since, due=due, what="upload big.bin, still open")
        assert "big.bin" not in m.store_files()
        big.write(b"2" * (1 << 20))
    os.close(gone)
    m.flush()
    assert m.store_files() == {"big.bin": b"1" * (3 << 20) + b"2" * (1 << 20)}
    assert os.listdir(m.mnt) == ["big.bin"]
    _kill(m, pid)  # a second takeover, with nothing open
    _daemon_pid(m, pid)
    assert (m.mnt / "big.bin").read_bytes() == b"1" * (3 << 20) + b"2" * (1 << 20)


def test_what_recovery_removes_leaves_the_kernel_after_a_takeover(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The kernel keeps its names across a takeover. A file whose cache file vanished before its upload
    is removed by the next daemon's recovery (its content is lost, an ERROR): the kernel's name and
    listing of it go too, before the mount serves again."""
    m = mount_factory(upload_delay=3600)
    m.allowed_log_words += [*TAKEOVER_LOG_WORDS, "vanished before it was uploaded"]
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "lost.bin").write_bytes(b"never uploaded")
    ino = os.stat(m.mnt / "d" / "lost.bin").st_ino  # the kernel holds the name and the listing
    assert os.listdir(m.mnt / "d") == ["lost.bin"]
    (m.cache / "data" / str(ino)).unlink()
    assert m.proc is not None
    first = m.proc.pid
    _kill(m, first)
    _daemon_pid(m, first)
    with pytest.raises(FileNotFoundError):
        os.stat(m.mnt / "d" / "lost.bin")
    assert os.listdir(m.mnt / "d") == []


def test_a_served_mountpoint_refuses_a_second_daemon(mount: Mount) -> None:
    result = mount.cli("mount", mount.source, str(mount.mnt), "--cache-dir", str(mount.root / "cache2"),
                       "--metrics-addr", "off")
    assert result.returncode != 0
    assert f"{mount.mnt} is served by ckptfs pid {mount.proc.pid if mount.proc else '?'}" in result.stderr
    (mount.mnt / "still.txt").write_text("served")
    assert (mount.mnt / "still.txt").read_text() == "served"


def test_the_holder_gives_up_on_a_daemon_that_cannot_start(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Daemons that exit before serving (here: the store went away) make the holder give up after a few:
    the mount is then aborted (ENOTCONN), as without a holder, and `ckptfs mount` works again once the
    store is back. Nothing written is lost."""
    m = mount_factory()
    m.allowed_log_words += [*TAKEOVER_LOG_WORDS, "before serving", "giving up", "stale FUSE mount"]
    (m.mnt / "a.bin").write_bytes(b"a" * 1000)
    m.flush()
    (m.mnt / "b.bin").write_bytes(b"b" * 1000)
    holder = m.holder_pid()
    assert holder is not None
    m.store.rename(m.root / "store-away")
    assert m.proc is not None
    _kill(m, m.proc.pid)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{holder}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{holder}").exists(), "the holder did not give up"
    with pytest.raises(OSError) as failure:
        os.listdir(m.mnt)  # (a stat may be answered from the attributes the kernel cached)
    assert failure.value.errno == errno.ENOTCONN
    log = m.log.read_text()
    assert "5 daemons in a row exited before serving; giving up" in log
    (m.root / "store-away").rename(m.store)
    m.start()
    m.flush()
    assert m.store_files() == {"a.bin": b"a" * 1000, "b.bin": b"b" * 1000}


def test_without_keep_mount_a_dead_daemon_leaves_the_mount_aborted(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m = mount_factory(extra_args=("--no-keep-mount",))
    assert m.holder_pid() is None
    assert m.proc is not None
    _kill(m, m.proc.pid)
    with pytest.raises(OSError) as failure:
        os.listdir(m.mnt)  # (a stat may be answered from the attributes the kernel cached)
    assert failure.value.errno == errno.ENOTCONN


def test_restart_hands_the_mount_to_a_new_daemon_without_unmounting(mount: Mount) -> None:
    """`ckptfs restart` (an upgrade): the daemon stops serving and executes the code installed now in the
    same process, which takes the connection and the open files over: a file being written and one being
    read carry on, and nothing is unmounted."""
    (mount.mnt / "read.bin").write_bytes(b"r" * 5000)
    reading = open(mount.mnt / "read.bin", "rb")  # noqa: SIM115
    with open(mount.mnt / "log.txt", "w") as log:
        log.write("before\n")
        log.flush()
        assert reading.read(1000) == b"r" * 1000
        result = mount.cli("restart", str(mount.mnt))
        assert result.returncode == 0, result.stderr
        assert mount.proc is not None
        assert f"new daemon (pid {mount.proc.pid})" in result.stdout
        assert os.path.ismount(mount.mnt)
        log.write("after\n")
        assert reading.read() == b"r" * 4000
        reading.close()
        status = mount.status()
        assert status["keep_mount"]["took_over"] is True
        assert status["keep_mount"]["handles_taken_over"] == 2
        assert status["keep_mount"]["holder_pid"] == mount.holder_pid()
    mount.flush()
    assert mount.store_files() == {"read.bin": b"r" * 5000, "log.txt": b"before\nafter\n"}
    assert "restarting: the FUSE connection" in mount.log.read_text()


def test_restart_of_a_mount_without_holder(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """With keep_mount off there is no holder: the connection goes to the new daemon in the process."""
    m = mount_factory(extra_args=("--no-keep-mount",))
    with open(m.mnt / "a.txt", "w") as f:
        f.write("1")
        f.flush()
        assert m.cli("restart", str(m.mnt)).returncode == 0
        f.write("2")
    m.flush()
    assert m.store_files() == {"a.txt": b"12"}
    keep = m.status()["keep_mount"]
    assert keep.pop("why").startswith("off: keep_mount = false")
    assert keep == {"holder_pid": None, "systemd_keeps": False, "took_over": True, "handles_taken_over": 1,
                    "enabled": False}


def test_a_runtime_dir_as_long_as_the_control_socket_allows(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The holder's socket is no longer than the control socket: a runtime dir whose control socket path has
    the most a Unix socket allows (107 bytes) works with keep_mount too (it failed the mount: "AF_UNIX path
    too long")."""
    m = mount_factory(start=False)
    length = 107 - len("/0123456789abcdef.sock")
    name_length = length - len(str(tmp_path)) - 1
    if name_length < 1:
        pytest.skip("the test's tmp dir is too long already")
    m.runtime = tmp_path / ("r" * name_length)
    m.env["CKPTFS_RUNTIME_DIR"] = str(m.runtime)
    m.start()
    assert m.holder_pid() is not None
    (m.mnt / "a.txt").write_text("a")
    assert m.status()["keep_mount"]["holder_pid"] == m.holder_pid()


def test_a_kept_mount_whose_holder_is_not_found_is_an_error_not_a_hang(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A daemon that finds a FUSE mount on its mountpoint kept alive by something it cannot reach (here: the
    holder's socket moved away, as a holder of another version would be) says so within seconds instead of
    waiting for ever on a stat of it (it hung the start); once the holder is found again, a daemon takes
    the mount over."""
    m = mount_factory()
    m.allowed_log_words += [*TAKEOVER_LOG_WORDS, "before serving", "whose connection is kept alive"]
    socket_file = m.holder_socket()
    moved = m.runtime / "moved.hold"
    socket_file.rename(moved)
    assert m.proc is not None
    _kill(m, m.proc.pid)
    deadline = time.monotonic() + 60
    while "whose connection is kept alive but that no daemon serves" not in m.log.read_text():
        assert time.monotonic() < deadline, m.log.read_text()[-3000:]
        time.sleep(0.2)
    moved.rename(socket_file)
    _daemon_pid(m, None)
    (m.mnt / "after.txt").write_text("served again")
    m.flush()
    assert m.store_files() == {"after.txt": b"served again"}
