"""The Daemon: one mount's parts built and wired together, run in the root nursery until stopped.

Its run: mount (or take over the connection a holder keeps), start every background service supervised
(services.py), the control socket and the reports (reporting.py), confirm the mount answers, report ready;
then wait for a stop (SIGTERM/SIGINT, `ckptfs umount` or `restart`, an external unmount) and carry it out
(stopping.py). An unusable journal ends it with the mount left aborted, so that nothing writes into the bare
mountpoint.

With startup.py, the only modules besides mount/adapter.py that import pyfuse3; the only owner of the root
nursery. It wires and starts; what it starts lives in modules of their own: mount/mountpoint.py (can it be
mounted on), keepmount/keeper.py (the connection beyond this daemon: holder, systemd's store, handles taken
over), control/answers.py (the control socket's requests), control/status.py (status, metrics and STATUS=,
from one gathering), retention/pruner.py (retention carried out).
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

from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor
from ckptfs.config import Config, parse_size
from ckptfs.control import server as ctl
from ckptfs.control.answers import ControlRequests
from ckptfs.control.metrics import InstrumentedStore, MetricsServer
from ckptfs.control.status import KeepMount, MountStats, credential_state, gather, status_line
from ckptfs.daemon.reporting import publish_metrics, report_to_systemd
from ckptfs.daemon.services import checkpoint_journal, innermost, supervise
from ckptfs.daemon.stopping import Stopping
from ckptfs.drain import Drain, FlushResult
from ckptfs.drain.recovery import RecoveryReport
from ckptfs.errors import CkptfsError, Faults
from ckptfs.fetch import Fetcher
from ckptfs.fetch.lister import DirLister
from ckptfs.fetch.prefetch import Prefetcher
from ckptfs.fs import Filesystem, probe_passthrough
from ckptfs.fs.handle_table import HandleTable, OpenHandle
from ckptfs.journal import Inode, Journal, journal_unusable
from ckptfs.keepmount import link as holder_link
from ckptfs.keepmount.keeper import ConnectionKeeper, Restart
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
from ckptfs.mount.mountpoint import set_read_ahead, wait_until_mounted
from ckptfs.nodes import NodeRecords, PeerRecords, node_id_of
from ckptfs.notices.preempter import Preempter
from ckptfs.notices.watchers import watch_notices
from ckptfs.retention.pruner import Pruner
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

EXIT_NOT_DRAINED = 3


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
        self.recovered = RecoveryReport()  # what recovery changed (set by startup.py)
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
        self.passthrough_why = "off: not probed yet"
        self.notifier = Notifier()
        self.stopping = Stopping(config.drain_timeout, drain=self.drain, fs=self.fs, records=self.records,
                                 preempter=self.preempter, notifier=self.notifier, statistics=self.statistics,
                                 terminate=pyfuse3.terminate, mountpoint=self.mountpoint, store_url=store.url,
                                 cache_root=cache.root)
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
        self.stopping.request(timeout)

    async def stopped(self) -> FlushResult:
        return await self.stopping.stopped()

    def begin_restart(self) -> str | None:
        if self.restart_argv is None:
            return ("this daemon was not started by `ckptfs mount`, so it cannot start itself again; unmount and"
                    " mount instead")
        if self.stopping.requested.is_set():
            return "the daemon is stopping"
        self.stopping.restarting = True
        self.stopping.requested.set()
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
                    nursery.start_soon(self._supervised, "systemd notifier", functools.partial(
                        report_to_systemd, self.notifier, self.statistics, self.drain.stats, self.stopping.requested))
                if self.metrics is not None:
                    nursery.start_soon(self._supervised, "metrics", functools.partial(
                        publish_metrics, self.metrics, self.statistics))
                if self.config.keep_last:
                    nursery.start_soon(self._supervised, "retention", functools.partial(
                        self.pruner.run, self.config.keep_last, self.config.keep))
                if self.keeper.wants_service:
                    nursery.start_soon(self._supervised, "holder service watch", self.keeper.watch_service)
                stopping = self.stopping
                await stopping.requested.wait()
                if stopping.leaving:
                    await stopping.drain_before_leaving()
                if stopping.restarting or stopping.leaving:
                    await stopping.stop_serving()
                else:
                    await stopping.shutdown()
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
                self.journal.path, innermost(exc))
            raise CkptfsError(f"the journal {self.journal.path} cannot be used any more: {innermost(exc)}; fix"
                              " the cache filesystem, then mount again (the mount is left aborted)") from None
        finally:
            stopping = self.stopping
            if stopping.leaving and not journal_failed and self.keeper.kept_by_service:
                self.keeper.leave_to_holder()
            elif stopping.leaving and not journal_failed:
                # The service went away while this daemon drained: nothing would keep the connection, and
                # closing it would leave the mount at ENOTCONN. Unmount as a plain SIGTERM does.
                log.warning("the node's holder service went away while draining: unmounting %s instead of"
                            " leaving it", self.mountpoint)
                stopping.leaving = False
                unmounted = True
                self.restart = self.keeper.let_go(unmounted=True, journal_failed=False, restarting=False,
                                                  exiting_now=stopping.exiting_now)
            else:
                self.restart = self.keeper.let_go(unmounted=unmounted, journal_failed=journal_failed,
                                                  restarting=stopping.restarting, exiting_now=stopping.exiting_now)
        if stopping.leaving:
            return 0
        if not unmounted or stopping.result is None or not stopping.result.ok:
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
        """A background service run by supervise() (services.py), its failures counted in this mount's faults."""
        await supervise(self.faults, name, service, task_status=task_status)

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
            self.stopping.fuse_done.set()
        # main() returns when the kernel ends the session: an external umount, or our terminate().
        if not self.stopping.requested.is_set():
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
                if self.stopping.requested.is_set():
                    log.warning("second signal: exiting now; pending uploads stay journaled for the next start")
                    self.stopping.exiting_now = True
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
                    self.stopping.leaving = True
                else:
                    log.info("%s: draining for up to %ss, then unmounting", name, timeout)
                self.request_stop(timeout)

    def statistics(self) -> MountStats:
        """Every statistic of the mount, read once (control/status.py derives the status, metrics and STATUS=)."""
        keeper = self.keeper
        keep_mount = KeepMount(keeper.link.holder_pid if keeper.link is not None else None, keeper.systemd_keeps,
                               self.held is not None, keeper.handles_taken_over, keeper.why)
        return gather(
            journal=self.journal, drain=self.drain, engine=self.engine, fetcher=self.fetcher, evictor=self.evictor,
            cache=self.cache, fs=self.fs, faults=self.faults, node_id=self.node_id, records=self.records,
            peers=self.peers, source=self.store.url, mountpoint=str(self.mountpoint), started_at=self.started_at,
            shutting_down=self.stopping.requested.is_set(), keep_mount=keep_mount,
            passthrough_why=self.passthrough_why, guard_why=self.guard_why,
            store_ops=self.store.op_stats if isinstance(self.store, InstrumentedStore) else None,
            fuse_ops=self.fuse_ops.op_stats if self.fuse_ops is not None else None,
            credentials=credential_state(self.store),
        )

    async def _serve_control(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        path = ctl.socket_path(self.mountpoint)
        try:
            await ctl.serve(path, self.control.answer, self.stopping.control_stop, task_status=task_status)
        finally:
            self.stopping.control_done.set()
