"""The commands on a mount itself rather than on its files: umount (drain, then unmount), restart (a new
daemon, nothing unmounted), guard and unguard of a bare mountpoint, and the node's holder service.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from ckptfs.cli.arguments import configured_settings
from ckptfs.control import client
from ckptfs.errors import CkptfsError
from ckptfs.mount import guard

log = logging.getLogger("ckptfs")


def cmd_restart(args: argparse.Namespace) -> int:
    configured_settings(args)
    mountpoint = client.canonical_mountpoint(args.mountpoint)
    pid = client.restart(mountpoint)
    print(f"ckptfs: {mountpoint} is served by a new daemon (pid {pid}); nothing was unmounted")
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    timeout = args.timeout
    if timeout is None:
        timeout = configured_settings(args).get("drain_timeout")
    else:
        configured_settings(args)
    mountpoint = client.canonical_mountpoint(args.mountpoint)
    client.unmount(mountpoint, timeout=timeout)  # NotDrainedError: exit 3 with the daemon's count
    print(f"ckptfs: {mountpoint} drained and unmounted")
    if guard.is_guarded(mountpoint):
        print(f"ckptfs: a read-only guard now covers {mountpoint}, so that a job still saving there gets EROFS"
              f" instead of writing onto the disk below; while it is there, removing {mountpoint} (rm -rf of a"
              f" directory above it) fails with EBUSY. `ckptfs unguard {mountpoint}` lifts it")
    return 0


def _guard_target(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The mountpoint a guard/unguard command names, directly or through the configuration."""
    settings = configured_settings(args)
    return client.canonical_mountpoint(args.mountpoint), settings


def cmd_guard(args: argparse.Namespace) -> int:
    mountpoint, settings = _guard_target(args)
    if not settings.get("guard_mountpoint", True):
        print(f"ckptfs: guard_mountpoint is false in the configuration: {mountpoint} is left unguarded")
        return 0
    top = guard.mounted_at(mountpoint)
    if top is not None and top.is_guard:
        print(f"ckptfs: {mountpoint} is guarded already")
        return 0
    if top is not None and top.fstype == "fuse.ckptfs":
        raise CkptfsError(f"{mountpoint} is a ckptfs mount (served, or left by a daemon that died): not guarding"
                          f" over it; `ckptfs umount {mountpoint}` unmounts it and leaves a guard")
    if top is not None:
        raise CkptfsError(f"{mountpoint} is a mount point ({top.describe()}): not guarding over another mount")
    guard.place(mountpoint, strict=True)
    print(f"ckptfs: guarded {mountpoint}: writes into it fail with EROFS until ckptfs mounts it"
          f" (`ckptfs unguard {mountpoint}` removes the guard)")
    return 0


def cmd_unguard(args: argparse.Namespace) -> int:
    mountpoint, _ = _guard_target(args)
    top = guard.mounted_at(mountpoint)
    if top is None:
        print(f"ckptfs: {mountpoint} is not guarded")
        return 0
    if not top.is_guard:
        raise CkptfsError(f"{mountpoint} is not guarded: what is mounted there is {top.describe()}, not a ckptfs"
                          " guard; left alone")
    guard.remove(mountpoint, strict=True)
    print(f"ckptfs: removed the guard on {mountpoint}: writes into it land on the disk below until ckptfs"
          " mounts it")
    return 0


def cmd_holder(args: argparse.Namespace) -> int:
    from ckptfs.keepmount import holder

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    client.ensure_runtime_dir(client.runtime_dir())
    for mountpoint in args.guard:
        _guard_before_the_first_mount(client.canonical_mountpoint(mountpoint))
    return holder.serve_node()


def _guard_before_the_first_mount(mountpoint: Path) -> None:
    """A mountpoint with nothing mounted on it is made if missing and guarded (a new node's hostPath starts
    empty); one with a mount (a daemon's, or a guard already) is left as it is, unlooked-into: a FUSE mount
    no daemon serves yet would hang a stat."""
    top = guard.mounted_at(mountpoint)
    if top is not None:
        log.info("holder service: %s is mounted already (%s): no guard needed", mountpoint, top.describe())
        return
    try:
        mountpoint.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptfsError(f"cannot make the mountpoint {mountpoint} to guard: {exc.strerror}") from None
    guard.place(mountpoint, strict=True)
    log.info("holder service: guarded %s until a daemon mounts it", mountpoint)
