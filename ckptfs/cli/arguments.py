"""The command line's arguments: the parser of every command, and what they mean as settings: the Config
`ckptfs mount` runs with, and the configured keys (a MOUNTPOINT above all) other commands use.

Owns argparse and the mapping of flags to config keys; what each command does is in the modules that run it
(launch.py, mounts.py, show.py, actions.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ckptfs.config import CONFIG_ENV, Config, env_name, load_config, load_settings
from ckptfs.errors import UsageError

MOUNTPOINT_HELP = "(default: $CKPTFS_MOUNTPOINT, or the mountpoint of the config file $CKPTFS_CONFIG)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="Checkpoint filesystem: local-speed writes, "
                                     "background upload to object storage.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mount = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT (foreground unless --daemon)")
    mount.add_argument("source", nargs="?", help="file:///DIR, s3://BUCKET[/PREFIX], gs://..., az://..."
                       " (default: $CKPTFS_SOURCE, or the config file's)")
    mount.add_argument("mountpoint", nargs="?", type=Path, help="(default: $CKPTFS_MOUNTPOINT, or the config file's)")
    mount.add_argument("--cache-dir", type=Path)
    mount.add_argument("--config", type=Path, help=f"TOML file (default: ${CONFIG_ENV}); CKPTFS_<KEY> environment"
                       " variables override its keys, flags override both")
    mount.add_argument("--cache-size")
    mount.add_argument("--min-free")
    mount.add_argument("--dirty-wait", type=float)
    mount.add_argument("--refresh-interval", type=float)
    mount.add_argument("--rename-wait", type=float, metavar="SECS",
                       help="how long a rename or rmdir of a directory waits for other nodes' pending work in its"
                            " checkpoint (default 30)")
    mount.add_argument("--keep-last", type=int, help="retention: keep the newest N checkpoints (0: off)")
    mount.add_argument("--keep", action="append", help="retention: never delete names matching this glob")
    mount.add_argument("--upload-delay", type=float)
    mount.add_argument("--small-file-wait", type=float)
    mount.add_argument("--upload-while-writing", choices=["auto", "on", "off"],
                       help="upload a large file part by part while it is still open: auto where the store needs"
                            " no copy at close for it (file://, gs://), on (also s3://, az://), off (the default)")
    mount.add_argument("--gateway", action="store_true", default=None,
                       help="gateway mode, for a mount an NFS server exports: files still open for writing are"
                            " uploaded once idle (--idle-upload, 5 s), after an fsync (NFS COMMIT), and again when"
                            " they change; flush does not wait for their close")
    mount.add_argument("--idle-upload", type=float, metavar="SECS",
                       help="upload a file still open for writing after SECS without a write (0: only with"
                            " --gateway, 5 s)")
    mount.add_argument("--passthrough", choices=["auto", "off"],
                       help="let the kernel read and write cached files itself (FUSE passthrough, Linux >= 6.9):"
                            " auto (the default: on where the kernel and the pyfuse3 build allow it), off")
    mount.add_argument("--cross-node-ordering", action=argparse.BooleanOptionalAction, default=None,
                       help="commit markers also wait for what other nodes mounting this prefix closed before them"
                            " (the default; --no-cross-node-ordering: this node only, no records in the store)")
    mount.add_argument("--keep-mount", action=argparse.BooleanOptionalAction, default=None,
                       help="the mount outlives the daemon: a holder process keeps the FUSE connection and starts"
                            " a daemon that died again, which takes it over (the default; --no-keep-mount: a dead"
                            " daemon leaves the mount at 'Transport endpoint is not connected')")
    mount.add_argument("--keep-mount-on-stop", action=argparse.BooleanOptionalAction, default=None,
                       help="on SIGTERM, when the node's holder service (`ckptfs holder`) keeps the connection, drain"
                            " (serving on), then leave the mount to it for the next daemon instead of unmounting"
                            " (Kubernetes)")
    mount.add_argument("--guard-mountpoint", action=argparse.BooleanOptionalAction, default=None,
                       help="after a clean unmount, guard the bare mountpoint so that writes into it fail with EROFS"
                            " (the default; --no-guard-mountpoint: leave the bare directory writable)")
    mount.add_argument("--endpoint-url")
    mount.add_argument("--transfers", type=int)
    mount.add_argument("--part-size")
    mount.add_argument("--memory-budget")
    mount.add_argument("--parts-in-flight", type=int)
    for direction, to in (("upload", "sent to"), ("download", "read from")):
        mount.add_argument(f"--{direction}-limit", metavar="RATE",
                           help=f"cap the bytes per second {to} the store, all transfers together: 200M, off (the"
                                " default), or a timetable of local times of day, \"08:00,50M 19:00,off\";"
                                f" `ckptfs limit --{direction}` changes it while mounted")
    mount.add_argument("--read-ahead")
    mount.add_argument("--metrics-addr")
    mount.add_argument("--drain-timeout", type=float)
    mount.add_argument("--preempt-on-sigterm", type=float, metavar="SECONDS",
                       help="SIGTERM is a preemption notice with this deadline: the newest complete step first, the"
                            " whole stop within it (0: off)")
    mount.add_argument("--preemption-notice", choices=["aws", "gcp", "azure", "off"],
                       help="watch the cloud's preemption notice and act on it (ckptfs preempt) by itself")
    mount.add_argument("--preemption-keep-limits", action="store_true", default=None,
                       help="keep the bandwidth caps under a preemption notice (they are lifted by default)")
    mount.add_argument("--preemption-notice-url", metavar="URL", help="the metadata endpoint to ask (default: the"
                       " cloud's own)")
    mount.add_argument("--allow-other", action="store_true", default=None)
    mount.add_argument("--daemon", action="store_true", default=None, help="detach once the mount is live")
    mount.add_argument("--foreground", dest="daemon", action="store_false", help="stay in the foreground"
                       " (the default; overrides daemon = true in the config file)")
    mount.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    umount = sub.add_parser("umount", help="drain, then unmount")
    umount.add_argument("mountpoint", type=Path, nargs="?")
    umount.add_argument("--timeout", type=float, help="seconds to wait for the drain (default: no limit, or"
                        " the configured drain_timeout: config file or $CKPTFS_DRAIN_TIMEOUT)")
    umount.add_argument("--config", type=Path, help="take the mountpoint (and drain_timeout) from this file")

    restart = sub.add_parser("restart", help="replace the daemon by one of the code installed now (an upgrade),"
                             " without unmounting: open files and the job carry on")
    restart.add_argument("mountpoint", type=Path, nargs="?")
    restart.add_argument("--config", type=Path, help="take the mountpoint from this file")
    for name, what in (
        ("guard", "mount a read-only guard over MOUNTPOINT while ckptfs does not serve it, so that writes into the"
                  " bare directory fail with EROFS (at boot, or a unit's ExecStopPost)"),
        ("unguard", "remove the guard from MOUNTPOINT (ckptfs mount does this by itself)"),
    ):
        command = sub.add_parser(name, help=what)
        command.add_argument("mountpoint", type=Path, nargs="?")
        command.add_argument("--config", type=Path, help="take the mountpoint (and guard_mountpoint) from this file")

    holder = sub.add_parser("holder", help="serve as this node's holder service: keep the FUSE connections that"
                            " daemons hand in, so that a mount outlives its daemon's pod (Kubernetes: its own"
                            " DaemonSet); in the foreground until SIGTERM")
    holder.add_argument("--guard", action="append", default=[], type=Path, metavar="MOUNTPOINT",
                        help="at start, make MOUNTPOINT if missing and guard it while nothing is mounted there, so"
                             " that a job started before the daemon (a node's boot) gets EROFS instead of writing"
                             " onto the disk below; the daemon's mount replaces the guard (repeatable)")

    status = sub.add_parser("status", help="files and bytes per state, queue, oldest dirty age, last error")
    status.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    status.add_argument("--json", action="store_true")

    prune = sub.add_parser("prune", help="delete all but the newest N checkpoints, in the mount and the store")
    prune.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    prune.add_argument("--keep-last", type=int, required=True, metavar="N")
    prune.add_argument("--keep", action="append", default=[], metavar="GLOB", help="never delete these (repeatable)")
    prune.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")

    refresh = sub.add_parser("refresh", help="show objects other nodes wrote (or deleted) now")
    refresh.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)

    flush = sub.add_parser("flush", help="wait until everything (or PATHs) is durable in the store")
    flush.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    flush.add_argument("paths", nargs="*", type=Path)
    flush.add_argument("--timeout", type=float, help="seconds (default: no limit)")
    flush.add_argument("--all-nodes", action="store_true",
                       help="then wait until what every other node of this prefix had closed is durable too")

    limit = sub.add_parser("limit", help="show the bandwidth caps in effect, or change them until the daemon restarts"
                           " (or the configured timetable's next entry)")
    limit.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    limit.add_argument("--upload", metavar="RATE", help="bytes per second sent to the store, like 200M; off: no cap")
    limit.add_argument("--download", metavar="RATE", help="bytes per second read from the store; off: no cap")
    limit.add_argument("--json", action="store_true")

    preempt = sub.add_parser("preempt", help="a preemption notice: upload the newest complete step first, then the"
                             " next, for up to DEADLINE; print the report (also JSON in the cache dir)")
    preempt.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    preempt.add_argument("--deadline", required=True, metavar="SECONDS",
                         help="the time the node has left, like 30 or 30s (or 2m)")
    preempt.add_argument("--keep-limits", action="store_true", help="keep the bandwidth caps (they are lifted"
                         " by default)")
    preempt.add_argument("--no-wait", dest="wait", action="store_false", help="return at once, not with the report")
    preempt.add_argument("--json", action="store_true")
    preempt.add_argument("--config", type=Path, help="take the mountpoint from this file")
    prefetch = sub.add_parser("prefetch", help="fetch a checkpoint's files into this node's cache before a restart"
                              " reads them; they stay until read once or released")
    prefetch.add_argument("mountpoint", type=Path, help=MOUNTPOINT_HELP)
    prefetch.add_argument("step", nargs="?", help="a directory or file under the mount (relative to it, or"
                          " absolute); with --release, default the whole mount")
    prefetch.add_argument("--wait", action="store_true", help="return once every file is in the cache")
    prefetch.add_argument("--release", action="store_true", help="fetch nothing; let the prefetched files not"
                          " read yet be evicted again")
    prefetch.add_argument("--json", action="store_true")

    nodes = sub.add_parser("nodes", help="the nodes whose work on this prefix is not durable yet (cross-node"
                           " ordering of commit markers); --forget gives up on a node lost for good")
    nodes.add_argument("mountpoint", type=Path, nargs="?", help=MOUNTPOINT_HELP)
    nodes.add_argument("--forget", metavar="NODE", help="give up on NODE: markers stop waiting for it; a marker"
                       " that waited for it is held (not uploaded) unless NODE comes back and drains")
    nodes.add_argument("--json", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        "source": args.source,
        "mountpoint": args.mountpoint,
        "cache_dir": args.cache_dir,
        "cache_size": args.cache_size,
        "min_free": args.min_free,
        "dirty_wait": args.dirty_wait,
        "refresh_interval": args.refresh_interval,
        "rename_wait": args.rename_wait,
        "keep_last": args.keep_last,
        "keep": args.keep,
        "upload_delay": args.upload_delay,
        "small_file_wait": args.small_file_wait,
        "upload_while_writing": args.upload_while_writing,
        "gateway": args.gateway,
        "idle_upload": args.idle_upload,
        "passthrough": args.passthrough,
        "cross_node_ordering": args.cross_node_ordering,
        "keep_mount": args.keep_mount,
        "keep_mount_on_stop": args.keep_mount_on_stop,
        "guard_mountpoint": args.guard_mountpoint,
        "endpoint_url": args.endpoint_url,
        "transfers": args.transfers,
        "part_size": args.part_size,
        "memory_budget": args.memory_budget,
        "read_ahead": args.read_ahead,
        "parts_in_flight": args.parts_in_flight,
        "upload_limit": args.upload_limit,
        "download_limit": args.download_limit,
        "metrics_addr": args.metrics_addr,
        "drain_timeout": args.drain_timeout,
        "preempt_on_sigterm": args.preempt_on_sigterm,
        "preemption_notice": args.preemption_notice,
        "preemption_notice_url": args.preemption_notice_url,
        "preemption_keep_limits": args.preemption_keep_limits,
        "allow_other": args.allow_other,
        "daemon": args.daemon,
        "log_level": args.log_level,
    }
    return load_config(args.config, overrides, os.environ)


def configured_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The configured keys a command other than mount uses (its MOUNTPOINT argument over the environment
    and the config file: --config, else $CKPTFS_CONFIG), as `ckptfs mount` would have them."""
    settings = load_settings(getattr(args, "config", None), {"mountpoint": args.mountpoint}, os.environ)
    if settings.get("mountpoint") is None:
        also = ", or --config FILE naming one" if hasattr(args, "config") else ""
        raise UsageError(f"{args.command} needs a MOUNTPOINT (or {env_name('mountpoint')} in the environment{also})")
    args.mountpoint = settings["mountpoint"]
    return settings


def mountpoint_from_environment(args: argparse.Namespace) -> None:
    """A command given no MOUNTPOINT uses the configured one (a container's CKPTFS_MOUNTPOINT)."""
    if args.mountpoint is None:
        configured_settings(args)
