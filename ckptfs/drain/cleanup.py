"""Cleanup the drain does in the store beside its jobs: aborting the staged uploads and spills of files
removed meanwhile, and sweeping the leftovers a failed cleanup left (in the background, backing off while
the store refuses, and at the end of a flush).

The scheduler (scheduler.py) starts both from its rounds; durability.py waits for the aborts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from ckptfs.backends.base import UploadState
from ckptfs.errors import BackendError
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

# Sweeps of the store's leftovers after one failed: the first this long after, doubling up to the cap.
SWEEP_RETRY_FIRST = 30.0
SWEEP_RETRY_CAP = 600.0
# A sweep lists only while no store call runs; it holds new calls off for at most this long waiting for
# the running ones (a stalled upload), and else tries again later.
SWEEP_PATIENCE = 5.0


class Cleanup:
    def __init__(self, engine: Transfers, *, notify: Callable[[], None]) -> None:
        self.engine = engine
        self.notify = notify
        # Called once an abort ended (a flush waits for them).
        self.progressed: Callable[[], None] = lambda: None
        # Staged uploads and spills of files removed meanwhile: aborted here, so that their parts do not
        # sit in the store until the next start-up's cleanup.
        self.discarded: list[UploadState] = []
        self._discards_running = 0
        # Background sweeps of leftovers while a cleanup failed (an abort, a sweep, the store's own).
        self._sweeps_running = 0
        self._sweep_due = math.inf
        self._sweep_delay = SWEEP_RETRY_FIRST

    @property
    def idle(self) -> bool:
        """No abort waits or runs."""
        return not self.discarded and not self._discards_running

    def discard_upload(self, state_text: str) -> None:
        """A file with a staged upload or spill (its journaled `upload_state`) was removed: abort it."""
        try:
            state = UploadState.from_json(state_text)
        except (ValueError, KeyError, TypeError):
            return
        self.discarded.append(state)
        self.notify()

    async def abort_discarded(self, state: UploadState) -> None:
        self._discards_running += 1
        try:
            await self.engine.abort_state(state)
            log.debug("aborted the staged upload of a removed file (%s)", state.key)
        finally:
            self._discards_running -= 1
            self.progressed()

    async def sweep(self) -> None:
        """Remove the leftovers a failed cleanup left (in the background, or at the end of a flush); if the
        store refuses, the background tries again later, backing off."""
        self._sweeps_running += 1
        try:
            removed = await self.engine.sweep_leftovers(patience=SWEEP_PATIENCE)
        except BackendError as exc:
            log.warning("cannot remove the leftovers of interrupted uploads from the store: %s; trying again"
                        " in %.0f s", exc, self._sweep_delay)
            self._sweep_due = trio.current_time() + self._sweep_delay
            self._sweep_delay = min(self._sweep_delay * 2, SWEEP_RETRY_CAP)
        else:
            if removed is None:  # the store calls running did not let it list: not the store's fault
                self._sweep_due = trio.current_time() + SWEEP_RETRY_FIRST
            else:
                self._sweep_delay = SWEEP_RETRY_FIRST
            if removed:
                log.info("removed %d leftovers of interrupted uploads from the store", removed)
        finally:
            self._sweeps_running -= 1
            self.notify()

    def sweep_wanted_at(self) -> float:
        """The trio time of the next background sweep (math.inf: none wanted)."""
        if self._sweeps_running:
            return math.inf
        if not self.engine.sweep_due:
            self._sweep_due = math.inf
            return math.inf
        if self._sweep_due == math.inf:  # a cleanup failed just now: give the store some time
            self._sweep_due = trio.current_time() + self._sweep_delay
        return self._sweep_due

    def sweep_started(self) -> None:
        """The scheduler starts the sweep that was due: the next one is due again once it ends."""
        self._sweep_due = math.inf
