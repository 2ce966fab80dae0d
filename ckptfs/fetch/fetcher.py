"""The Fetcher: fetches the chunks reads wait for (and read-ahead for sequential readers) into partial
files, pins every chunk of a Stream to the version of its first answer, follows a remote-only file the
drain moves while it is read, and adopts a complete, verified partial file as the inode's clean data file.
Whole-file fetches (open for writing, truncate) go through it too. See the package docstring."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from ckptfs.backends.base import RANGE_PIECE, WHOLE_FETCH_PIECE
from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import HIGH_WATER, Evictor
from ckptfs.checksums import combine_crcs, crc_text
from ckptfs.errors import BackendError, FsError, NotFoundBackendError, ObjectChangedError, errno_for_backend_error
from ckptfs.fetch.partials import PartialFiles
from ckptfs.fetch.stream import Reader, Stream, close_stream, identity_of
from ckptfs.journal import REMOTE, Inode, Journal, JournalFull
from ckptfs.transfer import Priority, Transfers

log = logging.getLogger(__name__)

MiB = 1 << 20
# Read-ahead of a sequential reader, in whole chunks: it starts small (a reader of a file's header does
# not download the file) and doubles with every chunk the reader moves into: from FIRST_READAHEAD bytes
# up to MAX_READAHEAD bytes (16 MiB and 128 MiB: 1 and 8 chunks of 16 MiB), and never more chunks than
# FIRST/MAX_READAHEAD_CHUNKS (small chunks: a small cache budget).
FIRST_READAHEAD = 16 * MiB
MAX_READAHEAD = 128 * MiB
FIRST_READAHEAD_CHUNKS = 2
MAX_READAHEAD_CHUNKS = 16
# A read starting this close to where the handle's previous read ended counts as sequential (the kernel
# may reorder its own read-ahead requests a little).
SEQUENTIAL_SLACK = 512 * 1024
# A rename of a remote-only file moves its object while it may be read: a read follows it this many times.
MOVES_FOLLOWED = 4


@dataclass
class FetchStats:
    bytes_downloaded: int = 0  # chunk bytes fetched for reads of remote files, since start
    chunks_fetched: int = 0
    chunks_punched: int = 0  # present chunks freed to make room (fetched again if read later)
    files_verified: int = 0  # partial files that became clean cached files
    checksum_failures: int = 0
    readers_waiting: int = 0  # reads blocked on a chunk now
    partial_files: int = 0  # remote files with a partial file in the cache now
    partial_bytes: int = 0  # bytes of chunks present or in flight now
    # Prefetch (fetch/prefetch.py): counters since start, and gauges of now.
    prefetched_files: int = 0
    prefetched_bytes: int = 0
    prefetch_failures: int = 0  # files a prefetch could not fetch
    prefetch_pending_files: int = 0
    prefetch_pending_bytes: int = 0  # of those files, bytes not in the cache yet
    kept_files: int = 0  # prefetched, not read yet: kept from eviction
    kept_bytes: int = 0


class Fetcher:
    def __init__(
        self, journal: Journal, cache: CacheDir, engine: Transfers, *, evictor: Evictor | None = None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.evictor = evictor
        self.chunk_size = engine.download_part_size
        self._nursery: trio.Nursery | None = None
        self.stats = FetchStats()
        self.partials = PartialFiles(cache, self.stats)
        # Remote files a prefetch is fetching now: inode id -> size (fetch/prefetch.py fills it).
        self.prefetching: dict[int, int] = {}
        if evictor is not None:
            evictor.partials = self.partials

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The service whose nursery owns every chunk fetch (a fetch outlives the read that started it)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def start_soon(self, fn: Callable[..., Awaitable[None]], *args: Any) -> bool:
        """Run `fn(*args)` in the service's nursery (work that outlives the request that asked for it);
        False if the service is not running."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True

    def statistics(self) -> FetchStats:
        stats = self.stats
        stats.partial_files = len(self.partials.all)
        stats.partial_bytes = self.partials.bytes_charged()
        stats.prefetch_pending_files = len(self.prefetching)
        pending = 0
        for inode_id, size in self.prefetching.items():
            stream = self.partials.streams.get(inode_id)
            present = 0 if stream is None or stream.complete else sum(stream.chunk_range(i)[1] for i in stream.present)
            pending += max(0, size - present)
        stats.prefetch_pending_bytes = pending
        kept = self.evictor.kept if self.evictor is not None else set()
        stats.kept_files = len(kept)
        stats.kept_bytes = sum(entry.charge for entry in map(self.cache.files.get, kept) if entry is not None)
        return stats

    # -- opening --------------------------------------------------------------------------------------

    def open_reader(self, inode: Inode) -> Reader:
        """A reader of a remote inode: no byte is fetched yet. Synchronous, so that the caller opens
        reader.path before anything can rename it."""
        stream = self.partials.stream_for(inode, self._stream_chunk_size())
        reader = Reader(stream)
        stream.readers.add(reader)
        if stream.size == 0 and not stream.complete:
            # Nothing to fetch, and no read will come for it (the kernel knows the size): an empty file is
            # whole at its open, as any other file is once its last chunk arrives.
            stream.present.add(0)
            stream.crcs[0] = 0
            self._complete(stream)
        return reader

    def close_reader(self, reader: Reader) -> None:
        stream = reader.stream
        stream.readers.discard(reader)
        if stream.detached and stream.idle():
            self.partials.drop_stream(stream)

    def discard(self, inode_id: int) -> None:
        """The inode's content no longer comes from the store (rewritten, truncated, removed): new opens
        must not use its Stream; its partial file goes once its readers are done."""
        stream = self.partials.streams.get(inode_id)
        if stream is not None:
            self.partials.detach(stream)

    # -- reads ----------------------------------------------------------------------------------------

    async def wait_readable(self, reader: Reader, offset: int, size: int) -> None:
        """Return once bytes [offset, offset + size) of the reader's file can be pread (or lie past its
        end); raise FsError if the store cannot deliver them."""
        stream = reader.stream
        if stream.complete:
            return
        needed = stream.chunks(offset, size)
        # A first read at 0 counts as sequential too: whole-file readers (cat, torch.load) start there.
        sequential = abs(offset - reader.next_offset) <= SEQUENTIAL_SLACK
        if needed:
            first = needed[0]
            # The kernel's own read-ahead sends several requests at once, not always in order: a reader
            # already proven sequential stays so while it reads in its chunk or the next.
            sequential = sequential or (reader.window > 0 and reader.position <= first <= reader.position + 1)
            if not sequential:
                reader.window = 0
            elif first != reader.position or reader.window == 0:
                chunk = stream.chunk_size
                opening = min(FIRST_READAHEAD_CHUNKS, max(1, FIRST_READAHEAD // chunk))
                widest = max(opening, min(MAX_READAHEAD_CHUNKS, MAX_READAHEAD // chunk))
                reader.window = min(widest, max(opening, reader.window * 2))
            reader.position = needed[-1]
        reader.next_offset = offset + size
        if stream.failure is not None:
            raise stream.failure
        missing = [i for i in needed if i not in stream.present]
        if self._nursery is not None:
            for index in missing:
                self._start(stream, index, Priority.READ)
            self._read_ahead(reader)
        if missing:
            await self._wait_chunks(stream, missing)

    def _stream_chunk_size(self) -> int:
        """The engine's download part size, but never more than a quarter of a small cache budget (whole
        MiB, at least one): a read must be able to hold its chunk, and a chunk larger than the budget could
        never be fetched."""
        limit = self.cache.limit
        if limit >= 4 * self.chunk_size:
            return self.chunk_size
        return min(self.chunk_size, max(MiB, int(limit) // 4 // MiB * MiB))

    def _read_ahead(self, reader: Reader) -> None:
        stream = reader.stream
        end = min(stream.count, reader.position + 1 + reader.window)
        for index in range(reader.position + 1, end):
            if index in stream.present or index in stream.inflight:
                continue
            length = stream.chunk_range(index)[1]
            if not self._room_now(length):
                return  # read-ahead never waits for room; the read itself will
            # Reserved now, not when the task runs: the next chunk's room check must see this one.
            self.cache.reserve(length)
            self._start(stream, index, Priority.READAHEAD, reserved=length)

    def _room_now(self, length: int) -> bool:
        """Room for a read-ahead chunk without waiting: evicting what is evictable, punching only chunks
        outside every reader's read-ahead window (never the window itself: that would thrash)."""
        cache = self.cache
        if cache.used + length <= cache.limit * HIGH_WATER:
            return True
        wanted = int(cache.used + length - cache.limit * HIGH_WATER)
        if self.evictor is not None:
            wanted -= self.evictor.evict(wanted, punch=False)
        if wanted > 0:
            self.partials.punch(wanted, keep_read_ahead=True)
        return cache.used + length <= cache.limit * HIGH_WATER

    async def _wait_chunks(self, stream: Stream, indexes: Iterable[int]) -> None:
        self.stats.readers_waiting += 1
        try:
            for index in indexes:
                retried = False
                while index not in stream.present:
                    if stream.failure is not None:
                        raise stream.failure
                    if stream.complete:
                        return
                    if stream.dropped:
                        raise FsError(errno.ESTALE, f"{stream.key}: the partial file was dropped")
                    event = stream.inflight.get(index)
                    if event is None:
                        error = stream.errors.get(index)
                        if error is not None and retried:
                            raise error
                        retried = True
                        if self._nursery is None:
                            await self._fetch_chunk(stream, index, Priority.READ)
                            continue
                        self._start(stream, index, Priority.READ)
                        event = stream.inflight[index]
                    await event.wait()
                    if index not in stream.present and index in stream.errors and not stream.complete:
                        raise stream.errors[index]
        finally:
            self.stats.readers_waiting -= 1

    def _start(self, stream: Stream, index: int, priority: Priority, *, reserved: int = 0) -> None:
        if index in stream.present or index in stream.inflight or stream.dropped or stream.complete:
            self.cache.unreserve(reserved)
            return
        assert self._nursery is not None
        stream.inflight[index] = trio.Event()
        pinner = self._claim_pin(stream, priority)
        self._nursery.start_soon(self._run_chunk, stream, index, priority, reserved, pinner)

    def _claim_pin(self, stream: Stream, priority: Priority) -> bool:
        """Whether this chunk's answer is the first, which fixes the version. Only a chunk a reader
        waits for pins (decided when it is started, before read-ahead starts), so the first byte never
        waits behind read-ahead."""
        if stream.pinned or stream.pinning or priority != Priority.READ:
            return False
        stream.pinning = True
        return True

    async def _run_chunk(self, stream: Stream, index: int, priority: Priority, reserved: int, pinner: bool) -> None:
        await self._fetch_chunk(stream, index, priority, started=True, reserved=reserved, pinner=pinner)

    async def _fetch_chunk(
        self, stream: Stream, index: int, priority: Priority, *, started: bool = False, reserved: int = 0,
        pinner: bool = False,
    ) -> None:
        """Fetch one chunk into the partial file. Never raises (but Cancelled): a failure is recorded
        in stream.errors (this chunk) or stream.failure (the whole Stream) for the waiters. `reserved`:
        the chunk's room in the cache was reserved by the caller (read-ahead)."""
        if not started:
            if index in stream.inflight:
                await stream.inflight[index].wait()
                return
            stream.inflight[index] = trio.Event()
            pinner = self._claim_pin(stream, priority)
        event = stream.inflight[index]
        stream.errors.pop(index, None)
        offset, length = stream.chunk_range(index)
        pinning = pinner
        repin = False
        try:
            # The first answer fixes the version: the others wait for it, then ask for that etag. If
            # the pinning read fails, another read's chunk pins; read-ahead gives up (a read that needs
            # the chunk fetches it again).
            while not stream.pinned and not pinning:
                if not stream.pinning:
                    if priority != Priority.READ:
                        return
                    stream.pinning = pinning = True
                    break
                await stream.pin_attempt.wait()
            if not reserved and self.evictor is not None:
                await self.evictor.wait_for_room(length, what=f"a read of {stream.key}")
            # Re-check after the awaits: the Stream may have been dropped or failed meanwhile.
            if stream.dropped or stream.failure is not None or stream.complete:
                return
            if not reserved:
                self.cache.reserve(length)
                reserved = length
            # Small pieces while the whole file is wanted, larger for a reader's chunks (backends/base.py).
            piece_size = WHOLE_FETCH_PIECE if stream.whole_waiters else RANGE_PIECE
            for _ in range(MOVES_FOLLOWED):
                key = stream.key
                try:
                    got = await self.engine.fetch_range(key, stream.fd, offset, length, if_match=stream.etag,
                                                        priority=priority, piece_size=piece_size)
                    break
                except (NotFoundBackendError, ObjectChangedError):
                    if not self._follow_move(stream, key):
                        raise
                    repin = True  # the copy has an etag of its own: this answer pins it
            else:
                raise NotFoundBackendError(f"{stream.key}: moved in the store more often than it could be read")
            if stream.dropped:
                return
            if pinning or repin:
                self._pin(stream, got.size, got.etag, got.checksum)
                if stream.failure is not None:
                    return
            stream.present.add(index)
            stream.crcs[index] = got.crc
            stream.charged += reserved
            reserved = 0
            self.stats.bytes_downloaded += got.length
            self.stats.chunks_fetched += 1
            if len(stream.present) == stream.count:
                self._complete(stream)
        except ObjectChangedError as exc:
            if self._fail(stream, FsError(errno.ESTALE, f"{stream.key} was replaced in the store while it was"
                                                        " read")):
                log.warning("%s was replaced in the store by another node while it was being read: its reads"
                            " fail with ESTALE until it is opened again (%s)", stream.key, exc)
        except BackendError as exc:
            stream.errors[index] = FsError(errno_for_backend_error(exc), f"read of {stream.key} failed: {exc}")
            log.warning("cannot read %s from %s: %s", stream.key, self.engine.store.url, exc)
        except FsError as exc:  # no room in the cache (ENOSPC after dirty_wait)
            stream.errors[index] = exc
        except OSError as exc:
            stream.errors[index] = FsError(exc.errno or errno.EIO, f"read of {stream.key} into the cache failed:"
                                           f" {exc.strerror}")
            log.warning("cannot write a chunk of %s into the cache: %s", stream.key, exc.strerror)
        finally:
            if reserved:
                self.cache.unreserve(reserved)
            if pinning:
                stream.pinning = False
                stream.pin_attempt.set()
                stream.pin_attempt = trio.Event()
            del stream.inflight[index]
            event.set()
            stream.notify()
            if stream.dropped and not stream.inflight:
                close_stream(stream)
            elif stream.detached and stream.idle():
                self.partials.drop_stream(stream)

    def _follow_move(self, stream: Stream, key: str) -> bool:
        """A read found nothing (or another object) at `key`: if the drain has meanwhile moved this very
        object to a new key (a rename of a remote-only file, copied then deleted in the store), switch the
        Stream to the new key and say so. The copy is the same version: only the key may differ."""
        if stream.key != key:
            return True  # another chunk of this Stream followed it already
        current = self.journal.names.get(stream.inode_id)
        if current is None or current.remote_key in (None, key):
            return False
        moved = identity_of(current)
        if moved[:1] + moved[2:] != stream.identity[:1] + stream.identity[2:]:
            return False  # rewritten or replaced: not a move
        log.debug("%s moved to %s while it was read: reading on from there", key, current.remote_key)
        stream.key = current.remote_key
        stream.identity = moved
        stream.etag = None
        return True

    def _pin(self, stream: Stream, size: int, etag: str | None, checksum: str | None) -> None:
        expected = stream.expected_checksum
        if size != stream.size or (
            checksum is not None and expected is not None and checksum.split(":")[0] == expected.split(":")[0]
            and checksum != expected
        ):
            self._fail(stream, FsError(errno.ESTALE, f"{stream.key} in the store is not the version this mount"
                                                      " knows"))
            log.warning("%s in the store is not the version this mount knows (size %d, expected %d): another"
                        " node replaced it; `ckptfs refresh` picks the new version up", stream.key, size,
                        stream.size)
            return
        stream.etag = etag
        stream.meta_checksum = checksum
        stream.pinned = True

    def _fail(self, stream: Stream, error: FsError) -> bool:
        """Make every read of the Stream fail with `error`; True the first time (log it then)."""
        if stream.failure is not None:
            return False
        stream.failure = error
        # The next open starts a new Stream (the namespace learns of the new version at refresh).
        self.partials.detach(stream)
        return True

    def _complete(self, stream: Stream) -> None:
        """Every chunk is present: verify the whole file, and make it an ordinary clean cached file."""
        checksum = crc_text(combine_crcs((stream.crcs[index], stream.chunk_range(index)[1])
                                         for index in range(stream.count)))
        expected = stream.expected_checksum
        if expected is None or not expected.startswith("crc32:"):
            expected = stream.meta_checksum if stream.meta_checksum and stream.meta_checksum.startswith("crc32:") \
                else None
        if expected is not None and expected != checksum:
            self.stats.checksum_failures += 1
            log.error("checksum mismatch reading %s: the store's bytes have %s, expected %s; the data is dropped"
                      " and reads fail with EIO", stream.key, checksum, expected)
            self._fail(stream, FsError(errno.EIO, f"{stream.key}: checksum mismatch (store {checksum}, expected"
                                                  f" {expected})"))
            self.partials.drop_stream(stream)
            return
        current = self.journal.names.get(stream.inode_id)
        if current is None or stream.detached or identity_of(current) != stream.identity:
            return  # the namespace moved on: serve the readers, never adopt
        data_path = self.cache.data_path(stream.inode_id)
        try:
            os.utime(stream.fd, ns=(current.mtime_ns, current.mtime_ns))
            os.rename(stream.path, data_path)
        except OSError as exc:
            log.warning("cannot move the fetched %s into the cache: %s", stream.key, exc.strerror)
            return
        stream.path = data_path
        stream.complete = True
        self.partials.adopted(stream)
        self.cache.adopt(stream.inode_id, stream.size)
        try:
            with self.journal.transaction():
                self.journal.copies.finish_fetch(stream.inode_id, size=stream.size, mtime_ns=current.mtime_ns)
        except JournalFull:
            # The journal cannot say the file is local (the cache filesystem is full): it stays remote,
            # without a cache file, and its readers keep the bytes they have open.
            self.cache.remove_data(stream.inode_id)
            log.warning("cannot keep the fetched %s in the cache: the cache filesystem is full", stream.key)
        else:
            if self.evictor is not None:
                self.evictor.touch(stream.inode_id, opened=False)  # a prefetch's keep lasts until an open
            self.stats.files_verified += 1
        if not stream.inflight:
            close_stream(stream)
        log.debug("fetched %s (%s), verified", stream.key, checksum)

    # -- whole files ----------------------------------------------------------------------------------

    async def fetch(self, inode: Inode) -> None:
        """Return once `inode` has local data (a clean cached file): every chunk fetched and the whole
        verified. For opens for writing, truncate and anything else that needs the whole content."""
        current = self.journal.names.get(inode.id)
        if current is None or current.state != REMOTE:
            return
        assert current.remote_key is not None
        if current.size > self.cache.limit:
            log.error(
                "cannot make %s local (for writing): it is %d bytes, larger than the whole cache budget (%d"
                " bytes); raise cache_size (reading it needs no room for the whole file)",
                current.path, current.size, self.cache.limit,
            )
            raise FsError(errno.EFBIG, f"{current.remote_key} is larger than the cache budget")
        stream = self.partials.stream_for(current, self._stream_chunk_size())
        stream.whole_waiters += 1
        try:
            todo = [i for i in range(stream.count) if i not in stream.present]
            failures: list[FsError] = []
            if self._nursery is None:
                await self._wait_chunks(stream, todo)
            else:
                # At most parts_in_flight chunks started at a time: a reader's chunk can still go first.
                async with trio.open_nursery() as nursery:
                    for _ in range(min(self.engine.parts_in_flight, len(todo))):
                        nursery.start_soon(self._whole_worker, stream, todo, failures)
            if stream.failure is not None:
                raise stream.failure
            if failures:
                raise failures[0]
            if not stream.complete and len(stream.present) == stream.count:
                self._complete(stream)
            if stream.failure is not None:
                raise stream.failure
        finally:
            stream.whole_waiters -= 1
            if stream.detached and stream.idle():
                self.partials.drop_stream(stream)
        latest = self.journal.names.get(inode.id)
        if latest is not None and latest.state == REMOTE and not stream.complete:
            raise FsError(errno.ESTALE, f"{current.remote_key} changed while it was fetched")

    async def _whole_worker(self, stream: Stream, todo: list[int], failures: list[FsError]) -> None:
        while todo and not failures:
            index = todo.pop(0)
            try:
                await self._wait_chunks(stream, [index])
            except FsError as exc:
                failures.append(exc)
