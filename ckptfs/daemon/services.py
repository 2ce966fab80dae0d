"""The daemon's background services kept running: each one supervised (an unexpected error ends only that
run of it, logged and counted, and it starts again after a pause), and the journal's WAL checkpointed in a
worker thread while the journal changes.

Owns the restart policy of a service and the checkpoint cadence; which services run is running.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from ckptfs.errors import Faults
from ckptfs.journal import Journal, JournalFull, journal_unusable

log = logging.getLogger(__name__)

# A background service that failed unexpectedly starts again after this long (doubling up to the cap).
RESTART_PAUSE = 1.0
RESTART_PAUSE_CAP = 60.0
# How often the journal's WAL is checkpointed in a worker thread while the journal changes: each one syncs
# two files, and syncs on the cache filesystem slow down the cache file creates of FUSE requests meanwhile.
JOURNAL_CHECKPOINT_INTERVAL = 0.5
JOURNAL_CHECKPOINT_COMMITS = 250  # about SQLite's 1000 WAL pages: a create or a close writes about 4


class _StartedOnce:
    """The task status of a service that may be restarted: the nursery hears `started` only once."""

    def __init__(self, inner: trio.TaskStatus[None]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: None = None) -> None:
        if not self.done:
            self.done = True
            self.inner.started(value)


async def supervise(
    faults: Faults, name: str, service: Callable[..., Awaitable[None]], *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a background service; an unexpected error ends only this run of it (logged, counted in
    ckptfs_internal_errors), and it starts again after a pause. A failure before it started fails the
    mount, and an unusable journal ends the daemon (see running.py)."""
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
            faults.record(name, repr(innermost(exc)))
        await trio.sleep(pause)
        pause = min(pause * 2, RESTART_PAUSE_CAP)


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


def innermost(exc: BaseException) -> BaseException:
    """The first error inside the exception groups that nurseries wrap errors in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
