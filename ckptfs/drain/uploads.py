"""Uploads: one entry's object put in the store (a closed file, a directory marker, a symlink), and small
closed files put together in batches.

Owns: re-checking that an upload the scan chose is still due, staging a file's upload (resuming one an
earlier attempt left, journaling each part), committing it and recording it (records.py), abandoning it
when the file changed, moved or went away meanwhile; and the batch path for files up to SMALL_FILE (one
transaction and one worker-thread hop for many files). A file whose start was spilled while it was written
is finished by spills.py instead. A file still open for writing (gateway mode) is uploaded here too, from
a snapshot of its cache file that must still hold after staging (open_uploads.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ckptfs.backends.base import UploadState
from ckptfs.cache.directory import CacheDir, CacheFile
from ckptfs.drain.object_records import (
    ObjectRecords,
    Uploaded,
    journal_holds,
    journaled_state,
    object_meta,
    upload_priority,
)
from ckptfs.drain.open_uploads import OpenUploads, Snapshot, settle, stat_snapshot
from ckptfs.drain.ordering import CommitMarkers, Job, changed_since_scan
from ckptfs.drain.retries import Retries
from ckptfs.drain.spill_jobs import SpillJobs
from ckptfs.drain.stats import DrainStats
from ckptfs.errors import NotFoundBackendError
from ckptfs.journal import DIR, FILE, SYMLINK, UPLOADING, Inode, Journal
from ckptfs.transfer import PutFile, SmallFile, StagedUpload, Transfers
from ckptfs.transfer.local_io import SourceChangedError

log = logging.getLogger(__name__)

# Closed files up to SMALL_FILE bytes upload together, up to SMALL_BATCH per job: one journal transaction
# and one worker-thread hop for all of them instead of three and two per file (Uploads.upload_small).
SMALL_FILE = 1 << 20
SMALL_BATCH = 64
SMALL_BATCH_BYTES = 16 << 20


class Uploads:
    def __init__(
        self,
        journal: Journal,
        cache: CacheDir,
        engine: Transfers,
        records: ObjectRecords,
        spills: SpillJobs,
        retries: Retries,
        markers: CommitMarkers,
        stats: DrainStats,
        open_uploads: OpenUploads,
        *,
        marker_blocked: Callable[[Inode], bool],
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.store = engine.store
        self.records = records
        self.spills = spills
        self.retries = retries
        self.markers = markers
        self.stats = stats
        self.marker_blocked = marker_blocked
        self.open_uploads = open_uploads

    def _still_due(self, inode_id: int, scanned_key: str, *, still_open: bool = False,
                   rows: dict[int, Inode] | None = None) -> Inode | None:
        """The inode, if the upload the scan chose is still to be done now: pending, under the key it was
        chosen for, not a blocked marker, and for a file not open for writing (`still_open`: one that is).
        `rows`: the journal's rows of a batch read at once since the last await, instead of this one's."""
        inode = self.journal.names.get(inode_id) if rows is None else rows.get(inode_id)
        if inode is None or inode.key is None or inode.state not in ("dirty", UPLOADING):
            return None
        if changed_since_scan(inode, (scanned_key,), (inode.key,), self.marker_blocked):
            return None
        if inode.kind == FILE and (inode.closed_at is None) != still_open:
            return None
        return inode

    async def upload(self, inode_id: int, scanned_key: str) -> None:
        current = self.journal.names.get(inode_id)
        if (self.open_uploads.enabled and current is not None and current.kind == FILE
                and current.closed_at is None):
            await self._upload_open(inode_id, scanned_key)
            return
        inode = self._still_due(inode_id, scanned_key)
        if inode is None:
            return
        key, version = inode.key, inode.version
        assert key is not None  # _still_due checked
        if inode.kind == FILE:
            try:
                spill = await self.spills.state_of(inode)
                if spill is not None and spill.early and not await self.spills.early_spill_holds(inode, spill):
                    spill = None
                if spill is not None:
                    await self.spills.finish(inode, spill)
                    return
            except FileNotFoundError:
                if self.journal.names.get(inode_id) is not None:
                    raise
                # Unlinked and purged during the awaits above: its spill's abort is queued (references.py).
                log.debug("%s was removed while its spill was being finished", inode.path)
                return
            current = self.journal.names.get(inode_id)
            if current is None or current.version != version or current.closed_at is None:
                return
            entry = self.cache.files.get(inode_id)
            if entry is not None and entry.freed:
                # Part of the file was spilled and its spill is gone: the cache file has holes, and
                # uploading it would put zeros in the store. Never do that; keep it pending and say so.
                raise RuntimeError(f"{current.path}: spilled part of the file is no longer staged")
            if self._kept_since_open_upload(current, key):
                return
            await self._upload_file(current, key)
        elif inode.kind == DIR:
            write_ahead = self.records.write_ahead(key)
            await self.engine.call(self.store.put_dir, key, object_meta(inode))
            self.records.record_upload(inode_id, key, version, None, 0, write_ahead)
        elif inode.kind == SYMLINK:
            assert inode.target is not None
            write_ahead = self.records.write_ahead(key)
            await self.engine.call(self.store.put_symlink, key, inode.target, object_meta(inode))
            self.records.record_upload(inode_id, key, version, None, 0, write_ahead)

    def _kept_since_open_upload(self, inode: Inode, key: str) -> bool:
        """A closed file the store got while it was open, unchanged since (gateway mode): recorded clean
        without another upload. True if so."""
        if not (self.open_uploads.enabled and inode.upload_state is None
                and self.open_uploads.unchanged_since_upload(inode, key)):
            return False
        self.records.record_kept(inode, key)
        log.debug("%s closed unchanged since its upload while open", key)
        return True

    async def _upload_open(self, inode_id: int, scanned_key: str) -> None:
        """Upload a file still open for writing as it is now (gateway mode): a snapshot of its cache file
        once every write in flight ended, staged, committed only if the snapshot still holds after staging
        (else thrown away: the file changed, the scan tries again once it is idle). Its content version
        goes up first if the store already holds the current one (then this is a newer content)."""
        inode = self._still_due(inode_id, scanned_key, still_open=True)
        if inode is None:
            return
        state = journaled_state(inode)
        if state is not None and state.spilled:
            return  # a spill (a full cache, or upload while writing) owns it until its close
        key = inode.key
        assert key is not None  # _still_due checked
        path = str(self.cache.data_path(inode_id))
        try:
            began, snap = await trio.to_thread.run_sync(settle, path)
        except FileNotFoundError:
            return  # removed meanwhile
        if self.open_uploads.in_store(inode, snap) or not self.open_uploads.holds(began, snap):
            return  # in the store as it is; or written just now: the scan looks again once it is idle
        with self.journal.transaction():
            current = self.journal.names.get(inode_id)
            if current is None or current.key != key or current.closed_at is not None:
                return
            if current.uploaded_version >= current.version:
                self.journal.work.new_content_version(inode_id)
            self.journal.names.set_attrs(inode_id, size=snap.size, mtime_ns=snap.mtime_ns)
            current = self.journal.names.get(inode_id)
        assert current is not None
        self.open_uploads.staging(inode_id, snap)
        committed = False
        try:
            committed = await self._upload_file(current, key, snap)
        except SourceChangedError:
            # Written while its parts were read: expected of a file still open, not a failure. The scan
            # takes it again once it is idle.
            log.debug("upload of %s (still open) abandoned: written while staged", key)
        finally:
            self.open_uploads.staged(inode_id, snap, committed=committed)

    async def _upload_file(self, inode: Inode, key: str, snapshot: Snapshot | None = None) -> bool:
        """Stage a closed file's upload (resuming an earlier one), then commit and record it; `snapshot`:
        the file is still open for writing, and the upload commits only if its cache file still has that
        snapshot after staging. True if committed."""
        inode_id, version = inode.id, inode.version
        with self.journal.transaction():
            self.journal.work.begin_upload(inode_id)
        started = trio.current_time()
        resume = await self._resumable_state(inode, key)
        priority = upload_priority(self.markers, inode)
        latest: list[UploadState] = []

        def progress(state: UploadState) -> None:
            latest[:] = [state]
            self.records.save_upload_state(inode_id, state)

        try:
            staged: StagedUpload = await self.engine.stage_upload(
                key, self.cache.data_path(inode_id), object_meta(inode), resume=resume, progress=progress,
                # The journal will call the local copy clean: it must survive power loss as it is.
                priority=priority, sync_source=True,
            )
        except BaseException as exc:
            current = self.journal.names.get(inode_id)
            removed = current is None or current.path is None
            # Nothing will resume the staged upload if the file was removed while we staged it (removed
            # before the journal had its state, the purge could not hand it to discard_upload), or if
            # the journal never got its state (a full cache filesystem refused the save).
            if latest and (removed or not journal_holds(current, latest[0])):
                with trio.move_on_after(30, shield=True):
                    await self.engine.abandon(latest[0])
                self.records.forget_upload_state(inode_id, latest[0])
            with self.journal.transaction():
                self.journal.work.abort_upload(inode_id)
            if removed and isinstance(exc, NotFoundBackendError):
                return False  # its cache file went with it: nothing to upload
            raise
        # Re-check after the awaits: abandon the upload if the file changed, moved or went away (a file
        # still open: if its cache file is not the snapshot staged any more).
        changed = snapshot is not None and await trio.to_thread.run_sync(
            stat_snapshot, str(self.cache.data_path(inode_id))) != snapshot
        current = self.journal.names.get(inode_id)
        if changed or current is None or current.key != key or current.version != version:
            await self.engine.abandon(staged.state)
            if current is not None:
                with self.journal.transaction():
                    self.journal.work.abort_upload(inode_id)
                    self.journal.work.save_upload_state(inode_id, None)
                log.debug("upload of %s abandoned: changed or renamed during upload", key)
            return False
        write_ahead = self.records.write_ahead(key)
        try:
            await self.engine.commit_upload(staged, priority=priority)
        except BaseException:
            with self.journal.transaction():
                self.journal.work.abort_upload(inode_id)
            raise
        self.stats.uploaded_files += 1
        self.stats.uploaded_bytes += staged.size
        self.stats.upload_seconds += trio.current_time() - started
        self.records.record_upload(inode_id, key, version, staged.checksum, staged.size, write_ahead,
                                   still_open=snapshot is not None)
        log.debug("uploaded %s (%d bytes, %s%s)", key, staged.size, staged.checksum,
                  ", still open" if snapshot is not None else "")
        return True

    async def upload_small(self, jobs: list[Job]) -> list[Job]:
        """Upload small closed files together (Transfers.put_files): one transaction begins them, one
        worker-thread hop reads them, one transaction re-checks them and queues their write-ahead deletes,
        one hop PUTs them, one transaction records them. Per file the protocol is upload's: the version
        read is the version recorded, a file renamed or changed before its PUT is not put (a change is
        also caught between the re-check and its PUT), nothing is recorded for a file removed meanwhile.
        Returns the jobs that need upload (a staged upload or a spill to finish, a file that grew)."""
        chosen: list[tuple[Job, Inode]] = []
        files: list[SmallFile] = []
        rest: list[Job] = []
        size = 0
        # One query, not one a file.
        rows: dict[int, Inode] | None = self.journal.names.get_many([job.ident for job in jobs])
        for job in jobs:
            inode = self._still_due(job.ident, job.keys[0], rows=rows)
            if inode is None:
                self.retries.succeeded(job)  # nothing to do now, as in upload
                continue
            key = inode.key
            assert key is not None  # _still_due checked
            if inode.kind == FILE and self._kept_since_open_upload(inode, key):
                self.retries.succeeded(job)
                rows = None  # that record may have changed another row of the batch: read each from here
                continue
            entry = self.cache.files.get(inode.id)
            if (inode.kind != FILE or inode.upload_state is not None or entry is None or entry.freed
                    or entry.size > SMALL_FILE):
                rest.append(job)
                continue
            chosen.append((job, inode))
            size += entry.size
            files.append(SmallFile(key, self.cache.data_path(inode.id), object_meta(inode),
                                   _change_detector(self.cache, inode.id, entry)))
        if not chosen:
            return rest
        keys = [file.key for file in files]
        with self.journal.transaction():
            for _, inode in chosen:
                self.journal.work.begin_upload(inode.id)
        write_aheads: dict[int, int] = {}

        def commit(read: list[int]) -> list[int]:
            """The files read that are still what was chosen, each with its write-ahead delete queued."""
            wanted = []
            with self.journal.transaction():
                rows = self.journal.names.get_many([chosen[index][1].id for index in read])
                for index in read:
                    _, inode = chosen[index]
                    current = rows.get(inode.id)
                    if current is None or current.key != inode.key or current.version != inode.version:
                        continue  # changed, moved or gone: not put (see upload)
                    write_aheads[index] = self.records.queue_write_ahead(keys[index])
                    wanted.append(index)
            return wanted

        started = trio.current_time()
        try:
            outcomes = await self.engine.put_files(files, size=size, commit=commit)
        except BaseException:
            with self.journal.transaction():
                for _, inode in chosen:
                    self.journal.work.abort_upload(inode.id)
            raise
        done: list[Uploaded] = []
        undone: list[tuple[Inode, int | None]] = []  # not put (changed, renamed, failed): back to dirty
        failed: list[tuple[Job, BaseException]] = []
        for index, ((job, inode), outcome) in enumerate(zip(chosen, outcomes, strict=True)):
            write_ahead = write_aheads.get(index)
            if isinstance(outcome, PutFile):
                assert write_ahead is not None
                done.append(Uploaded(inode.id, keys[index], inode.version, outcome.checksum, outcome.size,
                                     write_ahead))
                self.retries.succeeded(job)
                continue
            current = self.journal.names.get(inode.id)
            if outcome is None or isinstance(outcome, SourceChangedError):
                undone.append((inode, write_ahead))  # nothing was put: its write-ahead delete goes
                self.retries.succeeded(job)  # changed or renamed: pending again, the next scan takes it
                continue
            undone.append((inode, None))
            if isinstance(outcome, NotFoundBackendError) and (current is None or current.path is None):
                self.retries.succeeded(job)  # its cache file went with it: nothing to upload
            else:
                failed.append((job, outcome))
        if undone:
            with self.journal.transaction():
                for inode, write_ahead in undone:
                    self.journal.work.abort_upload(inode.id)
                    if write_ahead is not None:
                        self.journal.deletes.delete_done(write_ahead)
        self.records.record_uploads(done)
        uploaded = len(done)
        if uploaded:
            self.stats.uploaded_files += uploaded
            self.stats.uploaded_bytes += sum(u.size for u in done)
            self.stats.upload_seconds += trio.current_time() - started
        for job, exc in failed:
            self.retries.failed_unexpectedly(job, exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
        if log.isEnabledFor(logging.DEBUG):
            for item in done:
                log.debug("uploaded %s (%d bytes, %s)", item.key, item.size, item.checksum)
            log.debug("uploaded %d of %d small files in one batch", uploaded, len(chosen))
        return rest

    async def _resumable_state(self, inode: Inode, key: str) -> UploadState | None:
        """The staged upload an earlier attempt (or daemon) left for this file, if it can continue here.
        One for another key is thrown away. The store itself checks that the file is unchanged."""
        if inode.upload_state is None:
            return None
        state = UploadState.parse(inode.upload_state)
        if state is not None and state.key == key:
            log.info("resuming upload of %s: %d parts already in the store", key, len(state.parts))
            return state
        if state is not None:
            await self.engine.abandon(state)
        with self.journal.transaction():
            self.journal.work.save_upload_state(inode.id, None)
        return None


def _change_detector(cache: CacheDir, inode_id: int, entry: CacheFile) -> Callable[[], bool]:
    """For a worker thread: has a change of the file begun (or its cache file been replaced) since now?"""
    changes = entry.changes
    return lambda: entry.changes != changes or cache.files.get(inode_id) is not entry
