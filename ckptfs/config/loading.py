"""Loading the configuration: defaults, then a TOML file, then CKPTFS_<KEY> environment variables, then flags
(each overriding the one before, as rclone does), every value checked with one clear error naming where it
came from.

Owns reading the config file (the only file this package reads), the environment's config keys, and the
checks of each key's value; the Config dataclass is options.py's, sizes and rates units.py's.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptfs.config.options import Config
from ckptfs.config.units import TIMETABLE_HELP, parse_bandwidth, parse_size
from ckptfs.errors import UsageError

_BOOL_KEYS = ("allow_other", "daemon", "cross_node_ordering", "keep_mount", "keep_mount_on_stop", "guard_mountpoint",
              "gateway", "preemption_keep_limits")

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
            raise UsageError(f"{name} {value!r}: {TIMETABLE_HELP}")
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
