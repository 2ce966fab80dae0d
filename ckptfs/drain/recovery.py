"""Reconciliation of the journal with the cache directory and the store.

At start-up, before the mount goes live (`recover`): after a clean stop there is nothing to do; after a
crash or kill -9 it makes the journal consistent with the cache files (sizes of files that were open,
uploads that were in flight, inodes that were unlinked but open) so that every pending upload resumes, and
has the drain remove what interrupted uploads left in the store as soon as it starts. While mounted, the
store's namespace is read lazily by lister.DirLister.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field

from ckptfs.backends.base import UploadState
from ckptfs.cache.directory import CacheDir
from ckptfs.journal import CLEAN, FILE, REMOTE, ROOT_ID, UPLOADING, Inode, Journal
from ckptfs.journal.local_copies import rewritten
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    resumed_uploads: int = 0
    purged_unlinked: int = 0
    orphan_cache_files: int = 0
    lost: list[str] = field(default_factory=list)
    # What changed of entries the kernel may hold (after a takeover it keeps the last daemon's): names
    # removed (parent inode, name), and files whose attributes now come from the store's copy.
    removed_names: list[tuple[int, str]] = field(default_factory=list)
    reverted: list[int] = field(default_factory=list)


def repair_journal(
    journal: Journal, cache: CacheDir, now: float, *, still_open: Collection[int] = (),
    still_writing: Collection[int] = (),
) -> RecoveryReport:
    """Make the journal agree with the cache files after whatever stopped the last daemon. After a takeover
    the kernel still holds the last daemon's handles: files in `still_open` are kept even when unlinked,
    and files in `still_writing` stay open for writing (their close is still to come)."""
    report = RecoveryReport()
    cache.clear_tmp()
    data_ids = cache.data_ids()
    # Files an earlier daemon's death left open for writing: the kernel may have written them since.
    watched = journal.copies.stale_writers()
    still_watched: dict[int, float] = {}
    with journal.transaction():
        for inode in journal.names.all_inodes():
            if inode.id == ROOT_ID:
                continue
            if inode.parent is None and inode.id not in still_open:
                # Unlinked while open when the last daemon stopped: nothing can reach it any more.
                journal.names.purge(inode.id)
                cache.remove_data(inode.id)
                report.purged_unlinked += 1
                continue
            if inode.kind != FILE:
                if inode.state == UPLOADING:
                    journal.work.abort_upload(inode.id)
                continue
            if inode.state == REMOTE:
                if inode.id in data_ids:
                    # Not a local copy: a fetch that died between moving its verified file into data/
                    # and the journal saying so. The store's copy serves it (partial files in tmp/ went
                    # with clear_tmp above).
                    cache.remove_data(inode.id)
                    report.orphan_cache_files += 1
                continue
            if inode.id not in data_ids:
                _missing_cache_file(journal, inode, report)
                continue
            if inode.state == UPLOADING:
                journal.work.abort_upload(inode.id)
            if inode.state in ("dirty", UPLOADING):
                report.resumed_uploads += 1
            if inode.id in still_writing:
                if inode.id in watched:
                    still_watched[inode.id] = watched[inode.id]
                continue
            suspect = inode.closed_at is None or inode.id in watched
            if suspect or inode.state in ("dirty", UPLOADING):
                # It may have been written after the journal last saw its size: the cache file is truth.
                st = os.stat(cache.data_path(inode.id))
                changed_behind = False
                if suspect:
                    # Open for writing when a daemon died: unless that daemon's connection was taken over
                    # (still_writing), the kernel kept its passthrough handles, which write on.
                    changed_behind = rewritten(inode, st)
                    quiet = inode.closed_at is not None and not changed_behind
                    still_watched[inode.id] = watched.get(inode.id, now) if quiet else now
                    if inode.state == CLEAN and changed_behind:
                        # Written behind the journal, which says clean: a new version, uploaded again.
                        log.warning("%s changed without the daemon (a writer the kernel kept after an earlier"
                                    " daemon died): uploading it again", inode.path)
                        journal.copies.rewritten_behind(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns, now=now)
                        continue
                    if changed_behind and inode.uploaded_version >= inode.version:
                        # Uploaded while open (gateway mode), then written again: the store holds the
                        # journal's version, so what the cache file has now is a newer one (else a flush
                        # would take the file for durable while the drain still uploads it).
                        journal.copies.rewritten_behind(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns, now=now)
                        continue
                changed = (inode.closed_at is None and inode.state != CLEAN) or changed_behind
                journal.names.mark_closed(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns, changed=changed, now=now)
        known = {i.id for i in journal.names.all_inodes()}
        if still_watched or watched:
            journal.copies.set_stale_writers(still_watched)
    for orphan in data_ids - known:
        cache.remove_data(orphan)
        report.orphan_cache_files += 1
    if report.resumed_uploads or report.purged_unlinked:
        log.info(
            "recovered journal: %d pending uploads resume, %d unlinked files purged",
            report.resumed_uploads, report.purged_unlinked,
        )
    return report


def _missing_cache_file(journal: Journal, inode: Inode, report: RecoveryReport) -> None:
    if inode.remote_key is not None and inode.uploaded_version:
        # The store has a version: serve that one (the newer local one is gone).
        if inode.state != CLEAN:
            log.error("cache file of %s vanished; falling back to the version in the store", inode.path)
            report.lost.append(inode.path or "?")
        journal.copies.serve_from_store(inode.id)
        report.reverted.append(inode.id)
    else:
        log.error("cache file of %s vanished before it was uploaded; its content is lost", inode.path)
        report.lost.append(inode.path or "?")
        journal.names.detach(inode)
        journal.names.purge(inode.id)
        if inode.parent is not None and inode.name is not None:
            report.removed_names.append((inode.parent, inode.name))


def recover(
    journal: Journal, cache: CacheDir, engine: Transfers, now: float, *, still_open: Collection[int] = (),
    still_writing: Collection[int] = (),
) -> RecoveryReport:
    report = repair_journal(journal, cache, now, still_open=still_open, still_writing=still_writing)
    # Staged uploads the journal knows about resume; every other leftover of ours goes, swept by the drain
    # in the background (Leftovers.hold_until_swept): housekeeping (staged parts cost storage, nothing reads
    # them) that must not keep the mount from serving what the journal holds, as it did while a throttling
    # store made the sweep's listing wait out the retries.
    keep = set()
    for _inode_id, text in journal.work.upload_states():
        state = UploadState.parse(text)
        if state is not None:
            keep.add(state.ref)
    engine.leftovers.hold_until_swept(keep)
    # The store's namespace is read lazily, a directory at a time, as the mount looks into it (DirLister).
    return report
