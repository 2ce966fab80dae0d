"""Spill jobs: the start of a file still being written leaves for the store before the file is closed.

Owns: when a file being written has grown enough to spill (`spillable`), staging its parts in order (while
the cache is full: sealing each part, then punching it out of the cache file once the journal has it;
while it has room, an early spill that seals nothing), throwing a spill away when the file was truncated or
rewritten under it, and finishing a spill once the file is closed (the rest staged, the whole moved to its
key). The cache file's watermarks (`sealed`, `staged`) change only through its methods (cache.CacheFile).
See backends/base.py for how a store stages parts, and docs/design/drain.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import trio

from ckptfs.backends.base import UploadState
from ckptfs.cache.directory import CacheDir
from ckptfs.drain.object_records import ObjectRecords, journaled_state, object_meta, upload_priority
from ckptfs.drain.ordering import CommitMarkers
from ckptfs.drain.stats import DrainStats
from ckptfs.journal import FILE, Inode, Journal
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

# A spill leaves this much of the end of a file being written in the cache (a writer may still seek back
# a little, e.g. to patch a header), and takes parts of the engine's part size.
SPILL_LOOKAHEAD = 16 << 20


class SpillJobs:
    def __init__(
        self,
        journal: Journal,
        cache: CacheDir,
        engine: Transfers,
        records: ObjectRecords,
        markers: CommitMarkers,
        stats: DrainStats,
        *,
        early: bool,
        discard_upload: Callable[[str], None],
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.records = records
        self.markers = markers
        self.stats = stats
        self.discard_upload = discard_upload
        self.part_size = engine.part_size
        self.lookahead = SPILL_LOOKAHEAD
        # Early spills: files being written are staged while the cache has room, where the store can then
        # place them at their key without a copy (see UploadState.early).
        self.early = early
        # The cache is full (Drain.set_pressure): spill files being written, sealing what is taken.
        self.pressure = False
        # Called with an inode id once a spilled file is uploaded: its local copy has holes, evict it.
        self.on_spilled: Callable[[int], None] = lambda inode_id: None

    @property
    def room(self) -> int:
        """The cache a file being written needs to go on through spills: its lookahead, the part being
        uploaded and the next one being written."""
        return self.lookahead + 2 * self.part_size

    def spillable(self, inode_id: int) -> int:
        """Bytes of a file being written that a spill could take now."""
        entry = self.cache.files.get(inode_id)
        if entry is None or (entry.passthrough_writers and self.pressure):
            # A spill under pressure seals what it takes, and nothing could hold back a write the kernel
            # makes to the file itself (FUSE passthrough): such a file is only ever staged early.
            return 0
        if entry.preallocated:
            # Its size says what fallocate reserved, not what was written: a spill would stage zeros (and,
            # under pressure, seal them against the writes to come). Its writes fill what it reserved.
            return 0
        return entry.size - self.lookahead - max(entry.sealed, entry.staged)

    async def state_of(self, inode: Inode) -> UploadState | None:
        """The spill this file has in progress, if it is still valid; a stale one (the file was truncated
        or rewritten since) is thrown away."""
        state = journaled_state(inode)
        if state is None or not state.spilled:
            return None
        entry = self.cache.files.get(inode.id)
        # An early spill's parts are not sealed: a truncate below them (cache.resize lowers `staged`) ends it.
        if entry is not None and entry.freed == state.punched and (not state.early or entry.staged == state.size):
            return state
        await self.discard(inode, state, "it was rewritten since")
        return None

    async def spill(self, inode_id: int) -> None:
        """Upload the written start of a file still open for writing, part by part in order. While the
        cache is full, seal each part first and punch it out of the cache file once the journal has it;
        else (an early spill) leave the parts as they are."""
        inode = self.journal.names.get(inode_id)
        if inode is None or inode.kind != FILE or inode.path is None:
            return
        state = await self.state_of(inode)
        if state is not None and state.early and self.pressure:
            # Its parts were never sealed, so they cannot be punched out: start again with one that seals.
            await self.discard(inode, state, "the cache is full")
            state = None
        if state is None:
            earlier = journaled_state(inode)
            if earlier is not None and not earlier.spilled and inode.upload_state is not None:
                self.discard_upload(inode.upload_state)  # a staged upload of an earlier close
            early = not self.pressure
            state = await self.engine.spills.begin(self.part_size, early=early)
            with self.journal.transaction():
                self.journal.work.save_upload_state(inode_id, state.to_json())
            entry = self.cache.files.get(inode_id)
            if entry is not None:
                entry.restart_staging()
            if early:
                log.debug("uploading the start of %s while it is still being written", inode.path)
            else:
                log.info("cache full: uploading the start of %s while it is still being written", inode.path)
        if state.early:
            await self._spill_early(inode_id, state)
            return
        part = state.part_size
        path = self.cache.data_path(inode_id)
        while self.pressure:
            entry = self.cache.files.get(inode_id)
            if entry is None or entry.freed != state.size or self.spillable(inode_id) < part:
                log.debug("spill of inode %d pauses: freed %s, staged %d, spillable %d", inode_id,
                          entry and entry.freed, state.size, self.spillable(inode_id))
                return
            # Seal the part first: a write into it from now on fails instead of going unnoticed.
            entry.seal(state.size + part)
            state = await self.engine.spills.stage(state, path, state.size + part)
            current = self.journal.names.get(inode_id)
            if current is None or current.path is None or self.cache.files.get(inode_id) is not entry:
                await self.engine.abandon(state)  # removed meanwhile: nothing will finish this spill
                self.records.forget_upload_state(inode_id, state)
                return
            if entry.sealed < state.size:
                # Truncated while the part was uploading: what was staged is no longer the file's start.
                await self.discard(inode, state, "it was truncated")
                return
            # Journaled as punched before the hole is made: after a crash in between, the bytes are still
            # there but never read again (the parts have them).
            state = replace(state, punched=state.size)
            with self.journal.transaction():
                self.journal.work.save_upload_state(inode_id, state.to_json())
            # In the trio thread, with no await between the check above and the accounting: a truncate
            # and rewrite can never slip in and lose its new bytes to the hole (fallocate is quick).
            self.cache.punch_hole(inode_id, state.size - part, part)
            self.cache.punched(inode_id, state.size - part, part)
            self.stats.spilled_bytes += part
            entry.mark_staged(state.size)

    async def _spill_early(self, inode_id: int, state: UploadState) -> None:
        """Stage the parts of a file being written that its writer is done with (all but the last
        `lookahead` bytes), while the cache has room, a batch at a time, journaling each batch. Nothing
        is sealed: a write into a staged part is found when the file is closed (early_spill_holds), and the
        file is then uploaded whole."""
        part = state.part_size
        path = self.cache.data_path(inode_id)
        while not self.pressure:
            entry = self.cache.files.get(inode_id)
            if entry is None or entry.preallocated:  # (see spillable)
                return
            ready = (entry.size - self.lookahead - state.size) // part * part
            if ready <= 0:
                return
            # All the parts written meanwhile at once, in parallel (a writer can be faster than one part at a
            # time), and the cache file to disk with them: else all of it is written back in the fsync
            # before the file is called clean, seconds after close on a slow disk.
            staged = state.size
            state = await self.engine.spills.stage(state, path, staged + ready, sync_source=True)
            current = self.journal.names.get(inode_id)
            if current is None or current.path is None or self.cache.files.get(inode_id) is not entry:
                await self.engine.abandon(state)  # removed meanwhile: nothing will finish this spill
                self.records.forget_upload_state(inode_id, state)
                return
            if entry.staged != staged:  # truncated meanwhile (cache.resize lowered it)
                await self.discard(current, state, "it was truncated")
                return
            with self.journal.transaction():
                self.journal.work.save_upload_state(inode_id, state.to_json())
            entry.mark_staged(state.size)
            self.stats.spilled_bytes += ready
            if current.closed_at is not None:
                return  # closed: its upload stages the rest, parts in parallel, and need not wait for this

    async def discard(self, inode: Inode, state: UploadState, why: str) -> None:
        log.info("%s: discarding the part of it uploaded while it was written (%s)", inode.path, why)
        await self.engine.abandon(state)
        with self.journal.transaction():
            self.journal.work.save_upload_state(inode.id, None)
        entry = self.cache.files.get(inode.id)
        if entry is not None:
            entry.unstage()

    async def early_spill_holds(self, inode: Inode, state: UploadState) -> bool:
        """An early spill of a closed file can be finished if its staged parts are still the start of the
        file; else it is thrown away and the file is uploaded whole."""
        if await self.engine.spills.matches(state, self.cache.data_path(inode.id)):
            return True
        await self.discard(inode, state, "it changed where it was already uploaded")
        return False

    async def finish(self, inode: Inode, state: UploadState) -> None:
        """The spilled file was closed: stage the rest of it, then move the whole to its key."""
        inode_id, key, version = inode.id, inode.key, inode.version
        assert key is not None
        with self.journal.transaction():
            self.journal.work.begin_upload(inode_id)
        started = trio.current_time()
        path = self.cache.data_path(inode_id)
        try:
            entry = self.cache.file(inode_id)
            if not state.early:  # an early spill's file stays writable: a change is caught by its version
                entry.seal(entry.size)
            if state.size < entry.size:
                state = await self.engine.spills.stage(
                    state, path, entry.size, priority=upload_priority(self.markers, inode))
                with self.journal.transaction():
                    self.journal.work.save_upload_state(inode_id, state.to_json())
            current = self.journal.names.get(inode_id)
            current_key = current.key if current is not None else None
            if current is None or current.version != version or not current_key:
                # Rewritten (O_TRUNC) or removed: state_of discards the spill next time.
                with self.journal.transaction():
                    self.journal.work.abort_upload(inode_id)
                return
            meta = object_meta(current)
            write_ahead = self.records.write_ahead(current_key)
            await self.engine.spills.commit(state, current_key, meta)
        except BaseException:
            with self.journal.transaction():
                self.journal.work.abort_upload(inode_id)
            raise
        self.stats.uploaded_files += 1
        self.stats.uploaded_bytes += state.size
        self.stats.upload_seconds += trio.current_time() - started
        self.records.record_upload(inode_id, current_key, version, state.checksum, state.size, write_ahead)
        # Early spills are routine (DEBUG, as other uploads); a spill forced by a full cache is worth a line.
        (log.debug if state.early else log.info)("uploaded %s (%d bytes, started while it was written)",
                                                   current_key, state.size)
        if state.punched:
            self.on_spilled(inode_id)
