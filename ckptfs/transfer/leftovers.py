"""What interrupted uploads leave in the store, and its removal: the one owner of leftovers.

A staged upload or spill that nobody will finish stays in the store until it is aborted: those of a killed
run, those whose best-effort cleanup failed in this one (an abort of the engine, a delete a store makes on
its own and reports through its `left_behind`), those of a journal row that could not be read. `Leftovers`
keeps what a sweep needs to tell them from the uploads still in use, and sweeps: right after start-up
(`hold_until_swept`, then the drain's `sweep_at_start`, sparing what the journal resumes: the mount serves
meanwhile, and no store call that may leave something starts before it), in the background while a
cleanup has failed (`next_sweep_at`, `sweep_in_background`: 30 s after the failure, doubling up to 10 min),
and at the end of a flush (the drain calls `sweep_in_background` too).

What a store call has half made looks like a leftover in a listing (a file:// temp file of a put, the
multipart upload of an S3 copy, an upload whose id `open_upload` has not returned yet), so a sweep lists
only while no store call runs: every call that may leave something behind runs inside `store_call()`,
which a listing waits out and holds off. The store calls themselves (one attempt each, retried) are the
engine's: it hands them over as `call`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

import trio

from ckptfs.backends.base import TEMP_PREFIX, ObjectStore, UploadRef
from ckptfs.errors import BackendError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Background sweeps after a cleanup failed: the first this long after, doubling up to the cap.
SWEEP_RETRY_FIRST = 30.0
SWEEP_RETRY_CAP = 600.0
# A sweep lists only while no store call runs; a background sweep holds new calls off for at most this
# long waiting for the running ones (a stalled upload must not stall the others, nor a flush), and else
# tries again later.
SWEEP_PATIENCE = 5.0
# A flush's sweep that the store refused is tried again this long after, doubling up to the cap, until the
# flush's bound (drain/durability.py: SWEEP_AT_FLUSH).
REFUSED_RETRY_FIRST = 1.0
REFUSED_RETRY_CAP = 8.0
# A spill's hidden key: SPILL_PREFIX<owner>.<random> (its final key is known only when the file closes).
SPILL_PREFIX = f"{TEMP_PREFIX}spill."


class StoreCall(Protocol):
    """The engine's way to call the store: one call in a worker thread, retried on transient errors;
    `gated=False` for one that runs while a sweep lists (the sweep's own listing)."""

    def __call__(self, fn: Callable[..., T], *args: Any, gated: bool = ...) -> Awaitable[T]: ...


def is_spill(key: str) -> bool:
    """Is `key` the hidden key of a spill (the start of a file still being written, staged by the engine)?"""
    return key.rsplit("/", 1)[-1].startswith(SPILL_PREFIX)


class Leftovers:
    """This owner's leftovers in one store: which staged uploads are still in use, and the sweeps."""

    def __init__(self, store: ObjectStore, call: StoreCall) -> None:
        self.store = store
        self._call = call
        # The staged uploads this process still works on (upload id -> key), which a sweep spares.
        self._live: dict[str, str] = {}
        # Store calls running, which a sweep's listing waits out; set while a sweep lists, fired when done.
        self._calls_running = 0
        self._calls_idle: trio.Event | None = None
        self._listing: trio.Event | None = None
        self._lock = trio.Lock()
        # Something may be left in the store (a failed abort, a sweep that failed): sweep again.
        self._failed = False
        # The background sweeps: when the next is due (math.inf: none scheduled), how long after a failure.
        self._next_at = math.inf
        self._delay = SWEEP_RETRY_FIRST
        self._background = 0
        # Set once the start-up sweep has run (whatever its outcome); None before hold_until_swept().
        self._start_swept: trio.Event | None = None

    # -- what this process works on ----------------------------------------------------------------------

    def opened(self, ref: UploadRef) -> None:
        """A staged upload this process opened (or resumes): no sweep removes it until finished()."""
        self._live[ref.upload_id] = ref.key

    def finished(self, ref: UploadRef) -> None:
        """This process is done with a staged upload: completed, or aborted."""
        self._live.pop(ref.upload_id, None)

    def cleanup_failed(self) -> None:
        """A best-effort cleanup failed: something of ours may be left in the store for a sweep."""
        self._failed = True

    @contextlib.asynccontextmanager
    async def store_call(self) -> AsyncIterator[None]:
        """Around one attempt of a store call that may leave something in the store: never while a sweep
        lists the leftovers."""
        while self._listing is not None:
            await self._listing.wait()
        self._calls_running += 1
        try:
            yield
        finally:
            self._calls_running -= 1
            if not self._calls_running and self._calls_idle is not None:
                self._calls_idle.set()

    # -- sweeps ------------------------------------------------------------------------------------------

    @property
    def due(self) -> bool:
        """Did a cleanup fail (the engine's abort, a sweep, or one the store does on its own), so that a
        sweep would find something?"""
        return self._failed or self.store.left_behind

    def hold_until_swept(self, keep: Iterable[UploadRef] = ()) -> None:
        """At start-up (recovery): the staged uploads the journal resumes (`keep`) are this
        process's from now on, and every other leftover of this owner in the store is to go. Until
        sweep_at_start() has listed them, no store call that may leave something starts (as if a sweep were
        listing already), so that nothing this run stages is taken for the last run's. The mount serves
        meanwhile: under throttling the listing alone can take half a minute."""
        self._live.update((ref.upload_id, ref.key) for ref in keep)
        self._failed = True  # `due`: a flush waits for this sweep
        self._listing = trio.Event()
        self._start_swept = trio.Event()

    async def sweep_at_start(self) -> int:
        """The sweep hold_until_swept() announced, in the background (the drain's first task); how many
        leftovers went. A store that refuses it is not an error: the background sweeps and the next flush
        try again."""
        if self._start_swept is None or self._start_swept.is_set():
            return 0  # none announced, or run already (a drain started again): the background sweeps go on
        removed = 0
        try:
            removed = await self.sweep() or 0  # never None: no patience limit, and nothing it waits out runs
        except BackendError as exc:
            log.warning("cannot remove the interrupted uploads of the last run: %s; trying again in the"
                        " background", exc)
        finally:
            if self._start_swept is not None:
                self._start_swept.set()
        if removed:
            log.info("removed %d leftovers of uploads interrupted by the last stop", removed)
        return removed

    async def wait_start_sweep(self) -> None:
        """Return once the start-up sweep has run, or at once if none was announced."""
        if self._start_swept is not None:
            await self._start_swept.wait()

    async def sweep(self, *, patience: float = math.inf) -> int | None:
        """Remove this owner's staged uploads and spills that nobody will finish: those of a killed run, and
        those whose cleanup failed in this one. Spares the uploads this process works on. Returns how many
        went, or None if store calls still ran after `patience` seconds (nothing done, `due` stays true);
        raises BackendError (`due` stays true) if the store refuses."""
        async with self._lock:
            self._failed = True  # until this sweep succeeds
            self.store.left_behind = False  # what fails from now on, the next sweep sees
            # The start's hold (hold_until_swept) is released by the first sweep that lists, this one.
            listed = self._listing if self._listing is not None else trio.Event()
            self._listing = listed
            try:
                with trio.move_on_after(patience):
                    while self._calls_running:
                        self._calls_idle = trio.Event()
                        await self._calls_idle.wait()
                self._calls_idle = None
                if self._calls_running:
                    return None
                refs = await self._call(self.store.list_leftovers, gated=False)
                live = dict(self._live)
            finally:
                self._listing = None
                listed.set()
            removed = 0
            live_keys = set(live.values())
            for ref in refs:
                if ref.upload_id and ref.upload_id in live:
                    continue
                await self._call(self.store.abort_upload, ref)
                # A spill's hidden key is its own, but a create sent twice leaves a second ref of that key (a
                # marker without an upload id, s3markers.py): while the spill is live, the object there is
                # its staged bytes (completed there, to be copied), whose start the cache has freed.
                if is_spill(ref.key) and ref.key not in live_keys:
                    await self._call(self.store.delete, ref.key)
                removed += 1
                log.info("removed an interrupted upload of %s", ref.key or "(unknown key)")
            self._failed = False
            return removed

    def next_sweep_at(self) -> float:
        """The trio time of the next background sweep (math.inf: none wanted): while a cleanup has failed,
        SWEEP_RETRY_FIRST after it, and after each sweep the store refused, twice as long, up to the cap."""
        if self._background:
            return math.inf
        if not self.due:
            self._next_at = math.inf
            return math.inf
        if self._next_at == math.inf:  # a cleanup failed just now: give the store some time
            self._next_at = trio.current_time() + self._delay
        return self._next_at

    async def _sweep_asking_again(self, until: float) -> int | None:
        """sweep(patience=SWEEP_PATIENCE), asked again REFUSED_RETRY_FIRST later (doubling) while the next
        try starts before the trio time `until`: after a refusal (the last one is raised), and after a sweep
        during which a cleanup failed again (an S3 owner marker whose delete met a 503: the store's
        `left_behind`), so that a flush does not end with it in the store. Returns how many went in all."""
        pause = REFUSED_RETRY_FIRST
        removed = 0
        while True:
            try:
                swept = await self.sweep(patience=SWEEP_PATIENCE)
            except BackendError as exc:
                if trio.current_time() + pause >= until:
                    raise
                log.debug("sweep of leftovers refused (%s); trying again in %.0f s", exc, pause)
            else:
                if swept is None:
                    return removed or None
                removed += swept
                if not self.due or trio.current_time() + pause >= until:
                    return removed
                log.debug("a cleanup failed during the sweep of leftovers; sweeping again in %.0f s", pause)
            await trio.sleep(pause)
            pause = min(pause * 2, REFUSED_RETRY_CAP)

    async def sweep_in_background(self, *, refused_retry_until: float = -math.inf) -> None:
        """A sweep of the leftovers a failed cleanup left, for the drain: once next_sweep_at() has come, and
        at the end of a flush. A store that refuses it is not an error here: the next one is scheduled,
        backing off. `refused_retry_until` (a trio time; a flush's, and a clean stop's, after which nothing of
        this owner sweeps until its cache dir is mounted again): a refusal is tried again until then,
        REFUSED_RETRY_FIRST later and doubling, so that one 503 of a storm does not leave a staged upload
        behind the flush. Store calls that keep the sweep from listing are not retried here."""
        self._background += 1
        self._next_at = math.inf
        try:
            removed = await self._sweep_asking_again(refused_retry_until)
        except BackendError as exc:
            log.warning("cannot remove the leftovers of interrupted uploads from the store: %s; trying again"
                        " in %.0f s", exc, self._delay)
            self._next_at = trio.current_time() + self._delay
            self._delay = min(self._delay * 2, SWEEP_RETRY_CAP)
        else:
            if removed is None:  # the store calls running did not let it list: not the store's fault
                self._next_at = trio.current_time() + SWEEP_RETRY_FIRST
            else:
                self._delay = SWEEP_RETRY_FIRST
            if removed:
                log.info("removed %d leftovers of interrupted uploads from the store", removed)
        finally:
            self._background -= 1
