"""What the FUSE requests of a small file cost the journal, counted instead of timed (issue 31): the kernel's
sequence for `open(tmp, "wb")`, one write, `close()`, `rename(tmp, final)` (lookup of the new name, create,
write, release, lookup of the final name, rename), and for an unlink, driven through FuseOperations as the
daemon runs them. A bound that the code before failed keeps a request from quietly growing another read."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fsharness import Stack, check_consistency, make_stack

from ckptfs.fuse_ops import FuseOperations
from ckptfs.journal import ROOT_ID

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
    """Count the journal's statements (BEGIN and COMMIT too) and transactions."""
    counts = Counts()
    db, journal = stack.journal.db, stack.journal
    execute, transaction = db.execute, journal.transaction

    def counting_execute(*args: Any) -> Any:
        counts.statements += 1
        return execute(*args)

    @contextmanager
    def counting_transaction() -> Iterator[None]:
        counts.transactions += 1
        with transaction():
            yield

    monkeypatch.setattr(db, "execute", counting_execute)
    monkeypatch.setattr(journal, "transaction", counting_transaction)
    return counts


async def _small_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, FuseOperations, int, Counts]:
    stack = make_stack(tmp_path, upload_delay=3600)
    stack.fs.lister.refresh_interval = 60.0  # type: ignore[attr-defined]  # the daemon's: listed once
    ops = FuseOperations(stack.fs)
    ctx: Any = Ctx()
    folder = (await ops.mkdir(ROOT_ID, b"ckpt", 0o755, ctx)).st_ino
    await ops.lookup(folder, b"warm", ctx)  # the directory's one listing, not counted
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


async def test_a_small_file_written_to_a_temp_name_and_renamed_costs_ten_statements_and_three_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: 19 statements besides BEGIN and COMMIT, 14 of them reads of an inode row: each of lookup,
    create and rename read the directory and the entry one after the other, and rename read its four
    rows twice (prepare_rename, then rename), release the file's row before its close update."""
    stack, _ops, folder, counts = await _small_files(tmp_path, monkeypatch)
    assert counts.transactions == 3 * FILES  # create, the close at release, rename
    # 5 reads (2 lookups, create, 2 for rename), 5 writes (insert, close, move, 2 directory mtimes), and
    # BEGIN and COMMIT of each transaction.
    assert counts.statements <= 16 * FILES, counts.statements / FILES
    renamed = stack.journal.all_children(folder)
    assert sorted(i.name for i in renamed) == sorted(f"f{i}.bin" for i in range(FILES))
    assert all(i.closed_at is not None and i.size == 4096 for i in renamed)
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
    assert stack.journal.all_children(folder) == []
    check_consistency(stack)
