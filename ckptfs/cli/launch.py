"""`ckptfs mount`: the daemon run in this process (the foreground) or detached as a child that reports back
once the mount is live (--daemon), with the malloc pad its large writes need; and the re-execution that
`ckptfs restart` asks for (a daemon of the code installed now, in the same process).

Owns the start of the daemon process; the daemon itself is ckptfs.daemon's.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from ckptfs.cli.arguments import config_from_args
from ckptfs.cli.logs import setup_logging
from ckptfs.config import Config
from ckptfs.errors import CkptfsError

READY_FD_ENV = "CKPTFS_READY_FD"
# pyfuse3 copies every FUSE write into a new bytes object, and every read reply is one: 1 MiB each for
# a checkpoint. glibc's malloc hands such a block back to the kernel when it is freed (the top of the heap is
# trimmed), so every request faulted in and zeroed 256 fresh pages: half of the daemon's CPU for a large
# write. A pad kept at the top of the heap makes the next request reuse the same pages. Only a tunable read
# when the process starts does it (mallopt() later also turns off the dynamic mmap threshold, which puts
# every 1 MiB block in an mmap of its own), so the daemon is started, or re-executes itself, with it.
MALLOC_TUNABLE = "glibc.malloc.top_pad"
MALLOC_TOP_PAD = 16 << 20


def cmd_mount(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    setup_logging(config.log_level)
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
