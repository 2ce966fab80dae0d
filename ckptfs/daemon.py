"""Process lifecycle of a mount: checks, recovery, wiring, the root nursery, signals, ordered shutdown.

Start-up order: validate the mountpoint and the store, take the cache dir lock, open the journal, recover,
mount, start the drain and the control socket, confirm the mount answers, then report ready.
Shutdown order (SIGTERM/SIGINT, `ckptfs umount`, or an external unmount): stop new opens for writing, drain
with a deadline, unmount, close the journal. A second signal skips the drain; nothing written is lost,
because whatever was not uploaded stays journaled for the next start. SIGTERM with keep_mount_on_stop while
the node's holder service keeps the connection (Kubernetes): drain with a deadline while serving as before,
then leave the connection to the holder for the next daemon instead of unmounting.

This is the only module besides mount/adapter.py that imports pyfuse3, and the only owner of the root nursery.
It wires and starts; what it starts lives in modules of their own: mount/mountpoint.py (can it be mounted
on), keepmount/keeper.py (the connection beyond this daemon: holder, systemd's store, handles taken over),
control/answers.py (the control socket's requests), control/status.py (status, metrics and STATUS=, from one
gathering), retention/pruner.py (retention carried out).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable

import pyfuse3
import trio

from ckptfs.backends import check_store, open_store
from ckptfs.backends.base import UploadState
from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor
from ckptfs.config import Config, parse_bandwidth, parse_size
from ckptfs.control import server as ctl
from ckptfs.control.answers import RETIRE_RECORDS_WAIT, ControlRequests, deadline_after
from ckptfs.control.client import ensure_runtime_dir, runtime_dir
from ckptfs.control.metrics import InstrumentedStore, MetricsServer, parse_addr
from ckptfs.control.status import KeepMount, MountStats, credential_state, gather, metrics_snapshot, status_line
from ckptfs.drain import Drain, FlushResult
from ckptfs.drain.recovery import RecoveryReport, recover
from ckptfs.errors import CkptfsError, Faults
from ckptfs.fetch import Fetcher
from ckptfs.fetch.lister import DirLister
from ckptfs.fetch.prefetch import Prefetcher
from ckptfs.fs import Filesystem, probe_passthrough
from ckptfs.fs.handle_table import HandleTable, OpenHandle
from ckptfs.journal import Inode, Journal, JournalError, JournalFull, journal_unusable
from ckptfs.keepmount import link as holder_link
from ckptfs.keepmount.keeper import ConnectionKeeper, Restart, find_held_connection
from ckptfs.keepmount.systemd import Notifier
from ckptfs.mount import guard
from ckptfs.mount.adapter import (
    FuseOperations,
    forget_kernel_attrs,
    forget_kernel_data,
    forget_kernel_entry,
    forget_kernel_entry_now,
    inode_generation,
    kernel_backing_files,
    passthrough_granted,
)
from ckptfs.mount.mountpoint import check_fusermount, check_mountpoint, set_read_ahead, wait_until_mounted
from ckptfs.nodes import NodeRecords, PeerRecords, node_id_of
from ckptfs.notices.preempter import Preempter
from ckptfs.notices.watchers import watch_notices
from ckptfs.process import raise_open_file_limit, return_freed_part_buffers
from ckptfs.retention.pruner import Pruner
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

EXIT_NOT_DRAINED = 3
# How often systemd hears how things are (STATUS=), and how much more stop time a draining stop asks for
# each time it made progress (EXTEND_TIMEOUT_USEC=).
STATUS_INTERVAL = 5.0
METRICS_INTERVAL = 1.0
# A metrics snapshot takes at most this share of the trio thread: it sums the journal's files by state, a
# scan of every row (a namespace of 100k entries took 0.1-0.3 s each second, a fifth of a big walk's time).
METRICS_SHARE = 0.05


def metrics_pause(took: float) -> float:
    """Seconds until the next metrics snapshot, after one that took `took` seconds."""
    return max(METRICS_INTERVAL, took / METRICS_SHARE)
EXTEND_SECONDS = 30
# A background service that failed unexpectedly starts again after this long (doubling up to the cap).
RESTART_PAUSE = 1.0
# How often the journal's WAL is checkpointed in a worker thread while the journal changes: each one syncs
# two files, and syncs on the cache filesystem slow down the cache file creates of FUSE requests meanwhile.
JOURNAL_CHECKPOINT_INTERVAL = 0.5
JOURNAL_CHECKPOINT_COMMITS = 250  # about SQLite's 1000 WAL pages: a create or a close writes about 4
RESTART_PAUSE_CAP = 60.0
# `ckptfs restart`: how long the requests being served may take to finish before the connection goes to the
# new daemon anyway (the kernel sends it the unfinished ones again)
RESTART_REQUESTS_WAIT = 10.0
# A stop under a preemption notice: how long it waits past its drain for the report to be written.
PREEMPTION_REPORT_WAIT = 2.0


class _StartedOnce:
    """The task status of a service that may be restarted: the nursery hears `started` only once."""

    def __init__(self, inner: trio.TaskStatus[None]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        if not self.done:
            self.done = True
            self.inner.started(value)


async def checkpoint_journal(journal: Journal) -> None:
    """Checkpoint `journal` in a worker thread, for ever: while it keeps changing, once per
    JOURNAL_CHECKPOINT_COMMITS commits (as often as SQLite's own checkpoints: each syncs two files); once it
    is quiet, whatever is left. A checkpoint the full cache filesystem refuses is tried again later: the
    WAL keeps every commit meanwhile (found by the crash harness's full-cache rounds)."""
    seen = checkpointed = journal.commits
    full = False
    while True:
        await trio.sleep(JOURNAL_CHECKPOINT_INTERVAL)
        commits = journal.commits
        if commits - checkpointed >= JOURNAL_CHECKPOINT_COMMITS or (commits == seen != checkpointed):
            try:
                await trio.to_thread.run_sync(journal.checkpoint)
            except JournalFull:
                if not full:
                    log.warning("the journal's checkpoint waits for room: the cache filesystem is full")
                full = True
            else:
                checkpointed, full = commits, False
        seen = commits


class Daemon:
    """One mount: its parts built and wired together, run in the root nursery until stopped."""

    def __init__(
        self, config: Config, engine: Transfers, cache: CacheDir, journal: Journal,
        metrics: MetricsServer | None = None, *, handle_table: HandleTable | None = None,
        held: holder_link.Held | None = None, restored: list[OpenHandle] | None = None,
        restart_argv: list[str] | None = None,
    ) -> None:
        self.config = config
        self.handle_table = handle_table
        self.held = held
        self.restart_argv = restart_argv
        self.recovered = RecoveryReport()  # what recovery changed (set by run() below)
        self._exiting_now = False  # a second signal: unmount without draining (not a failure to recover from)
        self._restarting = False  # `ckptfs restart`: hand the connection to a new daemon instead of unmounting
        self._leaving = False  # SIGTERM with keep_mount_on_stop: leave the connection to the holder service
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
            open_upload_idle=config.open_upload_idle, faults=self.faults,
        )
        self.evictor = Evictor(
            journal, cache, in_use=self._in_use, dirty_wait=config.dirty_wait, on_pressure=self.drain.set_pressure,
            on_changed=self.drain.mount_changed,
        )
        self.fetcher = Fetcher(journal, cache, engine, evictor=self.evictor)
        # A listing leaves nothing in the store: it need not wait while a sweep of leftovers lists (the one
        # after start-up can take half a minute on a throttling store, and the mount serves meanwhile).
        self.lister = DirLister(journal, cache, store, refresh_interval=config.refresh_interval,
                                call=functools.partial(engine.call, gated=False))
        self.fs = Filesystem(journal, cache, self.fetcher.fetch, self.drain.mount_changed, self.evictor, self.lister,
                             streams=self.fetcher, wait_uploaded=lambda path: self.drain.wait_durable([path]),
                             discard_upload=self.drain.discard_upload, failure_of=self.drain.failure_of)
        self.lister.vanished = self.fs.vanished
        self.fs.on_fsync = self.drain.fsynced
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
            self.fs.listing.other_nodes = self.peers
        self.fs.listing.rename_wait = config.rename_wait
        self.fs.listing.on_straggler = lambda message: self.faults.record("rename", message)
        self.pruner = Pruner(journal, self.fs, self.lister, is_commit_marker=self.drain.is_commit_marker,
                             peers=self.peers, faults=self.faults)
        self.preempter = Preempter(self.drain, engine, cache.root)
        self.pruner.held = lambda: self.preempter.active  # retention waits under a preemption notice
        self.lister.forget_kernel_data = forget_kernel_data
        self.lister.forget_kernel_entry = forget_kernel_entry
        self.lister.forget_kernel_entry_now = forget_kernel_entry_now
        self.pruner.forget_kernel_entry_now = forget_kernel_entry_now
        self.pruner.forget_kernel_data = forget_kernel_data
        self.evictor.forget_kernel_attrs = forget_kernel_attrs
        self.drain.namespace.forget_kernel_entry = forget_kernel_entry
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
        self.control = ControlRequests(self, self.drain, self.lister, self.pruner, cache_root=cache.root,
                                       node_id=self.node_id, records=self.records, peers=self.peers,
                                       bandwidth=engine.bandwidth, preempter=self.preempter,
                                       prefetcher=Prefetcher(self.fetcher, self.lister.ensure))
        self.guarded, self.guard_why = guard.availability(config.guard_mountpoint)
        # The mount outliving this daemon (keepmount/keeper.py): holder, systemd's store, the handles taken over.
        self.keeper = ConnectionKeeper(
            pyfuse3, self.fs, self.notifier, mountpoint=self.mountpoint, cache_root=cache.root,
            keep_mount=config.keep_mount, guard_mountpoint=self.guarded, handle_table=handle_table,
            held=held, restored=restored or [], restart_argv=restart_argv,
            wait_for_service=config.keep_mount_on_stop)

    def _in_use(self, inode_id: int) -> bool:
        return self.fs.in_use(inode_id)

    def _marker_uploaded(self, inode: Inode) -> None:
        """A commit marker is in the store: a checkpoint is complete (retention runs then)."""
        if self.peers is not None:
            self.peers.uploaded(inode)
        if self.config.keep_last:
            self.pruner.checkpoint_completed()

    def request_stop(self, timeout: float | None) -> None:
        if not self._stop_requested.is_set():
            self._stop_timeout = timeout
            self._stop_requested.set()

    async def stopped(self) -> FlushResult:
        await self._finished.wait()
        assert self.result is not None
        return self.result

    def begin_restart(self) -> str | None:
        if self.restart_argv is None:
            return ("this daemon was not started by `ckptfs mount`, so it cannot start itself again; unmount and"
                    " mount instead")
        if self._stop_requested.is_set():
            return "the daemon is stopping"
        self._restarting = True
        self._stop_requested.set()
        return None

    def _forget_recovered(self) -> None:
        """After a takeover: the kernel drops the names recovery removed (a cache file gone before its upload)
        and the attributes and pages of files served from the store again (a cache file gone after it).
        In a worker thread."""
        for parent_id, name in self.recovered.removed_names:
            forget_kernel_entry_now(parent_id, name)
            forget_kernel_data(parent_id)
        for inode_id in self.recovered.reverted:
            forget_kernel_data(inode_id)

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
        self.fuse_ops = FuseOperations(self.fs, faults=self.faults, on_journal_failure=self._on_journal_failure,
                                       generation=inode_generation(self.store.owner))
        self.fuse_ops.enable_passthrough = self.config.passthrough != "off"
        stats = self.fuse_ops.op_stats
        self.drain.foreground_at = lambda: stats.last_at
        self.fs.handle_table = self.handle_table
        if self.held is not None:
            pyfuse3.takeover(self.fuse_ops, self.held.fd, self.held.init_request, options)
            self._probe_passthrough()
            self.keeper.take_over_handles()
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
                # From the mount on, SIGTERM drains and unmounts (a stop requested while the daemon starts
                # takes effect once it serves): before, a SIGTERM between the mount and the ready report
                # ended the daemon without unmounting (PID 1 of a container: cli.end_on_sigterm_as_init).
                nursery.start_soon(self._watch_signals, nursery)
                nursery.start_soon(self._watch_journal)
                if self.held is not None:
                    # The kernel kept what it cached of the mount: what recovery changed of it goes, while
                    # requests are served (a notification may wait for one the kernel sent again), and
                    # before the control socket says the mount is back.
                    await trio.to_thread.run_sync(self._forget_recovered)
                await nursery.start(self._supervised, "drain", self.drain.run)
                await nursery.start(self._supervised, "evictor", self.evictor.run)
                await nursery.start(self._supervised, "fetcher", self.fetcher.run)
                await nursery.start(self._supervised, "close recorder", self.fs.run)
                await nursery.start(self._supervised, "journal checkpoints", self._checkpoint_journal)
                await nursery.start(self._supervised, "listing ahead", self.lister.run)
                if self.records is not None and self.peers is not None:
                    await nursery.start(self._supervised, "node records", self.records.run)
                    await nursery.start(self._supervised, "other nodes' records", self.peers.run)
                await nursery.start(self._supervised, "preemption", self.preempter.run)
                if self.config.preemption_notice != "off":
                    await nursery.start(self._supervised, "preemption notices", functools.partial(
                        watch_notices, self.config, self.preempter))
                await nursery.start(self._serve_control)
                device = await wait_until_mounted(self.mountpoint)
                if self.held is None:
                    self._probe_passthrough()  # the kernel answered INIT before that stat
                    await self.keeper.start_holder()
                log.info("guard %s", self.guard_why)
                read_ahead = parse_size(self.config.read_ahead)
                if read_ahead:
                    set_read_ahead(device, read_ahead)
                log.info("%s %s on %s (cache %s)", "took over the mount of" if self.held else "mounted",
                         self.store.url, self.mountpoint, self.cache.root)
                ready()
                self.notifier.notify(ready=1, status=status_line(self.statistics()))
                if self.notifier.enabled:
                    nursery.start_soon(self._supervised, "systemd notifier", self._report_to_systemd)
                if self.metrics is not None:
                    nursery.start_soon(self._supervised, "metrics", self._publish_metrics)
                if self.config.keep_last:
                    nursery.start_soon(self._supervised, "retention", functools.partial(
                        self.pruner.run, self.config.keep_last, self.config.keep))
                if self.keeper.wants_service:
                    nursery.start_soon(self._supervised, "holder service watch", self.keeper.watch_service)
                await self._stop_requested.wait()
                if self._leaving:
                    await self._drain_before_leaving()
                if self._restarting or self._leaving:
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
            if self._leaving and not journal_failed and self.keeper.kept_by_service:
                self.keeper.leave_to_holder()
            elif self._leaving and not journal_failed:
                # The service went away while this daemon drained: nothing would keep the connection, and
                # closing it would leave the mount at ENOTCONN. Unmount as a plain SIGTERM does.
                log.warning("the node's holder service went away while draining: unmounting %s instead of"
                            " leaving it", self.mountpoint)
                self._leaving = False
                unmounted = True
                self.restart = self.keeper.let_go(unmounted=True, journal_failed=False, restarting=False,
                                                  exiting_now=self._exiting_now)
            else:
                self.restart = self.keeper.let_go(unmounted=unmounted, journal_failed=journal_failed,
                                                  restarting=self._restarting, exiting_now=self._exiting_now)
        if self._leaving:
            return 0
        if not unmounted or self.result is None or not self.result.ok:
            return EXIT_NOT_DRAINED
        return 0

    def _probe_passthrough(self) -> None:
        backing, self.passthrough_why = probe_passthrough(self.config.passthrough, kernel_backing_files(),
                                                          passthrough_granted(),
                                                          self.cache.tmp_path(0) + ".passthrough-probe")
        if backing is not None:
            self.fs.backing = backing
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

    async def _checkpoint_journal(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Checkpoint the journal's WAL in a worker thread, so that no FUSE request waits for the syncs of
        one (Journal.checkpoints_elsewhere)."""
        self.journal.checkpoints_elsewhere()
        task_status.started()
        await checkpoint_journal(self.journal)

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
            # The kernel sends no more requests: a release it had not sent yet (a file closed just before
            # the umount: FUSE releases are asynchronous) never comes, and that file would count as open for
            # writing, so the drain would wait drain_timeout for its close. Every handle is closed now.
            self.fs.close_all()
            self.request_stop(self.config.drain_timeout)

    async def _watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self._stop_requested.is_set():
                    log.warning("second signal: exiting now; pending uploads stay journaled for the next start")
                    self._exiting_now = True
                    nursery.cancel_scope.cancel()
                    return
                timeout = self.config.drain_timeout
                if self.config.preempt_on_sigterm:
                    # A spot node's stop (a node agent, a pod's SIGTERM): a preemption notice, the newest
                    # complete step first, and the whole stop bounded by its deadline.
                    timeout = min(self.config.preempt_on_sigterm, timeout)
                    self.preempter.begin(self.config.preempt_on_sigterm, reason=name,
                                         lift_limits=not self.config.preemption_keep_limits)
                if self.config.keep_mount_on_stop and self.keeper.kept_by_service:
                    log.info("%s: draining for up to %ss, then leaving the mount of %s to the node's holder service"
                             " for the next daemon", name, timeout, self.mountpoint)
                    self._leaving = True
                else:
                    log.info("%s: draining for up to %ss, then unmounting", name, timeout)
                self.request_stop(timeout)

    async def _publish_metrics(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        assert self.metrics is not None
        task_status.started()
        while True:
            started = time.perf_counter()
            self.metrics.publish(metrics_snapshot(self.statistics()))
            await trio.sleep(metrics_pause(time.perf_counter() - started))

    def statistics(self) -> MountStats:
        """Every statistic of the mount, read once (control/status.py derives the status, metrics and STATUS=)."""
        keeper = self.keeper
        keep_mount = KeepMount(keeper.link.holder_pid if keeper.link is not None else None, keeper.systemd_keeps,
                               self.held is not None, keeper.handles_taken_over, keeper.why)
        return gather(
            journal=self.journal, drain=self.drain, engine=self.engine, fetcher=self.fetcher, evictor=self.evictor,
            cache=self.cache, fs=self.fs, faults=self.faults, node_id=self.node_id, records=self.records,
            peers=self.peers, source=self.store.url, mountpoint=str(self.mountpoint), started_at=self.started_at,
            shutting_down=self._stop_requested.is_set(), keep_mount=keep_mount,
            passthrough_why=self.passthrough_why, guard_why=self.guard_why,
            store_ops=self.store.op_stats if isinstance(self.store, InstrumentedStore) else None,
            fuse_ops=self.fuse_ops.op_stats if self.fuse_ops is not None else None,
            credentials=credential_state(self.store),
        )

    async def _report_to_systemd(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """STATUS= now and then; while a stop drains and makes progress, ask for more stop time."""
        task_status.started()
        last_uploaded = self.drain.stats.uploaded_bytes + self.drain.stats.spilled_bytes
        while True:
            await trio.sleep(STATUS_INTERVAL)
            fields: dict[str, str | int] = {"status": status_line(self.statistics())}
            uploaded = self.drain.stats.uploaded_bytes + self.drain.stats.spilled_bytes
            if self._stop_requested.is_set() and uploaded > last_uploaded:
                fields["extend_timeout_usec"] = EXTEND_SECONDS * 1_000_000
            last_uploaded = uploaded
            self.notifier.notify(**fields)

    async def _shutdown(self) -> None:
        self.notifier.notify(stopping=1, status=status_line(self.statistics()))
        self.fs.stop_writes()
        self.result = await self.drain.flush(None, deadline_after(self._stop_timeout))
        await self._preemption_reported()
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

    async def _preemption_reported(self) -> None:
        """A stop under a preemption notice: its report is written before the daemon goes (for a moment)."""
        if self.preempter.active and not self.preempter.reported.is_set():
            with trio.move_on_after(PREEMPTION_REPORT_WAIT):
                await self.preempter.reported.wait()

    async def _drain_before_leaving(self) -> None:
        """SIGTERM with keep_mount_on_stop: upload what is pending for up to drain_timeout while the mount
        goes on serving as before (the job keeps saving: nothing refuses its writes), then leave. What is
        not uploaded by then stays journaled for the next daemon, which the node may never start (a node
        drained for good)."""
        self.notifier.notify(stopping=1, status="draining before leaving the mount to the holder service")
        self.result = await self.drain.flush(None, deadline_after(self._stop_timeout))
        await self._preemption_reported()
        if self.result.ok:
            log.info("drained; leaving the mount of %s to the holder service", self.mountpoint)
        else:
            log.warning("%d entries not yet durable in %s; the mount goes to the holder service anyway and they"
                        " stay journaled at %s for the next daemon", len(self.result.remaining), self.store.url,
                        self.cache.root)

    async def _stop_serving(self) -> None:
        """`ckptfs restart`: stop reading requests, let the ones being served finish (for a while), answer
        the control clients; the connection, the open handles and the journal stay as they are for the new
        daemon (uploads cut short resume there)."""
        if self._restarting:
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
            await ctl.serve(path, self.control.answer, self._control_stop, task_status=task_status)
        finally:
            self._control_done.set()


def _innermost(exc: BaseException) -> BaseException:
    """The first error inside the exception groups that nurseries wrap errors in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _owner_tag(journal: Journal) -> str:
    """A random id of this cache dir, created once; it tags the uploads it stages in the store."""
    tag = journal.get_meta("owner")
    if tag is None:
        tag = secrets.token_hex(6)
        with journal.transaction():
            journal.set_meta("owner", tag)
    return tag


async def run(
    config: Config, ready: Callable[[], None] = lambda: None, restart_argv: list[str] | None = None
) -> int:
    """Mount and serve until stopped (or take over the mount a holder keeps for a daemon that died). Raises
    CkptfsError for anything the user must fix before mounting. `restart_argv`: the `ckptfs` arguments that
    start this daemon again (keep_mount; None: no holder)."""
    return_freed_part_buffers()
    raise_open_file_limit()
    ensure_runtime_dir(runtime_dir())  # the control socket's (and the holder's): a clear error before mounting
    check_fusermount()
    store = InstrumentedStore(open_store(config.source, endpoint_url=config.endpoint_url))
    await trio.to_thread.run_sync(check_store, store)
    # Before anything touches the mountpoint: if a holder keeps its connection, a stat would wait for a
    # daemon, and this is the one. (A daemon that cannot start fails before it attaches: its holder counts
    # that, and gives up after a few.)
    held, from_systemd = find_held_connection(config.mountpoint, pyfuse3)
    unguarded = held is None and check_mountpoint(config.mountpoint)
    try:
        return await _run_on(config, store, held, from_systemd, ready, restart_argv)
    except BaseException:
        guarded, _ = guard.availability(config.guard_mountpoint)
        if unguarded and guarded and guard.mounted_at(config.mountpoint) is None:
            guard.place(config.mountpoint)  # a start that failed before mounting: the guard goes back
        raise


async def _run_on(
    config: Config, store: InstrumentedStore, held: holder_link.Held | None, from_systemd: bool,
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
            log.info("ckptfs %s -> %s: %s", store.url, config.mountpoint, config.effective(cache.root))
            engine = Transfers(
                store, part_size=parse_size(config.part_size), memory_budget=parse_size(config.memory_budget),
                parts_in_flight=config.parts_in_flight,
                upload_limit=parse_bandwidth(config.upload_limit, "upload_limit"),
                download_limit=parse_bandwidth(config.download_limit, "download_limit"),
            )
            restored = handle_table.open(keep=held is not None)
            recovered = recover(journal, cache, engine, time.time(), still_open={h.inode_id for h in restored},
                                still_writing={h.inode_id for h in restored if h.writable})
            atimes = cache.scan()
            for inode_id, text in journal.work.upload_states():
                state = UploadState.parse(text)
                if state is not None and state.spilled:
                    cache.restore_spilled(inode_id, punched=state.punched, staged=state.size, sealed=not state.early)
            daemon = Daemon(config, engine, cache, journal, metrics, handle_table=handle_table, held=held,
                            restored=restored, restart_argv=restart_argv)
            daemon.recovered = recovered
            # Under systemd every connection taken over (Restart=, `ckptfs restart`) is also in its store.
            daemon.keeper.kept_by_systemd(from_systemd or (held is not None and config.keep_mount))
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
