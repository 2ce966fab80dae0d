"""What the journal's rows are: an inode (and its states and kinds), a pending delete, the root's id."""

from __future__ import annotations

from typing import NamedTuple

ROOT_ID = 1

# Content / marker states of an inode (column inodes.state).
DIRTY = "dirty"  # local data or entry is newer than the store's copy (or the store has none)
UPLOADING = "uploading"  # the drain is copying this version to the store right now
CLEAN = "clean"  # the store holds this version at remote_key; local data present
REMOTE = "remote"  # the store holds it; no local data (seen on a fresh node, or fetched never)

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"


class Inode(NamedTuple):
    """One row of inodes (see schema.create_tables for what each column means)."""

    id: int
    parent: int | None
    name: str | None
    path: str | None
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    target: str | None
    state: str
    version: int
    uploaded_version: int
    remote_key: str | None
    checksum: str | None
    meta_dirty: int
    upload_state: str | None
    closed_at: float | None
    seq: int
    # Set by utimens of an inode without local data; None: never set, reads as mtime_ns (see the schema).
    atime_ns: int | None = None

    @property
    def key(self) -> str | None:
        """The store key this inode belongs at now (None when unlinked; '' for the root, which has none)."""
        if not self.path:
            return self.path
        return self.path + "/" if self.kind == DIR else self.path

    @property
    def has_local_data(self) -> bool:
        return self.kind == FILE and self.state != REMOTE


# (id, name, kind, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, target, state): Names.entry_rows.
EntryRow = tuple[int, str, str, int, int, int, int, "int | None", int, int, "str | None", str]


class ListedEntry(NamedTuple):
    """An entry a store listing shows and the journal does not have yet (Names.import_listed)."""

    name: str
    kind: str
    size: int
    mtime_ns: int
    mode: int  # st_mode including the type bits
    key: str | None  # None: a directory implied by deeper keys, with no marker object of its own
    target: str | None = None
    checksum: str | None = None


class PendingDelete(NamedTuple):
    """One row of pending_deletes."""

    id: int
    key: str
    created_at: float


# Every column of inodes, in Inode's order: what a query selects to build an Inode.
INODE_COLUMNS = ", ".join(Inode._fields)
