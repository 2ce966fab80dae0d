"""The daemon process's own resources, set once at start: the open file limit, and how freed part
buffers go back to the system. Nothing here knows of the mount.
"""

from __future__ import annotations

import ctypes
import logging
import resource

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt(3)


def return_freed_part_buffers() -> None:
    """Part buffers (MiBs each) come and go on many threads. glibc raises its mmap threshold after the
    first large free and then serves such buffers from per-thread arenas it rarely gives back, so the
    daemon's RSS would settle far above what the transfer engine holds. A fixed threshold keeps every
    buffer of 256 KiB or more mmapped, and returned to the system when it is freed."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 256 << 10)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def raise_open_file_limit() -> None:
    """Every open file in the mount holds a descriptor on its cache file, and the drain and the store
    clients hold more: the usual soft limit of 1024 is reached by one big checkpoint save. Raise it to
    the hard limit (systemd's LimitNOFILE=, or the shell's ulimit -Hn), which needs no privilege."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft >= hard:
        log.info("open file limit %d (the hard limit)", soft)
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open file limit from %d to %s: %s", soft, hard, exc)
        return
    log.info("open file limit raised from %d to %s (the hard limit)", soft, hard)
