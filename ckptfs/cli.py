"""The `ckptfs` command line: argv -> Config -> daemon.run(), or a call of the Python API in control/client.py (the
control socket of a running daemon), so `ckptfs flush` and `ckptfs.wait_durable()` are one code path.

Owns argument parsing, the --daemon detach-and-wait-for-ready dance, human and JSON output, and mapping
errors to exit codes: 0 ok, 1 an error the user can fix (one line on stderr, no traceback), 2 bad usage,
3 not everything is durable in the store yet (flush/umount timed out).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckptfs.config import CONFIG_ENV, Config, env_name, human_size, load_config, load_settings, parse_rate
from ckptfs.control import client
from ckptfs.errors import CkptfsError, NotDurableError, UsageError
from ckptfs.mount import guard

log = logging.getLogger("ckptfs")

EXIT_NOT_DURABLE = NotDurableError.exit_code  # flush/umount timed out (NotDrainedError too)
READY_FD_ENV = "CKPTFS_READY_FD"
# pyfuse3 copies every FUSE write into a new bytes object, and every read reply is one: 1 MiB each for
# a checkpoint. glibc's malloc hands such a block back to the kernel when it is freed (the top of the heap is
# trimmed), so every request faulted in and zeroed 256 fresh pages: half of the daemon's CPU for a large
# write. A pad kept at the top of the heap makes the next request reuse the same pages. Only a tunable read
# when the process starts does it (mallopt() later also turns off the dynamic mmap threshold, which puts
# every 1 MiB block in an mmap of its own), so the daemon is started, or re-executes itself, with it.
MALLOC_TUNABLE = "glibc.malloc.top_pad"
MALLOC_TOP_PAD = 16 << 20


MOUNTPOINT_HELP = "(default: $CKPTFS_MOUNTPOINT, or the mountpoint of the config file $CKPTFS_CONFIG)"


def _parser() -> argparse.ArgumentParser:
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


def _config_from_args(args: argparse.Namespace) -> Config:
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


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The configured keys a command other than mount uses (its MOUNTPOINT argument over the environment
    and the config file: --config, else $CKPTFS_CONFIG), as `ckptfs mount` would have them."""
    settings = load_settings(getattr(args, "config", None), {"mountpoint": args.mountpoint}, os.environ)
    if settings.get("mountpoint") is None:
        also = ", or --config FILE naming one" if hasattr(args, "config") else ""
        raise UsageError(f"{args.command} needs a MOUNTPOINT (or {env_name('mountpoint')} in the environment{also})")
    args.mountpoint = settings["mountpoint"]
    return settings


def _mountpoint_from_environment(args: argparse.Namespace) -> None:
    """A command given no MOUNTPOINT uses the configured one (a container's CKPTFS_MOUNTPOINT)."""
    if args.mountpoint is None:
        _settings(args)


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


def _setup_logging(level: str) -> None:
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


def cmd_mount(args: argparse.Namespace) -> int:
    config = _config_from_args(args)
    _setup_logging(config.log_level)
    if config.daemon:
        return _detach(config)
    if args.restartable:
        _restart_with_malloc_pad()
    end_on_sigterm_as_init()
    import trio

    from ckptfs import daemon
    from ckptfs.keepmount import keeper

    ready_fd = int(os.environ.pop(READY_FD_ENV, "-1"))
    waiting = [ready_fd >= 0]  # the parent still waits on ready_fd (closed once it heard "ready")

    def ready() -> None:
        if waiting[0]:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
            waiting[0] = False

    try:
        # A daemon that dies is started again with this command line by the mount's holder (keepmount/holder.py).
        restart_argv = sys.argv[1:] if args.restartable else None
        return trio.run(daemon.run, config, ready, restart_argv)
    except keeper.Restart as restart:  # `ckptfs restart`: the code installed now, in this process
        os.execve(sys.executable, [sys.executable, "-m", "ckptfs", *restart.argv], restart.env)
    except CkptfsError as exc:
        if waiting[0]:  # a failure after the mount was live goes to the log only
            os.write(ready_fd, f"error {exc.exit_code} {exc}\n".encode())
        raise


def end_on_sigterm_as_init() -> None:
    """As PID 1 (a container's entrypoint), the kernel drops every signal the process has no handler for:
    a SIGTERM before the daemon's own handler is set (once the mount is live, after the journal's
    recovery) would do nothing, and `podman stop` or a pod's deletion would wait its whole grace period for
    a SIGKILL. Until then, SIGTERM ends the process as it ends any other (the journal is kill -9 safe)."""
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, lambda signum, _frame: os._exit(128 + signum))


def _with_malloc_pad(environ: os._Environ[str] | dict[str, str]) -> os._Environ[str] | dict[str, str]:
    """`environ` with MALLOC_TUNABLE added to GLIBC_TUNABLES; `environ` itself if it is there (also as
    the operator set it) or if the C library is not glibc."""
    current = environ.get("GLIBC_TUNABLES", "")
    if MALLOC_TUNABLE in current:
        return environ
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return environ
    except (ValueError, OSError):
        return environ
    setting = f"{MALLOC_TUNABLE}={MALLOC_TOP_PAD}"
    return dict(environ, GLIBC_TUNABLES=f"{current}:{setting}" if current else setting)


def _restart_with_malloc_pad() -> None:
    """Re-execute this command with the malloc pad, unless it is set already; returns only if it is, or if
    the restart is not possible (then the daemon runs without it)."""
    tuned = _with_malloc_pad(os.environ)
    if tuned is os.environ or not sys.executable:  # sys.executable is empty or None when Python is embedded
        return
    try:  # the same process (pid, descriptors, systemd's notify socket), started again with the tunable
        os.execve(sys.executable, [sys.executable, "-m", "ckptfs", *sys.argv[1:]], tuned)
    except OSError as exc:
        logging.getLogger(__name__).warning("could not restart with %s (%s): large writes cost more CPU",
                                            MALLOC_TUNABLE, exc.strerror)


def _detach(config: Config) -> int:
    """Run the daemon as a child in its own session; return once it reports the mount live (or failed)."""
    cache_dir = config.resolved_cache_dir()
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_fd = os.open(cache_dir / "ckptfs.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CkptfsError(
            f"cache dir {cache_dir} is not writable ({exc.strerror}); choose another with --cache-dir"
        ) from None
    argv = [a for a in sys.argv[1:] if a != "--daemon"]
    read_fd, write_fd = os.pipe()
    env = dict(_with_malloc_pad(os.environ), **{READY_FD_ENV: str(write_fd)})
    child = subprocess.Popen(
        [sys.executable, "-m", "ckptfs", *argv, "--cache-dir", str(cache_dir), "--foreground"],
        stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
        pass_fds=(write_fd,), env=env, start_new_session=True,
    )
    os.close(write_fd)
    os.close(log_fd)
    with os.fdopen(read_fd, "rb") as ready:
        message = ready.read().decode(errors="replace").strip()
    if message == "ready":
        log_path = cache_dir / "ckptfs.log"
        print(f"ckptfs: {config.source} mounted on {config.mountpoint} (pid {child.pid}, log {log_path})")
        return 0
    child.wait()
    if message.startswith("error "):
        _, code, text = message.split(" ", 2)
        print(f"ckptfs: {text}", file=sys.stderr)
        return int(code)
    print(f"ckptfs: the daemon exited before the mount was live (exit {child.returncode});"
          f" see {cache_dir / 'ckptfs.log'}", file=sys.stderr)
    return 1


def cmd_restart(args: argparse.Namespace) -> int:
    _settings(args)
    mountpoint = client.canonical_mountpoint(args.mountpoint)
    pid = client.restart(mountpoint)
    print(f"ckptfs: {mountpoint} is served by a new daemon (pid {pid}); nothing was unmounted")
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    timeout = args.timeout
    if timeout is None:
        timeout = _settings(args).get("drain_timeout")
    else:
        _settings(args)
    mountpoint = client.canonical_mountpoint(args.mountpoint)
    client.unmount(mountpoint, timeout=timeout)  # NotDrainedError: exit 3 with the daemon's count
    print(f"ckptfs: {mountpoint} drained and unmounted")
    if guard.is_guarded(mountpoint):
        print(f"ckptfs: a read-only guard now covers {mountpoint}, so that a job still saving there gets EROFS"
              f" instead of writing onto the disk below; while it is there, removing {mountpoint} (rm -rf of a"
              f" directory above it) fails with EBUSY. `ckptfs unguard {mountpoint}` lifts it")
    return 0


def _guard_target(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The mountpoint a guard/unguard command names, directly or through the configuration."""
    settings = _settings(args)
    return client.canonical_mountpoint(args.mountpoint), settings


def cmd_guard(args: argparse.Namespace) -> int:
    mountpoint, settings = _guard_target(args)
    if not settings.get("guard_mountpoint", True):
        print(f"ckptfs: guard_mountpoint is false in the configuration: {mountpoint} is left unguarded")
        return 0
    top = guard.mounted_at(mountpoint)
    if top is not None and top.is_guard:
        print(f"ckptfs: {mountpoint} is guarded already")
        return 0
    if top is not None and top.fstype == "fuse.ckptfs":
        raise CkptfsError(f"{mountpoint} is a ckptfs mount (served, or left by a daemon that died): not guarding"
                          f" over it; `ckptfs umount {mountpoint}` unmounts it and leaves a guard")
    if top is not None:
        raise CkptfsError(f"{mountpoint} is a mount point ({top.describe()}): not guarding over another mount")
    guard.place(mountpoint, strict=True)
    print(f"ckptfs: guarded {mountpoint}: writes into it fail with EROFS until ckptfs mounts it"
          f" (`ckptfs unguard {mountpoint}` removes the guard)")
    return 0


def cmd_unguard(args: argparse.Namespace) -> int:
    mountpoint, _ = _guard_target(args)
    top = guard.mounted_at(mountpoint)
    if top is None:
        print(f"ckptfs: {mountpoint} is not guarded")
        return 0
    if not top.is_guard:
        raise CkptfsError(f"{mountpoint} is not guarded: what is mounted there is {top.describe()}, not a ckptfs"
                          " guard; left alone")
    guard.remove(mountpoint, strict=True)
    print(f"ckptfs: removed the guard on {mountpoint}: writes into it land on the disk below until ckptfs"
          " mounts it")
    return 0




def _credential_text(credentials: dict[str, Any]) -> str:
    """`ckptfs status`'s credential line: its source, when it expires, how often it was fetched again."""
    source = credentials["source"]
    if credentials.get("detail") and credentials["detail"] != source:
        source += f" ({credentials['detail']})"
    expires_at, left = credentials.get("expires_at"), credentials.get("expires_in_seconds")
    if expires_at is None:
        when = "does not expire" if credentials.get("fetched_at") else "not fetched yet"
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at))
        when = f"expires {stamp} (in {left:.0f} s)" if (left or 0) >= 0 else f"EXPIRED at {stamp}"
    text = (f"{source}, {when}; fetched again {credentials['refreshes']} times"
            f" ({credentials['renewals_after_rejection']} after the store rejected it as expired)")
    if credentials.get("last_error"):
        text += f"; last refresh failed: {credentials['last_error']}"
    return text


def cmd_status(args: argparse.Namespace) -> int:
    status = client.status(args.mountpoint)
    if args.json:  # scripts parse this: the same object as before the Python API, "ok" included
        print(json.dumps({"ok": True, **status}, indent=2, sort_keys=True))
        return 0
    print(f"{status['source']} on {status['mountpoint']} (pid {status['pid']}, up {status['uptime_seconds']}s)")
    print(f"cache dir  {status['cache_dir']}")
    print(f"{'state':<10} {'files':>8} {'bytes':>12}")
    for state, row in status["states"].items():
        print(f"{state:<10} {row['files']:>8} {human_size(row['bytes']):>12}")
    queue = status["queue"]
    print(f"queue      {queue['uploads']} uploads, {queue['moves']} moves, {queue['deletes']} deletes"
          f" ({queue['in_flight']} in flight); {status['open_for_write']} files open for writing")
    oldest = status["oldest_dirty_age_seconds"]
    print(f"oldest dirty  {'-' if oldest is None else f'{oldest}s'}")
    uploaded = status["uploaded"]
    print(f"uploaded   {uploaded['files']} files, {human_size(uploaded['bytes'])} since start")
    cache = status["cache"]
    budget = "-" if cache["budget_bytes"] is None else human_size(cache["budget_bytes"])
    print(f"cache      {human_size(cache['used_bytes'])} used of {budget}; {cache['evicted_files']} files"
          f" evicted; {cache['waits']} writes waited for room ({cache['writes_waiting']} now)")
    if cache.get("short_of_free_space"):
        print("           its filesystem is short of min_free: files being written spill to the store;"
              " free space there or lower --min-free")
    moved = status["transfers"]
    print(f"transfers  up {moved['parts_up']} parts, {human_size(moved['up_bytes_per_second'])}/s;"
          f" down {moved['parts_down']} parts, {human_size(moved['down_bytes_per_second'])}/s;"
          f" memory {human_size(moved['memory_bytes'])} of {human_size(moved['memory_budget_bytes'])}")
    limits = status.get("limits") or {}
    for label, direction in (("bandwidth  up", "upload"), ("           down", "download")):
        if direction in limits:
            print(f"{label} {_limit_text(limits[direction])}")
    credentials = status.get("credentials")
    if credentials:
        print(f"credential {_credential_text(credentials)}")
    prefetched = status.get("prefetch")
    if prefetched and (prefetched["files_prefetched"] or prefetched["files_pending"] or prefetched["files_kept"]):
        print(f"prefetch   {prefetched['files_prefetched']} files ({human_size(prefetched['bytes_prefetched'])})"
              f" fetched; {prefetched['files_pending']} pending ({human_size(prefetched['bytes_pending'])} to go);"
              f" {prefetched['files_kept']} kept until read ({human_size(prefetched['bytes_kept'])});"
              f" {prefetched['failures']} failed")
    reads = status.get("reads")
    if reads is not None:
        print(f"reads      {human_size(reads['bytes_downloaded'])} downloaded in {reads['chunks_fetched']} chunks;"
              f" {reads['partial_files']} partial files ({human_size(reads['partial_bytes'])});"
              f" {reads['readers_waiting']} reads waiting; {reads['checksum_failures']} checksum failures")
    # What is on and what is off, one line each, with why (and how to get what is off)
    passthrough = status.get("passthrough")
    if passthrough:
        print(f"passthrough {passthrough['why']} ({passthrough['opens']} opens)")
    keep = status.get("keep_mount")
    if keep:
        took = f" ({keep['handles_taken_over']} open files)" if keep.get("took_over") else ""
        print(f"keep mount {keep['why']}{took}")
    if status.get("guard"):
        print(f"guard      {status['guard']['why']}")
    nodes = status.get("nodes")
    if nodes and nodes.get("cross_node_ordering"):
        unannounced = f"; records not written: {nodes['unannounced']}" if nodes.get("unannounced") else ""
        print(f"node       {nodes['node']}: {len(nodes['records'])} pending records in the store{unannounced}")
        for marker in nodes["waiting_markers"]:
            held = " (held: " + ", ".join(marker["held_by"]) + " given up on)" if marker["held_by"] else ""
            print(f"  marker {marker['path']} waits for other nodes{held}: {'; '.join(marker['waits_for'])}")
    print(f"last error {status['last_error'] or '-'}")
    if status.get("failing_count"):
        print(f"parked     {status['failing_count']} entries fail unexpectedly again and again (retried every"
              " 10 minutes; see the log):")
        for failing in status["failing"][:10]:
            print(f"  {failing['path']}: {failing['job']}: {failing['error']}")
    for held in status.get("markers_held", [])[:10]:
        print(f"held back  commit marker {held['marker']}: {held['held_by']} is failing (never published over it)")
    if status.get("preempting"):
        print("preempting the newest complete step goes first (a preemption notice came)")
    return 0


def _limit_text(limit: dict[str, Any]) -> str:
    """One direction's cap for people: '8.0 MiB/s (set by ckptfs limit, until 19:00)', 'off (configured)'."""
    rate = limit.get("bytes_per_second")
    text = "off" if rate is None else f"{human_size(rate)}/s"
    source = limit.get("source")
    until = limit.get("until")
    why = {"config": "configured", "timetable": f"timetable entry {limit.get('entry')}",
           "runtime": "set by ckptfs limit", "lifted": "lifted until the daemon restarts"}.get(str(source), str(source))
    if until is not None:
        why += f", until {time.strftime('%H:%M', time.localtime(until))}"
    elif source == "runtime":
        why += ", until the daemon restarts"
    if source != "config":  # what applies again after a runtime change or at the next start
        why += f"; configured: {limit.get('configured')}"
    if limit.get("waiting"):
        why += f"; {limit['waiting']} transfers waiting for their turn"
    return f"{text} ({why})"


def cmd_limit(args: argparse.Namespace) -> int:
    for direction in ("upload", "download"):  # the daemon checks too: this only says so before connecting
        value = getattr(args, direction)
        if value is not None:
            parse_rate(value, f"--{direction}")
    limits = client.limit(args.mountpoint, upload=args.upload, download=args.download)
    if args.json:
        print(json.dumps(limits, indent=2, sort_keys=True))
        return 0
    for direction, limit in limits.items():
        print(f"{direction:<9} {_limit_text(limit)}")
    return 0


def parse_deadline(text: str) -> float:
    """`--deadline`: seconds, with an optional unit: 30, 30s, 2m."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--deadline {text!r} is not a time: give the seconds the node has left, like 30s or 2m")
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


def cmd_preempt(args: argparse.Namespace) -> int:
    """Exit 0 when the newest complete step is durable (or no step had work), EXIT_NOT_DURABLE when not."""
    deadline = parse_deadline(args.deadline)
    if args.mountpoint is None or args.config is not None:
        _settings(args)
    report = client.preempt(args.mountpoint, deadline, wait=args.wait, keep_limits=args.keep_limits,
                            reason="ckptfs preempt")
    if report is None:
        print("preemption started; the report is written to the cache dir")
        return 0
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for step in report["steps"]:
            state = ("durable, published" if step["published"] else "durable") if step["durable"] else (
                f"NOT durable: {step['why']}")
            print(f"{step['step']:<30} {state}")
        if not report["steps"]:
            print("no step had work pending")
    newest = next((s for s in report["steps"] if s["complete"]), None)
    return EXIT_NOT_DURABLE if newest is not None and not newest["durable"] else 0
def cmd_prefetch(args: argparse.Namespace) -> int:
    if args.step is None and not args.release:
        raise UsageError("name what to prefetch: ckptfs prefetch MOUNTPOINT STEP (a directory or file in the mount)")
    reply = client.prefetch(args.step or args.mountpoint, mountpoint=args.mountpoint, wait=args.wait,
                            release=args.release)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    elif args.release:
        print(f"released {reply['released']} prefetched files")
    else:
        fetched = (f"fetched {reply['fetched_files']} files ({human_size(reply['fetched_bytes'])})" if args.wait
                   else f"fetching {reply['to_fetch_files']} files ({human_size(reply['to_fetch_bytes'])}); ckptfs"
                   " status shows the progress")
        print(f"{reply['path'] or '/'}: {reply['files']} files, {reply['already_local']} in the cache already;"
              f" {fetched}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    client.wait_durable(args.mountpoint, args.paths, timeout=args.timeout, all_nodes=args.all_nodes)  # exit 3
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    reply = client.pending_nodes(args.mountpoint, forget=args.forget)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    if args.forget:
        print(f"forgot node {args.forget} ({reply['forgot_records']} pending records of it in the store)")
    print(f"this node  {reply['this_node']}")
    if not reply["nodes"]:
        print("no node has work pending in the store")
    for node in reply["nodes"]:
        what = " (this node)" if node["this_node"] else " (given up on)" if node["forgotten"] else ""
        since = node["oldest_written_at"]
        age = f", for {time.time() - since:.0f} s" if since else ""
        print(f"{node['node']}{what}: {node['host'] or '?'}, {node['records']} records{age}:"
              f" {', '.join(node['entries']) or '-'}")
    for marker in reply["waiting_markers"]:
        held = f" (held: {', '.join(marker['held_by'])} given up on)" if marker["held_by"] else ""
        print(f"marker {marker['path']} waits{held} for:")
        for line in marker["waits_for"]:
            print(f"  {line}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    result = client.prune(args.mountpoint, args.keep_last, args.keep, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for name in result.deleted:
        print(f"{verb} {name}")
    for name, why in sorted(result.kept.items()):
        print(f"kept    {name} ({why})")
    if not result.deleted:
        print(f"nothing to delete: {len(result.kept)} checkpoints kept")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    client.refresh(args.mountpoint)
    return 0


def cmd_holder(args: argparse.Namespace) -> int:
    from ckptfs.keepmount import holder

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    client.ensure_runtime_dir(client.runtime_dir())
    for mountpoint in args.guard:
        _guard_before_the_first_mount(client.canonical_mountpoint(mountpoint))
    return holder.serve_node()


def _guard_before_the_first_mount(mountpoint: Path) -> None:
    """A mountpoint with nothing mounted on it is made if missing and guarded (a new node's hostPath starts
    empty); one with a mount (a daemon's, or a guard already) is left as it is, unlooked-into: a FUSE mount
    no daemon serves yet would hang a stat."""
    top = guard.mounted_at(mountpoint)
    if top is not None:
        log.info("holder service: %s is mounted already (%s): no guard needed", mountpoint, top.describe())
        return
    try:
        mountpoint.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CkptfsError(f"cannot make the mountpoint {mountpoint} to guard: {exc.strerror}") from None
    guard.place(mountpoint, strict=True)
    log.info("holder service: guarded %s until a daemon mounts it", mountpoint)


COMMANDS = {
    "holder": cmd_holder,
    "mount": cmd_mount, "umount": cmd_umount, "restart": cmd_restart,
    "status": cmd_status, "flush": cmd_flush, "refresh": cmd_refresh,
    "prune": cmd_prune, "nodes": cmd_nodes, "guard": cmd_guard, "unguard": cmd_unguard, "limit": cmd_limit,
    "preempt": cmd_preempt,
    "prefetch": cmd_prefetch,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.restartable = argv is None  # sys.argv is this command line: the daemon may re-execute it
    try:
        if args.command in ("status", "flush", "refresh", "prune", "nodes", "limit"):
            _mountpoint_from_environment(args)
        return COMMANDS[args.command](args)
    except CkptfsError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
