"""The journal's SQLite connection, and the one place where SQLite's errors become the journal's: every
statement runs on a _Cursor, so no sqlite3 error leaves the journal. Callers catch JournalFull (the cache
filesystem is full: retry later) and test for JournalUnusable (the journal cannot record anything any more:
the daemon ends); any other failure of a statement is a JournalError (a bug).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any


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


class _Cursor(sqlite3.Cursor):
    """A cursor whose statements and rows raise journal errors, never sqlite3's."""

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        try:
            return super().execute(sql, parameters)
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc


class _Connection(sqlite3.Connection):
    """The journal's connection: every statement runs on a _Cursor, so no sqlite3 error leaves the journal."""

    def execute(self, sql: str, parameters: Any = (), /) -> _Cursor:
        try:
            cursor = self.cursor(_Cursor)
        except sqlite3.Error as exc:  # a closed connection
            raise from_sqlite(exc) from exc
        return cursor.execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> _Cursor:
        try:
            cursor = self.cursor(_Cursor)
            cursor.executemany(sql, seq_of_parameters)
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc
        return cursor

    def executescript(self, script: str, /) -> sqlite3.Cursor:
        try:
            return super().executescript(script)
        except sqlite3.Error as exc:
            raise from_sqlite(exc) from exc


def connect(path: Path) -> _Connection:
    try:
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=_Connection)
    except sqlite3.Error as exc:
        raise from_sqlite(exc) from exc
