"""A preemption notice carried out (issue 44): `ckptfs preempt`, ckptfs.preempt(), SIGTERM with
preempt_on_sigterm, and the cloud notices' watchers (notices/watchers.py) all come here.

On a notice: the drain takes the order of drain/preemption.py (the newest complete step first, its
shards then its markers, then the next; deletes and steps still being written wait), retention waits, and
the bandwidth caps are lifted (unless the caller keeps them). When every complete step is durable, or at
the deadline, whichever comes first, it writes the report: JSON in the cache dir (REPORT_NAME) and one log
line, naming the steps that are durable and those that are not, with why (bytes left, a failing file,
files still open). A second notice with an earlier deadline brings the report forward; the order lasts
until the daemon ends.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio

from ckptfs.drain import Drain
from ckptfs.drain.preemption import StepLeft
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

REPORT_NAME = "preemption-report.json"
# How often the report's condition (every complete step durable) is looked at while a notice lasts.
DONE_POLL = 0.2


class Preempter:
    def __init__(self, drain: Drain, engine: Transfers, cache_root: Path) -> None:
        self.drain = drain
        self.engine = engine
        self.report_path = cache_root / REPORT_NAME
        self.deadline = math.inf  # trio time
        self.started_at: float | None = None  # wall clock
        self.reason = ""
        self.report: dict[str, Any] | None = None
        self.reported = trio.Event()
        self._begun = trio.Event()
        self._sooner = trio.Event()  # set when a later notice brings the deadline forward

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def begin(self, seconds: float, *, reason: str, lift_limits: bool = True) -> None:
        """A notice with `seconds` left: reorder the drain now (no await: SIGTERM and the watchers call it)."""
        deadline = trio.current_time() + max(0.0, seconds)
        if self.active:
            if deadline < self.deadline:
                self.deadline = deadline
                self._sooner.set()
            return
        self.started_at = time.time()
        self.deadline = deadline
        self.reason = reason
        log.warning("preemption notice (%s): %.0f s to make the newest complete step durable%s", reason, seconds,
                    "; bandwidth caps lifted" if lift_limits else "")
        if lift_limits:
            self.engine.lift_limits()
        self.drain.preempt()
        self._begun.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """In the daemon's nursery: once a notice came, report when done or at the deadline."""
        task_status.started()
        await self._begun.wait()
        while trio.current_time() < self.deadline and self.drain.preemption.complete_steps_pending():
            # Jobs end without telling this task: poll; a later notice may bring the deadline forward.
            self._sooner = trio.Event()
            with trio.move_on_at(min(self.deadline, trio.current_time() + DONE_POLL)):
                await self._sooner.wait()
        report = self.make_report()
        await trio.to_thread.run_sync(self._save, report)
        self.report = report
        self.reported.set()

    async def wait_report(self) -> dict[str, Any]:
        await self.reported.wait()
        assert self.report is not None
        return self.report

    def make_report(self) -> dict[str, Any]:
        """What is durable now and what is not, and why (in the trio thread: it reads the journal)."""
        drain = self.drain
        steps = drain.preemption.steps_left(drain.retries.failing_now())
        now = time.time()
        rows = [step_json(step) for step in steps]
        durable = [row["step"] for row in rows if row["durable"]]
        not_durable = [row for row in rows if not row["durable"]]
        return {
            "reason": self.reason, "started_at": self.started_at, "reported_at": now,
            "seconds": round(now - (self.started_at or now), 3),
            "deadline_met": trio.current_time() <= self.deadline,
            "newest_complete_step": next((s.name for s in steps if s.complete), None),
            "durable": durable, "not_durable": {row["step"]: row["why"] for row in not_durable}, "steps": rows,
            "bytes_left": sum(row["bytes_left"] for row in rows),
        }

    def _save(self, report: dict[str, Any]) -> None:
        """The report as JSON next to the journal (written whole, then renamed into place), and one log line."""
        tmp = self.report_path.with_name(self.report_path.name + ".tmp")
        with open(tmp, "w") as out:
            json.dump(report, out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.report_path)
        not_durable = report["not_durable"]
        log.warning("preemption report (%s, after %.1f s): durable %s; not durable %s; written to %s",
                    report["reason"], report["seconds"], ", ".join(report["durable"]) or "none",
                    "; ".join(f"{step} ({why})" for step, why in not_durable.items()) or "none", self.report_path)


def step_json(step: StepLeft) -> dict[str, Any]:
    durable = step.files_left == 0
    why: str | None = None
    if not durable:
        if step.failing:
            path, error = step.failing[0]
            why = f"failing: {path} ({error})" + (f" and {len(step.failing) - 1} more" if len(step.failing) > 1 else "")
        elif step.why_waiting is not None:
            why = step.why_waiting
        else:
            why = f"{step.bytes_left} bytes left in {step.files_left} entries"
    row = asdict(step)
    row.pop("name")
    row["failing"] = [{"path": path, "error": error} for path, error in step.failing]
    return {"step": step.name, **row, "durable": durable, "published": durable and step.markers > 0, "why": why}
