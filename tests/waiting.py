"""Waiting in tests: one poll-until (threads and trio), and the drain's chance to do something.

A test that asserts something did NOT happen (the marker is not in the store yet) must first prove that it
could have happened: a fixed sleep proves nothing on a loaded machine. `drain_had_its_chance` waits for an
event the drain exposes (DrainStats.scans / last_scan_at / idle, also in `ckptfs status --json` under
"drain"): a scan that began after the point of interest (and after the upload delay), all it chose
dispatched, and the drain waiting for work with nothing notified since."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_UNSEEN = object()


def _timed_out(what: str, timeout: float, last: object) -> AssertionError:
    seen = "nothing (never evaluated)" if last is _UNSEEN else repr(last)
    if len(seen) > 2000:
        seen = seen[:2000] + "..."
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {seen}")


def wait_until(
    probe: Callable[[], T], *, what: str, timeout: float = 30.0, interval: float = 0.05,
    done: Callable[[T], object] = bool,
) -> T:
    """Call `probe` until `done(value)` holds (the value is truthy by default), and return that value. A guard
    against a hang, not a time bound: on timeout, fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = _UNSEEN
    while True:
        last = probe()
        if done(last):
            return last
        if time.monotonic() > deadline:
            raise _timed_out(what, timeout, last)
        time.sleep(interval)


async def until(
    probe: Callable[[], T], *, what: str, timeout: float = 30.0, interval: float = 0.02,
    done: Callable[[T], object] = bool,
) -> T:
    """wait_until for trio tests: the drain and the rest of the stack run while this sleeps."""
    deadline = trio.current_time() + timeout
    last: Any = _UNSEEN
    while True:
        last = probe()
        if done(last):
            return last
        if trio.current_time() > deadline:
            raise _timed_out(what, timeout, last)
        await trio.sleep(interval)


def _had_chance(drain: dict[str, Any], since: float) -> bool:
    return bool(drain["idle"]) and drain["last_scan_at"] is not None and drain["last_scan_at"] >= since


def mount_drain_had_its_chance(status: Callable[[], dict[str, Any]], *, since: float, what: str,
                               timeout: float = 60.0) -> None:
    """A mount (status: Mount.status): its drain began a scan at or after wall time `since` (the point of
    interest plus the upload delay), dispatched what it chose, and now waits with nothing new to look at."""
    wait_until(lambda: status()["drain"], what=f"the drain's chance to {what} (a scan after {since:.3f}, then idle)",
               timeout=timeout, done=lambda drain: _had_chance(drain, since))


async def drain_had_its_chance(drain: Any, *, since: float, what: str, timeout: float = 30.0) -> None:
    """mount_drain_had_its_chance for a Drain in this process (tests/fsharness.py's Stack.drain). `since` is
    on the drain's clock (time.time unless the test gave it another)."""
    stats = drain.stats
    await until(lambda: {"scans": stats.scans, "last_scan_at": stats.last_scan_at, "idle": stats.idle},
                what=f"the drain's chance to {what} (a scan after {since:.3f}, then idle)", timeout=timeout,
                done=lambda seen: _had_chance(seen, since))
