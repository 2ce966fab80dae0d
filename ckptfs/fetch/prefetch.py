"""Prefetch (`ckptfs prefetch MOUNTPOINT STEP`, ckptfs.prefetch()): warm this node's cache with the files
under one path of the mount before a restart reads them, and keep them there until they are read.

A prefetch lists the path's directories (through the daemon's DirLister: one listing per directory, shared with
every lookup that needs it at the same time), checks that the cache can hold what it adds, then fetches
its remote files whole with the Fetcher (many ranged GETs in flight per file, verified, adopted as clean
cached files), FILES_AT_ONCE files at a time. Every file of the path is `kept` by the evictor from the
start: never evicted until a handle opens it (read once), `release()` lets it go, or it is removed. The
keeps are journaled (cache/evictor.py, KeptFiles): a daemon that restarts keeps them too. A prefetch still
fetching when the daemon stops is not resumed: what it had not fetched is not kept.

Room: the files to fetch must fit in the budget beside what cannot leave the cache (files not yet
uploaded, open, kept by another prefetch, the other prefetches still running): otherwise the prefetch
fails at once with one clear error, before a byte is fetched, instead of evicting everything it just
fetched to fetch the rest (an eviction storm). Clean files that are not kept may be evicted for it (LRU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ckptfs.cache.evictor import HIGH_WATER, Evictor
from ckptfs.config import human_size
from ckptfs.errors import FsError, UsageError
from ckptfs.fetch.fetcher import Fetcher
from ckptfs.journal import DIR, FILE, REMOTE, ROOT_ID, Inode

log = logging.getLogger(__name__)

# Files fetched at once by one prefetch: each has up to parts_in_flight ranges in flight already (the engine
# caps them all together), so a second file only keeps the pipe full while the first one's last ranges end.
FILES_AT_ONCE = 2
FAILURES_NAMED = 20  # a reply names this many failed files (and counts them all)


@dataclass(eq=False)  # hashed by identity: the running set holds jobs
class PrefetchJob:
    path: str
    remote: list[Inode]  # what it fetches
    local: int  # files of the path in the cache already
    bytes_to_fetch: int
    done: trio.Event = field(default_factory=trio.Event)
    fetched_files: int = 0
    fetched_bytes: int = 0
    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # from the request to the last file fetched (once done)

    def reply(self) -> dict[str, object]:
        return {
            "path": self.path, "files": len(self.remote) + self.local, "already_local": self.local,
            "to_fetch_files": len(self.remote), "to_fetch_bytes": self.bytes_to_fetch,
            "fetched_files": self.fetched_files, "fetched_bytes": self.fetched_bytes, "done": self.done.is_set(),
            "seconds": round(self.seconds, 3),
            "failed": self.failures[:FAILURES_NAMED], "failed_count": len(self.failures),
        }


class Prefetcher:
    def __init__(self, fetcher: Fetcher, ensure_listed: Callable[[int], Awaitable[None]]) -> None:
        """`ensure_listed(dir inode id)`: returns once that directory's store entries are in the journal
        (DirLister.ensure: one listing however many wait for it)."""
        assert fetcher.evictor is not None, "a prefetch needs the evictor: it keeps what it fetched"
        self.fetcher = fetcher
        self.evictor: Evictor = fetcher.evictor
        self.journal = fetcher.journal
        self.cache = fetcher.cache
        self.ensure_listed = ensure_listed
        self.running: set[PrefetchJob] = set()

    async def prefetch(self, path: str, *, wait: bool) -> PrefetchJob:
        """Start fetching every remote file under `path` (mount-relative, "" for the whole mount), and keep
        all its files from eviction; with `wait`, return once every file is fetched or failed. Raises
        UsageError if the path does not exist or the cache cannot hold it."""
        target = await self._resolve(path)
        files = await self._files_under(target)
        remote = [inode for inode in files if inode.state == REMOTE]
        wanted = sum(inode.size for inode in remote)
        self._check_room(path, files, wanted)
        job = PrefetchJob(path, remote, len(files) - len(remote), wanted)
        self.evictor.kept.update(inode.id for inode in files)
        self.evictor.kept.save(self.journal)
        for inode in remote:
            self.fetcher.prefetching[inode.id] = inode.size
        self.running.add(job)
        log.info("prefetching %s: %d files (%d bytes) to fetch, %d in the cache already", path or "/",
                 len(remote), wanted, job.local)
        if wait or not self.fetcher.start_soon(self._run, job):
            await self._run(job)
        return job

    def release(self, path: str) -> int:
        """Let the kept files under `path` be evicted again; how many were kept."""
        prefix = path.strip("/")
        released = 0
        for inode_id in list(self.evictor.kept):
            inode = self.journal.names.get(inode_id)
            inside = inode is not None and inode.path is not None and (
                not prefix or inode.path == prefix or inode.path.startswith(prefix + "/"))
            if inode is None or inode.path is None or inside:
                self.evictor.kept.discard(inode_id)
                released += 1
        self.evictor.kick()  # over the high-water mark already: evict now, not at the next round
        return released

    async def _run(self, job: PrefetchJob) -> None:
        queue = list(job.remote)
        stats = self.fetcher.stats

        async def worker() -> None:
            while queue:
                inode = queue.pop(0)
                try:
                    await self.fetcher.fetch(inode)
                except FsError as exc:
                    job.failures.append(f"{inode.path}: {exc}")
                    stats.prefetch_failures += 1
                    self.evictor.kept.discard(inode.id)
                    log.warning("prefetch of %s failed: %s", inode.path, exc)
                else:
                    job.fetched_files += 1
                    job.fetched_bytes += inode.size
                    stats.prefetched_files += 1
                    stats.prefetched_bytes += inode.size
                finally:
                    self.fetcher.prefetching.pop(inode.id, None)

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(min(FILES_AT_ONCE, len(queue))):
                    nursery.start_soon(worker)
        finally:
            for inode in queue:  # cancelled (the daemon stops): not fetched, not kept
                self.fetcher.prefetching.pop(inode.id, None)
                self.evictor.kept.discard(inode.id)
            self.running.discard(job)
            job.seconds = time.monotonic() - job.started
            job.done.set()
        log.info("prefetched %s: %d files (%d bytes) fetched in %.1f s, %d failed", job.path or "/",
                 job.fetched_files, job.fetched_bytes, job.seconds, len(job.failures))

    async def _resolve(self, path: str) -> Inode:
        """The inode at mount-relative `path`, listing each directory on the way that is not listed yet."""
        inode = self.journal.names.get(ROOT_ID)
        assert inode is not None
        walked: list[str] = []
        for name in [part for part in path.split("/") if part]:
            if inode.kind != DIR:
                raise UsageError(f"cannot prefetch {path}: {'/'.join(walked)} is not a directory")
            await self.ensure_listed(inode.id)
            child = self.journal.names.lookup(inode.id, name)
            walked.append(name)
            if child is None:
                raise UsageError(f"cannot prefetch {path}: there is no {'/'.join(walked)} in the mount or the"
                                 " store (name a step's directory or file, relative to the mountpoint)")
            inode = child
        return inode

    async def _files_under(self, top: Inode) -> list[Inode]:
        """Every regular file at or below `top`, each directory listed first (once, however many ask)."""
        if top.kind == FILE:
            return [top]
        files: list[Inode] = []
        directories = [top] if top.kind == DIR else []
        while directories:
            directory = directories.pop()
            await self.ensure_listed(directory.id)
            for child in self.journal.names.all_children(directory.id):
                if child.kind == DIR:
                    directories.append(child)
                elif child.kind == FILE:
                    files.append(child)
        return files

    def _check_room(self, path: str, files: list[Inode], wanted: int) -> None:
        """Raise UsageError unless `wanted` more bytes fit in the cache beside everything that cannot be
        evicted for them: what the cache holds that is not clean, closed and unkept, and what the running
        prefetches still fetch."""
        limit = self.cache.limit
        budget = int(limit * HIGH_WATER) if limit != float("inf") else None
        if budget is None or not wanted:
            return
        ours = {inode.id for inode in files}
        evictable = 0
        for inode_id in self.journal.copies.clean_files():
            entry = self.cache.files.get(inode_id)
            if entry is None or inode_id in ours or inode_id in self.evictor.kept or self.evictor.in_use(inode_id):
                continue
            evictable += entry.charge
        partials = self.fetcher.partials
        evictable += sum(stream.charged for inode_id, stream in partials.streams.items()
                         if stream.idle() and inode_id not in ours)
        pending = sum(size for inode_id, size in self.fetcher.prefetching.items() if inode_id not in ours)
        held = max(0, self.cache.used - evictable) + pending
        if wanted + held <= budget:
            return
        if wanted > budget:
            raise UsageError(
                f"cannot prefetch {path or '/'}: its files to fetch take {human_size(wanted)}, more than the cache"
                f" can hold ({human_size(budget)}: {HIGH_WATER:.0%} of the {human_size(int(limit))} budget); raise"
                " cache_size"
                " (--cache-size), or prefetch a part of it (a subdirectory or file)")
        raise UsageError(
            f"cannot prefetch {path or '/'}: its files to fetch take {human_size(wanted)}, and only"
            f" {human_size(max(0, budget - held))} of the cache's {human_size(budget)} can be made free:"
            f" {human_size(held)} are files not yet uploaded, open, kept by an earlier prefetch or being"
            " prefetched. Release earlier prefetches (ckptfs prefetch --release), wait for the drain (ckptfs"
            " flush), or raise cache_size")
