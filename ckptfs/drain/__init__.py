"""The drain: makes the store converge on the journal's namespace, in the background.

It learns its work only from the journal and records results only there; blocking store calls run in
worker threads. Between two awaits a run of journal calls is atomic, so every job re-reads its inode after
each await before it records anything. The protocol is written up in docs/design/drain.md.

One concern per module:
    scheduler.py   Drain: scans the journal, chooses the jobs that may start; what ckptfs calls
    dispatch.py    runs a scan's jobs as slots free up: claimed keys, small uploads in batches, a job's end
    ordering.py    the pure ordering rules (commit markers, busy keys, moves waiting for keys, parents first)
    retries.py     backoff after a failure, parking of jobs that keep failing unexpectedly
    uploads.py     one entry's upload, and small closed files in batches
    small_lane.py  starting the claimed batches of small files, each in a lull of the FUSE layer's requests
    spill_jobs.py  staging the start of a file still being written, and finishing it once closed
    namespace_jobs.py  moves, metadata rewrites and deletes in the store
    object_records.py  write-ahead deletes, recording what the store holds, a staged upload's journaled state
    open_uploads.py    uploads of files still open for writing (the NFS gateway mode)
    preemption.py  the order under a preemption notice: the newest complete step first
    recovery.py    start-up reconciliation of the journal with the cache dir and the store
    durability.py  the waiters of `ckptfs flush`: what is pending, and when it is durable
    cleanup.py     aborts of removed files' staged uploads, sweeps of the store's leftovers
    stats.py       the counters the metrics and `ckptfs status` show
"""

from ckptfs.drain.durability import FlushResult
from ckptfs.drain.retries import PARK_AFTER, Parked
from ckptfs.drain.scheduler import BURST_QUIET, Drain
from ckptfs.drain.stats import DrainStats
from ckptfs.drain.uploads import SMALL_BATCH, SMALL_FILE

__all__ = ["BURST_QUIET", "PARK_AFTER", "SMALL_BATCH", "SMALL_FILE", "Drain", "DrainStats", "FlushResult", "Parked"]
