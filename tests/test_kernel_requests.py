"""The requests as a kernel sends them (fs/requests.py), without a kernel: what a request the kernel sent
again after a takeover finds of its own effect is answered as a success, and the same request not sent
again gets its error; and the passthrough probe (fs/kernel_cache.py) says why passthrough is off."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from fsharness import GID, UID, Stack, check_consistency, make_stack

from ckptfs.errors import FsError
from ckptfs.fs import RESENT, probe_passthrough
from ckptfs.journal import ROOT_ID

FIRST = 41  # a request id as the kernel gives it
AGAIN = FIRST | RESENT  # the same request, sent again after a takeover


@pytest.fixture
async def stack(tmp_path: Path, nursery: trio.Nursery) -> AsyncIterator[Stack]:
    s = make_stack(tmp_path)
    await nursery.start(s.drain.run)
    yield s
    check_consistency(s)


async def test_a_mkdir_or_symlink_sent_again_finds_its_entry_made(stack: Stack) -> None:
    requests = stack.fs.requests
    made = await requests.mkdir(ROOT_ID, b"step_1", 0o755, UID, GID, FIRST)
    assert (await requests.mkdir(ROOT_ID, b"step_1", 0o755, UID, GID, AGAIN)).ino == made.ino
    with pytest.raises(FsError) as not_again:
        await requests.mkdir(ROOT_ID, b"step_1", 0o755, UID, GID, FIRST)
    assert not_again.value.errno == errno.EEXIST

    link = await requests.symlink(ROOT_ID, b"latest", b"step_1", UID, GID, FIRST)
    assert (await requests.symlink(ROOT_ID, b"latest", b"step_1", UID, GID, AGAIN)).ino == link.ino
    # an entry of another kind at the name is not the request's own effect
    with pytest.raises(FsError) as other_kind:
        await requests.mkdir(ROOT_ID, b"latest", 0o755, UID, GID, AGAIN)
    assert other_kind.value.errno == errno.EEXIST


async def test_an_unlink_rmdir_or_rename_sent_again_finds_its_source_gone(stack: Stack) -> None:
    requests = stack.fs.requests
    stack.write_file("a.pt", b"x")
    await requests.mkdir(ROOT_ID, b"d", 0o755, UID, GID, FIRST)
    requests.unlink(ROOT_ID, b"a.pt", FIRST)
    requests.unlink(ROOT_ID, b"a.pt", AGAIN)
    with pytest.raises(FsError) as unlink_error:
        requests.unlink(ROOT_ID, b"a.pt", FIRST)
    assert unlink_error.value.errno == errno.ENOENT

    await requests.rmdir(ROOT_ID, b"d", FIRST)
    await requests.rmdir(ROOT_ID, b"d", AGAIN)
    with pytest.raises(FsError) as rmdir_error:
        await requests.rmdir(ROOT_ID, b"d", FIRST)
    assert rmdir_error.value.errno == errno.ENOENT

    stack.write_file("tmp.pt", b"y")
    await requests.rename(ROOT_ID, b"tmp.pt", ROOT_ID, b"model.pt", 0, FIRST)
    await requests.rename(ROOT_ID, b"tmp.pt", ROOT_ID, b"model.pt", 0, AGAIN)
    assert stack.fs.lookup(ROOT_ID, b"model.pt").size == 1
    # sent again, but the new name is not there either: the caller's error after all
    with pytest.raises(FsError) as rename_error:
        await requests.rename(ROOT_ID, b"gone.pt", ROOT_ID, b"never.pt", 0, AGAIN)
    assert rename_error.value.errno == errno.ENOENT


async def test_a_create_sent_again_opens_the_file_it_made(stack: Stack) -> None:
    requests = stack.fs.requests
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fh, attr = await requests.create(ROOT_ID, b"shard.pt", 0o644, flags, UID, GID, FIRST)
    stack.fs.write(fh, 0, b"abc")
    stack.fs.release(fh)
    again, again_attr = await requests.create(ROOT_ID, b"shard.pt", 0o644, flags, UID, GID, AGAIN)
    assert again_attr.ino == attr.ino and stat.S_ISREG(again_attr.mode) and again_attr.size == 3
    stack.fs.release(again)
    with pytest.raises(FsError) as exclusive:
        await requests.create(ROOT_ID, b"shard.pt", 0o644, flags, UID, GID, FIRST)
    assert exclusive.value.errno == errno.EEXIST


class _Backing:
    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.registered: list[int] = []

    def open(self, fd: int) -> int:
        if self.refuse:
            raise OSError(self.refuse, os.strerror(self.refuse))
        self.registered.append(fd)
        return 7

    def close(self, backing_id: int) -> None:
        assert backing_id == 7


def test_the_passthrough_probe_says_why_it_is_off(tmp_path: Path) -> None:
    probe = str(tmp_path / "probe")
    assert probe_passthrough("off", _Backing(), True, probe) == (None, "off: passthrough = off")
    backing, why = probe_passthrough("auto", None, False, probe)
    assert backing is None and "stock build" in why
    backing, why = probe_passthrough("auto", _Backing(), False, probe)
    assert backing is None and "did not grant" in why
    backing, why = probe_passthrough("auto", _Backing(refuse=errno.EPERM), True, probe)
    assert backing is None and "CAP_SYS_ADMIN" in why
    works = _Backing()
    backing, why = probe_passthrough("auto", works, True, probe)
    assert backing is works and why.startswith("on:") and len(works.registered) == 1
    assert not os.path.exists(probe)  # the scratch file is removed again
