"""Read-through: bring a file that exists only in the store ('remote') into the cache.

The whole object is downloaded to CACHE_DIR/tmp by the transfer engine (ranges in parallel), its checksum
compared with the one the journal recorded at upload (when there is one), then renamed to the data file and the journal
marks it clean. Concurrent opens of the same file share one download. Never touches FUSE or the namespace.
"""

from __future__ import annotations

import errno
import logging
import os

import trio

from ckptfs.cache import CacheDir
from ckptfs.errors import BackendError, FsError, errno_for_backend_error
from ckptfs.evict import Evictor
from ckptfs.journal import REMOTE, Inode, Journal
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)


class Fetcher:
    def __init__(
        self, journal: Journal, cache: CacheDir, engine: Transfers, *, evictor: Evictor | None = None,
    ) -> None:
        self.journal = journal
        self.cache = cache
        self.engine = engine
        self.evictor = evictor
        self._in_flight: dict[int, trio.Event] = {}
        self._failures: dict[int, FsError] = {}

    async def fetch(self, inode: Inode) -> None:
        """Return once `inode` has local data; raise FsError if the store cannot deliver it."""
        while True:
            current = self.journal.get(inode.id)
            if current is None or current.state != REMOTE:
                return
            event = self._in_flight.get(inode.id)
            if event is None:
                break
            await event.wait()
            failure = self._failures.get(inode.id)
            if failure is not None:
                raise failure
        event = trio.Event()
        self._in_flight[inode.id] = event
        self._failures.pop(inode.id, None)
        try:
            await self._download(current)
        except FsError as exc:
            self._failures[inode.id] = exc
            raise
        finally:
            del self._in_flight[inode.id]
            event.set()

    async def _download(self, inode: Inode) -> None:
        assert inode.remote_key is not None
        key = inode.remote_key
        tmp = self.cache.tmp_path(inode.id)
        log.debug("fetching %s (%d bytes)", key, inode.size)
        if inode.size > self.cache.limit:
            log.error(
                "cannot open %s: it is %d bytes, larger than the whole cache budget (%d bytes); raise cache_size",
                inode.path, inode.size, self.cache.limit,
            )
            raise FsError(errno.EFBIG, f"{key} is larger than the cache budget")
        if self.evictor is not None:
            await self.evictor.wait_for_room(inode.size, what=f"the fetch of {key}")
        # The download's bytes count against the budget from the start (the tmp file grows meanwhile).
        self.cache.reserve(inode.size)
        try:
            await self._download_reserved(inode, key, tmp)
        finally:
            self.cache.unreserve(inode.size)

    async def _download_reserved(self, inode: Inode, key: str, tmp: str) -> None:
        try:
            checksum = await self.engine.download(key, tmp)
        except BackendError as exc:
            log.warning("cannot fetch %s from %s: %s", key, self.engine.store.url, exc)
            raise FsError(errno_for_backend_error(exc), f"fetch of {key} failed: {exc}") from exc
        except OSError as exc:
            raise FsError(exc.errno or errno.EIO, f"fetch of {key} into the cache failed: {exc.strerror}") from exc
        # Re-check after the await: the file may have been removed, truncated or renamed meanwhile.
        current = self.journal.get(inode.id)
        if current is None or current.state != REMOTE:
            os.unlink(tmp)
            return
        same_algorithm = current.checksum is not None and current.checksum.split(":")[0] == checksum.split(":")[0]
        if same_algorithm and current.checksum != checksum:
            os.unlink(tmp)
            log.error("checksum mismatch fetching %s: journal %s, store %s", key, current.checksum, checksum)
            raise FsError(errno.EIO, f"{key}: checksum mismatch (store {checksum}, expected {current.checksum})")
        st = os.stat(tmp)
        os.utime(tmp, ns=(current.mtime_ns, current.mtime_ns))
        os.rename(tmp, self.cache.data_path(inode.id))
        self.cache.adopt(inode.id, st.st_size)
        with self.journal.transaction():
            self.journal.finish_fetch(inode.id, size=st.st_size, mtime_ns=current.mtime_ns)
        log.debug("fetched %s", key)
