"""The journal: SQLite (WAL) holding the namespace, every file's state and the pending remote operations.

It is the single source of truth. The FUSE layer changes state only through it, the drain learns its work
only from it, and a restart rebuilds everything from it. All calls are synchronous and must be made from
the trio thread: a run of journal calls between two awaits is therefore atomic with respect to every other
task. The one exception is `checkpoint()`, which copies the WAL into the database file on a connection of
its own, in a worker thread (the daemon's, after `checkpoints_elsewhere()`), so that no commit syncs files.
It knows nothing about FUSE, trio or object stores; it stores keys as plain strings.

Durability: WAL with synchronous=NORMAL survives a crash or kill -9 of the daemon after every commit;
`sync()` makes everything committed so far survive power loss (fsync() on a file calls it).

The Journal (journal.py) owns the connection and builds the tables on it: objects that share the one
connection, its transactions and its row cache, each for one concern, so that a caller uses the table it
needs (`journal.names.lookup(...)`, `journal.work.uploads_due(...)`):
  journal.names    Names (tree.py): inodes by id, lookups and walks of the tree, its changes (create,
                   attributes, open and close for writing, unlink, rename), the store's entries imported,
                   when each directory was last listed;
  journal.work     DrainWork (work.py): the drain's work and its results, store keys' owners;
  journal.deletes  PendingDeletes (deletes.py): store keys queued for deletion, which names and work queue;
  journal.copies   LocalCopies (local_copies.py): fetch, eviction, files rewritten behind the daemon, status.
The Journal itself keeps what spans them: transaction(), sync(), checkpoint(), the meta table, close().
The other modules: rows (Inode, PendingDelete, the rows of listings and readdir, states and kinds), schema
(create_tables, the schema version and its migrations), connection (the SQLite connection; SQLite's errors
become JournalFull, JournalUnusable or JournalError there, and nowhere else: once per call into a table or
the core, once per transaction), core (JournalCore: opening, transactions, the sequence of work, meta; and
JournalTable, the tables' base: the core as a collaborator), rowcache (the rows and directory entries read
or written, kept exact by every mutator and dropped by a rollback: a request reads a row SQLite gave once
already from memory).

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
