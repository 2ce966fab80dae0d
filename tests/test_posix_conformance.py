"""What pjdfstest (github.com/pjd/pjdfstest) checks of a filesystem, for the parts ckptfs supports, through a
real mount (kernel FUSE, daemon in a subprocess, file:// store) with Python's os calls.

Each test names the pjdfstest file and assertion it reproduces. The files ckptfs fails by design (FIFOs,
device nodes, sockets, hard links, paths beyond what a store keeps) are listed in docs/SEMANTICS.md under
"Not supported", with the errno a program gets and why.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Mount

SLOW = 30.0  # an upload_delay that no test waits out: uploads happen only when a flush asks for them
DATE1 = 1_900_000_000_000_000_000  # pjdfstest's DATE1..DATE4, in nanoseconds
DATE2 = 1_950_000_000_000_000_000
DATE3 = 1_960_000_000_000_000_000
DATE4 = 1_970_000_000_000_000_000


def expect_errno(code: int, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == code, f"expected {errno.errorcode[code]}, got {info.value!r}"


def _as_nobody(cwd: Path, calls: list[Callable[[], object]]) -> list[int]:
    """Each call's errno (0: it succeeded) in a forked child working in `cwd` as uid and gid 65534, as
    pjdfstest's -u/-g run them (the venv's interpreter is under /root, which that user cannot run)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        results = []
        try:
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            for call in calls:
                try:
                    call()
                    results.append(0)
                except OSError as exc:
                    results.append(exc.errno or -1)
            os.write(write_fd, " ".join(map(str, results)).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as answer:
        out = answer.read().decode()
    os.waitpid(pid, 0)
    return [int(code) for code in out.split()]


def _times(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_atime_ns, st.st_mtime_ns


def test_utimensat_keeps_the_atime_of_directories_and_symlinks(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """utimensat/00.t (a directory: atime DATE1, mtime DATE2) and utimensat/05.t (a symlink with
    AT_SYMLINK_NOFOLLOW: atime DATE3, mtime DATE4): the atime set is the atime stat reports, not the mtime,
    also after the store has them and after a restart (the journal keeps it; the store keeps no atime)."""
    m: Mount = mount_factory(upload_delay=SLOW)
    d = m.mnt / "dir"
    d.mkdir()
    os.utime(d, ns=(DATE1, DATE2))
    assert _times(d) == (DATE1, DATE2)
    os.symlink("dir", m.mnt / "link")
    os.utime(m.mnt / "link", ns=(DATE3, DATE4), follow_symlinks=False)
    assert _times(m.mnt / "link") == (DATE3, DATE4)
    assert _times(d) == (DATE1, DATE2)  # the link's times are its own
    # UTIME_OMIT of the mtime (os.utime cannot say it; touch -a does) keeps the mtime and sets the atime.
    os.utime(d, ns=(DATE3, DATE2))
    assert _times(d) == (DATE3, DATE2)
    # A directory listing (readdirplus) reports the same times as stat.
    entries = {e.name: e.stat(follow_symlinks=False) for e in os.scandir(m.mnt)}
    assert (entries["dir"].st_atime_ns, entries["link"].st_atime_ns) == (DATE3, DATE3)
    m.flush()
    assert m.umount().returncode == 0
    m.start()
    assert _times(m.mnt / "dir") == (DATE3, DATE2)
    assert _times(m.mnt / "link") == (DATE3, DATE4)


def test_what_pjdfstest_finds_refused_gets_its_errno_after_the_kernels_checks(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The pjdfstest files listed as refused in docs/SEMANTICS.md fail only at the call that would make a FIFO,
    a device node, a socket or a hard link (EPERM), or a path over 1000 bytes (ENAMETOOLONG): every check
    the kernel makes before it asks ckptfs answers as on ext4 (mkfifo/05.t, mkfifo/06.t, mkfifo/09.t,
    mknod/08.t, link/10.t, mkfifo/01.t, mkfifo/02.t). As pjdfstest runs: --allow-other, and another user's
    calls from a child process."""
    m: Mount = mount_factory(upload_delay=SLOW, extra_args=("--allow-other",))
    (m.mnt / "file").write_bytes(b"x")
    os.mkdir(m.mnt / "closed", 0o755)  # root's: others may not create in it
    # What ckptfs refuses by design.
    expect_errno(errno.EPERM, os.mkfifo, m.mnt / "fifo")
    expect_errno(errno.EPERM, os.mknod, m.mnt / "blk", stat.S_IFBLK | 0o644, os.makedev(1, 2))
    expect_errno(errno.EPERM, os.link, m.mnt / "file", m.mnt / "hard")
    with socket.socket(socket.AF_UNIX) as sock:
        expect_errno(errno.EPERM, sock.bind, str(m.mnt / "sock"))
    deep = m.mnt / "/".join(["d" * 99] * 9)  # 899 bytes below the root
    os.makedirs(deep)
    expect_errno(errno.ENAMETOOLONG, os.mkdir, deep / ("e" * 101))  # 1001 bytes
    expect_errno(errno.ENAMETOOLONG, os.stat, deep / ("e" * 101))
    # The kernel's checks come first.
    expect_errno(errno.EEXIST, os.mkfifo, m.mnt / "file")
    expect_errno(errno.EEXIST, os.mknod, m.mnt / "closed", stat.S_IFCHR | 0o644, os.makedev(1, 2))
    expect_errno(errno.EEXIST, os.link, m.mnt / "file", m.mnt / "closed")
    expect_errno(errno.ENOTDIR, os.mkfifo, m.mnt / "file" / "fifo")
    expect_errno(errno.ENAMETOOLONG, os.mkfifo, m.mnt / ("n" * 256))
    # Another user, in the mount's root as pjdfstest works (the test's tmp dir above it is root's, 0700): it
    # may create in a directory open to it, and gets EACCES in root's before ckptfs is asked.
    os.mkdir(m.mnt / "open", 0o777)
    os.chmod(m.mnt / "open", 0o777)  # whatever the umask
    assert _as_nobody(m.mnt, [
        lambda: os.close(os.open("open/mine", os.O_CREAT | os.O_WRONLY, 0o644)),
        lambda: os.mkfifo("open/fifo"),
        lambda: os.mkfifo("closed/fifo"),
        lambda: os.link("open/mine", "closed/hard"),  # its own file: protected_hardlinks lets it try
    ]) == [0, errno.EPERM, errno.EACCES, errno.EACCES]
    assert sorted(os.listdir(m.mnt)) == ["closed", "d" * 99, "file", "open"]
    assert os.listdir(m.mnt / "open") == ["mine"] and os.listdir(m.mnt / "closed") == []
