"""The cache directory: its layout, its lock, the data file of every inode, and space accounting.

Layout (all 0700 / 0600):
    CACHE_DIR/lock         flock()ed by the one daemon using this cache dir
    CACHE_DIR/journal.db   the journal (ckptfs/journal/ owns its contents)
    CACHE_DIR/data/<id>    the content of file inode <id>, byte for byte; its size and mtime are the file's
    CACHE_DIR/tmp/         partial files of remote objects being read (fetch/), sparse at the object's
                           size; renamed into data/ once every chunk is there and verified. Removed at
                           start-up: a partial file is never mistaken for a local copy.

Space accounting (trio thread only: the write path updates it without a lock): `used` is the sum of
the apparent sizes of the data files, minus ranges already freed by a spill (see drain/spill_jobs.py) and minus the
holes that a truncate or a write past the end left (the filesystem under the cache stores nothing for
them), plus the blocks fallocate(KEEP_SIZE) reserved past a file's end (stored, though no read sees them), plus
`reserved`: the chunks of partial files that are present or in flight (fetch/ reserves a chunk before
it is fetched and unreserves it when it is punched out or its file dropped or adopted into data/);
`limit` is the budget: `cache_size`,
lowered when the cache filesystem would otherwise keep less than `min_free` free, but never below the
`working_room` a file being written needs to spill (drain/spill_jobs.py) while the filesystem has that much: when
others fill it past `min_free`, writes go on, uploaded in parts as they are written, instead of waiting
for room only others can free (what s3fs's ensure_diskfree does). Both are plain
attributes read on every FUSE write, so the write path pays two attribute loads and a compare. The
evictor (cache/evictor.py) keeps `used` under `limit` and makes writers wait when it cannot. Writes the daemon does
not see (holes filled later; the kernel writing a data file itself, with FUSE passthrough) are charged
when the file is measured again from its size and st_blocks (`observe`): at close and fsync, and every
evictor round for the files in `measured`.

It knows inode ids but not the namespace or file states (the journal has those), nor any object store.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ckptfs.config import parse_size
from ckptfs.errors import CkptfsError


class CacheFile:
    """What the accounting knows of one data file. Open handles share it, so the write path updates
    it without a dict lookup."""

    __slots__ = (
        "beyond", "changes", "freed", "holes", "inode_id", "passthrough_writers", "preallocated", "sealed", "size",
        "staged",
    )

    def __init__(self, inode_id: int, size: int, holes: int = 0) -> None:
        self.inode_id = inode_id
        self.size = size  # apparent size as far as the accounting has seen it
        # Bytes within `size` (beyond `freed`) that were never written: a truncate or a write past the end
        # extended the file over them. Writes that fill them later are charged at the next remeasure.
        self.holes = holes
        # fallocate() reserved space in the file (fs/data_path.py), since it was created or last truncated to 0:
        # no spill takes it (what was reserved may not be written yet: a spill would upload zeros and seal them,
        # and fail the writes to come; and its writes need no more room), and blocks reserved past its end
        # (FALLOC_FL_KEEP_SIZE) are charged, in `beyond`.
        self.preallocated = False
        self.beyond = 0  # bytes allocated past `size` by fallocate(KEEP_SIZE): no read sees them, the disk holds them
        # Handles that write to the file through FUSE passthrough (the kernel writes the data file directly:
        # `size` is what observe() saw last). A spill never seals such a file: nothing could stop a write.
        self.passthrough_writers = 0
        # Content changes begun (fs/changes.py, before their first byte): an upload that read the file in another
        # thread compares it with what it saw when it chose the file (Transfers.put_files).
        self.changes = 0
        # A spill (drain/spill_jobs.py) uploads the start of a file still being written and punches it out:
        self.sealed = 0  # bytes at the start that are being or have been spilled: writes there fail
        self.freed = 0  # bytes at the start already punched out: reads there fail too
        # Bytes at the start staged by a spill, sealed or not (an early spill, made while the cache had room,
        # leaves them writable: the drain checks them against the file when it is closed).
        self.staged = 0

    @property
    def charge(self) -> int:
        return self.size - self.freed - self.holes + self.beyond

    # The spill watermarks (`sealed`, `staged`) change only through these methods; `freed` changes with the
    # budget's accounting (CacheDir.punched).

    def seal(self, end: int) -> None:
        """A spill takes the first `end` bytes: writes there fail from now on."""
        self.sealed = end

    def mark_staged(self, end: int) -> None:
        """A spill has staged the first `end` bytes in the store."""
        self.staged = end

    def restart_staging(self) -> None:
        """A new spill begins: what an earlier one staged belongs to another version (it was completed)."""
        self.staged = 0

    def unstage(self) -> None:
        """The spill was thrown away: only its sealed start (which cannot change) still counts as staged."""
        self.staged = self.sealed

    def clip_watermarks(self, size: int) -> None:
        """The file was cut to `size`: nothing beyond it is sealed or staged."""
        self.sealed = min(self.sealed, size)
        self.staged = min(self.staged, size)

    def restore_watermarks(self, staged: int, *, sealed: bool) -> None:
        """At start-up, from the journaled spill: the first `staged` bytes were staged (`sealed`: not to be
        written again)."""
        self.staged = min(staged, self.size)
        self.sealed = self.staged if sealed else 0


# The working room never takes the last of the filesystem: the journal must still be able to record
# uploads and evictions, which is what frees room again.
JOURNAL_ROOM = 64 << 20

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def _holes(st: os.stat_result) -> int:
    """Bytes of a file's apparent size that its filesystem stores no block for (0 for a dense file)."""
    return max(0, st.st_size - st.st_blocks * 512)


def fallocate_fd(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) (os has only posix_fallocate, which is mode 0); OSError with its errno."""
    if _fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_hole_fd(fd: int, offset: int, length: int) -> None:
    """Free `length` bytes at `offset` of an open file, keeping its size (reads there return zeros)."""
    fallocate_fd(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


@dataclass(frozen=True)
class SpaceInfo:
    total_bytes: int
    free_bytes: int
    block_size: int
    total_files: int
    free_files: int


class CacheDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.tmp_dir = root / "tmp"
        self.journal_path = root / "journal.db"
        self._lock_fd: int | None = None
        self._data_dir_str = str(self.data_dir) + "/"
        self.files: dict[int, CacheFile] = {}
        # ids of the data files whose accounting is measured from the file each round: those with holes
        # (CacheFile.holes), those written through passthrough (CacheFile.passthrough_writers) and those with
        # blocks reserved past their end (CacheFile.beyond: writes that fill them are charged twice until then).
        self.measured: set[int] = set()
        self.used = 0
        self.reserved = 0
        # No budget until configure_budget(): the filesystem's own free space is the only limit.
        self.limit: float = math.inf
        self._cap: str | int | None = None
        self._min_free: str | int = 0
        self._working_room = 0
        # Set by measure(): others left the filesystem so little free space that min_free would take the
        # budget below the working room (writes then spill), and what was measured, for the messages.
        self.squeezed = False
        self.free_bytes = 0
        self.min_free_bytes = 0

    def prepare(self) -> None:
        """Create the layout (0700) and check that it is writable; raise a CkptfsError naming the fix."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.root.chmod(0o700)
            for sub in (self.data_dir, self.tmp_dir):
                sub.mkdir(mode=0o700, exist_ok=True)
            probe = self.tmp_dir / ".write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except PermissionError:
            raise CkptfsError(
                f"cache dir {self.root} is not writable by this user; choose another with --cache-dir"
            ) from None
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise CkptfsError(
                    f"cache dir {self.root} is on a read-only filesystem; choose another with --cache-dir"
                ) from None
            raise CkptfsError(f"cache dir {self.root} cannot be used: {exc.strerror}") from None

    def lock(self) -> None:
        """Take the cache dir for this process; a second daemon on it gets a clear error."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise CkptfsError(
                f"cache dir {self.root} is in use by another ckptfs daemon (pid {holder or 'unknown'});"
                " unmount that one first or choose another --cache-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def data_path(self, inode_id: int) -> str:
        return self._data_dir_str + str(inode_id)

    def tmp_path(self, inode_id: int) -> str:
        return str(self.tmp_dir / f"{inode_id}.part")

    def partial_path(self, inode_id: int, serial: int) -> str:
        """The partial file of one version of a remote inode being read (several may coexist while old
        readers finish with a version the namespace has replaced)."""
        return str(self.tmp_dir / f"{inode_id}.{serial}.part")

    def create_data(self, inode_id: int) -> int:
        """An empty cache file for the inode; a read-write descriptor of it, the caller's to close (the
        create of a small file opens it once, not twice)."""
        fd = os.open(self.data_path(inode_id), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self._account(inode_id, 0)
        return fd

    def remove_data(self, inode_id: int) -> None:
        try:
            os.unlink(self.data_path(inode_id))
        except FileNotFoundError:
            pass
        entry = self.files.pop(inode_id, None)
        if entry is not None:
            self.used -= entry.charge
        self.measured.discard(inode_id)

    # -- space accounting -----------------------------------------------------------------------------

    def configure_budget(self, cache_size: str | int, min_free: str | int, *, working_room: int = 0) -> None:
        """Set the budget (sizes as in config: bytes, '512M' or a percentage of the cache filesystem);
        `working_room` is the floor min_free cannot push it under."""
        self._cap = cache_size
        self._min_free = min_free
        self._working_room = working_room
        self.measure()

    def measure(self) -> None:
        """Recompute `limit` from the filesystem's free space now (others may write to it too)."""
        if self._cap is None:
            return
        space = self.space()
        cap = parse_size(self._cap, total=space.total_bytes)
        min_free = parse_size(self._min_free, total=space.total_bytes)
        # Our own files are part of what the filesystem has used: they count as room we may keep.
        room = self.used + space.free_bytes
        floor = min(cap, self._working_room, room - JOURNAL_ROOM)
        self.squeezed = room - min_free < floor
        self.free_bytes, self.min_free_bytes = space.free_bytes, min_free
        self.limit = max(0, floor, min(cap, room - min_free))

    def scan(self) -> dict[int, float]:
        """Account every data file (at start-up, after recovery); return their last access times."""
        self.files.clear()
        self.measured.clear()
        self.used = self.reserved
        atimes = {}
        for inode_id in self.data_ids():
            try:
                st = os.stat(self.data_path(inode_id))
            except FileNotFoundError:
                continue
            self._account(inode_id, st.st_size, _holes(st))
            atimes[inode_id] = st.st_atime
        return atimes

    def _account(self, inode_id: int, size: int, holes: int = 0) -> CacheFile:
        old = self.files.get(inode_id)
        if old is not None:
            self.used -= old.charge
        entry = CacheFile(inode_id, size, holes)
        self.files[inode_id] = entry
        self.used += entry.charge
        if holes:
            self.measured.add(inode_id)
        return entry

    def file(self, inode_id: int) -> CacheFile:
        """The accounting entry of a data file that exists (created on first sight)."""
        entry = self.files.get(inode_id)
        if entry is None:
            st = os.stat(self.data_path(inode_id))
            entry = self._account(inode_id, st.st_size, _holes(st))
        return entry

    def grow(self, entry: CacheFile, offset: int, end: int) -> None:
        """A write of [offset, end) extended a data file past its end (the write path: keep it cheap). A
        gap it left after the old end is a hole: neither the filesystem nor the budget pays for it."""
        if offset > entry.size:
            entry.holes += offset - entry.size
            self.measured.add(entry.inode_id)
            self.used += end - offset
        else:
            self.used += end - entry.size
        entry.size = end

    def resize(self, inode_id: int, size: int) -> None:
        """A truncate made a data file's apparent size `size`. Growing it adds a hole; shrinking a file
        with holes measures what it still holds."""
        entry = self.files.get(inode_id)
        if entry is None:
            self._account(inode_id, size)
            self.remeasure(inode_id)
            return
        if size == 0:
            entry.preallocated = False  # nothing fallocate reserved is left (see CacheFile.preallocated)
        if size >= entry.size:
            if size > entry.size:
                entry.holes += size - entry.size
                self.measured.add(inode_id)
            entry.size = size
            return
        self._shrink(entry, size)
        if entry.holes or entry.beyond:  # (a truncate frees what fallocate reserved past the new end too)
            self.remeasure(inode_id)

    def _shrink(self, entry: CacheFile, size: int) -> None:
        self.used += size - entry.size
        entry.size = size
        entry.clip_watermarks(size)
        if entry.freed > size:
            self.used += entry.freed - size
            entry.freed = size
        if entry.holes > size - entry.freed:
            self.used += entry.holes - (size - entry.freed)
            entry.holes = size - entry.freed

    def observe(self, inode_id: int, st: os.stat_result) -> None:
        """The data file as stat'ed now is the truth: its size (writes this daemon did not see, made by the
        kernel straight to the file with FUSE passthrough) and the blocks it holds (holes filled or cut)."""
        entry = self.files.get(inode_id)
        if entry is None:
            self._account(inode_id, st.st_size, _holes(st))
            return
        if st.st_size < entry.size:
            self._shrink(entry, st.st_size)
        before = entry.charge
        entry.size = st.st_size
        within = entry.size - entry.freed
        allocated = st.st_blocks * 512
        entry.holes = max(0, within - allocated)
        if entry.preallocated or entry.beyond:
            # Blocks past the end are what fallocate(KEEP_SIZE) reserved (other files' few metadata blocks are
            # not charged: only files fallocate reserved space in are measured so).
            entry.beyond = max(0, allocated - within)
        self.used += entry.charge - before
        if entry.holes or entry.passthrough_writers or entry.beyond:
            self.measured.add(inode_id)
        else:
            self.measured.discard(inode_id)

    def remeasure(self, inode_id: int) -> None:
        """observe() the data file now, if it exists."""
        if inode_id not in self.files:
            return
        try:
            st = os.stat(self.data_path(inode_id))
        except FileNotFoundError:
            return
        self.observe(inode_id, st)

    def remeasure_all(self) -> None:
        """remeasure() every data file with holes or written through passthrough (the evictor, each round:
        writes that filled holes, or that the daemon never saw, are charged within a round)."""
        for inode_id in list(self.measured):
            if inode_id in self.files:
                self.remeasure(inode_id)
            else:
                self.measured.discard(inode_id)

    def passthrough_opened(self, inode_id: int) -> None:
        """A handle that writes through FUSE passthrough opened the file: its writes bypass the daemon, so
        its accounting is measured from the file (observe) every round until the last such handle closes."""
        self.file(inode_id).passthrough_writers += 1
        self.measured.add(inode_id)

    def passthrough_closed(self, inode_id: int) -> None:
        entry = self.files.get(inode_id)
        if entry is not None:
            entry.passthrough_writers = max(0, entry.passthrough_writers - 1)
            self.remeasure(inode_id)

    def punch_hole(self, inode_id: int, offset: int, length: int) -> None:
        """Free `length` bytes at `offset` of a data file, keeping its size (the accounting is `punched`)."""
        fd = os.open(self.data_path(inode_id), os.O_WRONLY | os.O_CLOEXEC)
        try:
            punch_hole_fd(fd, offset, length)
        finally:
            os.close(fd)

    def punched(self, inode_id: int, offset: int, length: int) -> None:
        """Account a hole punched by punch_hole: the start of the file up to offset + length is gone."""
        entry = self.files.get(inode_id)
        if entry is not None and entry.freed < offset + length:
            self.used -= offset + length - entry.freed
            entry.freed = offset + length
            if entry.holes:  # some of what was punched may have been a hole already
                self.remeasure(inode_id)

    def restore_spilled(self, inode_id: int, *, punched: int, staged: int, sealed: bool) -> None:
        """At start-up: a spill had staged the first `staged` bytes of this data file (`sealed`: not to be
        written again) and punched out the first `punched` before the restart."""
        entry = self.files.get(inode_id)
        if entry is not None and punched <= entry.size:
            # scan() counted the punched start among the file's holes: it is `freed` instead.
            self.used -= entry.charge
            entry.freed = punched
            entry.holes = max(0, entry.holes - punched)
            entry.restore_watermarks(staged, sealed=sealed)
            self.used += entry.charge

    def reserve(self, size: int) -> None:
        """Count a chunk of a partial file (fetch/) before its bytes arrive, and while they are there."""
        self.reserved += size
        self.used += size

    def unreserve(self, size: int) -> None:
        self.reserved -= size
        self.used -= size

    def adopt(self, inode_id: int, size: int) -> None:
        """A finished download became the data file of `inode_id`."""
        self._account(inode_id, size)

    def has_data(self, inode_id: int) -> bool:
        return os.path.exists(self.data_path(inode_id))

    def data_ids(self) -> set[int]:
        ids = set()
        for name in os.listdir(self.data_dir):
            if name.isdigit():
                ids.add(int(name))
        return ids

    def clear_tmp(self) -> None:
        for name in os.listdir(self.tmp_dir):
            os.unlink(self.tmp_dir / name)

    def sync_data_dir(self) -> None:
        """Make the directory entries of data files durable (after creating one that must survive)."""
        fd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def space(self) -> SpaceInfo:
        st = os.statvfs(self.root)
        return SpaceInfo(
            total_bytes=st.f_blocks * st.f_frsize,
            free_bytes=st.f_bavail * st.f_frsize,
            block_size=st.f_frsize,
            total_files=st.f_files,
            free_files=st.f_favail,
        )
