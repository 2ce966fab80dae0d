"""LocalStore: the `file:///DIR` backend, a local or shared (NFS, Lustre) directory as the object store.

Objects are plain files at DIR/<key>; directory markers are directories; symlinks are symlinks (never
followed). An upload is written to a temp file in DIR/.ckptfs-tmp.staging/, fsynced, then renamed over the
final name, so a reader of DIR never sees a partial file. Staging outside the key's directory matters: a
temp file there would create that directory before the object exists and keep it alive after the drain
deleted it (a directory renamed away while one of its files was uploading came back, empty, after a crash).
The staging directory is removed whenever it is left empty, so a drained store holds only its objects;
whoever creates a temp file recreates it, and tries again if another upload removed it meanwhile.
It knows nothing of inodes or the journal.
Notes (base.py) are files below DIR/.ckptfs-tmp.notes/ (localnotes.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from ckptfs.backends.base import (
    DIR,
    FILE,
    RANGE_PIECE,
    SYMLINK,
    TEMP_PREFIX,
    DirListing,
    ObjectInfo,
    ObjectMeta,
    PartLimits,
    RangeRead,
    RangeSink,
    UploadPart,
    UploadRef,
    piece_buffer,
    pread_exact,
)
from ckptfs.backends.common import WholeCopies
from ckptfs.backends.localnotes import STALE_TEMP_SECONDS, LocalNotes, create_file, fsync_dir, translate_os_error
from ckptfs.checksums import crc32, crc_text
from ckptfs.errors import CkptfsError, NotFoundBackendError, ObjectChangedError, TransientBackendError, UploadGoneError

COPY_CHUNK = 8 << 20
STAGING_DIR = f"{TEMP_PREFIX}staging"
MAX_NAME = 255
STAGING_ATTEMPTS = 8

T = TypeVar("T")


def copy_with_checksum(src_fd: int, dst_fd: int) -> tuple[int, str]:
    """Copy src to dst from offset 0; return (bytes, 'crc32:<hex>') of what was written."""
    crc = 0
    total = 0
    buf = bytearray(COPY_CHUNK)
    view = memoryview(buf)
    while True:
        n = os.readv(src_fd, [buf])
        if n == 0:
            break
        chunk = view[:n]
        crc = crc32(chunk, crc)
        written = 0
        while written < n:
            written += os.write(dst_fd, chunk[written:])
        total += n
    return total, f"crc32:{crc:08x}"


class LocalStore(WholeCopies, LocalNotes):
    listing_has_metadata = True  # a listing is lstat(): exact mtime and mode
    left_behind = False
    # Parts are pwrite()s into one temp file: any size works; parallel parts still overlap reads and writes.
    limits = PartLimits(min_part_size=1, max_part_size=1 << 40, max_parts=1_000_000, completes_anywhere=True)

    def __init__(self, root: Path, owner: str = "anon") -> None:
        self.root = root
        self.url = f"file://{root}"
        self.owner = owner
        # Temp files being created right now; while there are any, this process does not remove the
        # staging directory (it would pull it from under a create between its mkdir and its open).
        self._creating = 0
        self._staging_lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.rstrip("/"))

    def check(self) -> None:
        if not self.root.exists():
            raise CkptfsError(f"store directory {self.root} does not exist; create it (mkdir -p {self.root})")
        if not self.root.is_dir():
            raise CkptfsError(f"store path {self.root} is not a directory")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CkptfsError(f"store directory {self.root} is not writable by this user")

    def _staged(self, key: str, create: Callable[[str], T]) -> tuple[str, T]:
        """Run create(temp) on a fresh path in the staging directory; the name carries the owner and (if it
        fits) the key. The directory is (re)made first; if another process removed it before create ran,
        try again rather than fail."""
        staging = os.path.join(self.root, STAGING_DIR)
        head = f"{self.owner}."
        quoted = urllib.parse.quote(key.rstrip("/"), safe="")
        with self._staging_lock:
            self._creating += 1
        try:
            for _ in range(STAGING_ATTEMPTS):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(staging, 0o700)
                name = f"{head}{secrets.token_hex(4)}."
                temp = os.path.join(staging, name + quoted[:MAX_NAME - len(name)])
                try:
                    return temp, create(temp)
                except FileNotFoundError:
                    if os.path.isdir(staging):
                        raise  # something else is missing (a copy's source)
        finally:
            with self._staging_lock:
                self._creating -= 1
        raise TransientBackendError(f"{key}: the staging directory {staging} keeps disappearing")

    def _tidy_staging(self) -> None:
        """Remove the staging directory if no upload is using it: rmdir fails if a temp file is in it, and
        a create of this process about to put one there makes the next tidy do it instead."""
        with self._staging_lock:
            if self._creating:
                return
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.root, STAGING_DIR))

    # -- staged uploads: a temp file in the staging directory, renamed over the key -------------------

    def list_leftovers(self) -> list[UploadRef]:
        """This owner's temp files. Other owners' are removed here once a day old: a node that died for
        good never comes back for them. The temp files of notes a killed process of this owner was writing
        are removed here too (a note's temp file is nobody's upload: no abort of the caller's needed)."""
        self.remove_crashed_note_temps()
        mine = f"{self.owner}."
        found = []
        now = time.time()
        try:
            entries = list(os.scandir(os.path.join(self.root, STAGING_DIR)))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise translate_os_error(exc, STAGING_DIR) from exc
        for entry in entries:
            temp = f"{STAGING_DIR}/{entry.name}"
            if entry.name.startswith(mine):
                found.append(UploadRef(key=_key_of(entry.name), upload_id=temp))
            else:
                # ctime, not mtime: a staged temp file carries its source's (possibly old) mtime
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_ctime > STALE_TEMP_SECONDS:
                        os.unlink(entry.path)
        if not found:
            self._tidy_staging()
        return found

    def put_object(self, key: str, data: bytes, meta: ObjectMeta, checksum: str) -> None:
        final = self._path(key)
        try:
            temp, fd = self._staged(key, create_file)
            try:
                view = memoryview(data)
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fchmod(fd, meta.mode & 0o7777)
                os.utime(fd, ns=(meta.mtime_ns, meta.mtime_ns))
                os.fsync(fd)  # one sync per small object: the small-file path pays for each
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(temp, final)
            fsync_dir(os.path.dirname(final))
        except OSError as exc:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(temp)
            raise translate_os_error(exc, key) from exc
        finally:
            self._tidy_staging()

    def open_upload(self, key: str, meta: ObjectMeta | None, checksum: str | None) -> UploadRef:
        try:
            temp, fd = self._staged(key, create_file)
            try:
                if meta is not None:
                    os.fchmod(fd, meta.mode & 0o7777)
            finally:
                os.close(fd)
        except OSError as exc:
            self._tidy_staging()
            raise translate_os_error(exc, key) from exc
        # The mtime is set at complete (writing the parts changes it); the marker carries it until then.
        return UploadRef(key=key, upload_id=os.path.relpath(temp, self.root),
                         marker="" if meta is None else str(meta.mtime_ns))

    def put_part(self, upload: UploadRef, number: int, offset: int, data: bytes | bytearray, crc: int) -> UploadPart:
        try:
            fd = os.open(os.path.join(self.root, upload.upload_id), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UploadGoneError(f"{upload.key}: the staged upload is gone") from None
        except OSError as exc:
            raise translate_os_error(exc, upload.key) from exc
        try:
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], offset + written)
            # A spill frees its parts from the cache once they are staged: they must survive power loss.
            os.fdatasync(fd)
        except OSError as exc:
            raise translate_os_error(exc, upload.key) from exc
        finally:
            os.close(fd)
        return UploadPart(number, crc_text(crc), crc_text(crc))

    def list_parts(self, upload: UploadRef) -> dict[int, tuple[str, int]] | None:
        return None  # a temp file does not record which parts arrived: an interrupted upload starts afresh

    def complete_upload(
        self, upload: UploadRef, parts: Sequence[UploadPart], size: int, checksum: str | None, *,
        key: str | None = None, meta: ObjectMeta | None = None,
    ) -> None:
        key = upload.key if key is None else key
        temp = os.path.join(self.root, upload.upload_id)
        final = self._path(key)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # aborted, or a complete retried after it renamed it (the engine checks)
            raise UploadGoneError(f"{key}: the staged upload is gone") from None
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        try:
            if os.fstat(fd).st_size != size:
                raise TransientBackendError(f"{key}: the staged upload is incomplete")
            if meta is not None:
                os.fchmod(fd, meta.mode & 0o7777)
            mtime = meta.mtime_ns if meta is not None else int(upload.marker) if upload.marker else None
            if mtime is not None:
                os.utime(fd, ns=(mtime, mtime))
            os.fsync(fd)
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        finally:
            os.close(fd)
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(temp, final)
            fsync_dir(os.path.dirname(final))
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        self._tidy_staging()

    def abort_upload(self, upload: UploadRef) -> None:
        try:
            os.unlink(os.path.join(self.root, upload.upload_id))
        except (FileNotFoundError, IsADirectoryError):
            pass
        except OSError as exc:
            raise translate_os_error(exc, upload.key) from exc
        self._tidy_staging()

    def get_range(
        self, key: str, offset: int, length: int, *, if_match: str | None = None, sink: RangeSink | None = None,
        piece_size: int = RANGE_PIECE,
    ) -> RangeRead:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        try:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise NotFoundBackendError(f"{key}: not a file")
                etag = _etag(st)
                if if_match is not None and if_match != etag:
                    raise ObjectChangedError(f"{key}: the object was replaced during the download")
                data = pread_exact(fd, length, offset) if sink is None else b""
            except OSError as exc:
                raise translate_os_error(exc, key) from exc
            if sink is not None:
                _stream(fd, offset, min(length, max(0, st.st_size - offset)), sink, key, piece_size)
        finally:
            os.close(fd)
        return RangeRead(data, st.st_size, etag, None)

    def copy(self, src_key: str, dst_key: str, meta: ObjectMeta | None = None, checksum: str | None = None) -> None:
        src, dst = self._path(src_key), self._path(dst_key)

        def stage_copy(temp: str) -> None:
            if os.path.islink(src):
                os.symlink(os.readlink(src), temp)
            else:
                try:
                    os.link(src, temp)  # same bytes, no copy; both names are independent from here on
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
                        raise
                    self._copy_file(src, temp)
            if meta is not None:
                if not os.path.islink(temp):
                    # A hard link shares the source's inode: give the copy its own before changing it.
                    if os.stat(temp).st_nlink > 1:
                        os.unlink(temp)
                        self._copy_file(src, temp)
                    os.chmod(temp, meta.mode & 0o7777)
                os.utime(temp, ns=(meta.mtime_ns, meta.mtime_ns), follow_symlinks=False)

        try:
            temp, _ = self._staged(dst_key, stage_copy)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(temp, dst)
            # rename(2) of a hard link over another link of the same file does nothing and succeeds: a copy
            # redone after a crash (dst already links the source) would leave the temp name in the store.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            fsync_dir(os.path.dirname(dst))
        except OSError as exc:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(temp)
            if exc.errno == errno.ENOENT and os.path.lexists(src):
                # Only a missing source may read as NotFound: the caller drops a file whose object vanished.
                raise TransientBackendError(f"{src_key} -> {dst_key}: {exc}") from exc
            raise translate_os_error(exc, src_key) from exc
        finally:
            self._tidy_staging()

    def _copy_file(self, src: str, temp: str) -> None:
        sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(sfd)
            dfd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                copy_with_checksum(sfd, dfd)
                os.fchmod(dfd, stat.S_IMODE(st.st_mode))
                os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.fsync(dfd)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            if key.endswith("/"):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return  # foreign files keep the directory alive, as they would keep an S3 prefix alive
            raise translate_os_error(exc, key) from exc

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        try:
            os.makedirs(self._path(key), exist_ok=True)
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        self.set_meta(key, meta)

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        path = self._path(key)
        try:
            if not os.path.islink(path):  # a symlink's own mode cannot be set on Linux
                os.chmod(path, meta.mode & 0o7777)
            os.utime(path, ns=(meta.mtime_ns, meta.mtime_ns), follow_symlinks=False)
        except OSError as exc:
            raise translate_os_error(exc, key) from exc

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        final = self._path(key)
        try:
            temp, _ = self._staged(key, lambda temp: os.symlink(target, temp))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(temp, final)
        except OSError as exc:
            with contextlib.suppress(OSError, UnboundLocalError):
                os.unlink(temp)
            raise translate_os_error(exc, key) from exc
        finally:
            self._tidy_staging()

    def _info(self, key: str, path: str, st: os.stat_result) -> ObjectInfo:
        if stat.S_ISLNK(st.st_mode):
            return ObjectInfo(key, SYMLINK, 0, st.st_mtime_ns, 0o777, target=os.readlink(path))
        if stat.S_ISDIR(st.st_mode):
            return ObjectInfo(key + "/", DIR, 0, st.st_mtime_ns, stat.S_IMODE(st.st_mode))
        return ObjectInfo(key, FILE, st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode))

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        return self._info(key.rstrip("/"), path, st)

    def list_dir(self, prefix: str = "") -> DirListing:
        directory = self._path(prefix) if prefix else str(self.root)
        try:
            scanned = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return DirListing([], [], marker=False)
        except OSError as exc:
            raise translate_os_error(exc, prefix) from exc
        entries, subdirs = [], []
        is_file, is_dir, new_info = stat.S_ISREG, stat.S_ISDIR, tuple.__new__
        # The plain file's ObjectInfo made here, not by _info, and as a plain tuple (ObjectInfo() would fill in
        # its defaults in Python): a big directory is mostly these.
        for entry in scanned:
            name = entry.name
            if name.startswith(TEMP_PREFIX):
                continue
            st = entry.stat(follow_symlinks=False)
            mode = st.st_mode
            if is_file(mode):
                entries.append(new_info(ObjectInfo, (prefix + name, FILE, st.st_size, st.st_mtime_ns, mode & 0o7777,
                                                     None, None, None)))
            elif is_dir(mode):
                subdirs.append(name)
            elif stat.S_ISLNK(mode):
                entries.append(self._info(prefix + name, entry.path, st))
        return DirListing(entries, subdirs, marker=True)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Walk below prefix. Temp files of unfinished uploads are skipped (and removed once stale)."""
        start = self._path(prefix) if prefix else str(self.root)
        stack = [start]
        now = time.time()
        while stack:
            directory = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise translate_os_error(exc, directory) from exc
            for entry in entries:
                key = os.path.relpath(entry.path, self.root)
                st = entry.stat(follow_symlinks=False)
                if entry.name.startswith(TEMP_PREFIX):
                    # ctime, not mtime: a staged temp file carries its source's (possibly old) mtime. Only
                    # files: the staging and notes directories are bookkeeping, never entered here.
                    if not stat.S_ISDIR(st.st_mode) and now - st.st_ctime > STALE_TEMP_SECONDS:
                        try:
                            os.unlink(entry.path)
                        except OSError:
                            pass
                    continue
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    continue
                info = self._info(key, entry.path, st)
                yield info
                if info.kind == DIR:
                    stack.append(entry.path)


def _stream(fd: int, offset: int, length: int, sink: RangeSink, key: str, piece_size: int) -> None:
    """Pass [offset, offset + length) of fd to sink in pieces of `piece_size`. The sink's own OSError (a full
    cache disk) must not look like the store's, so only the reads are translated."""
    view = piece_buffer(piece_size)
    end = offset + length
    while offset < end:
        try:
            got = os.preadv(fd, [view[: min(piece_size, end - offset)]], offset)
        except OSError as exc:
            raise translate_os_error(exc, key) from exc
        if not got:
            break
        sink(view[:got])
        offset += got


def _key_of(name: str) -> str:
    """The key a staged temp file stands for (best effort: a long key is cut to fit a file name)."""
    return urllib.parse.unquote(name.split(".", 2)[2])


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}"


__all__ = ["FILE", "TEMP_PREFIX", "LocalStore"]
