"""One failing request never ends the mount: errors the handlers did not expect (a plain OSError from the
cache directory, a bug) are answered with an errno and the mount keeps serving everyone else. Driven
through a real mount: the daemon's open-file limit is lowered under it with prlimit(1)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from conftest import Mount

FILES = 60
LOW_LIMIT = 40


def _set_soft_nofile(mount: Mount, limit: int) -> None:
    """Only the soft limit: raising a hard limit again needs CAP_SYS_RESOURCE."""
    assert mount.proc is not None
    subprocess.run(["prlimit", f"--nofile={limit}:", "--pid", str(mount.proc.pid)], check=True)


def _open_fds(mount: Mount) -> int:
    assert mount.proc is not None
    return len(os.listdir(f"/proc/{mount.proc.pid}/fd"))


def test_open_file_limit_is_raised_to_the_hard_limit_at_start(mount: Mount) -> None:
    assert mount.proc is not None
    limits = Path(f"/proc/{mount.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line
    assert "open file limit" in mount.log.read_text()


def test_out_of_file_descriptors_answers_emfile_and_the_mount_survives(mount: Mount) -> None:
    mount.allowed_log_words.append("Too many open files")
    for i in range(FILES):
        (mount.mnt / f"f{i}").write_bytes(b"x%d" % i)
    mount.flush()
    assert _open_fds(mount) < LOW_LIMIT, "the test needs the daemon below the limit it sets"
    _set_soft_nofile(mount, LOW_LIMIT)
    held: list[int] = []
    refused = []
    try:
        for i in range(FILES):
            try:
                held.append(os.open(mount.mnt / f"f{i}", os.O_RDONLY))
            except OSError as exc:
                refused.append(exc.errno)
        assert refused and set(refused) == {errno.EMFILE}, refused
        # A create that cannot get its descriptor leaves nothing behind: no entry, no cache file.
        with pytest.raises(OSError) as raised:
            os.close(os.open(mount.mnt / "new", os.O_WRONLY | os.O_CREAT, 0o644))
        assert raised.value.errno == errno.EMFILE
        assert "new" not in os.listdir(mount.mnt)
        # Everything that needs no new descriptor still works while at the limit.
        assert os.pread(held[0], 10, 0) == b"x0"
        assert len(os.listdir(mount.mnt)) == FILES
        os.utime(mount.mnt / "f1", ns=(1_000_000_000, 2_000_000_000))
        os.statvfs(mount.mnt)
    finally:
        for fd in held:
            os.close(fd)
    _set_soft_nofile(mount, 1024)
    # The mount is alive, and what was refused works now.
    for i in range(FILES):
        assert (mount.mnt / f"f{i}").read_bytes() == b"x%d" % i
    (mount.mnt / "new").write_bytes(b"new")
    mount.flush()
    assert mount.store_files()["new"] == b"new"
    assert mount.store_files()["f0"] == b"x0"
    assert mount.status()
    assert mount.umount().returncode == 0


async def test_every_handler_answers_an_errno_never_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The adapter over a real Filesystem: an FsError keeps its errno, an OSError its own, and anything
    else (here: a bug inside fs) becomes EIO with one traceback. A handle the daemon does not know (the
    kernel kept it across a takeover, and it could not be restored) is EBADF, and its release a no-op
    (the kernel sends a release again after a takeover when the daemon before had done it)."""
    import pyfuse3
    from fsharness import make_stack

    from ckptfs.mount.adapter import FuseOperations

    stack = make_stack(tmp_path)
    ops = FuseOperations(stack.fs)
    ctx = pyfuse3.RequestContext()
    missing = await ops.lookup(pyfuse3.ROOT_INODE, b"missing", ctx)
    assert missing.st_ino == 0 and missing.entry_timeout == 0  # a negative entry, which the kernel does not keep
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.lookup(pyfuse3.InodeT(999), b"missing", ctx)  # no such directory
    assert raised.value.errno == errno.ENOENT
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.getxattr(pyfuse3.ROOT_INODE, b"user.other", ctx)
    assert raised.value.errno == errno.ENODATA
    await ops.release(999)
    for unknown in (ops.read(999, 0, 1), ops.write(999, 0, b"x"), ops.fsync(999, False)):
        with pytest.raises(pyfuse3.FUSEError) as raised:
            await unknown
        assert raised.value.errno == errno.EBADF

    def bug(*args: object) -> None:
        raise KeyError("a bug")

    stack.fs.getattr = bug  # type: ignore[method-assign]
    stack.fs.readlink = bug  # type: ignore[method-assign]
    for unexpected in (ops.getattr(pyfuse3.ROOT_INODE, ctx), ops.readlink(pyfuse3.ROOT_INODE, ctx)):
        with caplog.at_level("ERROR", logger="ckptfs.mount.adapter"), pytest.raises(pyfuse3.FUSEError) as raised:
            await unexpected
        assert raised.value.errno == errno.EIO
    tracebacks = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    assert len(tracebacks) == 2


async def test_a_create_of_a_name_that_exists_opens_it_unless_exclusive(tmp_path: Path) -> None:
    """The kernel sends CREATE only for a name it saw missing: one that exists is a CREATE the kernel sent
    again after a takeover (the daemon before created the file and died before answering). Without O_EXCL
    it opens the file, as open(O_CREAT) does (truncated with O_TRUNC); with O_EXCL, EEXIST."""
    import pyfuse3
    from fsharness import make_stack

    from ckptfs.mount.adapter import FuseOperations

    stack = make_stack(tmp_path)
    ops = FuseOperations(stack.fs)
    ctx = pyfuse3.RequestContext()
    flags = os.O_WRONLY | os.O_CREAT
    info, entry = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, flags, ctx)
    assert stack.fs.write(info.fh, 0, b"abc") == 3
    again, entry_again = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, flags, ctx)
    assert entry_again.st_ino == entry.st_ino and again.fh != info.fh
    assert entry_again.st_size == 3
    truncated, entry_truncated = await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, flags | os.O_TRUNC, ctx)
    assert entry_truncated.st_ino == entry.st_ino and entry_truncated.st_size == 0
    with pytest.raises(pyfuse3.FUSEError) as raised:
        await ops.create(pyfuse3.ROOT_INODE, b"f", 0o644, flags | os.O_EXCL, ctx)
    assert raised.value.errno == errno.EEXIST
    for fh in (info.fh, again.fh, truncated.fh):
        await ops.release(fh)
