"""What the journal records of the objects the drain puts in the store, for uploads, spills and moves.

Owns: the write-ahead delete journaled before any object appears at a key (so that the store never keeps
an object no journal row accounts for), recording an object once the store holds it (the inode owns the
key then, and its write-ahead delete goes), the commit-marker hook that follows, the journaled state
of a staged upload or spill (saved after each part, read back, forgotten once aborted), and what an
inode's object is put with (its metadata, its priority).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from ckptfs.backends.base import ObjectMeta, UploadState
from ckptfs.drain.ordering import CommitMarkers
from ckptfs.journal import Inode, Journal
from ckptfs.transfer import Priority


class Uploaded(NamedTuple):
    """An object the store now holds for an inode, to be recorded (ObjectRecords.record_uploads)."""

    inode_id: int
    key: str
    version: int
    checksum: str | None
    size: int
    write_ahead: int  # the id of the delete queued before the object appeared
    still_open: bool = False  # a file still open for writing (gateway mode): it stays dirty


class ObjectRecords:
    def __init__(self, journal: Journal, markers: CommitMarkers) -> None:
        self.journal = journal
        self.markers = markers
        # Called once a commit marker is in the store: a checkpoint is complete (retention runs then).
        self.on_marker_uploaded: Callable[[Inode], None] = lambda inode: None

    def write_ahead(self, key: str) -> int:
        """Before an object appears at `key`, journal its deletion; its id. If the daemon dies before
        recording which inode owns the object (or the inode is removed meanwhile), that delete removes the
        orphan; the transaction that records the owner drops it (a delete job would drop it too, since an
        inode owns the key, but at the cost of a job per object: a third of the drain's work per small file)."""
        with self.journal.transaction():
            return self.queue_write_ahead(key)

    def queue_write_ahead(self, key: str) -> int:
        """write_ahead inside the caller's transaction."""
        delete_id = self.journal.deletes.queue_delete(key)
        assert delete_id is not None
        return delete_id

    def record_upload(
        self, inode_id: int, key: str, version: int, checksum: str | None, size: int, write_ahead: int,
        *, still_open: bool = False,
    ) -> None:
        self.record_uploads([Uploaded(inode_id, key, version, checksum, size, write_ahead, still_open)])

    def record_kept(self, inode: Inode, key: str) -> None:
        """A closed file whose content the store got while it was open (gateway mode), unchanged since: it
        is clean without another upload."""
        with self.journal.transaction():
            self.journal.work.finish_upload(inode, key=key, version=inode.version, checksum=inode.checksum,
                                       size=inode.size, clean=True)
        if self.markers.match(inode.name):
            self.on_marker_uploaded(inode)

    def record_uploads(self, done: list[Uploaded]) -> None:
        """The store holds these objects now: record each for its inode, in one transaction."""
        if not done:
            return
        markers = []
        with self.journal.transaction():
            for item in done:
                # One at a time, not get_many: recording one object may change another's row (release_key
                # forgets a copy that lived at this key), and a stale row would delete what was just put.
                current = self.journal.names.get(item.inode_id)
                if current is None or current.path is None:
                    continue  # removed while the object was committed: the write-ahead delete removes the object
                self.journal.work.finish_upload(
                    current, key=item.key, version=item.version, checksum=item.checksum, size=item.size,
                    # A file still open for writing stays dirty: the daemon does not see its writes (FUSE
                    # passthrough), so only its close or a later snapshot can say it is unchanged.
                    clean=current.version == item.version and not item.still_open,
                )
                self.journal.deletes.delete_done(item.write_ahead)  # the inode owns the key now
                if self.markers.match(current.name):
                    markers.append(current)
        for current in markers:
            self.on_marker_uploaded(current)

    def save_upload_state(self, inode_id: int, state: UploadState) -> None:
        """Journal each step of a staged upload (the engine calls it after every part), so that a crash
        resumes from the last finished part."""
        with self.journal.transaction():
            self.journal.work.save_upload_state(inode_id, state.to_json())

    def forget_upload_state(self, inode_id: int, aborted: UploadState) -> None:
        """Drop the journal's record of an upload just aborted (if it is still that one), so that a purge
        does not hand it to discard_upload again."""
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.upload_state is None:
            return
        journaled = journaled_upload_id(inode)
        if journaled is not None and journaled != aborted.upload_id:
            return  # a newer upload's (an unreadable record is dropped too)
        with self.journal.transaction():
            self.journal.work.save_upload_state(inode_id, None)


def journaled_state(inode: Inode | None) -> UploadState | None:
    """The staged upload the journal remembers for the inode (None: none, or unreadable)."""
    if inode is None or inode.upload_state is None:
        return None
    return UploadState.parse(inode.upload_state)


def journaled_upload_id(inode: Inode | None) -> str | None:
    state = journaled_state(inode)
    return None if state is None else state.upload_id


def journal_holds(inode: Inode | None, state: UploadState) -> bool:
    """The journal remembers this staged upload (any of its steps) for the inode: a retry resumes it."""
    return journaled_upload_id(inode) == state.upload_id


def object_meta(inode: Inode) -> ObjectMeta:
    """The metadata an inode's object carries in the store."""
    return ObjectMeta(mtime_ns=inode.mtime_ns, mode=inode.mode & 0o7777)


def upload_priority(markers: CommitMarkers, inode: Inode) -> Priority:
    """Commit markers wait behind other uploads in the engine's queues (they complete a checkpoint last)."""
    return Priority.MARKER if markers.match(inode.name) else Priority.UPLOAD
