"""The Journal class: one connection, its concerns composed (each a module of this package)."""

from __future__ import annotations

from ckptfs.journal.local import LocalCopies
from ckptfs.journal.namespace import Namespace
from ckptfs.journal.work import DrainWork


class Journal(Namespace, DrainWork, LocalCopies):
    """The journal of one cache dir: open it with its path (journal.db); see the package's docstring."""
