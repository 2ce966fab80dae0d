"""The daemon's logging: its format and level, and the filters that keep it readable (a storm of one
error held to a few lines; pyfuse3's harmless refused replies made DEBUG; no SDK secrets at DEBUG).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time


class RepeatFilter(logging.Filter):
    """Lets a message (same logger, same format string) through at most `burst` times a minute; the next
    one that passes says how many were held back. Keeps a storm of identical errors to a few lines."""

    def __init__(self, burst: int = 5, window: float = 60.0) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self._seen: dict[tuple[str, object], list[float]] = {}  # key -> [window start, count, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg)
        now = time.monotonic()
        state = self._seen.get(key)
        if state is None or now - state[0] >= self.window:
            suppressed = int(state[2]) if state is not None else 0
            self._seen[key] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} (and {suppressed} more like it in the last minute)"
            return True
        state[1] += 1
        if state[1] <= self.burst:
            return True
        state[2] += 1
        return False


class AnswerNobodyWaitsFor(logging.Filter):
    """pyfuse3 logs an ERROR when the kernel refuses a reply with ENOENT: the request is no longer waited
    for (interrupted, or its mount went away, as when a RELEASE is answered after `fusermount -u`). Nothing
    is wrong then: such lines are DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.endswith("fuse_reply_* failed with %s")
                and record.args == (os.strerror(errno.ENOENT),)):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger().isEnabledFor(logging.DEBUG)
        return True


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if logging.getLogger().level > logging.DEBUG:  # DEBUG means: show everything
        for handler in logging.getLogger().handlers:
            handler.addFilter(RepeatFilter())
    logging.getLogger("pyfuse3").addFilter(AnswerNobodyWaitsFor())
    # The SDKs' DEBUG output carries access key ids and request signatures: never log those.
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3", "azure", "google"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
