"""The requests that change the namespace or open a file, as a kernel sends them: each one carried out by
its owner, then announced to the other nodes (cross-node ordering) before it is answered, and each one's
answer when the kernel sent it again after a takeover of the mount.

A request sent again (FUSE_NOTIFY_RESEND, the high bit of its id: `RESENT`) is one the daemon before this
one had read and may have carried out before it died, without its answer going out. What it finds then is
its own effect, not a conflict: the mkdir or symlink finds its entry made, the unlink, rmdir or rename finds
its source gone, the create finds its file, the open or create its handle already made (Takeover.unanswered).
Each is answered as if it had just succeeded. A request not sent again gets the error as it is. Builds of
pyfuse3 without request ids (the stock one) pass 0: never sent again.

The FUSE adapter (mount/adapter.py) converts types and errors only; everything a kernel's request means beyond
the POSIX call is here, so that another adapter would repeat none of it."""

from __future__ import annotations

import errno
import os
import stat

from ckptfs.errors import FsError
from ckptfs.fs.announce import Announcements
from ckptfs.fs.attributes import Attributes
from ckptfs.fs.data_path import DataPath
from ckptfs.fs.interface import Attr
from ckptfs.fs.listing import Listing
from ckptfs.fs.namespace import Namespace
from ckptfs.fs.open_files import OpenFiles
from ckptfs.fs.references import References
from ckptfs.fs.takeover import RESENT, Takeover


def sent_again(request: int) -> bool:
    """The kernel sent request `request` (its id) again after a takeover."""
    return bool(request & RESENT)


class KernelRequests:
    def __init__(self, namespace: Namespace, listing: Listing, data_path: DataPath, attributes: Attributes,
                 open_files: OpenFiles, takeover: Takeover, references: References,
                 announcements: Announcements) -> None:
        self._namespace = namespace
        self._listing = listing
        self._data_path = data_path
        self._attributes = attributes
        self._open_files = open_files
        self._takeover = takeover
        self._references = references
        self._announcements = announcements

    async def mkdir(self, parent_id: int, raw_name: bytes, mode: int, uid: int, gid: int, request: int = 0) -> Attr:
        try:
            attr = self._namespace.mkdir(parent_id, raw_name, mode, uid, gid)
        except FsError as exc:
            attr = self._made_before(exc, request, parent_id, raw_name, stat.S_IFDIR)
        await self._announcements.announce(attr.ino)
        return attr

    async def symlink(self, parent_id: int, raw_name: bytes, target: bytes, uid: int, gid: int,
                      request: int = 0) -> Attr:
        try:
            attr = self._namespace.symlink(parent_id, raw_name, target, uid, gid)
        except FsError as exc:
            attr = self._made_before(exc, request, parent_id, raw_name, stat.S_IFLNK)
        await self._announcements.announce(attr.ino)
        return attr

    def _made_before(self, exc: FsError, request: int, parent_id: int, raw_name: bytes, kind: int) -> Attr:
        """A mkdir or symlink sent again that finds an entry of its kind at its name: the daemon before made
        it. Anything else re-raises `exc`."""
        if exc.errno != errno.EEXIST or not sent_again(request):
            raise exc
        attr = self._namespace.lookup(parent_id, raw_name)
        if stat.S_IFMT(attr.mode) != kind:
            raise exc
        return attr

    def unlink(self, parent_id: int, raw_name: bytes, request: int = 0) -> None:
        try:
            self._namespace.unlink(parent_id, raw_name)
        except FsError as exc:
            if exc.errno != errno.ENOENT or not sent_again(request):
                raise

    async def rmdir(self, parent_id: int, raw_name: bytes, request: int = 0) -> None:
        try:
            await self._listing.prepare_rmdir(parent_id, raw_name)
            self._namespace.rmdir(parent_id, raw_name)
        except FsError as exc:
            if exc.errno != errno.ENOENT or not sent_again(request):
                raise

    async def rename(self, old_parent_id: int, raw_old: bytes, new_parent_id: int, raw_new: bytes, flags: int,
                     request: int = 0) -> None:
        try:
            entries = await self._listing.prepare_rename(old_parent_id, raw_old, new_parent_id, raw_new)
            # No await in between: what prepare_rename read is still what the journal holds.
            moved = self._namespace.rename(old_parent_id, raw_old, new_parent_id, raw_new, flags, entries)
        except FsError as exc:
            if exc.errno != errno.ENOENT or not sent_again(request):
                raise
            # The source is gone: the daemon before renamed it, if the new name is there (ENOENT if not:
            # then it is the caller's error).
            self._namespace.lookup(new_parent_id, raw_new)
            return
        if moved is not None:
            await self._announcements.announce(*moved)

    async def create(self, parent_id: int, raw_name: bytes, mode: int, flags: int, uid: int, gid: int,
                     request: int = 0) -> tuple[int, Attr]:
        resent = sent_again(request)
        fh = self._takeover.unanswered(request) if resent else None
        if fh is not None:  # made by the daemon before, which died before its answer went out
            inode_id = self._open_files.get(fh).inode_id
            self._references.remember(inode_id)  # the answer gives the kernel a reference, as create's does
            return fh, self._attributes.getattr(inode_id)
        try:
            fh, attr = self._data_path.create(parent_id, raw_name, mode, flags, uid, gid)
        except FsError as exc:
            if exc.errno != errno.EEXIST or (flags & os.O_EXCL and not resent):
                raise
            # The kernel sends CREATE only for a name it saw missing: this is one it sent again (the daemon
            # before created the file and died before answering). open(O_CREAT) of a name that exists opens it.
            attr = self._namespace.lookup(parent_id, raw_name)
            fh = await self._data_path.open(attr.ino, flags)
            attr = self._attributes.getattr(attr.ino)
        await self._announced(fh)
        return fh, attr

    async def open(self, inode_id: int, flags: int, request: int = 0) -> int:
        fh = self._takeover.unanswered(request) if sent_again(request) else None
        if fh is None:
            fh = await self._data_path.open(inode_id, flags)
            await self._announced(fh)
        return fh

    async def _announced(self, fh: int) -> None:
        """Announce a writer (cross-node ordering); a handle whose open then fails is released here: the
        kernel never sends RELEASE for an open it got an error for."""
        try:
            await self._announcements.announce_writer(fh)
        except BaseException:
            self._data_path.release(fh)
            raise
