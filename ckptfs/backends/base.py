"""The object store primitives every backend implements, and the value types they speak.

A store implements only what differs between services; everything about parts (sizing, parallelism,
retries, the memory budget, resume, spills, ranged reads) lives once, in ckptfs/transfer.py. Stores know
keys, bytes and a little metadata (mtime, mode); never inodes, paths of the mount or the journal. Every
method is blocking, thread-safe, and makes one attempt (plus whatever the SDK retries on its own), without
threads of its own: callers run them in worker threads and own the retries and the parallelism. Keys are
relative to the store's prefix, use '/' as separator, and a key ending in '/' is a directory marker.

The primitives:
  - staged uploads: `open_upload` (invisible until complete) -> `put_part` N (bytes plus their CRC32, which
    the server verifies where it can) or `copy_part` N (bytes of another object, server-side) ->
    `complete_upload` (the object appears at the key atomically) or `abort_upload`; a store that no longer
    has the upload raises UploadGoneError; `list_parts` tells which parts of an interrupted upload the
    server still holds, and `list_leftovers` finds this owner's interrupted uploads after a crash.
    `put_object` is the one-request form for small objects.
  - reads: `get_range` (one ranged GET, optionally pinned to a version by its etag, its bytes returned or
    streamed to a sink piece by piece), `head`, `list_dir` (one level), `list` (recursive).
  - namespace: `copy` (server-side, optionally with new metadata), `delete`, `put_dir`, `put_symlink`,
    `set_meta`.
  - notes: `put_note`, `get_note`, `list_notes`, `delete_note`: small bookkeeping objects that every node
    of a multi-node job reads and writes (cross-node ordering records), at <prefix>/NOTES_DIR<name>. A
    write replaces a note atomically and a listing sees every note written before it started (S3, GCS
    and Azure listings are strongly consistent; so is a directory). Names are checked by
    `check_note_name`, the same for every store.

Whole-object checksums are 'crc32:<hex>' everywhere (the journal, object metadata, LocalStore); the
math is in ckptfs/checksums.py.

Basenames starting with TEMP_PREFIX are reserved for the stores' and the engine's own bookkeeping (temp
files, upload markers, spill staging objects, notes): listings never return them and a key containing such
a component must not be written by a user. Notes have a directory of their own (NOTES_DIR), apart from
every store's upload bookkeeping, so that no sweep of leftovers ever lists or removes them.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import random
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol, TypeVar

from ckptfs.errors import BackendError as BackendError  # for nodes.py, a layer that cannot import errors
from ckptfs.errors import PermanentBackendError

FILE = "file"
DIR = "dir"
SYMLINK = "symlink"
TEMP_PREFIX = ".ckptfs-tmp."
# Notes live at <store prefix>/NOTES_DIR<name>: hidden like all bookkeeping, and in a directory no sweep of
# upload leftovers (S3/Azure `.ckptfs-tmp.uploads/`, GCS `.ckptfs-tmp.parts/`, file:// staging) looks into.
NOTES_DIR = f"{TEMP_PREFIX}notes/"
# A note's name: '/'-separated components of these characters. Short enough for every store: a component
# is a file name on file:// (255 bytes), and the whole name plus the store prefix fits an S3 key (1024).
NOTE_COMPONENT = re.compile(r"[A-Za-z0-9._-]{1,255}")
MAX_NOTE_NAME = 512


@dataclass(frozen=True)
class ObjectMeta:
    """What travels with an object besides its bytes."""

    mtime_ns: int
    mode: int  # permission bits only


class ObjectInfo(NamedTuple):
    """One object as the store lists or heads it. A named tuple, not a frozen dataclass: a listing makes one
    per object (100,000 in a big tree's first walk), and a frozen dataclass cost 3.3 us each, a tuple 0.4."""

    key: str
    kind: str  # FILE, DIR (a directory marker) or SYMLINK
    size: int
    mtime_ns: int
    mode: int
    target: str | None = None  # symlink target
    checksum: str | None = None  # whole-content checksum ('crc32:<hex>') when the store knows it
    etag: str | None = None  # changes whenever the object is replaced


@dataclass(frozen=True)
class DirListing:
    """One level of the store below a directory prefix."""

    entries: list[ObjectInfo]  # files and symlinks directly below (keys include the prefix)
    subdirs: list[str]  # names of directories directly below (with or without a marker object)
    marker: bool  # the directory itself has a marker object (always true for file:// directories)


@dataclass(frozen=True)
class UploadRef:
    """A staged upload in the store: where it will appear, and the store's own handles on it."""

    key: str
    upload_id: str  # S3: the multipart UploadId; file://: the temp file's name; ...
    marker: str = ""  # the store's owner bookkeeping for it, if it keeps any (S3: the marker object)


@dataclass(frozen=True)
class UploadPart:
    """One finished part of a staged upload."""

    number: int  # 1-based; part N covers bytes [(N-1) x part_size, N x part_size) of the object
    etag: str  # the store's receipt for the part
    checksum: str  # the part's CRC32 as the store verified it (S3: base64 big-endian)


# Takes the bytes of a ranged GET piece by piece, in order, as they arrive (see ObjectStore.get_range). A
# piece may be a view of a buffer the store reads the next piece into: it is valid during the call only, a
# sink that keeps bytes copies them.
RangeSink = Callable[[bytes | memoryview], None]
# The size of the pieces a store hands a sink where it can choose it; the caller may ask for other sizes
# (`piece_size`). Measured on this machine (2 vCPUs, 1 MiB of L2 each; S3 on SeaweedFS, CRC32 and pwrite of
# every piece into the cache file, each thread reading into one buffer it reuses):
#   - a reader's chunks (a 1 GiB restore through the mount, up to 8 ranges at once): 1 MiB pieces took
#     1.23-1.29 s, 64 KiB pieces 1.36-1.52 s (more pieces, more handoffs of the GIL with the FUSE loop);
#   - a whole-file fetch (a 2 GiB prefetch, 16 ranges at once): 1 MiB pieces took 4.0-4.4 s, of which the
#     daemon spent 4.4 s of kernel time copying pieces into the page cache (pwrite read each piece back
#     from memory); 256 KiB 3.3 s, 128 KiB 2.4 s, 64 KiB 1.8-1.9 s (s5cmd: 1.6-1.9 s).
RANGE_PIECE = 1 << 20
WHOLE_FETCH_PIECE = 64 << 10
_piece_buffers = threading.local()


def piece_buffer(size: int) -> memoryview:
    """This thread's buffer of `size` bytes for the pieces a store hands a sink: one per worker thread,
    reused for every piece, so that it stays in the CPU's cache and no piece is a new object."""
    view: memoryview | None = getattr(_piece_buffers, "view", None)
    if view is None or len(view) < size:
        view = _piece_buffers.view = memoryview(bytearray(max(size, RANGE_PIECE)))
    return view[:size]


@dataclass(frozen=True)
class RangeRead:
    """The answer of one ranged GET."""

    data: bytes  # empty when the bytes went to a sink
    size: int  # the whole object's size
    etag: str | None  # the object's version; pass it back as `if_match` to read more of the same version
    checksum: str | None  # the whole object's checksum from its metadata, when it has one


@dataclass(frozen=True)
class UploadState:
    """Everything needed to continue (or throw away) a staged upload in a later process; the transfer
    engine keeps it in the journal (to_json()) after every finished part.

    A spill (`spilled`) stages the start of a file still being written at a hidden key; `size` is then the
    bytes staged so far, `checksum` their running CRC32 and `punched` the bytes its owner freed locally. An
    early spill (`early`) is one made while the cache had room, so that the file is in the store soon after
    it is closed: its bytes stay in the cache and may still change, so they are checked against the file
    before the spill is completed (see drain.py)."""

    key: str
    upload_id: str
    marker: str
    size: int
    checksum: str  # whole-file checksum, also in the object's metadata
    mtime_ns: int
    mode: int
    part_size: int
    parts: tuple[UploadPart, ...] = field(default=())
    spilled: bool = False
    punched: int = 0
    early: bool = False
    # Unreadable journal rows already reported (parse): the drain reads the same row at every scan.
    _unreadable: ClassVar[set[str]] = set()

    @property
    def ref(self) -> UploadRef:
        return UploadRef(self.key, self.upload_id, self.marker)

    def to_json(self) -> str:
        data = {k: v for k, v in self.__dict__.items() if k != "parts"}
        data["parts"] = [[p.number, p.etag, p.checksum] for p in self.parts]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UploadState:
        data = json.loads(text)
        parts = tuple(UploadPart(int(n), str(e), str(c)) for n, e, c in data.pop("parts"))
        return cls(**data, parts=parts)

    @classmethod
    def parse(cls, text: str | None) -> UploadState | None:
        """The state a journal row holds (its `upload_state`), or None: no row, or one that cannot be read
        (reported once; the upload it described is then a leftover, which the sweeps remove)."""
        if text is None:
            return None
        try:
            return cls.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if text not in cls._unreadable:
                cls._unreadable.add(text)
                log.warning("ignoring an unreadable staged-upload record in the journal (%r: %s)", text[:200], exc)
            return None


@dataclass(frozen=True)
class PartLimits:
    """What a store accepts for staged uploads."""

    min_part_size: int  # every part but the last is at least this big
    max_part_size: int
    max_parts: int
    # put_part may get its data in a bytearray the engine reuses for later parts; False: as bytes (an SDK
    # that takes only bytes would copy each part, outside the memory budget).
    reusable_buffers: bool = True
    # complete_upload can place a staged upload at any key, with metadata given then (file://: a rename;
    # GCS: a compose into any object): a spill needs no copy, so files being written upload early. S3 and
    # Azure fix the key and metadata when the upload opens, so there a spill costs a server-side copy.
    completes_anywhere: bool = False
    # The largest object `copy` (and `set_meta`, where it copies) copies in one request; above it they raise
    # TooLargeToCopyError and the engine copies part by part with `copy_part` (S3: 5 GiB). None: any size,
    # and the store has no copy_part.
    max_copy_size: int | None = None


@dataclass(frozen=True)
class CredentialState:
    """What a cloud store says of the credential it signs with (`ckptfs status`, the credential metrics).
    A store that has one has an attribute `credentials` with a `state()` method (an attribute, not a method,
    so that metrics.InstrumentedStore passes it through untimed); file:// has none."""

    source: str  # where it comes from: "web-identity", "container", "env", "assume-role", "adc:...", ...
    detail: str  # more of the same (the SDK's own name for the source), never a secret
    expires_at: float | None  # wall-clock; None: it does not expire, or the SDK does not say when
    fetched_at: float | None  # wall-clock time of the last fetch (None: not fetched yet)
    refreshes: int  # fetched again since the first time (before an expiry or after a rejection)
    renewals_after_rejection: int  # of those, because the server said it had expired
    last_error: str | None  # the last refresh's failure, while no refresh has succeeded since


class ObjectStore(Protocol):
    url: str
    # Identifies the cache dir that stages uploads through this store object. Leftovers of interrupted
    # uploads carry it, so that the next daemon on the same cache dir removes its own (and only its own).
    owner: str
    # True if list() reports each object's own mtime and mode (file://); False where a listing carries no
    # metadata (object stores report the upload time and a default mode; head() has the real values).
    listing_has_metadata: bool
    limits: PartLimits
    # Set (from any thread) when a best-effort cleanup failed and left something of `owner` behind (an upload
    # marker, parts of a completed upload): the engine's next sweep of leftovers removes it.
    left_behind: bool

    def check(self) -> None:
        """Verify the store exists and is usable, one attempt; raise StoreCheckError naming the problem and
        the fix (backends.check_store tries again while that may help)."""

    # -- uploads ----------------------------------------------------------------------------------------

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        """Write a whole (small) object in one request; it appears at `key` atomically."""
        ...

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        """Start a staged upload that will appear at `key` on complete_upload. `meta` and `checksum` go into
        the object's metadata (None: a hidden staging object that will be copied to its key with them)."""
        ...

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        """Stage part `number` (1-based) holding the object's bytes at `offset`; `crc` is CRC32(data), sent
        for the server to verify where it can. `data` is the engine's buffer, reused for another part once
        this returns: a store must not keep it, or anything that shares its memory. UploadGoneError where
        the store can tell that the upload is gone."""
        ...

    def copy_part(self, upload: UploadRef, number: int, src_key: str, offset: int, length: int,
                  if_match: str | None = None) -> UploadPart:
        """Stage part `number` as a server-side copy of bytes [offset, offset + length) of the object at
        src_key (pinned to version `if_match`: ObjectChangedError if it was replaced). Only stores with a
        limits.max_copy_size have it. The part's checksum is the server's CRC32 of it, '' if it gave none."""
        ...

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        """{part number: (etag, size)} the server holds for an interrupted upload; None if the upload is
        gone or the store cannot tell (the caller then starts afresh)."""
        ...

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        """Make the staged parts (in order, all of them) the object at upload.key, atomically. UploadGoneError
        if the store no longer has the upload: aborted, or completed by a try whose answer was lost (the
        engine then checks the object at the key: `size`, `checksum`). With `key` and `meta` (only where
        limits.completes_anywhere), the object appears at `key` instead, with `meta` and `checksum` as its
        metadata, as if the upload had been opened with them."""
        ...

    def abort_upload(self, upload: UploadRef) -> None:
        """Throw a staged upload away; a missing one is not an error."""
        ...

    def list_leftovers(self) -> list[UploadRef]:
        """Staged uploads of `owner` that are still in the store (interrupted by a crash or failed aborts).
        Never another owner's."""
        ...

    # -- reads ------------------------------------------------------------------------------------------

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        """Bytes [offset, offset + length) of the object (fewer at its end). NotFoundBackendError if it is
        missing; ObjectChangedError if `if_match` is given and the object is no longer that version.
        With `sink`, the bytes are passed to it as they arrive, in order, in pieces of about `piece_size`
        (where the SDK lets the store choose), and `data` is empty: a range is never held in memory
        whole. An exception raised by the sink ends the read and propagates as it is, never mapped to a
        BackendError. A read that fails may have passed some pieces already: a retry starts over."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list_dir(self, prefix: str = "") -> DirListing:
        """The files, symlinks and subdirectory names directly below the directory `prefix` ('' for the
        root, else ending in '/'), listing metadata as list() does. Missing prefix: an empty listing."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object below the directory `prefix` (recursively), in no particular order. A directory
        with no marker object of its own may be missing (object stores list only `dir/` markers)."""
        ...

    # -- namespace ----------------------------------------------------------------------------------------

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        """Server-side copy; dst appears atomically, with `meta` and `checksum` as its metadata if given (else
        the source's). NotFoundBackendError if src is missing; TooLargeToCopyError above limits.max_copy_size
        (Transfers.copies then copies it part by part)."""
        ...

    def delete(self, key: str) -> None:
        """Delete an object or directory marker; a missing key is not an error."""
        ...

    def put_dir(self, key: str, meta: ObjectMeta) -> None: ...

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None: ...

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        """Rewrite the metadata (mode, mtime) of an existing object without changing its bytes.
        Raises NotFoundBackendError if the key is missing."""
        ...

    # -- notes: small bookkeeping objects shared by the nodes of a job ------------------------------------
    # Each is one attempt (one request on object stores, per listing page for list_notes): the caller
    # (Transfers.call) retries TransientBackendError. A bad name raises PermanentBackendError.
    # `builtins.list`: below the method `list`, a bare `list[str]` would name the method.

    def put_note(self, name: str, data: bytes) -> None:
        """Write or replace note `name` atomically: a reader sees the old bytes or the new, never a mix or a
        part (a single PUT on object stores, a fsynced temp file renamed into place on file://)."""
        ...

    def get_note(self, name: str) -> bytes | None:
        """The bytes of note `name`; None if there is no such note."""
        ...

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """The names of all notes that start with `prefix` (a plain string prefix, not only whole components:
        'pending/' and 'pending/node-a/' both work), at any depth, sorted. Sees every note whose put_note
        returned before it was called. The part of `prefix` up to its last '/' must be a valid name."""
        ...

    def delete_note(self, name: str) -> None:
        """Remove note `name`; a missing note is not an error."""
        ...


T = TypeVar("T")
log = logging.getLogger(__name__)


def check_note_name(name: str) -> str:
    """`name` if it may name a note, else PermanentBackendError: one or more '/'-separated components of
    [A-Za-z0-9._-], none empty, '.' or '..' (file:// maps names to paths, which must not leave the notes
    directory) and none starting with TEMP_PREFIX (the stores' own temp files there)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NOTE_NAME:
        raise PermanentBackendError(f"note name {name!r}: not 1 to {MAX_NOTE_NAME} characters")
    for part in name.split("/"):
        if not NOTE_COMPONENT.fullmatch(part) or part in (".", "..") or part.startswith(TEMP_PREFIX):
            raise PermanentBackendError(
                f"note name {name!r}: each '/'-separated component must be made of A-Z a-z 0-9 . _ -, and be"
                f" neither empty, '.', '..' nor start with {TEMP_PREFIX}"
            )
    return name


def check_note_prefix(prefix: str) -> str:
    """`prefix` if a note's name may start with it: its part up to the last '/' is a valid name (so that on
    file:// it names a directory inside the notes directory); the rest is any start of a component."""
    head, slash, _tail = prefix.rpartition("/")
    if slash:
        check_note_name(head)
    return prefix


def listed_note_names(keys: Iterable[str], base: str) -> list[str]:
    """The note names, sorted, among the store keys of a listing below `base` (the notes directory): only
    what put_note can have written (not a stray `x/` marker of another tool, nor a bookkeeping name)."""
    names = []
    for key in keys:
        name = key[len(base):]
        if name and not name.endswith("/") and not any(p.startswith(TEMP_PREFIX) for p in name.split("/")):
            names.append(name)
    return sorted(names)


def pread_into(fd: int, buffer: bytearray, offset: int) -> int:
    """Fill `buffer` from fd at `offset`; the bytes read, fewer than len(buffer) only at the end of the file."""
    view = memoryview(buffer)
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """`length` bytes of fd from `offset`, fewer only at the end of the file (pread may return less)."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    chunks = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


def backoff_delays(base: float = 0.2, cap: float = 30.0) -> Iterator[float]:
    """Exponential backoff with full jitter, forever."""
    attempt = 0
    while True:
        yield random.uniform(0, min(cap, base * 2**attempt))
        attempt += 1


# The HTTP statuses of a store that is busy (throttling, a passing server error): at mount it is waited for.
BUSY_STATUSES = frozenset({429, 500, 502, 503, 504})
