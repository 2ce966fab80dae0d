"""Every Prometheus metric of ckptfs, defined in one place (METRICS), and the HTTP endpoint that serves them.

The daemon builds a snapshot of all values in the trio thread about once a second (journal queries must
not run in the HTTP server's thread) and hands it to `MetricsServer.publish`; a scrape renders the latest
snapshot. Counters the hot paths keep are plain integers read at snapshot time, so instrumenting costs the
FUSE write path no lock and no allocation. docs/METRICS.md lists the same set (a test checks they agree).

This module knows nothing of the rest of ckptfs: `InstrumentedStore` wraps any object store by duck typing.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import Metric


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...] = ()


METRICS: tuple[MetricDef, ...] = (
    MetricDef("ckptfs_files", "gauge", "Files in the mount by state (dirty, uploading, clean, remote).", ("state",)),
    MetricDef("ckptfs_bytes", "gauge", "Bytes of the files in the mount by state.", ("state",)),
    MetricDef("ckptfs_upload_queue", "gauge", "Entries waiting for the drain: uploads, moves, deletes.", ("kind",)),
    MetricDef("ckptfs_transfers_in_flight", "gauge", "Drain jobs running now."),
    MetricDef("ckptfs_transfer_parts_in_flight", "gauge",
              "Part transfers in flight now, by direction (up, down).", ("direction",)),
    MetricDef("ckptfs_transfer_bytes", "counter", "Bytes of part data moved, by direction.", ("direction",)),
    MetricDef("ckptfs_transfer_retries", "counter", "Part and request retries after transient store errors."),
    MetricDef("ckptfs_transfer_memory_bytes", "gauge",
              "Bytes of part data held in memory now, spare part buffers included."),
    MetricDef("ckptfs_transfer_memory_budget_bytes", "gauge", "The memory budget of all transfers (memory_budget)."),
    MetricDef("ckptfs_upload_limit_bytes_per_second", "gauge",
              "The upload cap in effect now, bytes per second (upload_limit, its timetable or `ckptfs limit`);"
              " 0: none."),
    MetricDef("ckptfs_download_limit_bytes_per_second", "gauge",
              "The download cap in effect now, bytes per second (download_limit, its timetable or `ckptfs limit`);"
              " 0: none."),
    MetricDef("ckptfs_oldest_dirty_age_seconds", "gauge",
              "Seconds since the oldest file not yet uploaded was closed (0 if none)."),
    MetricDef("ckptfs_cache_used_bytes", "gauge", "Bytes the cache's data files hold (apparent size)."),
    MetricDef("ckptfs_cache_budget_bytes", "gauge",
              "The cache budget (cache_size, lowered to keep min_free, but not below the room a spill needs)."),
    MetricDef("ckptfs_uploaded_files", "counter", "Files committed to the store since start."),
    MetricDef("ckptfs_uploaded_bytes", "counter", "Bytes committed to the store since start."),
    MetricDef("ckptfs_upload_seconds", "counter", "Seconds spent uploading files (summed over uploads)."),
    MetricDef("ckptfs_spilled_bytes", "counter",
              "Bytes of files still being written uploaded (to make room, or early: upload_while_writing)."),
    MetricDef("ckptfs_drain_errors", "counter",
              "Drain jobs that failed and will be retried, by job (upload, move, meta, delete, spill).", ("job",)),
    MetricDef("ckptfs_internal_errors", "counter",
              "Unexpected errors survived (a bug met by one entry, request or task), by where they happened.",
              ("where",)),
    MetricDef("ckptfs_credential_expiry_timestamp_seconds", "gauge",
              "When the store's credential expires (Unix time; 0: it does not expire or does not say), by source"
              " (web-identity, container, env, assume-role, adc:..., DefaultAzureCredential, ...).", ("source",)),
    MetricDef("ckptfs_credential_refreshes", "counter",
              "Times the store's credential was fetched again since start (before its expiry, or after the store"
              " rejected it), by source.", ("source",)),
    MetricDef("ckptfs_credential_rejections", "counter",
              "Times the store answered that the credential had expired and ckptfs fetched it again and sent the"
              " request once more (the request then went on; an alert on its rate finds clock skew or revoked"
              " sessions), by source.", ("source",)),
    MetricDef("ckptfs_drain_parked", "gauge",
              "Drain jobs parked after failing unexpectedly again and again (ckptfs status names them)."),
    MetricDef("ckptfs_markers_held", "gauge",
              "Commit markers held back by a parked entry of their step: a checkpoint that will not be published"
              " until it uploads (ckptfs status names both). Alert on > 0."),
    MetricDef("ckptfs_preempting", "gauge",
              "1 once a preemption notice came (ckptfs preempt, SIGTERM with preempt_on_sigterm, a watcher)."),
    MetricDef("ckptfs_passthrough_enabled", "gauge",
              "1 when the kernel reads and writes cached files itself (FUSE passthrough), 0 when it is off."),
    MetricDef("ckptfs_passthrough_opens", "counter", "Opens served with FUSE passthrough since start."),
    MetricDef("ckptfs_keep_mount_enabled", "gauge",
              "1 when something besides the daemon keeps the FUSE connection (a holder, the node's holder service,"
              " systemd), so that the mount outlives the daemon; 0 when it does not (ckptfs status says why)."),
    MetricDef("ckptfs_guard_enabled", "gauge",
              "1 when the daemon guards the bare mountpoint after the mount ends; 0 when it cannot or may not."),
    MetricDef("ckptfs_node_records", "gauge",
              "This node's pending records in the store (cross-node ordering): it has work not yet durable."),
    MetricDef("ckptfs_node_record_failures", "counter",
              "Times this node's pending record could not be written (closes went on without it)."),
    MetricDef("ckptfs_markers_waiting_for_nodes", "gauge",
              "Commit markers of this node waiting for other nodes' files (ckptfs nodes names them)."),
    MetricDef("ckptfs_waiting_for_node", "gauge",
              "Commit markers of this node waiting for one other node, by node and checkpoint (top-level"
              " entry) it has work pending in; held markers wait for nodes given up on.", ("node", "checkpoint")),
    MetricDef("ckptfs_store_requests", "counter", "Calls to the object store, by operation.", ("op",)),
    MetricDef("ckptfs_store_errors", "counter", "Failed calls to the object store, by operation.", ("op",)),
    MetricDef("ckptfs_store_seconds", "counter", "Seconds spent in object store calls, by operation.", ("op",)),
    MetricDef("ckptfs_cache_hits", "counter", "Opens of files whose data was in the cache."),
    MetricDef("ckptfs_cache_misses", "counter", "Opens that had to download the file from the store."),
    MetricDef("ckptfs_fetch_bytes", "counter", "Bytes downloaded for reads of remote files (chunks)."),
    MetricDef("ckptfs_fetch_chunks", "counter", "Chunks downloaded for reads of remote files."),
    MetricDef("ckptfs_fetch_chunks_punched", "counter",
              "Chunks of partial files freed to make room (downloaded again if read again)."),
    MetricDef("ckptfs_fetch_readers_waiting", "gauge", "Reads waiting for a chunk from the store now."),
    MetricDef("ckptfs_fetch_partial_bytes", "gauge", "Bytes of partial files of remote objects in the cache now."),
    MetricDef("ckptfs_fetch_checksum_failures", "counter",
              "Remote files whose downloaded bytes did not match their checksum (reads got EIO)."),
    MetricDef("ckptfs_prefetch_files", "counter", "Files `ckptfs prefetch` fetched into the cache."),
    MetricDef("ckptfs_prefetch_bytes", "counter", "Bytes of the files `ckptfs prefetch` fetched into the cache."),
    MetricDef("ckptfs_prefetch_failures", "counter", "Files a prefetch could not fetch (see the log)."),
    MetricDef("ckptfs_prefetch_pending_bytes", "gauge", "Bytes running prefetches have yet to fetch."),
    MetricDef("ckptfs_prefetch_kept_bytes", "gauge",
              "Bytes of prefetched files not read yet: kept from eviction until opened or released."),
    MetricDef("ckptfs_evicted_files", "counter", "Clean files evicted from the cache."),
    MetricDef("ckptfs_evicted_bytes", "counter", "Bytes evicted from the cache."),
    MetricDef("ckptfs_backpressure_waits", "counter", "Writes and fetches that waited for room in the cache."),
    MetricDef("ckptfs_backpressure_wait_seconds", "counter", "Seconds writes and fetches waited for room."),
    MetricDef("ckptfs_backpressure_enospc", "counter", "Waits for room that gave up after dirty_wait (ENOSPC)."),
    MetricDef("ckptfs_fuse_requests", "counter", "FUSE requests answered, by operation.", ("op",)),
    MetricDef("ckptfs_fuse_errors", "counter", "FUSE requests answered with an error, by operation.", ("op",)),
    MetricDef("ckptfs_fuse_seconds", "counter", "Seconds spent answering FUSE requests, by operation.", ("op",)),
)
BY_NAME = {m.name: m for m in METRICS}

# name -> [(label values, value)]; built by status.metrics_snapshot.
Snapshot = dict[str, list[tuple[tuple[str, ...], float]]]


class OpStats:
    """Count, errors and seconds per operation, and when the last one ended; updated without locks from one
    thread at a time per key (the FUSE loop or a store worker thread: a lost increment under a race only
    blurs a counter)."""

    __slots__ = ("calls", "errors", "last_at", "seconds")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        # time.perf_counter() at the end of the last call (-inf: none yet). For the FUSE requests the drain
        # reads it to tell a writer's requests arriving back to back (Drain.foreground_at).
        self.last_at = -math.inf

    def record(self, op: str, started: float, failed: bool) -> None:
        """One call of `op` that began at `started` (time.perf_counter()) ended now."""
        self.last_at = ended = time.perf_counter()
        self.calls[op] = self.calls.get(op, 0) + 1
        self.seconds[op] = self.seconds.get(op, 0.0) + (ended - started)
        if failed:
            self.errors[op] = self.errors.get(op, 0) + 1

    def rows(self) -> tuple[list[tuple[tuple[str, ...], float]], ...]:
        ops = sorted(self.calls)
        return (
            [((op,), float(self.calls[op])) for op in ops],
            [((op,), float(self.errors.get(op, 0))) for op in ops],
            [((op,), self.seconds.get(op, 0.0)) for op in ops],
        )


class InstrumentedStore:
    """An object store whose every method call is counted and timed (ckptfs_store_*)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.op_stats = OpStats()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("_") or not callable(value):
            return value
        return self._timed(name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("_inner", "op_stats", "_lock"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)  # e.g. store.owner = ..., set by the daemon

    def _timed(self, op: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            failed = True
            try:
                result = method(*args, **kwargs)
                failed = False
                return result
            finally:
                with self._lock:  # store calls run in many worker threads at once
                    self.op_stats.record(op, started, failed)

        return call


def _snapshot_collector() -> Any:
    """A collector whose `snapshot` a scrape renders. prometheus_client (and the HTTP and email modules it
    brings) is imported here, by a daemon that serves metrics: every other start of the daemon spares it."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

    class SnapshotCollector(Collector):
        def __init__(self) -> None:
            self.snapshot: Snapshot = {}

        def collect(self) -> Iterator[Metric]:
            snapshot = self.snapshot  # replaced whole by publish(): no lock needed
            for metric in METRICS:
                family: Metric
                if metric.kind == "gauge":
                    family = GaugeMetricFamily(metric.name, metric.help, labels=list(metric.labels))
                else:
                    family = CounterMetricFamily(metric.name, metric.help, labels=list(metric.labels))
                for labels, value in snapshot.get(metric.name, []):
                    family.add_metric(list(labels), value)
                yield family

    return SnapshotCollector()


def parse_addr(text: str) -> tuple[str, int] | None:
    """'HOST:PORT' -> (host, port); 'off' -> None. Raises ValueError naming the expected form."""
    if text.strip().lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics_addr {text!r} is not HOST:PORT (like 127.0.0.1:9477) or off")
    return host.strip("[]") or "127.0.0.1", int(port)


class MetricsServer:
    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _snapshot_collector()
        self.registry.register(self._collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port

    def publish(self, snapshot: Snapshot) -> None:
        self._collector.snapshot = snapshot

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
