"""The FUSE connection beyond one daemon's life (keep_mount, docs/design/keep-mount.md): handing a
duplicate of it to a holder (keepmount/holder.py) or to systemd's file descriptor store, taking over the one a daemon
before left (its open handles, the requests it had not answered), and letting go of it at the end: unmount
after a clean stop, abort after a journal failure, hand over for `ckptfs restart`, keep for the next
daemon otherwise.

The FUSE session itself stays in the daemon (daemon/running.py and startup.py, with mount/adapter.py the only
modules that import pyfuse3): this module gets the few session calls it needs as a `FuseConnection` (the
pyfuse3 module is one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from pathlib import Path
from typing import Protocol

import trio

from ckptfs.control.client import service_path
from ckptfs.errors import CkptfsError
from ckptfs.fs import Filesystem
from ckptfs.fs.handle_table import HandleTable, OpenHandle
from ckptfs.keepmount import link as holder_link
from ckptfs.keepmount.systemd import Notifier, listen_fds
from ckptfs.mount import guard
from ckptfs.mount.mountpoint import unmount

log = logging.getLogger(__name__)

# FUSE_NOTIFY_RESEND (Linux >= 6.9): the kernel queues again every request its daemon read and did not answer
RESEND_NOTIFICATION = struct.pack("<IiQ", 16, 7, 0)  # struct fuse_out_header: len, notify code, unique 0
_WITHOUT_KEEP_MOUNT = "a daemon that dies leaves the mount at 'Transport endpoint is not connected'"


class Restart(Exception):  # not an error: how daemon.run() hands the connection to its caller
    """The daemon stopped serving to let a new one (the code installed now) take the connection over:
    the caller executes `argv` with `env` in this process (same pid: systemd and the holder see no death)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__("restart")
        self.argv = argv
        self.env = env


class FuseConnection(Protocol):
    """The session calls this module needs (pyfuse3's, with the project's patch)."""

    def fuse_fd(self) -> int: ...

    def init_request(self) -> bytes | None: ...

    def close(self, unmount: bool = ...) -> None: ...


# What a pyfuse3 needs to hand its FUSE connection on and to take one over: the project's additions
# (scripts/pyfuse3-passthrough.patch). The stock pyfuse3 has none of them.
KEEP_MOUNT_CALLS = ("fuse_fd", "init_request", "takeover")
GET_PATCHED_PYFUSE3 = ("scripts/install.sh builds the patched pyfuse3; elsewhere `pip install` the pyfuse3 wheel"
                       " that scripts/build-wheels.sh makes (docs/INSTALL.md)")


def can_keep(connection: object) -> bool:
    """Whether this pyfuse3 (`connection`) can hand its connection to a holder and take one over."""
    return all(callable(getattr(connection, name, None)) for name in KEEP_MOUNT_CALLS)


def find_held_connection(mountpoint: Path, connection: object) -> tuple[holder_link.Held | None, bool]:
    """The connection a daemon before left for this one to take over, if any, and whether it came from
    systemd's store (which then still keeps it). Looked for before anything touches the mountpoint.
    `connection`: the pyfuse3 module, which must be able to take a connection over if one is held."""
    held, from_systemd = _find_held(mountpoint)
    if held is not None and not can_keep(connection):
        os.close(held.fd)
        if held.link is not None:
            held.link.handover()  # the holder waits for a daemon that can take it, instead of starting this one
        raise CkptfsError(
            f"the FUSE connection of {mountpoint} is kept for a daemon to take over, but this pyfuse3 is the stock"
            f" build, which cannot take a connection over: {GET_PATCHED_PYFUSE3}; or run `ckptfs mount` from the"
            " installation that mounted it")
    return held, from_systemd


def _find_held(mountpoint: Path) -> tuple[holder_link.Held | None, bool]:
    held = holder_link.inherited()  # from the daemon before in this process (`ckptfs restart`)
    from_systemd = False
    if held is None:
        held = holder_link.from_systemd(listen_fds())  # from a daemon of this unit that died (Restart=)
        from_systemd = held is not None
    if held is None:
        held = holder_link.attach(mountpoint)
    else:
        held.link = holder_link.attach_link(mountpoint)
    return held, from_systemd


class ConnectionKeeper:
    """Who keeps this mount's connection besides the daemon, and what happens to it when the daemon ends.

    `held`: a connection taken over from the daemon before (with the handles the kernel still holds in
    `restored`); `restart_argv`: what the holder runs to start a daemon again (None: no holder is started).
    """

    def __init__(
        self, connection: FuseConnection, fs: Filesystem, notifier: Notifier, *, mountpoint: Path, cache_root: Path,
        keep_mount: bool, guard_mountpoint: bool, handle_table: HandleTable | None, held: holder_link.Held | None,
        wait_for_service: bool = False,
        restored: list[OpenHandle], restart_argv: list[str] | None,
    ) -> None:
        self.connection = connection
        self.fs = fs
        self.notifier = notifier
        self.mountpoint = mountpoint
        self.cache_root = cache_root
        self.keep_mount = keep_mount
        self.guard_mountpoint = guard_mountpoint
        self.handle_table = handle_table
        self.held = held
        self.restored = restored
        self.restart_argv = restart_argv
        # keep_mount_on_stop: the connection is for the node's holder service only (a holder of this daemon's
        # own would die with its pod); without one yet, wait for it rather than start one
        self.wait_for_service = wait_for_service
        self.link: holder_link.Link | None = held.link if held is not None else None
        self.handles_taken_over = 0
        # keep_mount under systemd: the unit's file descriptor store keeps the connection (no holder there)
        self.systemd_keeps = False
        # Whether the mount outlives this daemon, and why (or why not): `ckptfs status` and the log say it.
        self.why = "off: not started yet"
        if not keep_mount:
            self.why = f"off: keep_mount = false; {_WITHOUT_KEEP_MOUNT}"
        elif not can_keep(connection):
            self.why = (f"off: this pyfuse3 is the stock build, which cannot hand the FUSE connection on;"
                        f" {_WITHOUT_KEEP_MOUNT}. To get it: {GET_PATCHED_PYFUSE3}")
        elif restart_argv is None and held is None:
            self.why = f"off: this daemon was not started by `ckptfs mount`; {_WITHOUT_KEEP_MOUNT}"

    @property
    def keeps(self) -> bool:
        """Something besides this daemon keeps the connection (a holder or systemd's store)."""
        return self.link is not None or self.systemd_keeps

    @property
    def kept_by_service(self) -> bool:
        """The node's holder service keeps the connection (Kubernetes): it waits for the next daemon."""
        return self.link is not None and self.link.service

    def _init_request(self) -> bytes | None:
        """The kernel's INIT request of this connection (replayed by whoever takes it over next)."""
        return self.held.init_request if self.held is not None else self.connection.init_request()

    def kept_by_systemd(self, kept: bool) -> None:
        """The connection this daemon takes over came from systemd's store, which still keeps it."""
        self.systemd_keeps = kept and self.notifier.enabled

    def take_over_handles(self) -> None:
        """After pyfuse3.takeover (and the passthrough probe): the kernel's open handles, and the requests
        the dead daemon had read but not answered, queued again."""
        restored = self.handles_taken_over = self.fs.restore_handles(self.restored)
        writers = sum(1 for record in self.restored if record.writable)
        try:
            os.write(self.connection.fuse_fd(), RESEND_NOTIFICATION)
            resent = "the requests it had not answered are sent again"
        except OSError as exc:
            resent = (f"the kernel cannot send again the requests it had not answered ({exc.strerror}; it needs"
                      " Linux >= 6.9): the processes waiting on them stay blocked")
            log.warning("taking over the mount of %s: %s", self.mountpoint, resent)
        kept_by = (f"holder pid {self.link.holder_pid}" if self.link is not None
                   else "systemd" if self.notifier.enabled else "this process")
        if self.keeps:
            self.why = f"on: took the mount over from the daemon before (kept by {kept_by})"
        elif self.keep_mount:
            self.why = f"off: nothing but this daemon keeps the connection it took over; {_WITHOUT_KEEP_MOUNT}"
        log.info("took over the FUSE connection of %s from the daemon before (kept by %s): %d open files (%d for"
                 " writing), %s", self.mountpoint, kept_by, restored, writers, resent)

    async def start_holder(self) -> None:
        """Hand a duplicate of the connection to a holder process, so that the mount outlives this daemon:
        systemd's store under systemd, else the node's holder service if one listens (Kubernetes), else a
        holder of this daemon's own."""
        if not self.keep_mount or not can_keep(self.connection):
            log.log(logging.WARNING if self.keep_mount else logging.INFO, "keep_mount %s", self.why)
            return
        init_request = self.connection.init_request()
        if init_request is None:
            self.why = f"off: pyfuse3 did not keep the kernel's INIT request; {_WITHOUT_KEEP_MOUNT}"
            log.warning("keep_mount %s", self.why)
            return
        fuse_fd = self.connection.fuse_fd()
        if self.notifier.enabled:
            # Under systemd a holder would be killed with the unit's other processes; its file descriptor
            # store keeps the connection instead, and Restart= starts the daemon that takes it over.
            memfd = holder_link.init_memfd(init_request)
            try:
                self.systemd_keeps = (self.notifier.store_fd(holder_link.SYSTEMD_FUSE_FD, fuse_fd)
                                      and self.notifier.store_fd(holder_link.SYSTEMD_INIT_FD, memfd))
            finally:
                os.close(memfd)
            if self.systemd_keeps:
                self.why = ("on: systemd's file descriptor store keeps the FUSE connection for the daemon Restart="
                            " starts")
                log.info("keep_mount %s (the unit needs FileDescriptorStoreMax=2)", self.why)
            else:
                self.why = ("off: systemd's file descriptor store refused the FUSE connection (the unit needs"
                            f" FileDescriptorStoreMax=2); {_WITHOUT_KEEP_MOUNT}")
                log.warning("keep_mount %s", self.why)
            return
        try:
            if await self._hand_to_service(fuse_fd, init_request):
                return
        except CkptfsError as exc:
            log.warning("the node's holder service did not take the connection (%s)", exc)
        if self.wait_for_service:
            self.why = (f"off: waiting for the node's holder service (`ckptfs holder`, {service_path()}); until"
                        f" it takes the connection, {_WITHOUT_KEEP_MOUNT}")
            log.warning("keep_mount %s", self.why)
            return
        if self.restart_argv is None:
            self.why = f"off: this daemon was not started by `ckptfs mount`; {_WITHOUT_KEEP_MOUNT}"
            log.warning("keep_mount %s", self.why)
            return
        argv = list(self.restart_argv)
        if "--cache-dir" not in argv:
            argv += ["--cache-dir", str(self.cache_root)]
        try:
            self.link = await trio.to_thread.run_sync(
                lambda: holder_link.start(self.mountpoint, fuse_fd, init_request, argv=argv))
        except CkptfsError as exc:
            self.why = f"off: {exc}; {_WITHOUT_KEEP_MOUNT}"
            log.warning("keep_mount %s", self.why)
            return
        self.why = (f"on: holder pid {self.link.holder_pid} keeps the FUSE connection; a daemon that dies is started"
                    " again")
        log.info("keep_mount %s", self.why)

    async def _hand_to_service(self, fuse_fd: int, init_request: bytes) -> bool:
        """Hand the connection to the node's holder service; False if none listens."""
        link = await trio.to_thread.run_sync(
            lambda: holder_link.hand_to_service(self.mountpoint, fuse_fd, init_request))
        if link is None:
            return False
        self.link = link
        self.why = (f"on: the node's holder service keeps the FUSE connection (holder pid {link.holder_pid}); the"
                    " next daemon takes it over")
        log.info("keep_mount %s", self.why)
        return True

    @property
    def wants_service(self) -> bool:
        """The connection is (or is to be) kept by the node's holder service: watch_service looks after it."""
        return self.kept_by_service or (self.wait_for_service and self.link is None and self.keep_mount
                                        and can_keep(self.connection))

    async def watch_service(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """While the node's holder service keeps the connection: when its holder goes (the service's pod
        replaced), hand the connection in again as soon as a service listens, so that the mount outlives
        this daemon again. Also the first hand-in of a daemon that started before the service."""
        task_status.started()
        while True:
            if self.link is None:
                await self._hand_in_when_a_service_listens()
            link = self.link
            if link is None or not link.service:
                return
            await trio.lowlevel.wait_readable(link.fileno())
            if not link.broken():
                await trio.sleep(1)  # the holder said something unexpected: look again later
                continue
            link.close()
            self.link = None
            self.why = ("off: the node's holder service went away; until one listens again a daemon that dies"
                        " leaves the mount at 'Transport endpoint is not connected'")
            log.warning("keep_mount %s", self.why)

    async def _hand_in_when_a_service_listens(self) -> None:
        init_request = self._init_request()
        while self.link is None and init_request is not None:
            await trio.sleep(1)
            with contextlib.suppress(CkptfsError):
                await self._hand_to_service(self.connection.fuse_fd(), init_request)

    def leave_to_holder(self) -> None:
        """Stop serving and leave the connection to the holder service's holder, for the next daemon (a
        Kubernetes rollout): the mount, its open files and the requests not yet answered stay."""
        self.connection.close(unmount=False)
        self.fs.backing = None
        if self.link is not None:
            self.link.handover()
            self.link = None

    def let_go(self, *, unmounted: bool, journal_failed: bool, restarting: bool, exiting_now: bool) -> Restart | None:
        """The end of serving: unmount after a clean stop; leave the connection aborted when the journal
        failed (every access then fails with ENOTCONN, none lands on the disk below the mountpoint); hand
        it to the new daemon of a `ckptfs restart` (returned: the caller raises it once the journal and
        the lock are closed); and when this daemon fails otherwise while a holder keeps the connection,
        leave it to the daemon the holder starts next, handles and all. `exiting_now`: a second signal,
        not a failure to recover from."""
        if restarting and not journal_failed and self.restart_argv is not None:
            fd = os.dup(self.connection.fuse_fd())  # the session's own descriptor goes with close()
            init_request = self.connection.init_request() or b""
            self.connection.close(unmount=False)
            self.fs.backing = None
            if self.link is not None:
                self.link.handover()
                self.link = None
            os.set_inheritable(fd, True)
            return Restart(self.restart_argv, holder_link.handover_env(fd, init_request))
        failed = not unmounted and not journal_failed and not exiting_now
        if (self.link is not None or self.systemd_keeps) and failed:
            self.connection.close(unmount=False)
            self.fs.backing = None
            self.link = None  # its socket closes with the process: the holder starts a new daemon
            log.error("the daemon fails; the mount stays, held for the daemon started next")
            return None
        if self.systemd_keeps:
            self.notifier.remove_fds(holder_link.SYSTEMD_FUSE_FD)
            self.notifier.remove_fds(holder_link.SYSTEMD_INIT_FD)
            self.systemd_keeps = False
        # Closing our /dev/fuse descriptor without unmounting aborts the connection (with no holder left).
        self.connection.close(unmount=not journal_failed)
        self.fs.backing = None  # closed with the connection
        if self.held is not None and not journal_failed:
            unmount(self.mountpoint)  # a connection taken over: libfuse did not mount it, so it does not unmount
        if not journal_failed:
            if self.guard_mountpoint:  # writes into the bare directory fail (EROFS), not land on disk
                guard.place(self.mountpoint)
            self.fs.close_all()
            if self.handle_table is not None:
                self.handle_table.clear()
        if self.link is not None:
            if journal_failed:
                self.link.abort()
            else:
                self.link.release()
            self.link = None
        return None
