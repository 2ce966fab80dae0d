"""Start-up reconciliation of journal, cache directory and store, before the mount goes live.

After a clean stop this finds nothing to do but import what other nodes wrote. After a crash or kill -9 it
makes the journal consistent with the cache files (sizes of files that were open, uploads that were in
flight, inodes that were unlinked but open) so that every pending upload resumes. Runs synchronously in
the trio thread before anything else uses the journal; the store listing runs in a worker thread.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field

import trio

from ckptfs.backends.base import DIR as STORE_DIR
from ckptfs.backends.base import SYMLINK as STORE_SYMLINK
from ckptfs.backends.base import ObjectInfo, ObjectStore, UploadState
from ckptfs.cache import CacheDir
from ckptfs.journal import CLEAN, DIR, FILE, REMOTE, ROOT_ID, SYMLINK, UPLOADING, Inode, Journal

log = logging.getLogger(__name__)

MAX_PATH_BYTES = 1000


@dataclass
class RecoveryReport:
    resumed_uploads: int = 0
    purged_unlinked: int = 0
    orphan_cache_files: int = 0
    aborted_uploads: int = 0
    imported: int = 0
    skipped_keys: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


def repair_journal(journal: Journal, cache: CacheDir, now: float) -> RecoveryReport:
    """Make the journal agree with the cache files after whatever stopped the last daemon."""
    report = RecoveryReport()
    cache.clear_tmp()
    data_ids = cache.data_ids()
    with journal.transaction():
        for inode in journal.all_inodes():
            if inode.id == ROOT_ID:
                continue
            if inode.parent is None:
                # Unlinked while open when the last daemon stopped: nothing can reach it any more.
                journal.purge(inode.id)
                cache.remove_data(inode.id)
                report.purged_unlinked += 1
                continue
            if inode.kind != FILE:
                if inode.state == UPLOADING:
                    journal.abort_upload(inode.id)
                continue
            if inode.state == REMOTE:
                continue
            if inode.id not in data_ids:
                _missing_cache_file(journal, inode, report)
                continue
            if inode.state == UPLOADING:
                journal.abort_upload(inode.id)
            if inode.state in ("dirty", UPLOADING):
                report.resumed_uploads += 1
            if inode.closed_at is None or inode.state in ("dirty", UPLOADING):
                # It may have been written after the journal last saw its size: the cache file is truth.
                st = os.stat(cache.data_path(inode.id))
                changed = inode.closed_at is None and inode.state != CLEAN
                journal.mark_closed(inode.id, size=st.st_size, mtime_ns=st.st_mtime_ns, changed=changed, now=now)
        known = {i.id for i in journal.all_inodes()}
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
        journal.db.execute("UPDATE inodes SET state = 'remote' WHERE id = ?", (inode.id,))
    else:
        log.error("cache file of %s vanished before it was uploaded; its content is lost", inode.path)
        report.lost.append(inode.path or "?")
        journal.detach(inode)
        journal.purge(inode.id)


def _valid_path(key: str) -> str | None:
    """The mount path for a store key, or None if the key cannot be a path inside the mount."""
    path = key.rstrip("/")
    if not path or key.startswith("/") or "\0" in key or len(path.encode()) > MAX_PATH_BYTES:
        return None
    parts = path.split("/")
    if any(p in ("", ".", "..") or len(p.encode()) > 255 for p in parts):
        return None
    return path


def import_listing(
    journal: Journal, cache: CacheDir, listing: list[ObjectInfo], report: RecoveryReport, *, now: float,
    exact_mtimes: bool = True,
) -> None:
    """Bring the journal's view of the store up to date with a full listing of it. Imported entries belong
    to the daemon's user (object stores keep no owner)."""
    uid, gid = os.getuid(), os.getgid()
    owned = {i.remote_key for i in journal.all_inodes() if i.remote_key is not None}
    deleting = {d.key for d in journal.pending_deletes()}
    present: dict[str, ObjectInfo] = {}
    with journal.transaction():
        for info in sorted(listing, key=lambda i: i.key):
            path = _valid_path(info.key)
            if path is None:
                log.warning("skipping store key %r: it cannot be a path inside the mount", info.key)
                report.skipped_keys.append(info.key)
                continue
            present[info.key] = info
            if info.key in deleting:
                continue
            existing = journal.by_path(path)
            if existing is not None:
                if info.key in owned:
                    _refresh_clean(journal, cache, existing, info, exact_mtimes=exact_mtimes)
                continue
            if info.key in owned:
                continue  # an old copy of a renamed file; the drain moves it
            parent = _ensure_parents(journal, path, uid=uid, gid=gid, now=now)
            if parent is None:
                report.skipped_keys.append(info.key)
                continue
            name = path.rsplit("/", 1)[-1]
            kind = {STORE_DIR: DIR, STORE_SYMLINK: SYMLINK}.get(info.kind, FILE)
            type_bits = {DIR: stat.S_IFDIR, SYMLINK: stat.S_IFLNK, FILE: stat.S_IFREG}[kind]
            journal.import_remote(
                parent, name, kind, size=info.size, mtime_ns=info.mtime_ns, mode=type_bits | (info.mode & 0o7777),
                key=info.key, target=info.target, checksum=info.checksum, uid=uid, gid=gid, now=now,
            )
            report.imported += 1
        # Someone deleted these from the shared store (another node, an operator): the namespace is
        # shared, so the delete wins over our clean copies, as it would on any other node. Deepest first,
        # so that a directory emptied this way goes too; one that still holds local work keeps its place
        # and gets its marker back.
        vanished = [
            i for i in journal.all_inodes()
            if i.remote_key and i.remote_key not in present and i.state in (CLEAN, REMOTE)
        ]
        for inode in sorted(vanished, key=lambda i: (i.path or "").count("/"), reverse=True):
            if inode.kind == DIR and journal.has_children(inode.id):
                journal.forget_remote_copy(inode.id, now=now)
                continue
            log.warning("%s was deleted from the store by someone else; removing it here too", inode.path)
            journal.detach(inode._replace(remote_key=None))
            journal.purge(inode.id)
            if inode.kind == FILE:
                cache.remove_data(inode.id)
    if report.imported:
        log.info("imported %d entries from %s", report.imported, "the store")


def _refresh_clean(
    journal: Journal, cache: CacheDir, inode: Inode, info: ObjectInfo, *, exact_mtimes: bool
) -> None:
    """Another node replaced an object we hold clean: drop our copy, serve theirs (last upload wins).
    Where listings carry no metadata (object stores: mtime is the upload time) only the size tells."""
    if inode.kind != FILE or inode.state not in (CLEAN, REMOTE) or inode.remote_key != info.key:
        return
    if info.size == inode.size and (info.mtime_ns == inode.mtime_ns or not exact_mtimes):
        return
    journal.db.execute(
        "UPDATE inodes SET state = 'remote', size = ?, mtime_ns = ?, checksum = ? WHERE id = ?",
        (info.size, info.mtime_ns, info.checksum, inode.id),
    )
    cache.remove_data(inode.id)


def _ensure_parents(journal: Journal, path: str, *, uid: int, gid: int, now: float) -> Inode | None:
    parent = journal.get(ROOT_ID)
    assert parent is not None
    parts = path.split("/")[:-1]
    for part in parts:
        child = journal.lookup(parent.id, part)
        if child is None:
            # A directory implied by a deeper key, with no marker object of its own.
            child = journal.import_remote(
                parent, part, DIR, size=0, mtime_ns=parent.mtime_ns, mode=stat.S_IFDIR | 0o755, key=None,
                uid=uid, gid=gid, now=now,
            )
        elif child.kind != DIR:
            log.warning("skipping %s: %s is a file here", path, child.path)
            return None
        parent = child
    return parent


async def recover(journal: Journal, cache: CacheDir, store: ObjectStore, now: float) -> RecoveryReport:
    report = repair_journal(journal, cache, now)
    # Staged uploads the journal knows about resume; every other leftover of ours goes.
    keep = set()
    for _inode_id, text in journal.upload_states():
        try:
            keep.add(UploadState.from_json(text).upload_id)
        except (ValueError, KeyError, TypeError):
            pass
    report.aborted_uploads = await trio.to_thread.run_sync(store.abort_stale_uploads, keep)
    if report.aborted_uploads:
        log.info("removed %d leftovers of uploads interrupted by the last stop", report.aborted_uploads)
    listing = await trio.to_thread.run_sync(lambda: list(store.list()))
    import_listing(journal, cache, listing, report, now=now, exact_mtimes=store.listing_has_metadata)
    return report
