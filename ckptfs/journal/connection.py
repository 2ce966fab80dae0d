"""The journal's SQLite connection, and the one place where SQLite's errors become the journal's: at the
journal's boundary, once per call into it (translating(), around every public method) and once per
transaction (JournalCore.transaction, for its BEGIN, body and COMMIT), so no sqlite3 error leaves the
journal while its statements run on sqlite3's connection as it is. Callers catch JournalFull (the cache
filesystem is full: retry later) and test for JournalUnusable (the journal cannot record anything any more:
the daemon ends); any other failure of a statement is a JournalError (a bug).
"""

from __future__ import annotations

import functools
import inspect
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class JournalError(Exception):
    """The journal cannot do what was asked: a journal of another schema at open, or a statement that
    failed for a reason of neither kind below (a bug)."""


class JournalFull(JournalError):
    """The journal could not grow: its file system (the cache's) is full. Nothing was changed; the same
    write works once there is room."""


class JournalUnusable(JournalError):
    """The journal can no longer record anything: its file cannot be read or written (an I/O error, a
    corrupt page, a cache filesystem remounted read-only) or its connection is closed. Every promise
    rests on it, so this alone may end the daemon; any other failure is one entry's or one task's."""


# Primary SQLite result codes after which the journal cannot be trusted or reached any more.
_UNUSABLE_CODES = frozenset(
    (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CANTOPEN,
     sqlite3.SQLITE_READONLY)
)


def from_sqlite(exc: sqlite3.Error) -> JournalError:
    """What a failed statement means to the journal's callers; the one place that reads SQLite's codes."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code == sqlite3.SQLITE_FULL:
        return JournalFull(str(exc))
    if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
        return JournalUnusable(str(exc))
    if isinstance(exc, sqlite3.DatabaseError) and code is not None and code & 0xFF in _UNUSABLE_CODES:
        return JournalUnusable(str(exc))
    return JournalError(str(exc))


def journal_unusable(exc: BaseException) -> bool:
    """Is `exc` a JournalUnusable, or a group raised out of a nursery that holds one?"""
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(JournalUnusable) is not None
    return isinstance(exc, JournalUnusable)


def translating(method: Callable[P, R]) -> Callable[P, R]:
    """`method` with SQLite's errors raised as the journal's: how a call into the journal translates them,
    once at its boundary (around every public method of a table, JournalTable, and the core's entry points),
    not at every statement and every fetch inside it (each statement runs on sqlite3's own connection, in C)."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc

    return call


def translate_public_methods(cls: type) -> None:
    """Wrap each public method `cls` defines (and __init__) in translating(): what reaches a caller of the
    journal is a JournalError, never a sqlite3.Error."""
    for name, value in list(vars(cls).items()):
        if inspect.isfunction(value) and (name == "__init__" or not name.startswith("_")):
            setattr(cls, name, translating(value))


class JournalConnection(sqlite3.Connection):
    """sqlite3's connection, its methods as they are (in C: no Python frame per statement). A subclass only
    so that an instance takes attributes: tests count the journal's calls by wrapping its execute."""


def connect(path: Path) -> JournalConnection:
    try:
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=JournalConnection)
    except sqlite3.Error as exc:
        raise from_sqlite(exc) from exc
