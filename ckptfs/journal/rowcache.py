"""The journal's read-through cache of inode rows (by id) and of directory entries ((parent, name) -> id,
or None: no such entry), so that the requests of a small file read the rows they need once, not once per
request.

Coherent by construction, not by expiry: the journal's own mutators are the only writers of the inodes
table (one process holds the cache dir; in it every call is made from the trio thread, see the package's
docstring), and each of them, once its statement has run, either updates what it changed here to the
exact values it wrote or drops it (a statement whose effect depends on the row, such as `version + 1`).
A rollback drops everything (JournalCore.transaction): the rows read or written inside it may never have
been. What is dropped is read again from SQLite at its next use.

An entry's id is checked against its row at each use (Names.lookup): an entry can therefore never
answer with a row that moved away or was unlinked. A negative entry cannot be checked that way; every
statement that gives a directory a name (create_inode, import_remote, import_listed, move) drops or
replaces the name's entry.

A directory this daemon made (mkdir) starts empty and complete: every entry it gets is kept here, so a
name it does not hold is known to be missing without a read (the lookup before each new file's create).
A listing imported into it (names the cache is not told one by one), a clear, a rollback or an entry that
failed its check makes it incomplete again: its names are read from SQLite from then on.
"""

from __future__ import annotations

from typing import Any

from ckptfs.journal.rows import Inode

# Rows and entries kept (each); beyond, the cache starts again empty. A 100,000-file walk reads every row
# once, but the requests that read a row again (lookup, create, rename, getattr of the files being
# written) read the recent ones: a whole clear now and then costs one read of each of those. Full, it
# holds about 54 MB (measured with tracemalloc: 65,535 rows of 60-byte paths and as many entries).
CAPACITY = 65536


class RowCache:
    """Inode rows by id, and directory entries by (parent id, name)."""

    __slots__ = ("complete", "entries", "rows")

    def __init__(self) -> None:
        self.rows: dict[int, Inode] = {}
        # (parent, name) -> the id of the entry, or None: the directory has no entry of that name.
        self.entries: dict[tuple[int, str], int | None] = {}
        # Directories whose every entry is in `entries`: a name missing there is missing.
        self.complete: set[int] = set()

    def clear(self) -> None:
        self.rows.clear()
        self.entries.clear()
        self.complete.clear()

    def keep(self, inode: Inode) -> None:
        """`inode` is the row as the journal holds it now."""
        rows = self.rows
        if len(rows) >= CAPACITY:
            rows.clear()
        rows[inode.id] = inode

    def keep_entry(self, parent: int, name: str, inode_id: int | None) -> None:
        """The directory `parent` has the entry `name` with this id now (None: it has none)."""
        entries = self.entries
        if len(entries) >= CAPACITY:
            entries.clear()
            self.complete.clear()
        entries[(parent, name)] = inode_id

    def new_directory(self, inode_id: int) -> None:
        """The directory `inode_id` was just made: it has no entries."""
        self.complete.add(inode_id)

    def names_arrived(self, parent: int, names: list[str]) -> None:
        """The directory `parent` has these names from now on, of ids the caller does not know."""
        entries = self.entries
        for name in names:
            entries.pop((parent, name), None)
        self.complete.discard(parent)

    def update(self, inode_id: int, **columns: Any) -> None:
        """A statement set these columns of the row to these values (and changed nothing else of it)."""
        row = self.rows.get(inode_id)
        if row is not None:
            self.rows[inode_id] = row._replace(**columns)

    def drop(self, inode_id: int) -> None:
        """The row changed in a way only SQLite knows: read it again at its next use."""
        self.rows.pop(inode_id, None)

    def drop_entry(self, parent: int | None, name: str | None) -> None:
        """The directory `parent` has no entry `name` any more."""
        if parent is not None and name is not None:
            self.entries.pop((parent, name), None)

    def distrust_entry(self, parent: int, name: str) -> None:
        """The entry failed its check against its row: the directory's names are read from SQLite again."""
        self.entries.pop((parent, name), None)
        self.complete.discard(parent)
