"""LocalStore: the `file:///DIR` backend, a local or shared (NFS, Lustre) directory as the object store.

Objects are plain files at DIR/<key>; directory markers are directories; symlinks are symlinks (never
followed). An upload is written to a hidden temp file in the target directory, fsynced, then renamed over
the final name, so a reader of DIR never sees a partial file. It knows nothing of inodes or the journal.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time
import zlib
from collections.abc import Collection, Iterator
from dataclasses import replace
from pathlib import Path

from ckptfs.backends.base import (
    DIR,
    FILE,
    SYMLINK,
    TEMP_PREFIX,
    DirListing,
    ObjectInfo,
    ObjectMeta,
    ProgressCallback,
    StagedUpload,
    UploadState,
    crc_of,
    crc_text,
    read_range,
)
from ckptfs.errors import CkptfsError, NotFoundBackendError, PermanentBackendError, TransientBackendError

COPY_CHUNK = 8 << 20
STALE_TEMP_SECONDS = 24 * 3600


def _translate(exc: OSError, key: str) -> Exception:
    if exc.errno == errno.ENOENT:
        return NotFoundBackendError(f"{key}: no such object")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermanentBackendError(f"{key}: {exc.strerror}")
    return TransientBackendError(f"{key}: {exc.strerror}")


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
        crc = zlib.crc32(chunk, crc)
        written = 0
        while written < n:
            written += os.write(dst_fd, chunk[written:])
        total += n
    return total, f"crc32:{crc:08x}"


class LocalStore:
    listing_has_metadata = True  # a listing is lstat(): exact mtime and mode

    def __init__(self, root: Path, owner: str = "anon") -> None:
        self.root = root
        self.url = f"file://{root}"
        self.owner = owner

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.rstrip("/"))

    def check(self) -> None:
        if not self.root.exists():
            raise CkptfsError(f"store directory {self.root} does not exist; create it (mkdir -p {self.root})")
        if not self.root.is_dir():
            raise CkptfsError(f"store path {self.root} is not a directory")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CkptfsError(f"store directory {self.root} is not writable by this user")

    def _temp_name(self, final: str) -> str:
        directory, base = os.path.split(final)
        return os.path.join(directory, f"{TEMP_PREFIX}{self.owner}.{secrets.token_hex(4)}.{base[:100]}")

    def abort_stale_uploads(self, keep: Collection[str] = ()) -> int:
        # Staged uploads are rewritten whole, so `keep` spares only spills (named by their upload id).
        mine = f"{TEMP_PREFIX}{self.owner}."
        removed = 0
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(mine) and name not in keep:
                    try:
                        os.unlink(os.path.join(directory, name))
                        removed += 1
                    except FileNotFoundError:
                        pass
        return removed

    def stage_upload(
        self, key: str, src_path: str, meta: ObjectMeta, *,
        resume: UploadState | None = None, progress: ProgressCallback | None = None,
    ) -> StagedUpload:
        """A fresh temp copy every time: `resume` and `progress` do not apply to file://."""
        final = self._path(key)
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            temp = self._temp_name(final)
            src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                dst = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    size, checksum = copy_with_checksum(src, dst)
                    os.fchmod(dst, meta.mode & 0o7777)
                    os.utime(dst, ns=(meta.mtime_ns, meta.mtime_ns))
                    os.fsync(dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        except OSError as exc:
            raise _translate(exc, key) from exc
        return StagedUpload(key=key, size=size, checksum=checksum, handle=temp)

    def commit_upload(self, staged: StagedUpload) -> None:
        final = self._path(staged.key)
        try:
            os.replace(staged.handle, final)
            _fsync_dir(os.path.dirname(final))
        except OSError as exc:
            raise _translate(exc, staged.key) from exc

    def abort_upload(self, staged: StagedUpload) -> None:
        try:
            os.unlink(staged.handle)
        except FileNotFoundError:
            pass

    # -- spills: a hidden file in the store's root, appended to part by part, renamed into place -------

    def spill_begin(self, part_size: int) -> UploadState:
        name = f"{TEMP_PREFIX}{self.owner}.{secrets.token_hex(6)}.spill"
        try:
            os.close(os.open(self.root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            raise _translate(exc, name) from exc
        return UploadState(key=name, upload_id=name, marker="", size=0, checksum="", mtime_ns=0, mode=0,
                           part_size=part_size, spilled=True)

    def spill_part(self, state: UploadState, src_path: str, length: int) -> UploadState:
        data = read_range(src_path, state.size, length)
        try:
            fd = os.open(self.root / state.upload_id, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc, state.key) from exc
        try:
            view = memoryview(data)
            written = 0
            while written < length:
                written += os.pwrite(fd, view[written:], state.size + written)
            os.fsync(fd)
        finally:
            os.close(fd)
        return replace(state, size=state.size + length, checksum=crc_text(zlib.crc32(data, crc_of(state.checksum))))

    def spill_commit(self, state: UploadState, key: str, meta: ObjectMeta) -> None:
        staged = str(self.root / state.upload_id)
        final = self._path(key)
        try:
            if os.stat(staged).st_size != state.size:
                raise TransientBackendError(f"{key}: the spilled parts are incomplete")
            os.chmod(staged, meta.mode & 0o7777)
            os.utime(staged, ns=(meta.mtime_ns, meta.mtime_ns))
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(staged, final)
            _fsync_dir(os.path.dirname(final))
        except FileNotFoundError:
            if not (os.path.exists(final) and os.stat(final).st_size == state.size):  # a retried commit
                raise NotFoundBackendError(f"{key}: the spilled parts are gone") from None
        except OSError as exc:
            raise _translate(exc, key) from exc

    def spill_abort(self, state: UploadState) -> None:
        try:
            os.unlink(self.root / state.upload_id)
        except FileNotFoundError:
            pass

    def download(self, key: str, dst_path: str) -> str:
        try:
            src = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _, checksum = copy_with_checksum(src, dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        except OSError as exc:
            raise _translate(exc, key) from exc
        return checksum

    def copy(self, src_key: str, dst_key: str) -> None:
        src, dst = self._path(src_key), self._path(dst_key)
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            temp = self._temp_name(dst)
            if os.path.islink(src):
                os.symlink(os.readlink(src), temp)
            else:
                try:
                    os.link(src, temp)  # same bytes, no copy; both names are independent from here on
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):
                        raise
                    self._copy_file(src, temp)
            os.replace(temp, dst)
            _fsync_dir(os.path.dirname(dst))
        except OSError as exc:
            raise _translate(exc, src_key) from exc

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
            raise _translate(exc, key) from exc

    def put_dir(self, key: str, meta: ObjectMeta) -> None:
        try:
            os.makedirs(self._path(key), exist_ok=True)
        except OSError as exc:
            raise _translate(exc, key) from exc
        self.set_meta(key, meta)

    def set_meta(self, key: str, meta: ObjectMeta) -> None:
        path = self._path(key)
        try:
            if not os.path.islink(path):  # a symlink's own mode cannot be set on Linux
                os.chmod(path, meta.mode & 0o7777)
            os.utime(path, ns=(meta.mtime_ns, meta.mtime_ns), follow_symlinks=False)
        except OSError as exc:
            raise _translate(exc, key) from exc

    def put_symlink(self, key: str, target: str, meta: ObjectMeta) -> None:
        final = self._path(key)
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            temp = self._temp_name(final)
            os.symlink(target, temp)
            os.replace(temp, final)
        except OSError as exc:
            raise _translate(exc, key) from exc

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
            raise _translate(exc, key) from exc
        return self._info(key.rstrip("/"), path, st)

    def list_dir(self, prefix: str = "") -> DirListing:
        directory = self._path(prefix) if prefix else str(self.root)
        try:
            scanned = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return DirListing([], [], marker=False)
        except OSError as exc:
            raise _translate(exc, prefix) from exc
        entries, subdirs = [], []
        for entry in scanned:
            if entry.name.startswith(TEMP_PREFIX):
                continue
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(entry.name)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                entries.append(self._info(prefix + entry.name, entry.path, st))
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
                raise _translate(exc, directory) from exc
            for entry in entries:
                key = os.path.relpath(entry.path, self.root)
                st = entry.stat(follow_symlinks=False)
                if entry.name.startswith(TEMP_PREFIX):
                    # ctime, not mtime: a staged temp file carries its source's (possibly old) mtime
                    if now - st.st_ctime > STALE_TEMP_SECONDS:
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


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["FILE", "TEMP_PREFIX", "LocalStore"]
