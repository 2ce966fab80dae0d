"""How a mount's daemon stops, in order, and the state of a stop.

Owns the stop: whether one is requested and how (a plain stop drains and unmounts; `ckptfs restart` hands
the connection to a new daemon; SIGTERM with keep_mount_on_stop drains while serving, then leaves the
connection to the node's holder service; a second signal exits now), its deadline, the drain's result, and
the events the run loop and the control socket wait on. The order of a plain stop: stop new opens for
writing, drain with the deadline, retire this node's records, unmount, let the control clients have their
answer. What is not uploaded by the deadline stays journaled for the next start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import trio

from ckptfs.control.answers import RETIRE_RECORDS_WAIT, deadline_after
from ckptfs.control.status import MountStats, status_line
from ckptfs.drain import Drain, FlushResult
from ckptfs.fs import Filesystem
from ckptfs.keepmount.systemd import Notifier
from ckptfs.nodes import NodeRecords
from ckptfs.notices.preempter import Preempter

log = logging.getLogger(__name__)

# `ckptfs restart`: how long the requests being served may take to finish before the connection goes to the
# new daemon anyway (the kernel sends it the unfinished ones again)
RESTART_REQUESTS_WAIT = 10.0
# A stop under a preemption notice: how long it waits past its drain for the report to be written.
PREEMPTION_REPORT_WAIT = 2.0
# How long a stop waits for the control clients (ckptfs umount) to receive their answer.
CONTROL_ANSWER_WAIT = 5.0


class Stopping:
    def __init__(
        self, drain_timeout: float | None, *, drain: Drain, fs: Filesystem, records: NodeRecords | None,
        preempter: Preempter, notifier: Notifier, statistics: Callable[[], MountStats],
        terminate: Callable[[], None], mountpoint: Path, store_url: str, cache_root: Path,
    ) -> None:
        self.drain = drain
        self.fs = fs
        self.records = records
        self.preempter = preempter
        self.notifier = notifier
        self.statistics = statistics
        self.terminate = terminate  # pyfuse3.terminate: the FUSE session ends
        self.mountpoint = mountpoint
        self.store_url = store_url
        self.cache_root = cache_root
        self.requested = trio.Event()
        self.timeout = drain_timeout  # the drain's deadline, from the stop's request
        self.exiting_now = False  # a second signal: unmount without draining (not a failure to recover from)
        self.restarting = False  # `ckptfs restart`: hand the connection to a new daemon instead of unmounting
        self.leaving = False  # SIGTERM with keep_mount_on_stop: leave the connection to the holder service
        self.result: FlushResult | None = None
        self.fuse_done = trio.Event()  # pyfuse3.main() returned
        self.finished = trio.Event()
        self.control_stop = trio.Event()  # the control socket stops serving
        self.control_done = trio.Event()  # ... and has stopped

    def request(self, timeout: float | None) -> None:
        if not self.requested.is_set():
            self.timeout = timeout
            self.requested.set()

    async def stopped(self) -> FlushResult:
        await self.finished.wait()
        assert self.result is not None
        return self.result

    async def shutdown(self) -> None:
        self.notifier.notify(stopping=1, status=status_line(self.statistics()))
        self.fs.stop_writes()
        self.result = await self.drain.flush(None, deadline_after(self.timeout))
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
                len(self.result.remaining), self.store_url, self.cache_root,
            )
        self.terminate()
        self.finished.set()
        # Let control clients (ckptfs umount) receive their answer before the nursery is cancelled.
        self.control_stop.set()
        with trio.move_on_after(CONTROL_ANSWER_WAIT):
            await self.control_done.wait()

    async def _preemption_reported(self) -> None:
        """A stop under a preemption notice: its report is written before the daemon goes (for a moment)."""
        if self.preempter.active and not self.preempter.reported.is_set():
            with trio.move_on_after(PREEMPTION_REPORT_WAIT):
                await self.preempter.reported.wait()

    async def drain_before_leaving(self) -> None:
        """SIGTERM with keep_mount_on_stop: upload what is pending for up to drain_timeout while the mount
        goes on serving as before (the job keeps saving: nothing refuses its writes), then leave. What is
        not uploaded by then stays journaled for the next daemon, which the node may never start (a node
        drained for good)."""
        self.notifier.notify(stopping=1, status="draining before leaving the mount to the holder service")
        self.result = await self.drain.flush(None, deadline_after(self.timeout))
        await self._preemption_reported()
        if self.result.ok:
            log.info("drained; leaving the mount of %s to the holder service", self.mountpoint)
        else:
            log.warning("%d entries not yet durable in %s; the mount goes to the holder service anyway and they"
                        " stay journaled at %s for the next daemon", len(self.result.remaining), self.store_url,
                        self.cache_root)

    async def stop_serving(self) -> None:
        """`ckptfs restart`: stop reading requests, let the ones being served finish (for a while), answer
        the control clients; the connection, the open handles and the journal stay as they are for the new
        daemon (uploads cut short resume there)."""
        if self.restarting:
            log.info("restarting: the FUSE connection of %s goes to a new daemon started from the code installed"
                     " now", self.mountpoint)
            self.notifier.notify(status="restarting: handing the mount to a new daemon")
        self.terminate()
        with trio.move_on_after(RESTART_REQUESTS_WAIT):
            await self.fuse_done.wait()
        self.control_stop.set()
        with trio.move_on_after(CONTROL_ANSWER_WAIT):
            await self.control_done.wait()
