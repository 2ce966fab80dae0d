"""The daemon of a mount: its process, its start, its parts wired and run in the root nursery, its stop.

One concern per module:
    startup.py    the checks before mounting, the cache dir, journal and recovery, then a Daemon run (`run`)
    running.py    Daemon: the parts wired together, the root nursery, signals, an external unmount
    stopping.py   the ordered stop: drain with a deadline, unmount; or hand over (restart), or leave (holder)
    services.py   background services supervised (restarted after a failure), the journal's checkpoints
    reporting.py  metrics published from the mount's statistics, systemd's STATUS= and stop-time extensions
    process.py    the process's own resources: the open file limit, freed part buffers returned
"""

from ckptfs.daemon.reporting import METRICS_INTERVAL, metrics_pause
from ckptfs.daemon.services import checkpoint_journal
from ckptfs.daemon.startup import run

__all__ = ["METRICS_INTERVAL", "checkpoint_journal", "metrics_pause", "run"]
