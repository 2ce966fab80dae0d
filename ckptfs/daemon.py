"""Process lifecycle of a mount: checks, recovery, wiring, the root nursery, signals, ordered shutdown.

Start-up order: validate the mountpoint and the store, take the cache dir lock, open the journal, recover,
mount, start the drain and the control socket, confirm the mount answers, then report ready.
Shutdown order (SIGTERM/SIGINT, `ckptfs umount`, or an external unmount): stop new opens for writing, drain
with a deadline, unmount, close the journal. A second signal skips the drain; nothing written is lost,
because whatever was not uploaded stays journaled for the next start.

This is the only module besides fuse_ops.py that imports pyfuse3, and the only owner of the root nursery.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import math
import os
import resource
import secrets
import signal
import struct
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from ckptfs import ctl, guard, holder
from ckptfs.backends import check_store, open_store
from ckptfs.backends.base import UploadState
from ckptfs.cache import CacheDir
from ckptfs.config import Config, parse_size
from ckptfs.drain import Drain, FlushResult
from ckptfs.errors import CkptfsError, Faults
from ckptfs.evict import Evictor
from ckptfs.fetch import Fetcher
from ckptfs.fs import Filesystem
from ckptfs.fuse_ops import FuseOperations, KernelBackingFiles, passthrough_build, passthrough_granted
from ckptfs.handles import HandleTable, OpenHandle
from ckptfs.journal import DIR, FILE, ROOT_ID, Inode, Journal, JournalError, journal_unusable
from ckptfs.metrics import InstrumentedStore, MetricsServer, Snapshot, parse_addr
from ckptfs.nodes import TOP_FILES, HeldError, NodeRecords, PeerRecords, node_id_of
from ckptfs.recovery import DirLister, recover
from ckptfs.retention import Checkpoint, Plan, pinned_by_pointers, plan
from ckptfs.systemd import Notifier, listen_fds
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt(3)

EXIT_NOT_DRAINED = 3
# How often systemd hears how things are (STATUS=), and how much more stop time a draining stop asks for
# each time it made progress (EXTEND_TIMEOUT_USEC=).
STATUS_INTERVAL = 5.0
METRICS_INTERVAL = 1.0
EXTEND_SECONDS = 30
# A background service that failed unexpectedly starts again after this long (doubling up to the cap).
RESTART_PAUSE = 1.0
RESTART_PAUSE_CAP = 60.0
STALE_MOUNT_STAT_WAIT = 5.0  # how long the start waits on a stat of a FUSE mount already on the mountpoint
RETIRE_RECORDS_WAIT = 10.0  # after a flush or the unmount's drain: how long deleting this node's records may take
# FUSE_NOTIFY_RESEND (Linux >= 6.9): the kernel queues again every request its daemon read and did not answer
RESEND_NOTIFICATION = struct.pack("<IiQ", 16, 7, 0)  # struct fuse_out_header: len, notify code, unique 0
# `ckptfs restart`: how long the requests being served may take to finish before the connection goes to the
# new daemon anyway (the kernel sends it the unfinished ones again)
RESTART_REQUESTS_WAIT = 10.0


class Restart(Exception):  # not an error: how run() hands the connection to its caller
    """The daemon stopped serving to let a new one (the code installed now) take the connection over:
    the caller executes `argv` with `env` in this process (same pid: systemd and the holder see no death)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__("restart")
        self.argv = argv
        self.env = env


class _StartedOnce:
    """The task status of a service that may be restarted: the nursery hears `started` only once."""

    def __init__(self, inner: trio.TaskStatus[None]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        if not self.done:
            self.done = True
            self.inner.started(value)


def check_mountpoint(mountpoint: Path) -> bool:
    """Whether `mountpoint` can be mounted on (CkptfsError naming why not). Returns whether a guard was
    removed from it: a guard (guard.py) kept writes off the bare directory while nothing served it, and
    mounting replaces it."""
    removed = guard.remove(mountpoint)
    try:
        st = _stat_of_a_mountpoint(mountpoint)
    except FileNotFoundError:
        raise CkptfsError(f"mountpoint {mountpoint} does not exist; create it with: mkdir -p {mountpoint}") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            # A FUSE mount whose daemon died (kill -9, OOM): detach it so this daemon can take over.
            log.warning("mountpoint %s is a stale FUSE mount (its daemon died); detaching it", mountpoint)
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)], check=False)
            return check_mountpoint(mountpoint) or removed
        raise CkptfsError(f"mountpoint {mountpoint} cannot be used: {exc.strerror}") from None
    import stat as stat_module

    if not stat_module.S_ISDIR(st.st_mode):
        raise CkptfsError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise CkptfsError(f"mountpoint {mountpoint} is already a mount point; unmount it first")
    if any(os.scandir(mountpoint)):
        raise CkptfsError(f"mountpoint {mountpoint} is not empty; mount on an empty directory")
    return removed


def _stat_of_a_mountpoint(mountpoint: Path) -> os.stat_result:
    """os.stat, bounded where a FUSE mount is there: one whose connection something keeps while no daemon
    serves it (a holder this daemon does not find, say one of another version) would make the stat wait
    for ever. A dead one answers ENOTCONN at once."""
    top = guard.mounted_at(mountpoint)
    if top is None or not top.fstype.startswith("fuse"):
        return os.stat(mountpoint)
    result: list[os.stat_result | OSError] = []
    probe = threading.Thread(target=lambda: result.append(_stat_or_error(mountpoint)), daemon=True)
    probe.start()
    probe.join(STALE_MOUNT_STAT_WAIT)
    if not result:
        raise CkptfsError(
            f"mountpoint {mountpoint} is a FUSE mount ({top.describe()}) whose connection is kept alive but that no"
            f" daemon serves, and no holder answers at {holder.holder_path(mountpoint)}: the mount was kept by"
            " another ckptfs version's holder, or another process holds its /dev/fuse. Stop that process, or"
            f" detach the mount (umount -l {mountpoint}: the processes using it then get errors), then mount again")
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def _stat_or_error(path: Path) -> os.stat_result | OSError:
    try:
        return os.stat(path)
    except OSError as exc:
        return exc


def read_ahead_path(dev: int) -> str:
    """The sysfs file of the kernel's read-ahead for the filesystem on device `dev` (FUSE mounts have a
    backing device info of their own, named by the anonymous device number)."""
    return f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"


def set_read_ahead(dev: int, nbytes: int) -> None:
    """Make a sequential reader's reads of the mount arrive as few large FUSE requests. The kernel's default
    read-ahead for FUSE is 128 KiB: a 1 GiB read from the cache took 8,000 requests, 1.4-3.1 s and 1.2-4.0 s
    of daemon CPU; with 4 MiB, 1 MiB requests, 0.7 s and 0.55 s. Only root may change it: anyone else
    keeps the default and is told how to change it."""
    path = read_ahead_path(dev)
    kib = max(4, nbytes // 1024)
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.info("cannot set the mount's read-ahead to %d KiB (%s): sequential reads take more requests; as"
                 " root: echo %d > %s", kib, exc.strerror, kib, path)
    else:
        log.debug("read-ahead of the mount: %d KiB", kib)


class Daemon:
    def __init__(
        self, config: Config, engine: Transfers, cache: CacheDir, journal: Journal,
        metrics: MetricsServer | None = None, *, handle_table: HandleTable | None = None,
        held: holder.Held | None = None, restored: list[OpenHandle] | None = None,
        restart_argv: list[str] | None = None,
    ) -> None:
        self.config = config
        # The mount outliving this daemon (holder.py): a connection taken over from the daemon before
        # (`held`, with the handles the kernel still holds), the link to the holder, and what the holder
        # runs to start a daemon again (None: no holder is started).
        self.handle_table = handle_table
        self.held = held
        self.restored = restored or []
        self.restart_argv = restart_argv
        self.link: holder.Link | None = held.link if held is not None else None
        self._handles_taken_over = 0
        # keep_mount under systemd: the unit's file descriptor store keeps the connection (no holder there)
        self._systemd_keeps = False
        self._exiting_now = False  # a second signal: unmount without draining (not a failure to recover from)
        self._restarting = False  # `ckptfs restart`: hand the connection to a new daemon instead of unmounting
        self.restart: Restart | None = None  # set once handed over
        self.metrics = metrics
        self.engine = engine
        self.store = store = engine.store
        self.cache = cache
        self.journal = journal
        self.mountpoint = ctl.canonical_mountpoint(config.mountpoint)
        self.started_at = time.time()
        self.faults = Faults()
        # Set (with the error) when the journal became unusable: the daemon ends, the connection aborted.
        self._journal_failure: BaseException | None = None
        self._journal_failed = trio.Event()
        self.drain = Drain(
            journal, cache, engine,
            transfers=config.transfers, upload_delay=config.upload_delay, small_file_wait=config.small_file_wait,
            commit_markers=config.commit_markers, upload_while_writing=config.upload_while_writing,
            faults=self.faults,
        )
        self.evictor = Evictor(
            journal, cache, in_use=self._in_use, dirty_wait=config.dirty_wait, on_pressure=self.drain.set_pressure
        )
        self.fetcher = Fetcher(journal, cache, engine, evictor=self.evictor)
        self.lister = DirLister(journal, cache, store, refresh_interval=config.refresh_interval, call=engine.call)
        self.fs = Filesystem(journal, cache, self.fetcher.fetch, self.drain.mount_changed, self.evictor, self.lister,
                             streams=self.fetcher, wait_uploaded=lambda path: self.drain.wait_durable([path]),
                             discard_upload=self.drain.discard_upload, failure_of=self.drain.failure_of)
        self.lister.vanished = self.fs.vanished
        self._prune_wanted = trio.Event()
        self.drain.on_marker_uploaded = self._marker_uploaded
        # Cross-node ordering of commit markers (nodes.py): only markers need it.
        self.node_id = node_id_of(journal, lambda: secrets.token_hex(4))
        self.records: NodeRecords | None = None
        self.peers: PeerRecords | None = None
        if config.cross_node_ordering and config.commit_markers:
            self.records = NodeRecords(journal, engine, self.node_id)
            self.peers = PeerRecords(engine, self.node_id)
            self.peers.on_change = self.drain.notify
            self.drain.waits_for_nodes = self.peers.blocks
            self.drain.why_marker_waits = self.peers.why
            self.fs.announcer = self.records
        self.lister.forget_kernel_data = _forget_kernel_data
        self.lister.forget_kernel_entry = _forget_kernel_entry
        self.drain.on_spilled = self.evictor.evict_if_clean
        self._stop_requested = trio.Event()
        self._fuse_done = trio.Event()
        self._stop_timeout: float | None = config.drain_timeout
        self._finished = trio.Event()
        self._control_stop = trio.Event()
        self._control_done = trio.Event()
        self.result: FlushResult | None = None
        self.passthrough_why = "off: not probed yet"
        self.notifier = Notifier()
        self.fuse_ops: FuseOperations | None = None

    def _in_use(self, inode_id: int) -> bool:
        return self.fs.in_use(inode_id)

    def _marker_uploaded(self, inode: Inode) -> None:
        """A commit marker is in the store: a checkpoint is complete (retention runs then)."""
        if self.peers is not None:
            self.peers.uploaded(inode)
        if self.config.keep_last:
            self._prune_wanted.set()

    def request_stop(self, timeout: float | None) -> None:
        if not self._stop_requested.is_set():
            self._stop_timeout = timeout
            self._stop_requested.set()

    async def run(self, ready: Callable[[], None]) -> int:
        options = set(pyfuse3.default_options) - {"default_permissions"}
        options |= {"fsname=" + self.store.url.replace(",", "_"), "subtype=ckptfs"}
        if self.config.allow_other:
            options.add("allow_other")
        # The kernel checks permissions against the journal's mode, uid and gid, unless only root can reach
        # the mount (FUSE turns every other user away without allow_other) and root passes those checks
        # anyway (execute bits aside, which FUSE checks itself). There they cost two of the nine requests of
        # each small file written: every create and rename made the kernel ask for the directory's
        # attributes again before the next lookup.
        if self.config.allow_other or os.geteuid() != 0:
            options.add("default_permissions")
        self.fuse_ops = FuseOperations(self.fs, faults=self.faults, on_journal_failure=self._on_journal_failure)
        self.fuse_ops.enable_passthrough = self.config.passthrough != "off"
        self.fs.handle_table = self.handle_table
        if self.held is not None:
            pyfuse3.takeover(self.fuse_ops, self.held.fd, self.held.init_request, options)
            self._take_over_handles()
        else:
            pyfuse3.init(self.fuse_ops, str(self.mountpoint), options)
        unmounted = False
        journal_failed = False
        try:
            async with trio.open_nursery() as nursery:
                if self.held is not None and self.records is not None:
                    # Files the job still has open for writing are covered before any record of the dead
                    # daemon can go (nodes.py deletes those once nothing they covered is pending).
                    for inode_id, path in self.fs.restored_writers():
                        await self.records.cover(inode_id, path, writer=True)
                nursery.start_soon(self._fuse_main, nursery)
                nursery.start_soon(self._watch_journal)
                await nursery.start(self._supervised, "drain", self.drain.run)
                await nursery.start(self._supervised, "evictor", self.evictor.run)
                await nursery.start(self._supervised, "fetcher", self.fetcher.run)
                await nursery.start(self._supervised, "close recorder", self.fs.run)
                if self.records is not None and self.peers is not None:
                    await nursery.start(self._supervised, "node records", self.records.run)
                    await nursery.start(self._supervised, "other nodes' records", self.peers.run)
                await nursery.start(self._serve_control)
                root = await trio.to_thread.run_sync(os.stat, self.mountpoint)
                if self.held is None:
                    self._probe_passthrough()  # the kernel answered INIT before that stat
                    await self._start_holder()
                read_ahead = parse_size(self.config.read_ahead)
                if read_ahead:
                    set_read_ahead(root.st_dev, read_ahead)
                log.info("%s %s on %s (cache %s)", "took over the mount of" if self.held else "mounted",
                         self.store.url, self.mountpoint, self.cache.root)
                ready()
                self.notifier.notify(ready=1, status=self._status_line())
                if self.notifier.enabled:
                    nursery.start_soon(self._supervised, "systemd notifier", self._report_to_systemd)
                if self.metrics is not None:
                    nursery.start_soon(self._supervised, "metrics", self._publish_metrics)
                if self.config.keep_last:
                    nursery.start_soon(self._supervised, "retention", self._retention)
                nursery.start_soon(self._watch_signals, nursery)
                await self._stop_requested.wait()
                if self._restarting:
                    await self._stop_serving()
                else:
                    await self._shutdown()
                    unmounted = True
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            journal_failed = journal_unusable(exc)
            if not journal_failed:
                raise
            log.critical(
                "the journal %s cannot be used any more (%s): the daemon ends and leaves the mount aborted"
                " (Transport endpoint is not connected), so that nothing writes into the bare mountpoint. What"
                " was written before is in the cache dir; fix its filesystem, then run `ckptfs mount` again",
                self.journal.path, _innermost(exc))
            raise CkptfsError(f"the journal {self.journal.path} cannot be used any more: {_innermost(exc)}; fix"
                              " the cache filesystem, then mount again (the mount is left aborted)") from None
        finally:
            self._let_go_of_connection(unmounted=unmounted, journal_failed=journal_failed)
        if not unmounted or self.result is None or not self.result.ok:
            return EXIT_NOT_DRAINED
        return 0

    def kept_by_systemd(self, kept: bool) -> None:
        """The connection this daemon takes over came from systemd's store, which still keeps it."""
        self._systemd_keeps = kept and self.notifier.enabled

    def _take_over_handles(self) -> None:
        """After pyfuse3.takeover: passthrough as the connection has it, the kernel's open handles, and the
        requests the dead daemon had read but not answered, queued again."""
        self._probe_passthrough()
        restored = self._handles_taken_over = self.fs.restore_handles(self.restored)
        writers = sum(1 for record in self.restored if record.writable)
        try:
            os.write(pyfuse3.fuse_fd(), RESEND_NOTIFICATION)
            resent = "the requests it had not answered are sent again"
        except OSError as exc:
            resent = (f"the kernel cannot send again the requests it had not answered ({exc.strerror}; it needs"
                      " Linux >= 6.9): the processes waiting on them stay blocked")
            log.warning("taking over the mount of %s: %s", self.mountpoint, resent)
        kept_by = (f"holder pid {self.link.holder_pid}" if self.link is not None
                   else "systemd" if self.notifier.enabled else "this process")
        log.info("took over the FUSE connection of %s from the daemon before (kept by %s): %d open files (%d for"
                 " writing), %s", self.mountpoint, kept_by, restored, writers, resent)

    async def _start_holder(self) -> None:
        """Hand a duplicate of the connection to a holder process, so that the mount outlives this daemon."""
        if not self.config.keep_mount or self.restart_argv is None:
            return
        init_request = pyfuse3.init_request()
        if init_request is None:
            log.warning("keep_mount is off for this mount: pyfuse3 did not keep the kernel's INIT request")
            return
        if self.notifier.enabled:
            # Under systemd a holder would be killed with the unit's other processes; its file descriptor
            # store keeps the connection instead, and Restart= starts the daemon that takes it over.
            memfd = holder.init_memfd(init_request)
            try:
                self._systemd_keeps = (self.notifier.store_fd(holder.SYSTEMD_FUSE_FD, pyfuse3.fuse_fd())
                                       and self.notifier.store_fd(holder.SYSTEMD_INIT_FD, memfd))
            finally:
                os.close(memfd)
            if self._systemd_keeps:
                log.info("the mount outlives this daemon: systemd's file descriptor store keeps the FUSE"
                         " connection for the daemon Restart= starts (the unit needs FileDescriptorStoreMax=2)")
            return
        argv = list(self.restart_argv)
        if "--cache-dir" not in argv:
            argv += ["--cache-dir", str(self.cache.root)]
        try:
            self.link = await trio.to_thread.run_sync(
                lambda: holder.start(self.mountpoint, pyfuse3.fuse_fd(), init_request, argv=argv))
        except CkptfsError as exc:
            log.warning("keep_mount is off for this mount: %s; a daemon that dies leaves the mount at"
                        " 'Transport endpoint is not connected'", exc)
            return
        log.info("the mount outlives this daemon: holder pid %d keeps the FUSE connection", self.link.holder_pid)

    def _let_go_of_connection(self, *, unmounted: bool, journal_failed: bool) -> None:
        """The end of serving: unmount after a clean stop; leave the connection aborted when the journal
        failed (every access then fails with ENOTCONN, none lands on the disk below the mountpoint); hand
        it to the new daemon of a `ckptfs restart`; and when this daemon fails otherwise while a holder keeps
        the connection, leave it to the daemon the holder starts next, handles and all."""
        if self._restarting and not journal_failed and self.restart_argv is not None:
            fd = os.dup(pyfuse3.fuse_fd())  # the session's own descriptor goes with close()
            init_request = pyfuse3.init_request() or b""
            pyfuse3.close(unmount=False)
            self.fs.backing = None
            if self.link is not None:
                self.link.handover()
                self.link = None
            os.set_inheritable(fd, True)
            self.restart = Restart(self.restart_argv, holder.handover_env(fd, init_request))
            return
        failed = not unmounted and not journal_failed and not self._exiting_now
        if (self.link is not None or self._systemd_keeps) and failed:
            pyfuse3.close(unmount=False)
            self.fs.backing = None
            self.link = None  # its socket closes with the process: the holder starts a new daemon
            log.error("the daemon fails; the mount stays, held for the daemon started next")
            return
        if self._systemd_keeps:
            self.notifier.remove_fds(holder.SYSTEMD_FUSE_FD)
            self.notifier.remove_fds(holder.SYSTEMD_INIT_FD)
            self._systemd_keeps = False
        # Closing our /dev/fuse descriptor without unmounting aborts the connection (with no holder left).
        pyfuse3.close(unmount=not journal_failed)
        self.fs.backing = None  # closed with the connection
        if self.held is not None and not journal_failed:
            _unmount(self.mountpoint)  # a connection taken over: libfuse did not mount it, so it does not unmount
        if not journal_failed:
            if self.config.guard_mountpoint:  # writes into the bare directory fail (EROFS), not land on disk
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

    def _probe_passthrough(self) -> None:
        """Turn FUSE passthrough on where the option, the pyfuse3 build, the kernel and this process's
        privileges allow it; otherwise the mount works as without it. Never a failure: says which."""
        if self.config.passthrough == "off":
            self.passthrough_why = "off: passthrough = off"
        elif not passthrough_build():
            self.passthrough_why = ("off: this pyfuse3 is the stock build, without passthrough support"
                                    " (scripts/install.sh builds one against libfuse >= 3.17)")
        elif not passthrough_granted():
            self.passthrough_why = ("off: the kernel did not grant FUSE passthrough (it needs Linux >= 6.9"
                                    " with CONFIG_FUSE_PASSTHROUGH)")
        else:
            backing = KernelBackingFiles()
            probe = self.cache.tmp_path(0) + ".passthrough-probe"
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    backing.close(backing.open(fd))
                finally:
                    os.close(fd)
                    os.unlink(probe)
            except OSError as exc:
                need = " (it needs CAP_SYS_ADMIN: run the daemon as root)" if exc.errno == errno.EPERM else ""
                self.passthrough_why = f"off: the kernel refused a backing file: {exc.strerror}{need}"
            else:
                self.fs.backing = backing
                self.passthrough_why = "on: the kernel reads and writes the cache files of open files itself"
        log.info("FUSE passthrough %s", self.passthrough_why)

    async def _supervised(
        self, name: str, service: Callable[..., Awaitable[None]], *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a background service; an unexpected error ends only this run of it (logged, counted in
        ckptfs_internal_errors), and it starts again after a pause. A failure before it started fails the
        mount, and an unusable journal ends the daemon (see run)."""
        status = _StartedOnce(task_status)
        pause = RESTART_PAUSE
        while True:
            try:
                await service(task_status=status)
                return
            except Exception as exc:
                if journal_unusable(exc) or not status.done:
                    raise
                log.error("%s failed unexpectedly; starting it again in %.0f s", name, pause, exc_info=exc)
                self.faults.record(name, repr(_innermost(exc)))
            await trio.sleep(pause)
            pause = min(pause * 2, RESTART_PAUSE_CAP)

    def _on_journal_failure(self, exc: BaseException) -> None:
        """A FUSE request met an unusable journal (it was answered EIO): end the daemon (run)."""
        if self._journal_failure is None:
            self._journal_failure = exc
            self._journal_failed.set()

    async def _watch_journal(self) -> None:
        await self._journal_failed.wait()
        assert self._journal_failure is not None
        raise self._journal_failure

    async def _fuse_main(self, nursery: trio.Nursery) -> None:
        try:
            await pyfuse3.main()
        finally:
            self._fuse_done.set()
        # main() returns when the kernel ends the session: an external umount, or our terminate().
        if not self._stop_requested.is_set():
            log.info("%s was unmounted externally; draining before exit", self.mountpoint)
            self.request_stop(self.config.drain_timeout)

    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self._stop_requested.is_set():
                    log.info(
                        "%s: draining for up to %ss, then unmounting", signal.Signals(signum).name,
                        self.config.drain_timeout,
                    )
                    self.request_stop(self.config.drain_timeout)
                else:
                    log.warning("second signal: exiting now; pending uploads stay journaled for the next start")
                    self._exiting_now = True
                    nursery.cancel_scope.cancel()
                    return

    async def _retention(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply keep_last after each completed checkpoint (a commit marker reached the store)."""
        task_status.started()
        while True:
            await self._prune_wanted.wait()
            self._prune_wanted = trio.Event()
            try:
                result = await self.prune(self.config.keep_last, self.config.keep, dry_run=False)
            except Exception as exc:
                if journal_unusable(exc):
                    raise
                log.exception("retention failed; it runs again after the next checkpoint")
                self.faults.record("retention", repr(exc))
                continue
            if result.delete:
                log.info("retention (keep_last %d): deleted %s", self.config.keep_last, ", ".join(result.delete))

    async def prune(self, keep_last: int, keep_globs: tuple[str, ...], *, dry_run: bool) -> Plan:
        """Delete all but the newest `keep_last` top-level checkpoints (see retention.py) through the
        namespace, so that the drain removes them from the store too."""
        await self.lister.ensure(ROOT_ID)
        top = [c for c in self.journal.all_children(ROOT_ID) if c.name and not c.name.startswith(".")]
        pointers = [c for c in top if c.kind == FILE and (self.drain.is_commit_marker(c.name) or c.name == "latest")]
        texts = {}
        for pointer in pointers:
            if pointer.size <= 4096:
                texts[pointer.name or ""] = (await self._read_small(pointer)).decode("utf-8", "replace")
        candidates = [c for c in top if c not in pointers]
        # What other nodes still have pending work in is not complete, however it looks from here.
        elsewhere: set[str] = set()
        if self.peers is not None:
            await self.peers.refresh()
            elsewhere = self.peers.pending_entries()
        checkpoints = [Checkpoint(c.name or "", c.mtime_ns, self._complete(c) and c.name not in elsewhere
                                  and not (c.kind != DIR and TOP_FILES in elsewhere))
                       for c in candidates]
        result = plan(checkpoints, keep_last=keep_last, keep_globs=keep_globs,
                      pinned=pinned_by_pointers(texts, [c.name for c in checkpoints]))
        if not dry_run:
            for name in result.delete:
                await self._remove_tree(name)
        return result

    def _complete(self, inode: Inode) -> bool:
        for entry in [inode, *self.journal.descendants(inode.path or "")]:
            if entry.state in ("dirty", "uploading") or (entry.kind == FILE and entry.closed_at is None):
                return False
        return True

    async def _read_small(self, inode: Inode) -> bytes:
        fh = await self.fs.open(inode.id, os.O_RDONLY)
        try:
            return await self.fs.read(fh, 0, 4096)
        finally:
            self.fs.release(fh)

    async def _remove_tree(self, name: str) -> None:
        """rm -r of a top-level entry, through the fs (its store listing is read first: objects nobody
        here has listed must be deleted too)."""
        entry = self.journal.lookup(ROOT_ID, name)
        if entry is None:
            return
        if entry.kind == DIR:
            await self._list_subtree(entry.id)
            for child in sorted(self.journal.descendants(entry.path or ""),
                                key=lambda i: -(i.path or "").count("/")):
                parent = child.parent
                if parent is None or child.name is None:
                    continue
                if child.kind == DIR:
                    self.fs.rmdir(parent, child.name.encode())
                else:
                    self.fs.unlink(parent, child.name.encode())
            self.fs.rmdir(ROOT_ID, name.encode())
        else:
            self.fs.unlink(ROOT_ID, name.encode())

    async def _list_subtree(self, inode_id: int) -> None:
        await self.lister.ensure(inode_id, required=True, fresh=True)
        for child in self.journal.all_children(inode_id):
            if child.kind == DIR:
                await self._list_subtree(child.id)

    async def _publish_metrics(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.metrics is not None
        task_status.started()
        while True:
            self.metrics.publish(self.metrics_snapshot())
            await trio.sleep(METRICS_INTERVAL)

    def metrics_snapshot(self) -> Snapshot:
        """Every metric's current value (metrics.METRICS names them), read in the trio thread."""
        summary = self.journal.state_summary()
        states = ("dirty", "uploading", "clean", "remote")
        oldest = self.journal.oldest_dirty_closed_at()
        drain, evict = self.drain.stats, self.evictor.stats
        reads = self.fetcher.statistics()
        moved = self.engine.statistics()
        out: Snapshot = {
            "ckptfs_files": [((s,), summary.get(s, {}).get("files", 0)) for s in states],
            "ckptfs_bytes": [((s,), summary.get(s, {}).get("bytes", 0)) for s in states],
            "ckptfs_upload_queue": [
                (("uploads",), len(self.journal.pending_uploads())),
                (("moves",), len(self.journal.misplaced())),
                (("deletes",), len(self.journal.pending_deletes())),
            ],
            "ckptfs_transfers_in_flight": [((), self.drain.in_flight())],
            "ckptfs_transfer_parts_in_flight": [(("up",), moved.parts_up), (("down",), moved.parts_down)],
            "ckptfs_transfer_bytes": [(("up",), moved.bytes_up), (("down",), moved.bytes_down)],
            "ckptfs_transfer_retries": [((), moved.retries)],
            "ckptfs_transfer_memory_bytes": [((), moved.memory_in_use)],
            "ckptfs_transfer_memory_budget_bytes": [((), moved.memory_budget)],
            "ckptfs_oldest_dirty_age_seconds": [((), max(0.0, time.time() - oldest) if oldest else 0.0)],
            "ckptfs_cache_used_bytes": [((), self.cache.used)],
            "ckptfs_cache_budget_bytes": [((), self.cache.limit if self.cache.limit != math.inf else 0)],
            "ckptfs_uploaded_files": [((), drain.uploaded_files)],
            "ckptfs_uploaded_bytes": [((), drain.uploaded_bytes)],
            "ckptfs_upload_seconds": [((), drain.upload_seconds)],
            "ckptfs_spilled_bytes": [((), drain.spilled_bytes)],
            "ckptfs_drain_errors": [((job,), n) for job, n in sorted(drain.errors_by_job.items())],
            "ckptfs_internal_errors": [((where,), n) for where, n in sorted(self.faults.counts.items())],
            "ckptfs_passthrough_enabled": [((), 1.0 if self.fs.backing is not None else 0.0)],
            "ckptfs_passthrough_opens": [((), self.fs.passthrough_opens)],
            "ckptfs_drain_parked": [((), len(self.drain.failing()))],
            **self._node_metrics(),
            "ckptfs_cache_hits": [((), self.fs.cache_hits)],
            "ckptfs_cache_misses": [((), self.fs.cache_misses)],
            "ckptfs_fetch_bytes": [((), reads.bytes_downloaded)],
            "ckptfs_fetch_chunks": [((), reads.chunks_fetched)],
            "ckptfs_fetch_chunks_punched": [((), reads.chunks_punched)],
            "ckptfs_fetch_readers_waiting": [((), reads.readers_waiting)],
            "ckptfs_fetch_partial_bytes": [((), reads.partial_bytes)],
            "ckptfs_fetch_checksum_failures": [((), reads.checksum_failures)],
            "ckptfs_evicted_files": [((), evict.evicted_files)],
            "ckptfs_evicted_bytes": [((), evict.evicted_bytes)],
            "ckptfs_backpressure_waits": [((), evict.waits)],
            "ckptfs_backpressure_wait_seconds": [((), evict.wait_seconds)],
            "ckptfs_backpressure_enospc": [((), evict.enospc)],
        }
        if isinstance(self.store, InstrumentedStore):
            calls, errors, seconds = self.store.op_stats.rows()
            out.update(ckptfs_store_requests=calls, ckptfs_store_errors=errors, ckptfs_store_seconds=seconds)
        if self.fuse_ops is not None:
            calls, errors, seconds = self.fuse_ops.op_stats.rows()
            out.update(ckptfs_fuse_requests=calls, ckptfs_fuse_errors=errors, ckptfs_fuse_seconds=seconds)
        return out

    def _node_metrics(self) -> Snapshot:
        if self.records is None or self.peers is None:
            return {"ckptfs_node_records": [((), 0)], "ckptfs_node_record_failures": [((), 0)],
                    "ckptfs_markers_waiting_for_nodes": [((), 0)], "ckptfs_waiting_for_node": []}
        waiting = self.peers.waiting_markers()
        per_node = self.peers.waiting_per_node()
        return {
            "ckptfs_node_records": [((), len(self.records.status()["records"]))],
            "ckptfs_node_record_failures": [((), self.records.announce_failures)],
            "ckptfs_markers_waiting_for_nodes": [((), len(waiting))],
            "ckptfs_waiting_for_node": [((node, entry), n) for (node, entry), n in sorted(per_node.items())],
        }

    def _status_line(self) -> str:
        summary = self.journal.state_summary()
        pending_files = sum(summary.get(s, {}).get("files", 0) for s in ("dirty", "uploading"))
        pending_bytes = sum(summary.get(s, {}).get("bytes", 0) for s in ("dirty", "uploading"))
        what = "draining before unmount" if self._stop_requested.is_set() else "mounted"
        return (f"{what}: {pending_files} files ({_human(pending_bytes)}) not yet uploaded,"
                f" {self.drain.in_flight()} transfers in flight, cache {_human(self.cache.used)} used")

    async def _report_to_systemd(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """STATUS= now and then; while a stop drains and makes progress, ask for more stop time."""
        task_status.started()
        last_uploaded = self.drain.stats.uploaded_bytes + self.drain.stats.spilled_bytes
        while True:
            await trio.sleep(STATUS_INTERVAL)
            fields: dict[str, str | int] = {"status": self._status_line()}
            uploaded = self.drain.stats.uploaded_bytes + self.drain.stats.spilled_bytes
            if self._stop_requested.is_set() and uploaded > last_uploaded:
                fields["extend_timeout_usec"] = EXTEND_SECONDS * 1_000_000
            last_uploaded = uploaded
            self.notifier.notify(**fields)

    async def _shutdown(self) -> None:
        self.notifier.notify(stopping=1, status=self._status_line())
        self.fs.stop_writes()
        self.result = await self.drain.flush(None, _deadline(self._stop_timeout))
        if self.result.ok and self.records is not None:
            # Nothing of this node is pending: its records go, so that no other node's marker waits for it.
            with trio.move_on_after(RETIRE_RECORDS_WAIT):
                await self.records.retire_all()
        if self.result.ok:
            log.info("drained; unmounting %s", self.mountpoint)
        else:
            log.warning(
                "%d entries not yet durable in %s; they stay in the journal at %s and resume at the next mount",
                len(self.result.remaining), self.store.url, self.cache.root,
            )
        pyfuse3.terminate()
        self._finished.set()
        # Let control clients (ckptfs umount) receive their answer before the nursery is cancelled.
        self._control_stop.set()
        with trio.move_on_after(5):
            await self._control_done.wait()

    async def _stop_serving(self) -> None:
        """`ckptfs restart`: stop reading requests, let the ones being served finish (for a while), answer
        the control clients; the connection, the open handles and the journal stay as they are for the new
        daemon (uploads cut short resume there)."""
        log.info("restarting: the FUSE connection of %s goes to a new daemon started from the code installed"
                 " now", self.mountpoint)
        self.notifier.notify(status="restarting: handing the mount to a new daemon")
        pyfuse3.terminate()
        with trio.move_on_after(RESTART_REQUESTS_WAIT):
            await self._fuse_done.wait()
        self._control_stop.set()
        with trio.move_on_after(5):
            await self._control_done.wait()

    async def _serve_control(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        path = ctl.socket_path(self.mountpoint)
        try:
            await ctl.serve(path, self._control, self._control_stop, task_status=task_status)
        finally:
            self._control_done.set()

    # -- control socket -----------------------------------------------------------------------------

    async def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "flush":
            paths = [p.strip("/") for p in request.get("paths") or []] or None
            deadline = _deadline(request.get("timeout"))
            result = await self.drain.flush(paths, deadline)
            if result.ok and self.records is not None:
                # Flushed: this node's records whose work is done go now, not after LINGER, so that no
                # other node's marker waits for them and the store holds no bookkeeping of a quiet node.
                with trio.move_on_at(min(deadline, trio.current_time() + RETIRE_RECORDS_WAIT)):
                    await self.records.tidy(final=True)
            if result.ok and request.get("all_nodes"):
                result = await self._flush_other_nodes(deadline)
            return {"ok": result.ok, "remaining": result.remaining[:100], "remaining_count": len(result.remaining)}
        if op == "nodes":
            return await self._nodes(request)
        if op == "prune":
            keep_last = request.get("keep_last")
            if not isinstance(keep_last, int) or keep_last < 1:
                return {"ok": False, "error": "keep_last must be a whole number >= 1"}
            pruned = await self.prune(keep_last, tuple(request.get("keep") or ()), dry_run=bool(request.get("dry_run")))
            return {"ok": True, "delete": pruned.delete, "reasons": pruned.reasons}
        if op == "refresh":
            self.lister.invalidate_all()
            await self.lister.ensure(ROOT_ID)
            return {"ok": True}
        if op == "restart":
            if self.restart_argv is None:
                return {"ok": False, "error": "this daemon was not started by `ckptfs mount`, so it cannot start"
                                              " itself again; unmount and mount instead"}
            if self._stop_requested.is_set():
                return {"ok": False, "error": "the daemon is stopping"}
            self._restarting = True
            self._stop_requested.set()
            return {"ok": True, "pid": os.getpid()}
        if op == "umount":
            self.request_stop(request.get("timeout"))
            await self._finished.wait()
            assert self.result is not None
            return {
                "ok": self.result.ok,
                "remaining": self.result.remaining[:100],
                "remaining_count": len(self.result.remaining),
                "cache_dir": str(self.cache.root),
                "pid": os.getpid(),
            }
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def _flush_other_nodes(self, deadline: float) -> FlushResult:
        """After this node's flush: wait until every other node's work pending now is durable."""
        if self.peers is None:
            raise CkptfsError("--all-nodes needs cross-node ordering (cross_node_ordering = true and commit"
                              " markers configured)")
        try:
            with trio.move_on_at(deadline):
                await self.peers.wait_all()
                return FlushResult(True, [])
        except HeldError as exc:
            return FlushResult(False, exc.lines)
        return FlushResult(False, self.peers.describe(self.peers.waited_for()))

    async def _nodes(self, request: dict[str, Any]) -> dict[str, Any]:
        """`ckptfs nodes`: every node with pending records in the store; `forget` gives one up."""
        if self.peers is None:
            return {"ok": False, "error": "cross-node ordering is off on this mount (cross_node_ordering = false,"
                    " or no commit_markers)"}
        forget = request.get("forget")
        forgotten = None
        if forget:
            if not isinstance(forget, str) or forget == self.node_id:
                return {"ok": False, "error": f"cannot forget {forget!r}: name another node (ckptfs nodes lists"
                        " them)"}
            forgotten = await self.peers.forget(forget)
        else:
            await self.peers.refresh()
        return {"ok": True, "this_node": self.node_id, "nodes": self.peers.nodes(),
                "waiting_markers": self.peers.waiting_markers(), "forgot_records": forgotten}

    def _nodes_status(self) -> dict[str, Any]:
        if self.records is None or self.peers is None:
            return {"node": self.node_id, "cross_node_ordering": False}
        return {**self.records.status(), "cross_node_ordering": True,
                "waiting_markers": self.peers.waiting_markers(), "listing_error": self.peers.last_error}

    def status(self) -> dict[str, Any]:
        summary = self.journal.state_summary()
        pending = self.journal.pending_uploads()
        oldest = self.journal.oldest_dirty_closed_at()
        stats = self.drain.stats
        moved = self.engine.statistics()
        reads = self.fetcher.statistics()
        failing = self.drain.failing()
        last_error, last_error_at = stats.last_error, stats.last_error_at
        if self.faults.last_at is not None and (last_error_at is None or self.faults.last_at > last_error_at):
            last_error, last_error_at = self.faults.last, self.faults.last_at
        return {
            "source": self.store.url,
            "mountpoint": str(self.mountpoint),
            "cache_dir": str(self.cache.root),
            "pid": os.getpid(),
            "uptime_seconds": round(time.time() - self.started_at, 1),
            "started_at": self.started_at,
            "keep_mount": {
                "holder_pid": self.link.holder_pid if self.link is not None else None,
                "systemd_keeps": self._systemd_keeps,
                "took_over": self.held is not None,
                "handles_taken_over": self._handles_taken_over,
            },
            "states": {s: summary.get(s, {"files": 0, "bytes": 0}) for s in ("dirty", "uploading", "clean", "remote")},
            "queue": {
                "uploads": len(pending),
                "moves": len(self.journal.misplaced()),
                "deletes": len(self.journal.pending_deletes()),
                "in_flight": self.drain.in_flight(),
            },
            "oldest_dirty_age_seconds": round(time.time() - oldest, 1) if oldest else None,
            "open_for_write": self.fs.open_writers(),
            "nodes": self._nodes_status(),
            "passthrough": {
                "enabled": self.fs.backing is not None,
                "why": self.passthrough_why,
                "opens": self.fs.passthrough_opens,
                "files_open": self.fs.passthrough_files(),
                "refused": self.fs.passthrough_errors,
            },
            "cache": {
                "used_bytes": self.cache.used,
                "budget_bytes": int(self.cache.limit) if self.cache.limit != math.inf else None,
                "short_of_free_space": self.cache.squeezed,
                "evicted_files": self.evictor.stats.evicted_files,
                "evicted_bytes": self.evictor.stats.evicted_bytes,
                "writes_waiting": self.evictor.waiting,
                "waits": self.evictor.stats.waits,
                "wait_seconds": round(self.evictor.stats.wait_seconds, 3),
                "enospc": self.evictor.stats.enospc,
            },
            "reads": {
                "bytes_downloaded": reads.bytes_downloaded,
                "chunks_fetched": reads.chunks_fetched,
                "chunks_punched": reads.chunks_punched,
                "readers_waiting": reads.readers_waiting,
                "partial_files": reads.partial_files,
                "partial_bytes": reads.partial_bytes,
                "files_verified": reads.files_verified,
                "checksum_failures": reads.checksum_failures,
            },
            "uploaded": {
                "files": stats.uploaded_files,
                "bytes": stats.uploaded_bytes,
                "seconds": round(stats.upload_seconds, 3),
                "moves": stats.moves,
                "deletes": stats.deletes,
                "spilled_bytes": stats.spilled_bytes,
            },
            "transfers": {
                "parts_up": moved.parts_up,
                "parts_down": moved.parts_down,
                "up_bytes_per_second": round(moved.up_bytes_per_second),
                "down_bytes_per_second": round(moved.down_bytes_per_second),
                "bytes_up": moved.bytes_up,
                "bytes_down": moved.bytes_down,
                "retries": moved.retries,
                "memory_bytes": moved.memory_in_use,
                "memory_peak_bytes": moved.memory_peak,
                "memory_budget_bytes": moved.memory_budget,
            },
            "errors": stats.errors,
            "last_error": last_error,
            "last_error_at": last_error_at,
            "internal_errors": dict(self.faults.counts),
            "failing": [
                {"path": path, "job": parked.job, "error": parked.error, "since": parked.since}
                for path, parked in failing[:100]
            ],
            "failing_count": len(failing),
            "shutting_down": self._stop_requested.is_set(),
        }


def _innermost(exc: BaseException) -> BaseException:
    """The first error inside the exception groups that nurseries wrap errors in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _effective(config: Config, cache: CacheDir) -> str:
    """The effective configuration, one line, for the log (config holds no secrets; an endpoint URL's
    user:password part, if any, is dropped)."""
    fields = dataclasses.asdict(config)
    fields["cache_dir"] = str(cache.root)
    if config.endpoint_url:
        parts = urllib.parse.urlsplit(config.endpoint_url)
        fields["endpoint_url"] = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")
                                                if parts.hostname else parts.netloc).geturl()
    fields.pop("source")
    fields.pop("mountpoint")
    fields["commit_markers"] = ",".join(config.commit_markers)
    fields["keep"] = ",".join(config.keep)
    return ", ".join(f"{key} {value}" for key, value in fields.items())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _deadline(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + float(timeout)


def _owner_tag(journal: Journal) -> str:
    """A random id of this cache dir, created once; it tags the uploads it stages in the store."""
    tag = journal.get_meta("owner")
    if tag is None:
        tag = secrets.token_hex(6)
        with journal.transaction():
            journal.set_meta("owner", tag)
    return tag


def _unmount(mountpoint: Path) -> None:
    result = subprocess.run(["fusermount3", "-u", "-z", "-q", str(mountpoint)], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0 and os.path.ismount(mountpoint):
        log.warning("cannot unmount %s: %s", mountpoint, result.stderr.strip())


def _forget_kernel_data(inode_id: int) -> None:
    """Another node replaced this file: the kernel must not serve its old pages or size (readable handles
    keep the page cache across opens)."""
    try:
        pyfuse3.invalidate_inode(inode_id)
    except OSError:
        pass  # ENOENT: the kernel holds nothing of it


def _forget_kernel_entry(parent_id: int, name: str) -> None:
    """Another node deleted this entry: the kernel must not keep resolving the name for entry_timeout."""
    pyfuse3.invalidate_entry_async(parent_id, name.encode(), ignore_enoent=True)


def _return_freed_part_buffers() -> None:
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


async def run(
    config: Config, ready: Callable[[], None] = lambda: None, restart_argv: list[str] | None = None
) -> int:
    """Mount and serve until stopped (or take over the mount a holder keeps for a daemon that died). Raises
    CkptfsError for anything the user must fix before mounting. `restart_argv`: the `ckptfs` arguments that
    start this daemon again (keep_mount; None: no holder)."""
    _return_freed_part_buffers()
    raise_open_file_limit()
    store = InstrumentedStore(open_store(config.source, endpoint_url=config.endpoint_url))
    await trio.to_thread.run_sync(check_store, store)
    # Before anything touches the mountpoint: if a holder keeps its connection, a stat would wait for a
    # daemon, and this is the one. (A daemon that cannot start fails before it attaches: its holder counts
    # that, and gives up after a few.)
    held = holder.inherited()  # from the daemon before in this process (`ckptfs restart`)
    from_systemd = False
    if held is None:
        held = holder.from_systemd(listen_fds())  # from a daemon of this unit that died (Restart=)
        from_systemd = held is not None
    if held is None:
        held = holder.attach(config.mountpoint)
    else:
        held.link = holder.attach_link(config.mountpoint)
    unguarded = held is None and check_mountpoint(config.mountpoint)
    try:
        return await _run_on(config, store, held, from_systemd, ready, restart_argv)
    except BaseException:
        if unguarded and config.guard_mountpoint and guard.mounted_at(config.mountpoint) is None:
            guard.place(config.mountpoint)  # a start that failed before mounting: the guard goes back
        raise


async def _run_on(
    config: Config, store: InstrumentedStore, held: holder.Held | None, from_systemd: bool,
    ready: Callable[[], None], restart_argv: list[str] | None,
) -> int:
    cache = CacheDir(config.resolved_cache_dir())
    cache.prepare()
    cache.lock()
    metrics = _start_metrics(config.metrics_addr)
    handle_table = HandleTable(cache.root / "handles")
    try:
        try:
            journal = Journal(cache.journal_path)
        except (JournalError, OSError) as exc:
            raise CkptfsError(str(exc)) from None
        try:
            store.owner = _owner_tag(journal)
            bound = journal.get_meta("source")
            if bound is None:
                with journal.transaction():
                    journal.set_meta("source", store.url)
            elif bound != store.url:
                raise CkptfsError(
                    f"cache dir {cache.root} holds data of {bound}, not {store.url};"
                    " use another --cache-dir (or mount that source)"
                )
            log.info("ckptfs %s -> %s: %s", store.url, config.mountpoint, _effective(config, cache))
            engine = Transfers(
                store, part_size=parse_size(config.part_size), memory_budget=parse_size(config.memory_budget),
                parts_in_flight=config.parts_in_flight,
            )
            restored = handle_table.open(keep=held is not None)
            await recover(journal, cache, engine, time.time(), still_open={h.inode_id for h in restored},
                          still_writing={h.inode_id for h in restored if h.writable})
            atimes = cache.scan()
            for inode_id, text in journal.upload_states():
                state = UploadState.from_json(text)
                if state.spilled:
                    cache.restore_spilled(inode_id, punched=state.punched, staged=state.size, sealed=not state.early)
            daemon = Daemon(config, engine, cache, journal, metrics, handle_table=handle_table, held=held,
                            restored=restored, restart_argv=restart_argv)
            # Under systemd every connection taken over (Restart=, `ckptfs restart`) is also in its store.
            daemon.kept_by_systemd(from_systemd or (held is not None and config.keep_mount))
            cache.configure_budget(config.cache_size, config.min_free, working_room=daemon.drain.spill_room)
            daemon.evictor.start(atimes)
            code = await daemon.run(ready)
            restart = daemon.restart
        finally:
            journal.close()
    finally:
        handle_table.close()
        if metrics is not None:
            metrics.close()
        cache.unlock()
    if restart is not None:
        raise restart
    return code


def _start_metrics(addr: str) -> MetricsServer | None:
    try:
        where = parse_addr(addr)
    except ValueError as exc:
        raise CkptfsError(str(exc)) from None
    if where is None:
        return None
    try:
        return MetricsServer(*where)
    except OSError as exc:
        raise CkptfsError(
            f"cannot serve metrics on {addr}: {exc.strerror}; is another ckptfs mount using it? Give each"
            " mount its own --metrics-addr HOST:PORT, or --metrics-addr off"
        ) from None
