"""What the FUSE requests of a small file cost the journal, counted instead of timed (issues 31 and 45): the
kernel's sequence for `open(tmp, "wb")`, one write, `close()`, `rename(tmp, final)` (lookup of the new name,
create, write, release, lookup of the final name, rename), and for an unlink, driven through FuseOperations as
the daemon runs them. Statements are counted by SQLite itself (the connection's trace callback: every
statement run, BEGIN and COMMIT among them). A bound that the code before failed keeps a request from
quietly growing another read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fsharness import Stack, check_consistency, make_stack

from ckptfs.journal import ROOT_ID
from ckptfs.mount.adapter import FuseOperations

FILES = 20


class Ctx:
    """The fields of pyfuse3's RequestContext that FuseOperations reads."""

    uid = os.getuid()
    gid = os.getgid()
    pid = os.getpid()
    umask = 0o022
    unique = 0


class Counts:
    def __init__(self) -> None:
        self.statements = 0
        self.transactions = 0


def _counted(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Counts:
    """Count the journal's statements (as SQLite runs them: BEGIN and COMMIT too) and transactions."""
    counts = Counts()
    journal = stack.journal
    transaction = journal.transaction

    def traced(_sql: str) -> None:
        counts.statements += 1

    @contextmanager
    def counting_transaction() -> Iterator[None]:
        counts.transactions += 1
        with transaction():
            yield

    journal.db.set_trace_callback(traced)
    monkeypatch.setattr(journal, "transaction", counting_transaction)
    return counts


async def _small_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, forget_first: bool = False
                       ) -> tuple[Stack, FuseOperations, int, Counts]:
    stack = make_stack(tmp_path, upload_delay=3600)
    stack.fs.lister.refresh_interval = 60.0  # type: ignore[attr-defined]  # the daemon's: listed once
    ops = FuseOperations(stack.fs)
    ctx: Any = Ctx()
    folder = (await ops.mkdir(ROOT_ID, b"ckpt", 0o755, ctx)).st_ino
    await ops.lookup(folder, b"warm", ctx)  # the directory's one listing, not counted
    if forget_first:
        stack.journal.cache.clear()  # as after a restart: the directory is not known to be complete
        await ops.lookup(folder, b"warm", ctx)
    counts = _counted(stack, monkeypatch)
    for i in range(FILES):
        temp, final = f".f{i}.tmp".encode(), f"f{i}.bin".encode()
        assert (await ops.lookup(folder, temp, ctx)).st_ino == 0  # the kernel's lookup before a create
        info, _entry = await ops.create(folder, temp, 0o100644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, ctx)
        assert await ops.write(info.fh, 0, b"x" * 4096) == 4096
        await ops.release(info.fh)
        assert (await ops.lookup(folder, final, ctx)).st_ino == 0
        await ops.rename(folder, temp, folder, final, 0, ctx)
    return stack, ops, folder, counts


async def test_a_small_file_written_to_a_temp_name_and_renamed_costs_at_most_six_statements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 left 16 statements in 3 transactions: the directory's row read 4 times, each name twice.
    Now the journal's cache answers the reads: the directory was made here, so the lookups of the new
    names are known misses, and the rows the create wrote serve the rename; the close and the rename of a
    file to a free name are one statement each, a transaction of their own; the create is BEGIN, INSERT,
    the directory's times, COMMIT."""
    stack, _ops, folder, counts = await _small_files(tmp_path, monkeypatch)
    assert counts.transactions == FILES  # the create's; the close and the rename are one statement each
    assert counts.statements <= 6 * FILES, counts.statements / FILES
    stack.journal.db.set_trace_callback(None)
    renamed = stack.journal.names.all_children(folder)
    assert sorted(i.name for i in renamed) == sorted(f"f{i}.bin" for i in range(FILES))
    assert all(i.closed_at is not None and i.size == 4096 for i in renamed)
    check_consistency(stack)


async def test_a_small_file_in_a_directory_from_the_store_costs_at_most_eight_statements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 45's bound where the cache cannot know a name is missing (a directory this daemon did not
    make, or one whose cache was dropped): each new name's first lookup is one read, the rest as above."""
    stack, _ops, _folder, counts = await _small_files(tmp_path, monkeypatch, forget_first=True)
    assert counts.statements <= 8 * FILES, counts.statements / FILES
    stack.journal.db.set_trace_callback(None)
    check_consistency(stack)


async def test_an_unlink_costs_one_read_and_one_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: two reads (the directory, then the entry)."""
    stack, ops, folder, counts = await _small_files(tmp_path, monkeypatch)
    ctx: Any = Ctx()
    statements, transactions = counts.statements, counts.transactions
    for i in range(FILES):
        await ops.unlink(folder, f"f{i}.bin".encode(), ctx)
    assert counts.transactions - transactions == FILES
    # the read, BEGIN, the detach, the directory's mtime, COMMIT
    assert counts.statements - statements <= 5 * FILES
    stack.journal.db.set_trace_callback(None)
    assert stack.journal.names.all_children(folder) == []
    check_consistency(stack)
