"""The journal: SQLite (WAL) holding the namespace, every file's state and the pending remote operations.

It is the single source of truth. The FUSE layer changes state only through it, the drain learns its work
only from it, and a restart rebuilds everything from it. All calls are synchronous and must be made from
the trio thread: a run of journal calls between two awaits is therefore atomic with respect to every other
task. The one exception is `checkpoint()`, which copies the WAL into the database file on a connection of
its own, in a worker thread (the daemon's, after `checkpoints_elsewhere()`), so that no commit syncs files.
It knows nothing about FUSE, trio or object stores; it stores keys as plain strings.

Durability: WAL with synchronous=NORMAL survives a crash or kill -9 of the daemon after every commit;
`sync()` makes everything committed so far survive power loss (fsync() on a file calls it).

Modules, one concern each: records (Inode, PendingDelete, the rows of listings and readdir, states and kinds),
schema (create_tables, the schema version and its migrations), connection (the SQLite connection; SQLite's
errors become JournalFull, JournalUnusable or JournalError there, and nowhere else), base (opening,
transactions, sync, meta), rowcache (the rows and directory entries read or written, kept exact by every
mutator and dropped by a rollback: a request reads a row SQLite gave once already from memory), and the
concerns of the Journal class: namespace, deletes, work (the drain's), local (fetch, eviction, status).

The cache is coherent because the journal's mutators are the only writers of its tables: one process
holds a cache dir (its lock), and in it every journal call is made from the trio thread (the drain's,
recovery's, the lister's imports and the peers' changes included); checkpoint() writes no row.
"""

from ckptfs.journal.connection import JournalError, JournalFull, JournalUnusable, journal_unusable
from ckptfs.journal.journal import Journal
from ckptfs.journal.local_copies import rewritten
from ckptfs.journal.rows import (
    CLEAN,
    DIR,
    DIRTY,
    FILE,
    REMOTE,
    ROOT_ID,
    SYMLINK,
    UPLOADING,
    EntryRow,
    Inode,
    ListedEntry,
    PendingDelete,
)
from ckptfs.journal.schema import SCHEMA_VERSION

__all__ = [
    "CLEAN", "DIR", "DIRTY", "FILE", "REMOTE", "ROOT_ID", "SCHEMA_VERSION", "SYMLINK", "UPLOADING", "EntryRow", "Inode",
    "Journal", "JournalError", "JournalFull", "JournalUnusable", "ListedEntry", "PendingDelete", "journal_unusable",
    "rewritten",
]
