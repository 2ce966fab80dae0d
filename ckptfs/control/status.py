"""How a mount is doing, gathered once and told three ways: `ckptfs status` (the JSON of the control
socket), the Prometheus metrics (metrics.METRICS names them) and systemd's one-line STATUS=.

`gather` reads every statistic once, in the trio thread (journal queries must not run elsewhere), into a
`MountStats`; `status_json`, `metrics_snapshot` and `status_line` only reshape it, so the three views
cannot disagree. The status JSON keys and the metric names are an interface (docs/METRICS.md, cli/show.py,
tests): change them only together with those.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from ckptfs.backends.base import CredentialState
from ckptfs.cache.directory import CacheDir
from ckptfs.cache.evictor import Evictor, EvictStats
from ckptfs.config import human_size
from ckptfs.control.metrics import OpStats, Snapshot
from ckptfs.drain import Drain, DrainStats, Parked
from ckptfs.errors import Faults
from ckptfs.fetch import Fetcher, FetchStats
from ckptfs.fs import Filesystem
from ckptfs.journal import Journal
from ckptfs.nodes import NodeRecords, PeerRecords
from ckptfs.transfer import LimitNow, Transfers, TransferStats, timetable_text

STATES = ("dirty", "uploading", "clean", "remote")
FAILING_LISTED = 100  # `ckptfs status` names this many parked jobs (and counts them all)


@dataclass(frozen=True)
class KeepMount:
    """What keeps the mount's connection beyond this daemon (keepmount/holder.py, systemd's store), and what this
    daemon took over."""

    holder_pid: int | None
    systemd_keeps: bool
    took_over: bool
    handles_taken_over: int
    why: str  # "on: ..." or "off: ..." with what it takes to get it (takeover.ConnectionKeeper.why)

    @property
    def enabled(self) -> bool:
        return self.why.startswith("on")


@dataclass(frozen=True)
class NodesView:
    """Cross-node ordering as this node sees it; `records` is None where it is off."""

    node_id: str
    records: dict[str, Any] | None  # NodeRecords.status()
    announce_failures: int
    waiting_markers: list[dict[str, Any]]
    waiting_per_node: dict[tuple[str, str], int]
    listing_error: str | None


@dataclass(frozen=True)
class MountStats:
    """Every statistic of one mount at one moment. The stats objects of the drain, the evictor, the
    fetcher and the engine are their live counters: derive the views in the same trio step as `gather`."""

    taken_at: float  # wall-clock time of the gathering
    source: str
    mountpoint: str
    cache_dir: str
    pid: int
    started_at: float
    shutting_down: bool
    keep_mount: KeepMount
    states: dict[str, dict[str, int]]  # state -> {"files": n, "bytes": n}, as LocalCopies.state_summary
    uploads_pending: int
    moves_pending: int
    deletes_pending: int
    in_flight: int  # drain jobs running
    oldest_dirty_closed_at: float | None
    open_for_write: int
    nodes: NodesView
    passthrough_enabled: bool
    passthrough_why: str
    guard_why: str  # "on: ..." or "off: ..." (guard.availability)
    passthrough_opens: int
    passthrough_files: int
    passthrough_refused: int
    cache_used: int
    cache_limit: float  # math.inf: no budget
    cache_squeezed: bool
    cache_hits: int
    cache_misses: int
    writes_waiting: int
    evictions: EvictStats
    reads: FetchStats
    drain: DrainStats
    moved: TransferStats
    failing: list[tuple[str, Parked]]
    markers_held: list[tuple[str, str]]  # (commit marker, the failing entry that holds it back)
    preempting: bool
    faults: Faults
    store_ops: OpStats | None  # None: the store is not instrumented
    fuse_ops: OpStats | None  # None: not serving yet
    credentials: CredentialState | None = None  # None: the store signs with none (file://)


def gather(
    *, journal: Journal, drain: Drain, engine: Transfers, fetcher: Fetcher, evictor: Evictor, cache: CacheDir,
    fs: Filesystem, faults: Faults, node_id: str, records: NodeRecords | None, peers: PeerRecords | None,
    source: str, mountpoint: str, started_at: float, shutting_down: bool, keep_mount: KeepMount,
    passthrough_why: str, guard_why: str, store_ops: OpStats | None, fuse_ops: OpStats | None,
    credentials: CredentialState | None = None,
) -> MountStats:
    if records is not None and peers is not None:
        nodes = NodesView(node_id, records.status(), records.announce_failures, peers.waiting_markers(),
                          peers.waiting_per_node(), peers.last_error)
    else:
        nodes = NodesView(node_id, None, 0, [], {}, None)
    return MountStats(
        taken_at=time.time(), source=source, mountpoint=mountpoint, cache_dir=str(cache.root), pid=os.getpid(),
        started_at=started_at, shutting_down=shutting_down, keep_mount=keep_mount,
        states=journal.copies.state_summary(), uploads_pending=len(journal.work.pending_uploads()),
        moves_pending=len(journal.work.misplaced()), deletes_pending=len(journal.deletes.pending_deletes()),
        in_flight=drain.in_flight(), oldest_dirty_closed_at=journal.work.oldest_dirty_closed_at(),
        open_for_write=fs.open_writers(), nodes=nodes,
        passthrough_enabled=fs.backing is not None, passthrough_why=passthrough_why, guard_why=guard_why,
        passthrough_opens=fs.passthrough_opens, passthrough_files=fs.passthrough_files(),
        passthrough_refused=fs.passthrough_errors,
        cache_used=cache.used, cache_limit=cache.limit, cache_squeezed=cache.squeezed,
        cache_hits=fs.cache_hits, cache_misses=fs.cache_misses, writes_waiting=evictor.waiting,
        evictions=evictor.stats, reads=fetcher.statistics(), drain=drain.stats, moved=engine.statistics(),
        failing=drain.failing(), markers_held=drain.markers_held(), preempting=drain.preemption.active,
        faults=faults, store_ops=store_ops, fuse_ops=fuse_ops, credentials=credentials,
    )


def credential_state(store: object) -> CredentialState | None:
    """The state of the credential a store signs with, if it has one (backends/base.CredentialState)."""
    credentials = getattr(store, "credentials", None)
    state = getattr(credentials, "state", None)
    return state() if callable(state) else None


def credentials_json(state: CredentialState | None, now: float) -> dict[str, Any] | None:
    """`ckptfs status`'s "credentials": where the store's credential comes from and when it expires."""
    if state is None:
        return None
    return {
        "source": state.source,
        "detail": state.detail,
        "expires_at": state.expires_at,
        "expires_in_seconds": None if state.expires_at is None else round(state.expires_at - now, 1),
        "fetched_at": state.fetched_at,
        "refreshes": state.refreshes,
        "renewals_after_rejection": state.renewals_after_rejection,
        "last_error": state.last_error,
    }


def _count(stats: MountStats, state: str, what: str) -> int:
    return stats.states.get(state, {}).get(what, 0)


def status_json(stats: MountStats) -> dict[str, Any]:
    """The answer to `ckptfs status` (without "ok")."""
    drain, moved, reads, evictions = stats.drain, stats.moved, stats.reads, stats.evictions
    last_error, last_error_at = drain.last_error, drain.last_error_at
    faults = stats.faults
    if faults.last_at is not None and (last_error_at is None or faults.last_at > last_error_at):
        last_error, last_error_at = faults.last, faults.last_at
    oldest = stats.oldest_dirty_closed_at
    return {
        "source": stats.source,
        "mountpoint": stats.mountpoint,
        "cache_dir": stats.cache_dir,
        "pid": stats.pid,
        "uptime_seconds": round(stats.taken_at - stats.started_at, 1),
        "started_at": stats.started_at,
        "keep_mount": {
            "holder_pid": stats.keep_mount.holder_pid,
            "systemd_keeps": stats.keep_mount.systemd_keeps,
            "took_over": stats.keep_mount.took_over,
            "handles_taken_over": stats.keep_mount.handles_taken_over,
            "enabled": stats.keep_mount.enabled,
            "why": stats.keep_mount.why,
        },
        "guard": {"enabled": stats.guard_why.startswith("on"), "why": stats.guard_why},
        "states": {s: stats.states.get(s, {"files": 0, "bytes": 0}) for s in STATES},
        "queue": {
            "uploads": stats.uploads_pending,
            "moves": stats.moves_pending,
            "deletes": stats.deletes_pending,
            "in_flight": stats.in_flight,
        },
        "drain": {"scans": drain.scans, "last_scan_at": drain.last_scan_at, "idle": drain.idle,
                  "next_scan_at": drain.next_scan_at},
        "oldest_dirty_age_seconds": round(stats.taken_at - oldest, 1) if oldest else None,
        "open_for_write": stats.open_for_write,
        "nodes": _nodes_json(stats.nodes),
        "passthrough": {
            "enabled": stats.passthrough_enabled,
            "why": stats.passthrough_why,
            "opens": stats.passthrough_opens,
            "files_open": stats.passthrough_files,
            "refused": stats.passthrough_refused,
        },
        "cache": {
            "used_bytes": stats.cache_used,
            "budget_bytes": int(stats.cache_limit) if stats.cache_limit != math.inf else None,
            "short_of_free_space": stats.cache_squeezed,
            "evicted_files": evictions.evicted_files,
            "evicted_bytes": evictions.evicted_bytes,
            "writes_waiting": stats.writes_waiting,
            "waits": evictions.waits,
            "wait_seconds": round(evictions.wait_seconds, 3),
            "enospc": evictions.enospc,
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
        "prefetch": {
            "files_prefetched": reads.prefetched_files,
            "bytes_prefetched": reads.prefetched_bytes,
            "files_pending": reads.prefetch_pending_files,
            "bytes_pending": reads.prefetch_pending_bytes,
            "files_kept": reads.kept_files,
            "bytes_kept": reads.kept_bytes,
            "failures": reads.prefetch_failures,
        },
        "uploaded": {
            "files": drain.uploaded_files,
            "bytes": drain.uploaded_bytes,
            "seconds": round(drain.upload_seconds, 3),
            "moves": drain.moves,
            "deletes": drain.deletes,
            "spilled_bytes": drain.spilled_bytes,
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
        "limits": limits_json(moved.upload_limit, moved.download_limit),
        "credentials": credentials_json(stats.credentials, stats.taken_at),
        "errors": drain.errors,
        "last_error": last_error,
        "last_error_at": last_error_at,
        "internal_errors": dict(faults.counts),
        "failing": [
            {"path": path, "job": parked.job, "error": parked.error, "since": parked.since}
            for path, parked in stats.failing[:FAILING_LISTED]
        ],
        "failing_count": len(stats.failing),
        "markers_held": [{"marker": marker, "held_by": by} for marker, by in stats.markers_held[:FAILING_LISTED]],
        "markers_held_count": len(stats.markers_held),
        "preempting": stats.preempting,
        "shutting_down": stats.shutting_down,
    }


def limits_json(upload: LimitNow | None, download: LimitNow | None) -> dict[str, Any]:
    """The bandwidth caps in effect, as `ckptfs status` and `ckptfs limit` show them."""
    return {"upload": _limit_json(upload), "download": _limit_json(download)}


def _limit_json(limit: LimitNow | None) -> dict[str, Any]:
    """One direction's bandwidth cap: the rate now (None: none), where it comes from, until when."""
    if limit is None:
        return {"bytes_per_second": None, "source": "config", "entry": None, "until": None, "configured": "off",
                "waiting": 0}
    return {
        "bytes_per_second": limit.rate,
        "source": limit.source,  # config, timetable, runtime (`ckptfs limit`) or lifted
        "entry": limit.entry,  # the timetable entry in effect ("08:00")
        "until": limit.until,  # wall-clock time of the timetable's next entry, if any
        "configured": timetable_text(limit.timetable),
        "waiting": limit.waiting,  # transfers waiting for their turn under the cap
    }


def _limit_value(limit: LimitNow | None) -> float:
    return 0.0 if limit is None or limit.rate is None else float(limit.rate)


def _nodes_json(nodes: NodesView) -> dict[str, Any]:
    if nodes.records is None:
        return {"node": nodes.node_id, "cross_node_ordering": False}
    return {**nodes.records, "cross_node_ordering": True, "waiting_markers": nodes.waiting_markers,
            "listing_error": nodes.listing_error}


def metrics_snapshot(stats: MountStats) -> Snapshot:
    """Every metric's current value (metrics.METRICS names them)."""
    drain, moved, reads, evictions = stats.drain, stats.moved, stats.reads, stats.evictions
    oldest = stats.oldest_dirty_closed_at
    out: Snapshot = {
        "ckptfs_files": [((s,), _count(stats, s, "files")) for s in STATES],
        "ckptfs_bytes": [((s,), _count(stats, s, "bytes")) for s in STATES],
        "ckptfs_upload_queue": [
            (("uploads",), stats.uploads_pending),
            (("moves",), stats.moves_pending),
            (("deletes",), stats.deletes_pending),
        ],
        "ckptfs_transfers_in_flight": [((), stats.in_flight)],
        "ckptfs_transfer_parts_in_flight": [(("up",), moved.parts_up), (("down",), moved.parts_down)],
        "ckptfs_transfer_bytes": [(("up",), moved.bytes_up), (("down",), moved.bytes_down)],
        "ckptfs_transfer_retries": [((), moved.retries)],
        "ckptfs_transfer_memory_bytes": [((), moved.memory_in_use)],
        "ckptfs_transfer_memory_budget_bytes": [((), moved.memory_budget)],
        "ckptfs_upload_limit_bytes_per_second": [((), _limit_value(moved.upload_limit))],
        "ckptfs_download_limit_bytes_per_second": [((), _limit_value(moved.download_limit))],
        "ckptfs_oldest_dirty_age_seconds": [((), max(0.0, stats.taken_at - oldest) if oldest else 0.0)],
        "ckptfs_cache_used_bytes": [((), stats.cache_used)],
        "ckptfs_cache_budget_bytes": [((), stats.cache_limit if stats.cache_limit != math.inf else 0)],
        "ckptfs_uploaded_files": [((), drain.uploaded_files)],
        "ckptfs_uploaded_bytes": [((), drain.uploaded_bytes)],
        "ckptfs_upload_seconds": [((), drain.upload_seconds)],
        "ckptfs_spilled_bytes": [((), drain.spilled_bytes)],
        "ckptfs_drain_errors": [((job,), n) for job, n in sorted(drain.errors_by_job.items())],
        "ckptfs_internal_errors": [((where,), n) for where, n in sorted(stats.faults.counts.items())],
        "ckptfs_passthrough_enabled": [((), 1.0 if stats.passthrough_enabled else 0.0)],
        "ckptfs_keep_mount_enabled": [((), 1.0 if stats.keep_mount.enabled else 0.0)],
        "ckptfs_guard_enabled": [((), 1.0 if stats.guard_why.startswith("on") else 0.0)],
        "ckptfs_passthrough_opens": [((), stats.passthrough_opens)],
        "ckptfs_drain_parked": [((), len(stats.failing))],
        "ckptfs_markers_held": [((), len(stats.markers_held))],
        "ckptfs_preempting": [((), 1.0 if stats.preempting else 0.0)],
        "ckptfs_node_records": [((), len(stats.nodes.records["records"]) if stats.nodes.records else 0)],
        "ckptfs_node_record_failures": [((), stats.nodes.announce_failures)],
        "ckptfs_markers_waiting_for_nodes": [((), len(stats.nodes.waiting_markers))],
        "ckptfs_waiting_for_node": [((node, entry), n)
                                    for (node, entry), n in sorted(stats.nodes.waiting_per_node.items())],
        "ckptfs_cache_hits": [((), stats.cache_hits)],
        "ckptfs_cache_misses": [((), stats.cache_misses)],
        "ckptfs_fetch_bytes": [((), reads.bytes_downloaded)],
        "ckptfs_fetch_chunks": [((), reads.chunks_fetched)],
        "ckptfs_fetch_chunks_punched": [((), reads.chunks_punched)],
        "ckptfs_fetch_readers_waiting": [((), reads.readers_waiting)],
        "ckptfs_fetch_partial_bytes": [((), reads.partial_bytes)],
        "ckptfs_fetch_checksum_failures": [((), reads.checksum_failures)],
        "ckptfs_prefetch_files": [((), reads.prefetched_files)],
        "ckptfs_prefetch_bytes": [((), reads.prefetched_bytes)],
        "ckptfs_prefetch_failures": [((), reads.prefetch_failures)],
        "ckptfs_prefetch_pending_bytes": [((), reads.prefetch_pending_bytes)],
        "ckptfs_prefetch_kept_bytes": [((), reads.kept_bytes)],
        "ckptfs_evicted_files": [((), evictions.evicted_files)],
        "ckptfs_evicted_bytes": [((), evictions.evicted_bytes)],
        "ckptfs_backpressure_waits": [((), evictions.waits)],
        "ckptfs_backpressure_wait_seconds": [((), evictions.wait_seconds)],
        "ckptfs_backpressure_enospc": [((), evictions.enospc)],
    }
    if stats.credentials is not None:
        source = (stats.credentials.source,)
        out.update(ckptfs_credential_expiry_timestamp_seconds=[(source, stats.credentials.expires_at or 0.0)],
                   ckptfs_credential_refreshes=[(source, stats.credentials.refreshes)],
                   ckptfs_credential_rejections=[(source, stats.credentials.renewals_after_rejection)])
    if stats.store_ops is not None:
        calls, errors, seconds = stats.store_ops.rows()
        out.update(ckptfs_store_requests=calls, ckptfs_store_errors=errors, ckptfs_store_seconds=seconds)
    if stats.fuse_ops is not None:
        calls, errors, seconds = stats.fuse_ops.rows()
        out.update(ckptfs_fuse_requests=calls, ckptfs_fuse_errors=errors, ckptfs_fuse_seconds=seconds)
    return out


def status_line(stats: MountStats) -> str:
    """systemd's STATUS=: what is not yet in the store, in one line."""
    pending_files = sum(_count(stats, s, "files") for s in ("dirty", "uploading"))
    pending_bytes = sum(_count(stats, s, "bytes") for s in ("dirty", "uploading"))
    what = "draining before unmount" if stats.shutting_down else "mounted"
    return (f"{what}: {pending_files} files ({human_size(pending_bytes)}) not yet uploaded,"
            f" {stats.in_flight} transfers in flight, cache {human_size(stats.cache_used)} used")

