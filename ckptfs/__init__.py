"""ckptfs: a checkpoint filesystem. Writes land in a local cache at disk speed; a background drain uploads
closed files to an object store; a SQLite journal makes every step survive a crash.

The Python API for a training script (a client of a running mount's control socket; importing it loads no
FUSE, trio or cloud SDK module):

    import ckptfs
    ckptfs.wait_durable("/checkpoints", ["step_100"], timeout=600)   # NotDurableError after 600 s
    ckptfs.status("/checkpoints")                                    # as `ckptfs status --json`
    ckptfs.wait_durable("/checkpoints", all_nodes=True)              # every node's files, too
    ckptfs.limit("/checkpoints", upload="200M")                      # cap the drain (until restart)
    ckptfs.preempt("/checkpoints", deadline=30)                      # newest complete step first; a report
    ckptfs.prefetch("/checkpoints/step_100", wait=True)              # warm this node's cache before a restore

See docs/INTEGRATIONS.md for the few lines each training library needs.
"""

from ckptfs.control.client import (
    PruneResult,
    limit,
    pending_nodes,
    preempt,
    prefetch,
    prune,
    refresh,
    status,
    unmount,
    wait_durable,
)
from ckptfs.errors import CkptfsError, DaemonError, NoDaemonError, NotDrainedError, NotDurableError, UsageError

__version__ = "0.1.0"

__all__ = [
    "CkptfsError",
    "DaemonError",
    "NoDaemonError",
    "NotDrainedError",
    "NotDurableError",
    "PruneResult",
    "UsageError",
    "limit",
    "pending_nodes",
    "preempt",
    "prefetch",
    "prune",
    "refresh",
    "status",
    "unmount",
    "wait_durable",
]
