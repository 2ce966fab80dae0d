"""Waiting in tests: one poll-until (threads and trio), and the drain's chance to do something.

A test that asserts something did NOT happen (the marker is not in the store yet) must first prove that it
could have happened: a fixed sleep proves nothing on a loaded machine. `drain_had_its_chance` waits for an
event the drain exposes (DrainStats.scans / last_scan_at / idle, also in `ckptfs status --json` under
"drain"): a scan that began after the point of interest (and after the upload delay), all it chose
dispatched, and the drain waiting for work with nothing notified since."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_UNSEEN = object()


def _describe(probe: Callable[[], object]) -> str:
    """What a probe waits for, when the caller did not say: its source (usually the lambda's line)."""
    try:
        return " ".join(inspect.getsource(probe).split())
    except (OSError, TypeError):
        return repr(probe)


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = "nothing (never evaluated)" if last is _UNSEEN else repr(last)
    if len(seen) > 2000:
        seen = seen[:2000] + "..."
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}")


def wait_until(
    probe: Callable[[], T], *, what: str | None = None, timeout: float = 30.0, interval: float = 0.05,
    done: Callable[[T], object] = bool,
) -> T:
    """Call `probe` until `done(value)` holds (the value is truthy by default), and return that value. A guard
    against a hang, not a time bound: on timeout, fail naming `what` (by default the probe's source) and the
    last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = _UNSEEN
    while True:
        last = probe()
        if done(last):
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what or _describe(probe), timeout, last)
        time.sleep(interval)


async def until(
    probe: Callable[[], T], *, what: str | None = None, seconds: float = 30.0, interval: float = 0.02,
    done: Callable[[T], object] = bool,
) -> T:
    """wait_until for trio tests: the drain and the rest of the stack run while this sleeps."""
    deadline = trio.current_time() + seconds
    last: Any = _UNSEEN
    while True:
        last = probe()
        if done(last):
            return last
        if trio.current_time() > deadline:
            raise _timed_out(what or _describe(probe), seconds, last)
        await trio.sleep(interval)


def _had_chance(drain: dict[str, Any], since: float, due: float) -> bool:
    """Idle after a scan that began at or after `since` (so it saw every change notified before: a later
    notification would have ended the idle), and no timed scan pending at or before `due` (the wall time by
    which what changed became due; a scan before then may have found it not due yet and set a timer)."""
    if not drain["idle"] or drain["last_scan_at"] is None or drain["last_scan_at"] < since:
        return False
    return drain["next_scan_at"] is None or drain["next_scan_at"] > due


def _chance_of(what: str, since: float, due: float) -> str:
    return (f"the drain's chance to {what} (idle after a scan that began at {since:.3f} or later, no timed scan "
            f"by {due:.3f})")


def mount_drain_had_its_chance(
    status: Callable[[], dict[str, Any]], *, since: float, due: float | None = None, what: str, timeout: float = 60.0,
) -> None:
    """Wait until a mount's drain (status: Mount.status) had its chance to act on changes made after wall time
    `since` and due by wall time `due` (default `since`; after a close, the time after it plus upload_delay):
    then a negative assertion ("the marker is not in the store") means the drain chose not to."""
    due = since if due is None else due
    wait_until(lambda: status()["drain"], what=_chance_of(what, since, due), timeout=timeout,
               done=lambda drain: _had_chance(drain, since, due))


async def drain_had_its_chance(
    drain: Any, *, since: float, due: float | None = None, what: str, seconds: float = 30.0,
) -> None:
    """mount_drain_had_its_chance for a Drain in this process (tests/fsharness.py's Stack.drain); times are on
    the drain's clock (time.time unless the test gave it another)."""
    due = since if due is None else due
    stats = drain.stats

    def seen() -> dict[str, Any]:
        return {"scans": stats.scans, "last_scan_at": stats.last_scan_at, "idle": stats.idle,
                "next_scan_at": stats.next_scan_at}

    await until(seen, what=_chance_of(what, since, due), seconds=seconds,
                done=lambda drain: _had_chance(drain, since, due))
