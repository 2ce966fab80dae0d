"""Configuration: one frozen dataclass (options.py), loaded from defaults, a TOML file, CKPTFS_<KEY>
environment variables and flags (loading.py), with the sizes and rates its values are written in (units.py).

Owns parsing and validation of every setting. It must not touch the filesystem beyond reading the config
file, nor open stores. The names the rest of ckptfs uses are here.
"""

from ckptfs.config.loading import (
    CONFIG_ENV,
    ENV_PREFIX,
    config_file,
    env_name,
    load_config,
    load_settings,
    settings_from_env,
)
from ckptfs.config.options import (
    DEFAULT_CACHE_ROOT,
    DEFAULT_COMMIT_MARKERS,
    GATEWAY_IDLE,
    Config,
    default_cache_dir,
    default_cache_root,
)
from ckptfs.config.units import MIN_RATE, Timetable, human_size, parse_bandwidth, parse_rate, parse_size

__all__ = [
    "CONFIG_ENV", "DEFAULT_CACHE_ROOT", "DEFAULT_COMMIT_MARKERS", "ENV_PREFIX", "GATEWAY_IDLE", "MIN_RATE", "Config",
    "Timetable", "config_file", "default_cache_dir", "default_cache_root", "env_name", "human_size", "load_config",
    "load_settings", "parse_bandwidth", "parse_rate", "parse_size", "settings_from_env",
]
