"""Configuration: one frozen dataclass, from defaults, a TOML file, CKPTFS_<KEY> environment variables and flags
(each overriding the one before, as rclone does).

Owns parsing and validation of every setting (sizes, durations, URLs as strings). It must not touch the
filesystem beyond reading the config file, nor open stores: checks that need the outside world (does the
store exist, is the cache dir writable) live in daemon.py and backends/.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tomllib
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfs.errors import UsageError

DEFAULT_CACHE_ROOT = Path("/var/cache/ckptfs")
# Gateway mode without idle_upload: a file open for writing is uploaded after this many seconds without a
# write (rclone's --vfs-write-back default is 5 s too).
GATEWAY_IDLE = 5.0

DEFAULT_COMMIT_MARKERS: tuple[str, ...] = (
    "latest",
    "latest.*",
    "latest_checkpointed_iteration.txt",
    ".metadata",
    "commit_success.txt",
    "*.done",
    "COMMITTED",
)


_BOOL_KEYS = ("allow_other", "daemon", "cross_node_ordering", "keep_mount", "keep_mount_on_stop", "guard_mountpoint",
              "gateway", "preemption_keep_limits")


@dataclass(frozen=True)
class Config:
    source: str
    """Where the data lives: file:///DIR, s3://bucket[/prefix], gs://..., az://...."""

    mountpoint: Path
    """An existing, empty directory to mount on."""

    cache_dir: Path | None = None
    """Local cache directory (journal and file data). Default: /var/cache/ckptfs/<name of the source>."""

    cache_size: str = "80%"
    """Cache budget: bytes with a suffix (512M, 200G) or a percentage of the cache filesystem."""

    min_free: str = "5%"
    """Free space the cache always leaves on its filesystem (bytes or a percentage of it)."""

    keep_last: int = 0
    """Retention: after each completed checkpoint keep only the newest N top-level checkpoints (0: off)."""

    keep: tuple[str, ...] = ()
    """Retention: glob patterns of top-level names never deleted by retention."""

    refresh_interval: float = 30.0
    """Seconds after which a directory's listing of the store is read again (objects other nodes wrote)."""

    dirty_wait: float = 600.0
    """Seconds a write waits for room when dirty data fills the cache, before it fails with ENOSPC."""

    upload_delay: float = 2.0
    """Seconds a closed file must stay unchanged before it is queued for upload."""

    small_file_wait: float = 10.0
    """While files keep being created, closed, renamed or removed (a save writing many small files), small
    files (up to 1 MiB) wait for a pause of 0.5 s before they upload, at most this many seconds more than
    upload_delay; 0: no wait."""

    upload_while_writing: str = "off"
    """Stage the written start of a large file while it is still open, part by part, so that it is in the
    store soon after it is closed: "auto" on stores that place a staged upload at any key with its final
    metadata (file://, gs://); "on" also on s3:// and az://, where it costs a server-side copy of the whole
    file at close; "off" (the default): only a full cache does it. It shortens the time from close to
    durable, and lengthens the save when the writer is as fast as the disk (they share it and the CPU)."""

    gateway: bool = False
    """Gateway mode, for a mount exported by an NFS server (nfs-ganesha, kernel nfsd), which keeps files open
    long after its clients closed them: files still open for writing are uploaded once idle (see
    idle_upload, 5 s unless set), 1 s after their last write once fsynced (an NFS COMMIT), and again when
    they change; `ckptfs flush` uploads them as they are instead of waiting for their close (docs/GATEWAY.md)."""

    idle_upload: float = 0.0
    """Seconds without a write after which a file still open for writing is uploaded as it is (and again
    after each later change); 0: only in gateway mode, after 5 s."""

    passthrough: str = "auto"
    """Kernel FUSE passthrough (Linux >= 6.9, a libfuse >= 3.17 build of pyfuse3, a root daemon): "auto"
    lets the kernel read and write the cache file of an open file itself, at the disk's speed, for files
    whose bytes are all local while the cache has room; it turns itself off (and says why) where it cannot
    work. "off": every read and write goes through the daemon."""

    transfers: int = 8
    """Files (or batches of small files) uploaded in parallel."""

    part_size: str = "64M"
    """Part size of staged (multipart) uploads; smaller for mid-size files so that parts go in parallel."""

    memory_budget: str = "256M"
    """Bytes of part data all transfers together may hold in memory at once (uploads and downloads)."""

    parts_in_flight: int = 16
    """Part transfers (up and down, all files together) in flight at once, within memory_budget."""

    upload_limit: str = "off"
    """Cap on the bytes per second sent to the store, all transfers together: a rate with a SIZE suffix
    ("200M"), "0" or "off" (no cap), or a timetable of local times of day ("08:00,50M 19:00,off": the last
    entry before now applies, wrapping round midnight). `ckptfs limit` changes it until the next entry."""

    download_limit: str = "off"
    """Cap on the bytes per second read from the store, as upload_limit."""

    read_ahead: str = "4M"
    """The kernel's read-ahead for the mount (its bdi read_ahead_kb): how much a sequential reader's reads
    ask for at once, in FUSE requests of up to 1 MiB; "0": leave the kernel's default (128 KiB)."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (also AWS_ENDPOINT_URL)."""

    metrics_addr: str = "127.0.0.1:9477"
    """HOST:PORT for the Prometheus endpoint, or "off"."""

    drain_timeout: float = 300.0
    """Seconds SIGTERM/SIGINT waits for the drain before unmounting anyway (the rest stays journaled)."""

    preempt_on_sigterm: float = 0.0
    """Seconds: SIGTERM is a preemption notice with this deadline (docs/OPERATIONS.md, preemption): the newest
    complete step goes first, and the whole stop (drain, report, unmount) takes at most this long (and at most
    drain_timeout). 0: off, SIGTERM drains whatever is queued for up to drain_timeout."""

    preemption_notice: str = "off"
    """Watch the cloud's preemption notice and act on it by itself: aws (IMDS spot/instance-action), gcp
    (metadata instance/preempted), azure (scheduled events, Preempt), or off."""

    preemption_notice_url: str | None = None
    """The metadata endpoint the watcher asks (default: the cloud's own, 169.254.169.254 or
    metadata.google.internal); a URL of scheme http."""

    preemption_deadline: float = 25.0
    """Seconds a notice seen by the watcher leaves for the drain (shortened to the time the notice itself
    names, less PREEMPTION_MARGIN, where it names one)."""

    preemption_keep_limits: bool = False
    """Keep the bandwidth caps under a preemption notice (by default they are lifted: what is left must go as
    fast as it can)."""

    preemption_poll: float = 5.0
    """Seconds between the watcher's looks at the metadata endpoint (AWS advises every 5 s)."""

    commit_markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS
    """Glob patterns (matched against the file name) of files uploaded only after everything before them."""

    cross_node_ordering: bool = True
    """Commit markers also wait for the files other nodes (mounts of the same prefix) closed before them
    (docs/design/cross-node.md): each node keeps a small record of its pending work in the store."""

    rename_wait: float = 30.0
    """Seconds a rename or rmdir of a directory waits, with cross-node ordering, for the work other nodes have
    pending in its checkpoint (the top-level directory it is in): what they closed before it is then in the
    store and moves with it (Orbax's multi-host save renames a tmp dir every host wrote into). Past it the
    operation goes on, and what they upload there later lands under the old name (logged, and in status)."""

    keep_mount: bool = True
    """The mount outlives the daemon (keepmount/holder.py): a holder process keeps the FUSE connection, and a daemon
    that dies is started again and takes it over; the job's requests wait instead of failing."""

    keep_mount_on_stop: bool = False
    """On SIGTERM, when the node's holder service keeps the FUSE connection (`ckptfs holder`, Kubernetes),
    drain for up to drain_timeout while serving as before (writes are not refused), then leave the mount to
    the holder instead of unmounting: the next daemon (the DaemonSet's next pod) takes it over, and the job's
    requests wait meanwhile. What is not uploaded by then stays journaled in the cache dir for the next
    daemon. A daemon that starts before the service waits for it (it starts no holder of its own, which would
    die with its pod). Without a holder service SIGTERM drains and unmounts as always."""

    guard_mountpoint: bool = True
    """After a clean unmount, mount a read-only guard (a tiny tmpfs, mount/guard.py) over the mountpoint, so that a
    job that keeps saving gets EROFS instead of writing onto the disk below, never uploaded. `ckptfs mount`
    replaces the guard by itself; `ckptfs unguard MNT` removes it. Needs root."""

    allow_other: bool = False
    """Let other users access the mount (implies default_permissions)."""

    daemon: bool = False
    """Detach once the mount is live."""

    log_level: str = "INFO"
    """Python logging level name."""

    def effective(self, cache_dir: Path) -> str:
        """The effective configuration, one line, for the log (config holds no secrets; an endpoint URL's
        user:password part, if any, is dropped)."""
        fields = dataclasses.asdict(self)
        fields["cache_dir"] = str(cache_dir)
        if self.endpoint_url:
            parts = urllib.parse.urlsplit(self.endpoint_url)
            fields["endpoint_url"] = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")
                                                    if parts.hostname else parts.netloc).geturl()
        fields.pop("source")
        fields.pop("mountpoint")
        fields["commit_markers"] = ",".join(self.commit_markers)
        fields["keep"] = ",".join(self.keep)
        return ", ".join(f"{key} {value}" for key, value in fields.items())

    @property
    def open_upload_idle(self) -> float | None:
        """Seconds of idleness after which a file open for writing is uploaded; None: never (not a gateway)."""
        if self.idle_upload > 0:
            return self.idle_upload
        return GATEWAY_IDLE if self.gateway else None

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir(self.source)


def default_cache_root() -> Path:
    """/var/cache/ckptfs for root; for another user, who cannot write there, their own cache directory
    ($XDG_CACHE_HOME/ckptfs, else ~/.cache/ckptfs)."""
    if os.geteuid() == 0:
        return DEFAULT_CACHE_ROOT
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "ckptfs"
    return Path.home() / ".cache" / "ckptfs"


def default_cache_dir(source: str) -> Path:
    """A readable, collision-free directory name for a source URL, under default_cache_root()."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", source).strip("-")[:80]
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]
    return default_cache_root() / f"{readable}-{digest}"


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
_TIMETABLE_HELP = (f"{_RATE_HELP}; or a timetable of local times of day, like \"08:00,50M 19:00,off\"")

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
        return ((0, parse_rate(text, name, hint=_TIMETABLE_HELP)),)
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
        raise UsageError(f"{name} {text!r}: {exc}; {_TIMETABLE_HELP}") from None
    return tuple(sorted(entries.items()))


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(name: str, value: Any) -> Any:
    if name in ("mountpoint", "cache_dir") and value is not None:
        return Path(value)
    if name in ("upload_delay", "small_file_wait", "drain_timeout", "dirty_wait", "refresh_interval", "idle_upload",
                "rename_wait", "preempt_on_sigterm", "preemption_deadline", "preemption_poll"):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a number of seconds, not {value!r}") from None
        if value < 0:
            raise UsageError(f"{name} must not be negative")
        return value
    if name == "keep_last":
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise UsageError(f"keep_last must be a whole number >= 0 (0 turns retention off), not {value!r}")
        return value
    if name == "keep":
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise UsageError("keep must be a list of glob strings")
        return tuple(value)
    if name in ("transfers", "parts_in_flight"):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be a whole number >= 1, not {value!r}")
        return value
    if name == "commit_markers":
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            raise UsageError("commit_markers must be a list of glob strings")
        return tuple(value)
    if name == "upload_while_writing":
        mode = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value).lower()
        if mode not in ("auto", "on", "off"):
            raise UsageError(f"upload_while_writing must be auto, on or off, not {value!r}")
        return mode
    if name == "preemption_notice":
        kind = str(value).strip().lower()
        if kind not in ("off", "aws", "gcp", "azure"):
            raise UsageError(f"preemption_notice must be aws, gcp, azure or off, not {value!r}")
        return kind
    if name == "preemption_notice_url" and value is not None:
        if not isinstance(value, str) or urllib.parse.urlsplit(value).scheme != "http":
            raise UsageError(f"preemption_notice_url must be an http:// URL (a metadata endpoint), not {value!r}")
        return value.rstrip("/")
    if name == "passthrough":
        mode = {True: "auto", False: "off"}.get(value, value) if isinstance(value, bool) else str(value).lower()
        if mode not in ("auto", "off"):
            raise UsageError(f"passthrough must be auto or off, not {value!r}")
        return mode
    if name in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be true or false")
        return value
    if name in ("part_size", "memory_budget", "read_ahead"):
        if str(value).strip().endswith("%"):
            raise UsageError(f"{name} must be a size like 64M, not a percentage")
        parse_size(value)
        return str(value)
    if name in ("cache_size", "min_free"):
        parse_size(value, total=100)  # validate now, resolve against the filesystem later
        return str(value)
    if name in ("upload_limit", "download_limit"):
        if not isinstance(value, str | int):
            raise UsageError(f"{name} {value!r}: {_TIMETABLE_HELP}")
        parse_bandwidth(value, name)  # validate now; the daemon parses it again for the engine
        return str(value).strip()
    return value


ENV_PREFIX = "CKPTFS_"
CONFIG_ENV = "CKPTFS_CONFIG"  # the TOML file, when --config does not name one

_BOOLEANS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
_INT_KEYS = ("keep_last", "transfers", "parts_in_flight")
_LIST_KEYS = ("keep", "commit_markers")
_MODE_KEYS = ("upload_while_writing", "passthrough")  # also take true/false, as in the file


def env_name(key: str) -> str:
    """The environment variable of a config key: CKPTFS_ and the key in upper case."""
    return ENV_PREFIX + key.upper()


def _from_text(key: str, text: str) -> Any:
    """An environment variable's text as the TOML value it stands for, so that _coerce checks both alike."""
    if key in _BOOL_KEYS:
        if text.strip().lower() not in _BOOLEANS:
            raise UsageError(f"{key} must be true or false (or yes/no, on/off, 1/0), not {text!r}")
        return _BOOLEANS[text.strip().lower()]
    if key in _MODE_KEYS and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if key in _INT_KEYS:
        return int(text) if re.fullmatch(r"\s*[+-]?\d+\s*", text) else text  # not a whole number: _coerce says so
    if key in _LIST_KEYS:
        if text.lstrip().startswith("["):  # a TOML array, for a pattern that holds a comma
            try:
                return tomllib.loads(f"value = {text}")["value"]
            except tomllib.TOMLDecodeError as exc:
                raise UsageError(f"{key}: {text!r} starts with [ but is not a TOML array of strings ({exc})") from None
        return [item.strip() for item in text.split(",") if item.strip()]
    return text


def settings_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config keys set in `environ` as CKPTFS_<KEY>, checked. Other CKPTFS_ names are not config keys
    (CKPTFS_RUNTIME_DIR, CKPTFS_READY_FD, ...) and an empty value counts as unset (what a template that
    renders nothing gives)."""
    values: dict[str, Any] = {}
    for key in _FIELDS:
        name = env_name(key)
        text = environ.get(name, "")
        if not text.strip():
            continue
        try:
            values[key] = _coerce(key, _from_text(key, text))
        except UsageError as exc:
            raise UsageError(f"environment variable {name}: {exc}") from None
    return values


def config_file(file: Path | None, environ: Mapping[str, str] | None) -> Path | None:
    """The TOML file: --config's, else $CKPTFS_CONFIG's (None: no file)."""
    if file is not None:
        return file
    named = (environ or {}).get(CONFIG_ENV, "").strip()
    return Path(named) if named else None


def _read_file(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {file} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {file} is not valid TOML: {exc}") from None
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise UsageError(f"config file {file}: unknown key(s) {', '.join(unknown)}")
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = _coerce(key, value)
        except UsageError as exc:
            raise UsageError(f"config file {file}: {exc}") from None
    return checked


def load_settings(
    file: Path | None, overrides: dict[str, Any], environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The keys set anywhere, checked, each from the strongest place that sets it: `overrides` (flags; None
    means not given), then `environ` (CKPTFS_<KEY>), then the TOML file (`file`, else $CKPTFS_CONFIG in
    `environ`). Keys set nowhere are absent (their default applies)."""
    file = config_file(file, environ)
    values = _read_file(file) if file is not None else {}
    if environ is not None:
        values.update(settings_from_env(environ))
    values.update({k: _coerce(k, v) for k, v in overrides.items() if v is not None})
    return values


def load_config(file: Path | None, overrides: dict[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """The configuration: defaults, then the TOML file, then `environ`'s CKPTFS_<KEY> variables (None: the
    environment is not read), then `overrides` (flags) on top."""
    values = load_settings(file, overrides, environ)
    for required in ("source", "mountpoint"):
        if required not in values:
            raise UsageError(f"{required} is missing (give it on the command line, as {env_name(required)} in the"
                             " environment, or in the config file)")
    return Config(**values)
