"""What pjdfstest (github.com/pjd/pjdfstest) checks of a filesystem, for the parts ckptfs supports, through a
real mount (kernel FUSE, daemon in a subprocess, file:// store) with Python's os calls.

Each test names the pjdfstest file and assertion it reproduces. The files ckptfs fails by design (FIFOs,
device nodes, sockets, hard links, paths beyond what a store keeps) are listed in docs/SEMANTICS.md under
"Not supported", with the errno a program gets and why.
"""

from __future__ import annotations

import os
from pathlib import Path

from conftest import Mount

SLOW = 30.0  # an upload_delay that no test waits out: uploads happen only when a flush asks for them
DATE1 = 1_900_000_000_000_000_000  # pjdfstest's DATE1..DATE4, in nanoseconds
DATE2 = 1_950_000_000_000_000_000
DATE3 = 1_960_000_000_000_000_000
DATE4 = 1_970_000_000_000_000_000


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
