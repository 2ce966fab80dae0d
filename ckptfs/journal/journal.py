"""The Journal class: one connection, its concerns composed (each a module of this package)."""

from __future__ import annotations

from ckptfs.journal.local_copies import LocalCopies
from ckptfs.journal.tree import Tree
from ckptfs.journal.work import DrainWork


class Journal(Tree, DrainWork, LocalCopies):
    """The journal of one cache dir: open it with its path (journal.db); see the package's docstring."""
