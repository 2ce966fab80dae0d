"""POSIX semantics of the mount, testable without a kernel; one module per concern, wired by Filesystem
(filesystem.py), the object mount/adapter.py translates kernel requests into calls of:

  interface.py     the values requests take and return (Attr, SetAttrs, ...), the protocols of collaborators
  inodes.py        an inode by id, as a directory, and its attributes (journal row + cache file)
  namespace.py     names and their limits; lookup, mkdir, symlink, unlink, rmdir, rename, vanished entries
  listing.py       the store's entries in the journal before a lookup, readdir, rename or rmdir needs them
  attributes.py    getattr, setattr (truncate included), the ckptfs xattrs, statfs
  open_files.py    the handle table: handle numbers (lowest free first), open and writer counts per inode
  data_path.py     open, create, read, write (the hot path), fallocate, fsync, release; back-pressure of a
                   full cache
  kernel_cache.py  passthrough backing files (and the probe whether passthrough works), direct I/O, when the
                   kernel's cached pages are stale
  changes.py       when content changes as the journal learns it: dirty before the first byte, the close
  references.py    the kernel's lookup counts, and the purge of an unlinked inode nothing refers to any more
  takeover.py      open handles recorded for, and restored by, a daemon that takes the mount over
  announce.py      cross-node ordering: opens for writing, new entries and renames announced to other nodes
  requests.py      the requests that change names or open files as the kernel sends them: announced, and
                   answered when the kernel sent them again after a takeover

The layer changes persistent state only through the journal and reads/writes file data only through
cache files (a read-only open of a remote file reads its partial file, whose chunks the fetcher brings in
as reads need them). It never talks to an object store (the fetcher does that for it) and never imports
pyfuse3: mount/adapter.py translates its results and FsError into FUSE replies.
"""

from ckptfs.fs.attributes import ERROR_XATTR, STATE_XATTR
from ckptfs.fs.filesystem import Filesystem
from ckptfs.fs.interface import Attr, DirEntry, Moved, RoomNeeded, SetAttrs, StatFs
from ckptfs.fs.kernel_cache import PASSTHROUGH_ROOM, probe_passthrough
from ckptfs.fs.namespace import RENAME_EXCHANGE, RENAME_NOREPLACE
from ckptfs.fs.takeover import RESENT

__all__ = [
    "ERROR_XATTR", "PASSTHROUGH_ROOM", "RENAME_EXCHANGE", "RENAME_NOREPLACE", "RESENT", "STATE_XATTR", "Attr",
    "DirEntry", "Filesystem", "Moved", "RoomNeeded", "SetAttrs", "StatFs", "probe_passthrough",
]
