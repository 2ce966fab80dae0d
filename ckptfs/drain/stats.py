"""The drain's counters: what it uploaded, moved, deleted and spilled, and its errors (the daemon's
metrics and `ckptfs status` read them; every part of the drain adds to them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DrainStats:
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    upload_seconds: float = 0.0
    moves: int = 0
    deletes: int = 0
    spilled_bytes: int = 0
    errors: int = 0
    errors_by_job: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    last_error_at: float | None = None
    # Rounds whose scan and dispatch are done; the wall time the last of them began its scan; whether the drain
    # now waits for work with nothing notified since that scan began; and the wall time of its next timed scan
    # (something becomes due then: a file's upload_delay, a retry; None: nothing). Whoever must show that
    # something did NOT happen (a test's "the marker is held back") waits on these instead of sleeping: a
    # scan that began after the change of interest, then idle with no timed scan before the change is due,
    # means the drain had its chance.
    scans: int = 0
    last_scan_at: float | None = None
    idle: bool = False
    next_scan_at: float | None = None

