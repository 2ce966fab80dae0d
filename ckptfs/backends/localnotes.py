"""The notes of LocalStore (local.py), files below DIR/.ckptfs-tmp.notes/, and the file helpers the two share.

Notes (base.py) are files at DIR/.ckptfs-tmp.notes/<name>, a name's '/' making subdirectories. A note is
written the way an object is, but with its temp file in the note's own directory (the rename must stay on
one filesystem, and nodes sharing DIR over NFS or Lustre each see either the old file or the new): written,
fsynced, renamed over the name, the directory fsynced; the temp file a killed process left is removed by
its owner's next process (remove_crashed_note_temps, in list_leftovers), another owner's once a day old.
A directory made for a note is fsynced into its parent, so a note that survived a crash can be found.
delete_note removes the directories it leaves empty (the notes directory too), and put_note makes them again
if a delete removed them under it. As a path cannot be a file and a directory, file:// cannot hold both a
note `x` and a note `x/y` (PermanentBackendError); object stores can.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import secrets
import stat
import time
from pathlib import Path

from ckptfs.backends.base import NOTES_DIR, TEMP_PREFIX, check_note_name, check_note_prefix
from ckptfs.errors import NotFoundBackendError, PermanentBackendError, TransientBackendError

NOTES_ROOT = NOTES_DIR.rstrip("/")
READ_CHUNK = 8 << 20
STALE_TEMP_SECONDS = 24 * 3600  # another owner's temp file of an interrupted put_note is removed once this old
CREATE_ATTEMPTS = 8
# A note's temp file is named <TEMP_PREFIX><owner>.<incarnation>.<random>: the incarnation tells this process's
# temp files (perhaps being written right now) from those a killed process of the same owner left, which
# this owner's next sweep removes (one process per owner at a time: the owner is the journal's tag).
INCARNATION = secrets.token_hex(4)


def translate_os_error(exc: OSError, key: str) -> Exception:
    """The BackendError an OSError of the store's directory stands for."""
    if exc.errno == errno.ENOENT:
        return NotFoundBackendError(f"{key}: no such object")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermanentBackendError(f"{key}: {exc.strerror}")
    return TransientBackendError(f"{key}: {exc.strerror}")


def create_file(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def note_error(exc: OSError, what: str) -> Exception:
    """A put_note's OSError: a path that is a file where a directory must be (or the reverse) means the name
    clashes with another note's, which no retry cures."""
    if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        return PermanentBackendError(f"{what}: a note and a directory of notes cannot share a name on file://")
    return translate_os_error(exc, what)


class LocalNotes:
    """put_note, get_note, list_notes and delete_note of a store rooted at the directory `root`, for the
    node `owner`."""

    root: Path
    owner: str

    def _note_path(self, name: str) -> str:
        return os.path.join(self.root, NOTES_ROOT, check_note_name(name))

    def _note_dirs(self, directory: str) -> None:
        """Make `directory` (the notes directory or one below it) and its missing parents; each one made is
        fsynced into its parent, or a crash could lose the path to a note whose own fsyncs had succeeded."""
        path = str(self.root)
        for part in os.path.relpath(directory, self.root).split(os.sep):
            parent, path = path, os.path.join(path, part)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            fsync_dir(parent)

    def put_note(self, name: str, data: bytes) -> None:
        final = self._note_path(name)
        directory = os.path.dirname(final)
        what = f"note {name}"
        fd = -1
        try:
            for _ in range(CREATE_ATTEMPTS):
                temp = os.path.join(directory, f"{TEMP_PREFIX}{self.owner}.{INCARNATION}.{secrets.token_hex(8)}")
                try:
                    self._note_dirs(directory)
                    fd = create_file(temp)
                    break
                except FileNotFoundError:
                    # A delete_note removed a directory it had left empty, after we made or saw it.
                    if not os.path.isdir(self.root):
                        raise
            else:
                raise TransientBackendError(f"{what}: its directory {directory} keeps disappearing")
            try:
                view = memoryview(data)
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, final)
            fsync_dir(directory)
        except OSError as exc:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            raise note_error(exc, what) from exc

    def remove_crashed_note_temps(self) -> int:
        """Remove the temp files of put_notes that a killed process of this owner left (not this process's:
        one may be being written now). Returns how many went."""
        mine = f"{TEMP_PREFIX}{self.owner}."
        current = f"{mine}{INCARNATION}."
        removed = 0
        for top, _, filenames in os.walk(os.path.join(self.root, NOTES_ROOT)):
            for name in filenames:
                if name.startswith(mine) and not name.startswith(current):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(top, name))
                        removed += 1
        return removed

    def get_note(self, name: str) -> bytes | None:
        what = f"note {name}"
        try:
            fd = os.open(self._note_path(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise translate_os_error(exc, what) from exc
        try:
            # The open file is one version: a put_note renaming a new one over the name does not change it.
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # a directory of notes below `name`, not a note
            chunks = []
            while chunk := os.read(fd, READ_CHUNK):
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise translate_os_error(exc, what) from exc
        finally:
            os.close(fd)

    def list_notes(self, prefix: str = "") -> builtins.list[str]:
        """Walk the notes below the directory part of `prefix`, descending only into directories that can
        hold a match. Temp files of interrupted put_notes are skipped (and removed once a day old)."""
        head = check_note_prefix(prefix).rpartition("/")[0]
        stack = [(os.path.join(self.root, NOTES_ROOT, head), f"{head}/" if head else "")]
        names = []
        now = time.time()
        while stack:
            directory, rel = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue  # no such notes, or removed by a delete_note just now
            except OSError as exc:
                raise translate_os_error(exc, f"notes {prefix!r}") from exc
            for entry in entries:
                name = rel + entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted meanwhile
                except OSError as exc:
                    raise translate_os_error(exc, f"notes {prefix!r}") from exc
                if entry.name.startswith(TEMP_PREFIX):
                    if stat.S_ISREG(st.st_mode) and now - st.st_ctime > STALE_TEMP_SECONDS:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                elif stat.S_ISDIR(st.st_mode):
                    if f"{name}/".startswith(prefix):
                        stack.append((entry.path, f"{name}/"))
                elif stat.S_ISREG(st.st_mode) and name.startswith(prefix):
                    names.append(name)
        return sorted(names)

    def delete_note(self, name: str) -> None:
        path = self._note_path(name)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # no such note (IsADirectory: only notes below `name`)
        except OSError as exc:
            raise translate_os_error(exc, f"note {name}") from exc
        # The removal must last too: a note that came back after a crash would be a record of the past. If
        # another delete_note has removed the directory (left empty) meanwhile, its parent holds the change.
        notes = os.path.join(self.root, NOTES_ROOT)
        directory = os.path.dirname(path)
        while True:
            try:
                fsync_dir(directory)
                break
            except FileNotFoundError as exc:
                if directory == str(self.root):
                    raise translate_os_error(exc, f"note {name}") from exc
                directory = os.path.dirname(directory)
            except OSError as exc:
                raise translate_os_error(exc, f"note {name}") from exc
        # Then the directories left empty, up to the notes directory itself (rmdir fails on one that holds
        # anything, a concurrent put_note's temp file included).
        directory = os.path.dirname(path)
        while True:
            try:
                os.rmdir(directory)
            except OSError:
                break
            if directory == notes:
                break
            directory = os.path.dirname(directory)
