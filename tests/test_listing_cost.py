"""What a fresh node's walk of a big tree costs, counted instead of timed: listing a directory is one store
call and one journal transaction whose statements do not grow with the number of entries, and readdir and
lookup after it are answered from the journal without another store call. The fast check of listed names
agrees with the full one (_valid_path) on every kind of bad key."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fsharness import Stack, check_consistency, make_stack
from waiting import until

from ckptfs.fetch.lister import MAX_PATH_BYTES, DirLister, _listed_name, _plain_names, _valid_path
from ckptfs.journal import REMOTE, ROOT_ID, JournalFull


class Counts:
    def __init__(self) -> None:
        self.statements = 0
        self.transactions = 0
        self.list_dir = 0


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Callable[[Stack], Counts]:
    """Count the journal's statements (execute, executemany) and transactions and the store's list_dir."""

    def install(stack: Stack) -> Counts:
        counts = Counts()
        db, journal, store = stack.journal.db, stack.journal, stack.store

        def counting(fn: Callable[..., Any], what: str) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                setattr(counts, what, getattr(counts, what) + 1)
                return fn(*args, **kwargs)
            return call

        monkeypatch.setattr(db, "execute", counting(db.execute, "statements"))
        monkeypatch.setattr(db, "executemany", counting(db.executemany, "statements"))
        monkeypatch.setattr(store, "list_dir", counting(store.list_dir, "list_dir"))
        transaction = journal.transaction

        @contextmanager
        def counted_transaction() -> Iterator[None]:
            counts.transactions += 1
            with transaction():
                yield

        monkeypatch.setattr(journal, "transaction", counted_transaction)
        return counts

    return install


def _tree(store: Path, files: int) -> None:
    (store / "big" / "sub").mkdir(parents=True)
    for i in range(files):
        (store / "big" / f"f{i:05d}.bin").write_bytes(b"x" * (i % 7))
    os.symlink("f00000.bin", store / "big" / "link")


async def _listing_cost(tmp_path: Path, counted: Callable[[Stack], Counts], files: int) -> tuple[int, int, int]:
    _tree(tmp_path / "store", files)
    stack = make_stack(tmp_path)
    await stack.fs.ensure_listed(ROOT_ID)
    big = stack.journal.names.by_path("big")
    assert big is not None
    counts = counted(stack)
    await stack.fs.ensure_listed(big.id)
    children = {c.name: c for c in stack.journal.names.all_children(big.id)}
    assert len(children) == files + 2  # the files, the symlink, the subdirectory
    assert children["f00003.bin"].size == 3 and children["f00003.bin"].state == REMOTE
    assert children["link"].target == "f00000.bin" and children["sub"].kind == "dir"
    assert big.id in stack.journal.names.listed_dirs()
    check_consistency(stack)
    return counts.statements, counts.transactions, counts.list_dir


async def test_listing_a_directory_costs_the_same_journal_work_for_10_or_800_entries(
    tmp_path: Path, counted: Callable[[Stack], Counts]
) -> None:
    """Before: three statements per listed entry (is the key owned, insert, read the row back), and the
    time of its listing in a transaction of its own."""
    small = await _listing_cost(tmp_path / "small", counted, 10)
    big = await _listing_cost(tmp_path / "big", counted, 800)  # (keys are checked 900 to a query)
    assert small == big, (small, big)
    statements, transactions, list_calls = big
    assert transactions == 1
    assert list_calls == 1
    # (20 since the deletes pending when the listing began are read too: one statement, whatever the size)
    assert statements <= 20, statements


async def test_a_directory_of_1000_files_goes_into_the_journal_by_one_insert(tmp_path: Path) -> None:
    """SQLite's work per statement run was a quarter of an import's: before, a directory of 1,000 files
    took 57 INSERT runs (64 rows each, the rest one by one); now one of 1,000 rows where SQLite takes that
    many parameters, and the two entries left over one by one. Every entry is there, as listed."""
    _tree(tmp_path / "store", 1000)
    stack = make_stack(tmp_path)
    await stack.fs.ensure_listed(ROOT_ID)
    big = stack.journal.names.by_path("big")
    assert big is not None
    inserts: list[str] = []
    stack.journal.db.set_trace_callback(lambda sql: sql.startswith("INSERT INTO inodes") and inserts.append(sql))
    try:
        await stack.fs.ensure_listed(big.id)
    finally:
        stack.journal.db.set_trace_callback(None)
    assert len(inserts) <= 3, len(inserts)
    children = {c.name: c for c in stack.journal.names.all_children(big.id)}
    assert len(children) == 1002
    assert [children[f"f{i:05d}.bin"].size for i in range(1000)] == [i % 7 for i in range(1000)]
    assert children["f00999.bin"].path == "big/f00999.bin" and children["f00999.bin"].remote_key == "big/f00999.bin"
    check_consistency(stack)


async def test_readdir_and_lookup_after_a_listing_ask_the_store_nothing(
    tmp_path: Path, counted: Callable[[Stack], Counts]
) -> None:
    _tree(tmp_path / "store", 300)
    stack = make_stack(tmp_path)
    stack.fs.lister.refresh_interval = 60.0  # type: ignore[attr-defined]
    counts = counted(stack)
    for _walk in range(2):  # the first walk lists each directory once, the second nothing
        await stack.fs.ensure_listed(ROOT_ID)
        big = stack.fs.lookup(ROOT_ID, b"big")
        await stack.fs.ensure_listed(big.ino)
        entries = list(stack.fs.readdir(stack.fs.opendir(big.ino), 0))
        assert len(entries) == 302
        for entry in entries:
            await stack.fs.ensure_listed(big.ino)
            assert stack.fs.lookup(big.ino, entry.name) == entry.attr
        assert counts.list_dir == 2  # the root and big/
    check_consistency(stack)


async def _listed_root_of_dirs(tmp_path: Path, count: int) -> tuple[Stack, DirLister, list[int]]:
    """A store of `count` directories of one file each, its root listed; their inode ids in readdir's order."""
    for d in range(count):
        (tmp_path / "store" / f"d{d}").mkdir(parents=True)
        (tmp_path / "store" / f"d{d}" / "f.bin").write_bytes(b"x")
    stack = make_stack(tmp_path)
    lister = stack.fs.lister
    assert isinstance(lister, DirLister)
    lister.refresh_interval = 60.0
    await stack.fs.ensure_listed(ROOT_ID)
    return stack, lister, sorted(c.id for c in stack.journal.names.all_children(ROOT_ID))


async def test_a_walk_is_listed_one_directory_ahead(tmp_path: Path, counted: Callable[[Stack], Counts]) -> None:
    """A walk opens a directory's subdirectories one after the other: while it reads one, the next is
    listed (on an object store its latency overlaps the walk's work). One ahead of each directory a request
    needed, not the tree; without the lister's task, nothing ahead."""
    stack, lister, ids = await _listed_root_of_dirs(tmp_path, 4)
    counts = counted(stack)
    await stack.fs.ensure_listed(ids[0])
    await trio.testing.wait_all_tasks_blocked()  # whatever runs without the lister's task had its chance
    assert counts.list_dir == 1 and ids[1] not in stack.journal.names.listed_dirs()
    async with trio.open_nursery() as nursery:
        await nursery.start(lister.run)
        await stack.fs.ensure_listed(ids[1])  # listed on request: the next one ahead of the walker
        await until(lambda: ids[2] in stack.journal.names.listed_dirs())
        assert counts.list_dir == 3
        await stack.fs.ensure_listed(ids[2])  # listed ahead before: the store is not asked again
        await until(lambda: ids[3] in stack.journal.names.listed_dirs())
        assert counts.list_dir == 4
        await stack.fs.ensure_listed(ids[3])  # the last one: nothing after it
        await trio.sleep(0.2)
        assert counts.list_dir == 4
        nursery.cancel_scope.cancel()
    assert [e.name for e in stack.fs.readdir(ids[3], 0)] == [b"f.bin"]
    check_consistency(stack)


async def test_a_full_cache_filesystem_skips_a_listing_ahead_and_the_next_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal cannot grow (JournalFull) while a directory is listed ahead: that listing is skipped,
    quietly (the request that needs it hears ENOSPC itself), and the task lists the next one."""
    stack, lister, ids = await _listed_root_of_dirs(tmp_path, 3)
    import_listed = stack.journal.names.import_listed
    full = [True]

    def once_full(directory: Any, *args: Any, **kwargs: Any) -> None:
        if directory.id == ids[1] and full:
            full.pop()
            raise JournalFull("database or disk is full")
        import_listed(directory, *args, **kwargs)

    monkeypatch.setattr(stack.journal.names, "import_listed", once_full)
    async with trio.open_nursery() as nursery:
        await nursery.start(lister.run)
        await stack.fs.ensure_listed(ids[0])  # d1 ahead: the journal is full
        await until(lambda: not full)
        await stack.fs.ensure_listed(ids[1])  # listed now, on request; d2 ahead
        await until(lambda: ids[2] in stack.journal.names.listed_dirs())
        nursery.cancel_scope.cancel()
    assert [e.name for e in stack.fs.readdir(ids[1], 0)] == [b"f.bin"]
    check_consistency(stack)


async def test_readdir_pages_through_entries_whose_ids_interleave_with_another_directorys(tmp_path: Path) -> None:
    """readdir reads a directory's rows by id in pages (Tree.entry_rows: the ids from the (parent, name)
    index, then their rows): with ids shared out between two directories, names out of id order, and pages
    of 3, each entry comes once, in id order, from wherever the kernel asks it to go on."""
    stack = make_stack(tmp_path)
    a = stack.fs.mkdir(ROOT_ID, b"a", 0o755, os.getuid(), os.getgid()).ino
    b = stack.fs.mkdir(ROOT_ID, b"b", 0o755, os.getuid(), os.getgid()).ino
    made: dict[int, list[int]] = {a: [], b: []}
    for n in range(10):
        for folder, name in ((a, f"a/{9 - n}"), (b, f"b/{n}")):
            made[folder].append(stack.write_file(name, b"x"))
    for folder, ids in made.items():
        assert ids == sorted(ids) and ids[-1] - ids[0] > len(ids)  # interleaved with the other's
        paged, after = [], 0
        while page := list(stack.fs.readdir(folder, after, 3)):
            assert len(page) <= 3
            paged.extend(entry.attr.ino for entry in page)
            after = page[-1].next_id
        assert paged == ids
        assert [entry.attr.ino for entry in stack.fs.readdir(folder, ids[4], 1000)] == ids[5:]
        assert [stack.fs.getattr(ino) for ino in ids] == [e.attr for e in stack.fs.readdir(folder, 0, 1000)]
    check_consistency(stack)


async def test_the_kernel_forgetting_a_walked_tree_is_one_query_per_batch(
    tmp_path: Path, counted: Callable[[Stack], Counts]
) -> None:
    """After a walk the kernel forgets its entries by the thousand (BATCH_FORGET). Before: a journal read
    per forgotten inode, to see whether it was unlinked and must be purged."""
    _tree(tmp_path / "store", 600)
    stack = make_stack(tmp_path)
    await stack.fs.ensure_listed(ROOT_ID)
    big = stack.fs.lookup(ROOT_ID, b"big")
    await stack.fs.ensure_listed(big.ino)
    walked = list(stack.fs.readdir(stack.fs.opendir(big.ino), 0))
    stack.fs.remember_many([entry.attr.ino for entry in walked])  # what readdirplus does for the entries it reports
    victim = stack.write_file("victim", b"gone soon")
    stack.fs.unlink(ROOT_ID, b"victim")  # the kernel still holds the reference of its create
    counts = counted(stack)
    stack.fs.forget_many([(entry.attr.ino, 1) for entry in walked] + [(victim, 1)])
    assert counts.statements <= 5, counts.statements  # which are unlinked; the victim's purge (4)
    assert stack.journal.names.get(victim) is None and not stack.cache.has_data(victim)
    assert len(stack.journal.names.all_children(big.ino)) == 602  # forgetting is no unlink
    check_consistency(stack)


GOOD = ["a", "a.b", "é" * 127, "x" * 255, "..." , ". a", "a b"]
BAD = ["", ".", "..", "x" * 256, "é" * 128, "a\0b", "a/b", "/a", "\udcff", "a\udcffb"]


@pytest.mark.parametrize("prefix", ["", "d/", "dir/" + "p" * 200 + "/"])
@pytest.mark.parametrize("name", GOOD + BAD)
def test_the_name_check_of_a_listing_agrees_with_the_path_check(prefix: str, name: str) -> None:
    # (An empty name as a file is the directory's own key: its marker, never an entry of its listing.)
    keys = [(prefix + name, False)] if name else []
    for key, subdir in [*keys, (prefix + name + "/", True)]:
        got = _listed_name(key, prefix, set(), subdir=subdir)
        if "/" in name:  # a deeper key is no entry of this directory (a listing by delimiter has none)
            assert got is None
            continue
        expected = _valid_path(key)
        assert (got is None) == (expected is None), (key, got, expected)
        if got is not None:
            assert prefix + got == expected


@pytest.mark.parametrize("prefix", ["", "d/", "dir/" + "p" * 200 + "/", "é/"])
@pytest.mark.parametrize("name", GOOD + BAD)
def test_the_check_of_a_whole_listing_agrees_with_the_check_of_each_name(prefix: str, name: str) -> None:
    """A big listing's names are checked all at once (_plain_names); when that says yes, every name is one
    _listed_name accepts as it is; when one name is not plain, it says no and each is checked on its own."""
    if not name:
        return  # the directory's own key: never an entry of its listing
    keys = [prefix + "ok1", prefix + name, prefix + "ok2"]
    plain = _plain_names(keys, prefix)
    each = [_listed_name(key, prefix, set()) for key in keys]
    if plain is not None:
        assert plain == each
    else:
        assert not (name.isascii() and name not in (".", "..") and "/" not in name and "\0" not in name
                    and 0 < len(name) <= 255 and len((prefix + name).encode()) <= MAX_PATH_BYTES), name
    if prefix:  # a key outside the directory whose tail looks like a name
        assert _plain_names([prefix + "a", "z" * len(prefix) + "b"], prefix) is None


def test_a_path_one_byte_too_long_is_refused_by_the_name_check() -> None:
    prefix = ("p" * 200 + "/") * 4  # 804 bytes
    fits = "n" * (MAX_PATH_BYTES - len(prefix))
    assert _listed_name(prefix + fits, prefix, set()) == fits
    assert _listed_name(prefix + fits + "n", prefix, set()) is None
    assert _listed_name(prefix + fits + "/", prefix, set(), subdir=True) == fits
    assert _listed_name(prefix + fits + "n/", prefix, set(), subdir=True) is None
    assert _plain_names([prefix + fits], prefix) == [fits]
    assert _plain_names([prefix + fits + "n"], prefix) is None
