"""Cleanup the drain does in the store beside its jobs: aborting the staged uploads and spills of files
removed meanwhile, and starting the sweeps of leftovers (the engine's `transfer/leftovers.py` owns them: when one is
due, backing off while the store refuses) from the scheduler's rounds and at the end of a flush.

The scheduler (scheduler.py) starts both from its rounds; durability.py waits for the aborts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ckptfs.backends.base import UploadState
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)


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

    @property
    def idle(self) -> bool:
        """No abort waits or runs."""
        return not self.discarded and not self._discards_running

    def discard_upload(self, state_text: str) -> None:
        """A file with a staged upload or spill (its journaled `upload_state`) was removed: abort it."""
        state = UploadState.parse(state_text)
        if state is None:
            return  # unreadable: what it staged is left for a sweep
        self.discarded.append(state)
        self.notify()

    async def abort_discarded(self, state: UploadState) -> None:
        self._discards_running += 1
        try:
            await self.engine.abandon(state)
            log.debug("aborted the staged upload of a removed file (%s)", state.key)
        finally:
            self._discards_running -= 1
            self.progressed()

    async def sweep_at_start(self) -> None:
        """The sweep of the last run's leftovers that recovery announced (the drain's first task)."""
        try:
            await self.engine.leftovers.sweep_at_start()
        finally:
            self.notify()

    async def sweep(self, *, refused_retry_until: float = -math.inf) -> None:
        """Remove the leftovers a failed cleanup left (in the background, or at the end of a flush: then a
        store's refusal is tried again until `refused_retry_until`, a trio time)."""
        try:
            await self.engine.leftovers.sweep_in_background(refused_retry_until=refused_retry_until)
        finally:
            self.notify()

    def sweep_wanted_at(self) -> float:
        """The trio time of the next background sweep (math.inf: none wanted)."""
        return self.engine.leftovers.next_sweep_at()
