"""How the mount reports on itself while it runs: the Prometheus metrics published from a snapshot of its
statistics, paced so that a snapshot takes a small share of the trio thread; and systemd's STATUS= now and
then, with more stop time asked for while a stop drains and makes progress.

Owns the cadence of both; what the statistics say is control/status.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from ckptfs.control.metrics import MetricsServer
from ckptfs.control.status import MountStats, metrics_snapshot, status_line
from ckptfs.drain import DrainStats
from ckptfs.keepmount.systemd import Notifier

# How often systemd hears how things are (STATUS=), and how much more stop time a draining stop asks for
# each time it made progress (EXTEND_TIMEOUT_USEC=).
STATUS_INTERVAL = 5.0
EXTEND_SECONDS = 30
METRICS_INTERVAL = 1.0
# A metrics snapshot takes at most this share of the trio thread: it sums the journal's files by state, a
# scan of every row (a namespace of 100k entries took 0.1-0.3 s each second, a fifth of a big walk's time).
METRICS_SHARE = 0.05


def metrics_pause(took: float) -> float:
    """Seconds until the next metrics snapshot, after one that took `took` seconds."""
    return max(METRICS_INTERVAL, took / METRICS_SHARE)


async def publish_metrics(
    metrics: MetricsServer, statistics: Callable[[], MountStats], *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish a metrics snapshot to `metrics`, for ever, metrics_pause() apart."""
    task_status.started()
    while True:
        started = time.perf_counter()
        metrics.publish(metrics_snapshot(statistics()))
        await trio.sleep(metrics_pause(time.perf_counter() - started))


async def report_to_systemd(
    notifier: Notifier, statistics: Callable[[], MountStats], drained: DrainStats, stopping: trio.Event, *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """STATUS= now and then; while a stop drains (`stopping` is set) and makes progress, ask for more stop
    time."""
    task_status.started()
    last_uploaded = drained.uploaded_bytes + drained.spilled_bytes
    while True:
        await trio.sleep(STATUS_INTERVAL)
        fields: dict[str, str | int] = {"status": status_line(statistics())}
        uploaded = drained.uploaded_bytes + drained.spilled_bytes
        if stopping.is_set() and uploaded > last_uploaded:
            fields["extend_timeout_usec"] = EXTEND_SECONDS * 1_000_000
        last_uploaded = uploaded
        notifier.notify(**fields)
