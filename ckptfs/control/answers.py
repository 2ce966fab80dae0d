"""The answers to the control socket's requests (`ckptfs status|flush|limit|nodes|preempt|prefetch|prune|refresh|
restart|umount`).

control/server.py is the socket (who may connect, one JSON object per line); this module decides what each request
does, through the parts of the mount it is given. What only the daemon's lifecycle can do (stop, restart,
say how it is) it asks of the daemon, as a `Lifecycle`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

import trio

from ckptfs.config import parse_rate
from ckptfs.control.status import MountStats, limits_json, status_json
from ckptfs.drain import Drain, FlushResult
from ckptfs.errors import CkptfsError, UsageError
from ckptfs.fetch.lister import DirLister
from ckptfs.nodes import HeldError, NodeRecords, PeerRecords
from ckptfs.notices.preempter import Preempter
from ckptfs.retention.pruner import Pruner
from ckptfs.transfer import Bandwidth

RETIRE_RECORDS_WAIT = 10.0  # after a flush or the unmount's drain: how long deleting this node's records may take
REMAINING_LISTED = 100  # a flush or unmount names this many entries not yet durable (and counts them all)


def deadline_after(timeout: float | None) -> float:
    """The trio deadline of a request's timeout (None: no deadline)."""
    return math.inf if timeout is None else trio.current_time() + float(timeout)


class Lifecycle(Protocol):
    """What the requests ask of the daemon itself."""

    def statistics(self) -> MountStats: ...

    def request_stop(self, timeout: float | None) -> None: ...

    async def stopped(self) -> FlushResult:
        """Once the stop drained (or gave up): what remained."""
        ...

    def begin_restart(self) -> str | None:
        """Hand the mount to a new daemon; why not, if it cannot."""
        ...


class PrefetchRun(Protocol):
    failures: list[str]

    def reply(self) -> dict[str, object]: ...


class Prefetching(Protocol):
    """fetch.prefetch.Prefetcher, as `ckptfs prefetch` uses it."""

    async def prefetch(self, path: str, *, wait: bool) -> PrefetchRun: ...

    def release(self, path: str) -> int: ...


class ControlRequests:
    """One mount's answers; `records` and `peers` are None without cross-node ordering."""

    def __init__(
        self, daemon: Lifecycle, drain: Drain, lister: DirLister, pruner: Pruner, *, cache_root: Path, node_id: str,
        records: NodeRecords | None, peers: PeerRecords | None, bandwidth: Bandwidth, preempter: Preempter,
        prefetcher: Prefetching,
    ) -> None:
        self.daemon = daemon
        self.drain = drain
        self.lister = lister
        self.pruner = pruner
        self.cache_root = cache_root
        self.node_id = node_id
        self.records = records
        self.peers = peers
        self.bandwidth = bandwidth
        self.preempter = preempter
        self.prefetcher = prefetcher

    async def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The answer to one request of the control socket (ctl.serve calls this)."""
        op = request.get("op")
        if op == "status":
            return {"ok": True, **status_json(self.daemon.statistics())}
        if op == "flush":
            paths = [p.strip("/") for p in request.get("paths") or []] or None
            deadline = deadline_after(request.get("timeout"))
            result = await self.drain.flush(paths, deadline)
            if result.ok and self.records is not None:
                # Flushed: this node's records whose work is done go now, not after LINGER, so that no
                # other node's marker waits for them and the store holds no bookkeeping of a quiet node.
                with trio.move_on_at(min(deadline, trio.current_time() + RETIRE_RECORDS_WAIT)):
                    await self.records.tidy(final=True)
            if result.ok and request.get("all_nodes"):
                result = await self._flush_other_nodes(deadline)
            return {"ok": result.ok, "remaining": result.remaining[:REMAINING_LISTED],
                    "remaining_count": len(result.remaining)}
        if op == "limit":
            return self._limit(request)
        if op == "preempt":
            return await self._preempt(request)
        if op == "nodes":
            return await self._nodes(request)
        if op == "prefetch":
            return await self._prefetch(request)
        if op == "prune":
            keep_last = request.get("keep_last")
            if not isinstance(keep_last, int) or keep_last < 1:
                return {"ok": False, "error": "keep_last must be a whole number >= 1"}
            pruned = await self.pruner.prune(keep_last, tuple(request.get("keep") or ()),
                                             dry_run=bool(request.get("dry_run")))
            return {"ok": True, "delete": pruned.delete, "reasons": pruned.reasons}
        if op == "refresh":
            await self.lister.refresh()
            return {"ok": True}
        if op == "restart":
            refused = self.daemon.begin_restart()
            if refused is not None:
                return {"ok": False, "error": refused}
            return {"ok": True, "pid": os.getpid()}
        if op == "umount":
            self.daemon.request_stop(request.get("timeout"))
            result = await self.daemon.stopped()
            return {
                "ok": result.ok,
                "remaining": result.remaining[:REMAINING_LISTED],
                "remaining_count": len(result.remaining),
                "cache_dir": str(self.cache_root),
                "pid": os.getpid(),
            }
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _limit(self, request: dict[str, Any]) -> dict[str, Any]:
        """`ckptfs limit`: change the bandwidth caps given (a rate, or "off"/0), until the timetable's next entry
        or the daemon's restart; answer with the caps in effect. Transfers waiting for their turn see a change
        at once (bandwidth.Direction.set_runtime)."""
        changes = {}
        for direction in ("upload", "download"):
            value = request.get(direction)
            if value is None:
                continue
            try:
                if not isinstance(value, str | int) or isinstance(value, bool):
                    raise UsageError(f"{direction} limit {value!r} is not a rate; use bytes per second like 200M, or"
                                     " off")
                changes[direction] = parse_rate(value, f"{direction} limit")
            except UsageError as exc:  # nothing is changed when one of the two is wrong
                return {"ok": False, "error": str(exc), "usage": True}
        for direction, rate in changes.items():
            self.bandwidth.direction(direction).set_runtime(rate)
        return {"ok": True, "limits": limits_json(*self.bandwidth.now())}

    async def _preempt(self, request: dict[str, Any]) -> dict[str, Any]:
        """`ckptfs preempt`: a preemption notice with `deadline` seconds left (notices/preempter.py); with `wait`,
        answer with the report once it is written (when every complete step is durable, or at the deadline)."""
        seconds = request.get("deadline")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
            return {"ok": False, "usage": True,
                    "error": f"deadline {seconds!r} is not a number of seconds > 0; give the time left, like 30"}
        self.preempter.begin(float(seconds), reason=str(request.get("reason") or "ckptfs preempt"),
                             lift_limits=not request.get("keep_limits"))
        if not request.get("wait", True):
            return {"ok": True, "report": None, "report_path": str(self.preempter.report_path)}
        report = await self.preempter.wait_report()
        return {"ok": True, "report": report, "report_path": str(self.preempter.report_path)}
    async def _prefetch(self, request: dict[str, Any]) -> dict[str, Any]:
        """`ckptfs prefetch`: fetch a path's files into the cache and keep them until read (fetch/prefetch.py);
        `wait`: answer once done; `release`: let kept files under the path be evicted again instead."""
        path = request.get("path")
        if not isinstance(path, str):
            return {"ok": False, "error": "prefetch needs a path inside the mount", "usage": True}
        path = path.strip("/")
        if request.get("release"):
            return {"ok": True, "released": self.prefetcher.release(path)}
        try:
            job = await self.prefetcher.prefetch(path, wait=bool(request.get("wait")))
        except UsageError as exc:
            return {"ok": False, "error": str(exc), "usage": True}
        reply = job.reply()
        return {"ok": not job.failures, **reply}

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
            await self.peers.refresh(entries=True)
        return {"ok": True, "this_node": self.node_id, "nodes": self.peers.nodes(),
                "waiting_markers": self.peers.waiting_markers(), "forgot_records": forgotten}
