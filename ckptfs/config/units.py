"""Sizes and rates as the settings and the command line write them: parse_size / human_size (512M, 80%,
1.5 GiB), parse_rate (a bandwidth cap) and parse_bandwidth (a cap or a timetable of caps by time of day).

Owns the text of these values and their one clear error each; nothing here knows the Config.
"""

from __future__ import annotations

import re

from ckptfs.errors import UsageError

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int, *, total: int | None = None) -> int:
    """'512M' -> bytes; '80%' -> that share of `total`. Suffixes are binary (K=1024)."""
    if isinstance(text, int):
        return text
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    if value.endswith("%"):
        if total is None:
            raise UsageError(f"size {text!r}: a percentage needs a filesystem to be a share of")
        try:
            pct = float(value[:-1])
        except ValueError:
            raise UsageError(f"size {text!r} is not a number followed by %") from None
        if not 0 < pct <= 100:
            raise UsageError(f"size {text!r}: a percentage must be in (0, 100]")
        return int(total * pct / 100)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", value)
    if not match:
        raise UsageError(f"size {text!r} is not understood; use bytes with K/M/G/T, like 512M or 200G, or 80%")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def human_size(n: float) -> str:
    """A byte count the way messages and `ckptfs status` show it: 1.5 GiB (parse_size reads it back)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


MIN_RATE = 1 << 10  # a cap below 1 KiB/s would look like a hung transfer, not a slow one
_RATE_HELP = "use bytes per second with K/M/G, like 200M, or 0 or off for no cap"
TIMETABLE_HELP = (f"{_RATE_HELP}; or a timetable of local times of day, like \"08:00,50M 19:00,off\"")

# A bandwidth setting, parsed: (minute of the day, bytes per second or None: no cap), sorted by the minute;
# one entry at minute 0 for a plain rate. The transfer engine applies it (transfer/bandwidth.py).
Timetable = tuple[tuple[int, int | None], ...]


def _rate(value: str | int) -> int | None:
    """parse_rate without the name: ValueError saying what is wrong."""
    if isinstance(value, bool):
        raise ValueError("not a rate")
    if isinstance(value, int):
        rate = value
    else:
        text = value.strip()
        if text.lower() in ("off", "none", "0", ""):
            return None
        if text.endswith("%"):
            raise ValueError("a rate cannot be a percentage")
        try:
            rate = parse_size(text)
        except UsageError:
            raise ValueError(f"{text!r} is not a rate") from None
    if rate < 0:
        raise ValueError("a rate cannot be negative")
    if rate == 0:
        return None
    if rate < MIN_RATE:
        raise ValueError(f"{value!r} is below 1K (bytes per second): every transfer would crawl")
    return rate


def parse_rate(text: str | int, name: str = "limit", *, hint: str = _RATE_HELP) -> int | None:
    """A bandwidth cap: bytes per second ('200M', 1048576), or None for no cap ('0', 'off', 0)."""
    try:
        return _rate(text)
    except ValueError as exc:
        raise UsageError(f"{name} {text!r}: {exc}; {hint}") from None


def parse_bandwidth(text: str | int, name: str = "limit") -> Timetable:
    """upload_limit / download_limit: a rate (one entry at 00:00, applying all day) or a timetable like
    rclone's --bwlimit: entries "HH:MM,RATE" separated by blanks, in local time; the last entry at or before
    the time of day applies, and before the first one the last one (it wraps round midnight)."""
    if isinstance(text, int) or "," not in text:
        return ((0, parse_rate(text, name, hint=TIMETABLE_HELP)),)
    entries: dict[int, int | None] = {}
    try:
        for item in text.split():
            match = re.fullmatch(r"(\d{1,2}):(\d{2}),(.+)", item)
            if not match:
                raise ValueError(f"the entry {item!r} is not HH:MM,RATE")
            hour, minute = int(match.group(1)), int(match.group(2))
            if hour > 23 or minute > 59:
                raise ValueError(f"{item!r}: {hour}:{minute:02d} is not a time of day (00:00 to 23:59)")
            at = hour * 60 + minute
            if at in entries:
                raise ValueError(f"{hour:02d}:{minute:02d} appears twice")
            try:
                entries[at] = _rate(match.group(3))
            except ValueError as exc:
                raise ValueError(f"the entry {item!r}: {exc}") from None
    except ValueError as exc:
        raise UsageError(f"{name} {text!r}: {exc}; {TIMETABLE_HELP}") from None
    return tuple(sorted(entries.items()))
