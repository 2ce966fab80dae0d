"""The Journal: the owner of one cache dir's journal. It opens the core (the connection, its transactions,
the row cache) and builds the tables on it, each an object of its own sharing that one connection:
`names` (the tree), `work` (the drain's), `deletes` (pending deletes) and `copies` (local copies)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from ckptfs.journal.core import JournalCore
from ckptfs.journal.deletes import PendingDeletes
from ckptfs.journal.local_copies import LocalCopies
from ckptfs.journal.tree import Names
from ckptfs.journal.work import DrainWork


class Journal:
    """The journal of one cache dir: open it with its path (journal.db); see the package's docstring. A
    caller uses the table it needs (`journal.names.lookup(...)`), and the journal itself for what spans
    them: a transaction, durability (sync, checkpoints), the meta table, closing."""

    def __init__(self, path: Path) -> None:
        self.core = JournalCore(path)
        self.path = path
        self.db = self.core.db
        self.cache = self.core.cache
        self.deletes = PendingDeletes(self.core)
        self.names = Names(self.core, self.deletes)
        self.work = DrainWork(self.core, self.deletes)
        self.copies = LocalCopies(self.core)

    @property
    def commits(self) -> int:
        """Transactions committed since open (the daemon checkpoints only after new ones)."""
        return self.core.commits

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """One transaction over every table (JournalCore.transaction): the calls in its body commit together."""
        return self.core.transaction()

    def sync(self) -> None:
        self.core.sync()

    def checkpoints_elsewhere(self) -> None:
        self.core.checkpoints_elsewhere()

    def checkpoint(self) -> None:
        self.core.checkpoint()

    def get_meta(self, key: str) -> str | None:
        return self.core.get_meta(key)

    def set_meta(self, key: str, value: str) -> None:
        self.core.set_meta(key, value)

    def close(self) -> None:
        self.core.close()
