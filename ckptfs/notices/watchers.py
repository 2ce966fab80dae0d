"""The clouds' preemption notices, watched (`preemption_notice = aws|gcp|azure`): each poll asks the
instance metadata endpoint whether this node is about to go, and a notice starts a preemption (notices/preempter.py)
with the time it leaves.

- aws: IMDSv2 (a session token, then) `latest/meta-data/spot/instance-action`: 404 until a notice, then
  {"action": "terminate", "time": "2026-11-28T12:00:00Z"}, about two minutes ahead.
- gcp: `computeMetadata/v1/instance/preempted` (header Metadata-Flavor: Google): TRUE once preempted,
  about 30 s ahead.
- azure: scheduled events, `metadata/scheduledevents?api-version=2020-07-01` (header Metadata: true): an
  event of type Preempt, with its NotBefore time, about 30 s ahead.

Plain HTTP to a link-local address (or the configured preemption_notice_url): no cloud SDK.
"""

from __future__ import annotations

import email.utils
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime

import trio

from ckptfs.config import Config
from ckptfs.notices.preempter import Preempter

log = logging.getLogger(__name__)

DEFAULT_URLS = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
                "azure": "http://169.254.169.254"}
# A notice's own time (AWS's `time`, Azure's NotBefore) less this margin is the drain's deadline: the report
# and the unmount need a moment before the node goes.
PREEMPTION_MARGIN = 5.0
REQUEST_TIMEOUT = 2.0
AWS_TOKEN_TTL = 21600


@dataclass(frozen=True)
class Notice:
    cloud: str
    ends_at: float | None  # wall-clock time the notice says the node goes (None: it does not say)
    detail: str


def _get(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _iso_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def ask(cloud: str, base: str) -> Notice | None:
    """One look at the metadata endpoint (blocking: in a worker thread). None: no notice."""
    if cloud == "aws":
        status, token = _get(f"{base}/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)},
                             method="PUT")
        headers = {"X-aws-ec2-metadata-token": token.decode()} if status == 200 else {}  # IMDSv1 otherwise
        status, body = _get(f"{base}/latest/meta-data/spot/instance-action", headers)
        if status != 200:
            return None
        action = json.loads(body)
        return Notice("aws", _iso_time(action["time"]) if action.get("time") else None,
                      f"spot/instance-action {action.get('action')} at {action.get('time')}")
    if cloud == "gcp":
        status, body = _get(f"{base}/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == b"TRUE":
            return Notice("gcp", None, "instance/preempted TRUE")
        return None
    if cloud == "azure":
        status, body = _get(f"{base}/metadata/scheduledevents?api-version=2020-07-01", {"Metadata": "true"})
        if status != 200:
            return None
        for event in json.loads(body).get("Events") or []:
            if event.get("EventType") == "Preempt":
                not_before = event.get("NotBefore")
                ends_at = email.utils.parsedate_to_datetime(not_before).timestamp() if not_before else None
                return Notice("azure", ends_at, f"scheduled event Preempt {event.get('EventId')} not before"
                              f" {not_before}")
        return None
    raise ValueError(f"unknown cloud {cloud!r}")


def seconds_left(notice: Notice, configured: float, now: float) -> float:
    """The drain's deadline for a notice: the configured preemption_deadline, shortened to the notice's own
    end less PREEMPTION_MARGIN where it names one."""
    if notice.ends_at is None:
        return configured
    return max(1.0, min(configured, notice.ends_at - now - PREEMPTION_MARGIN))


async def watch_notices(config: Config, preempter: Preempter, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Poll until a notice comes, then preempt (once: the order lasts until the daemon ends)."""
    task_status.started()
    cloud = config.preemption_notice
    base = config.preemption_notice_url or DEFAULT_URLS[cloud]
    log.info("watching %s's preemption notices at %s every %.0f s", cloud, base, config.preemption_poll)
    complained = False
    while not preempter.active:
        try:
            notice = await trio.to_thread.run_sync(ask, cloud, base)
        except (OSError, ValueError, KeyError) as exc:
            if not complained:
                log.warning("cannot ask %s for a preemption notice (%s); trying again every %.0f s", base, exc,
                            config.preemption_poll)
                complained = True
            notice = None
        if notice is not None:
            preempter.begin(seconds_left(notice, config.preemption_deadline, time.time()),
                            reason=f"{cloud} notice: {notice.detail}", lift_limits=not config.preemption_keep_limits)
            return
        await trio.sleep(config.preemption_poll)
