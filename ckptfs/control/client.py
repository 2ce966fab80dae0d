"""The client side of the control socket, and the Python API on top of it: what `import ckptfs` offers a
training script, and what every `ckptfs status|flush|limit|refresh|prune|umount` command calls (one code path).

Owns: where a mount's socket lives (the daemon binds where this module looks), the blocking one-request
protocol, turning replies into values or exceptions from ckptfs.errors with the messages the CLI prints.
Must not import trio, pyfuse3, a cloud SDK or any other ckptfs module but errors: a training process
imports this next to torch, and it has to work with nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptfs.errors import (
    DaemonError,
    NoDaemonError,
    NotDrainedError,
    NotDurableError,
    UsageError,
)

StrPath = str | os.PathLike[str]

# How long after its own deadline a waiting call still listens for the daemon's answer: the daemon
# replies when its deadline passes, so this covers only a slow reply, never a second wait.
REPLY_GRACE_SECONDS = 30.0
# How long umount waits for the daemon to exit after it replied (closing the journal is all that is left).
EXIT_WAIT_SECONDS = 30.0
# How long a call waits for the control socket of a mountpoint that is mounted but has none yet: a daemon
# that takes a kept mount over (a restart, a crash with keep_mount) serves the kernel a moment before its
# control socket is up, and a `ckptfs flush` right then must not fail for it.
SOCKET_WAIT_SECONDS = 10.0


def runtime_dir() -> Path:
    """Where control sockets live: $CKPTFS_RUNTIME_DIR; else /run/ckptfs for root; for another user (who
    cannot write /run) $XDG_RUNTIME_DIR/ckptfs, the per-user runtime dir of a login session, else
    /tmp/ckptfs-<uid>, as tmux does (ensure_runtime_dir checks that one is the user's own)."""
    configured = os.environ.get("CKPTFS_RUNTIME_DIR")
    if configured:
        return Path(configured)
    uid = os.geteuid()
    if uid == 0:
        return Path("/run/ckptfs")
    session = os.environ.get("XDG_RUNTIME_DIR")
    if session and os.path.isabs(session):
        return Path(session) / "ckptfs"
    return Path(f"/tmp/ckptfs-{uid}")


def ensure_runtime_dir(path: Path) -> None:
    """Create the runtime dir `path` (0700) if missing. The /tmp fallback is refused if another user owns it
    or can write into it: anyone could have made it first, to answer in a daemon's place."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise UsageError(f"cannot create the runtime dir {path} ({exc.strerror}); set CKPTFS_RUNTIME_DIR to a"
                         " directory of yours") from None
    shared_parent = path.parent == Path("/tmp")
    if shared_parent and (info.st_uid != os.geteuid() or info.st_mode & 0o022 or not stat.S_ISDIR(info.st_mode)):
        raise UsageError(f"the runtime dir {path} is not this user's own (owner uid {info.st_uid}, mode"
                         f" {stat.S_IMODE(info.st_mode):o}); remove it, or set CKPTFS_RUNTIME_DIR to a directory"
                         " of yours")


def canonical_mountpoint(mountpoint: StrPath) -> Path:
    """The absolute mountpoint with symlinks in its parents resolved, without touching the mount itself
    (a stat of a hung mount would hang the caller, and the daemon's own loop would deadlock on it)."""
    absolute = Path(os.path.abspath(mountpoint))
    return Path(os.path.realpath(absolute.parent)) / absolute.name


def socket_path(mountpoint: StrPath) -> Path:
    digest = hashlib.sha256(str(canonical_mountpoint(mountpoint)).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.sock"


def holder_path(mountpoint: str | Path) -> Path:
    """The holder's socket: beside the mount's control socket, found from the mountpoint alone (a stat of a
    mount nobody serves would hang). Its name is as long as the control socket's (a Unix socket's path has
    at most 107 bytes)."""
    return socket_path(mountpoint).with_suffix(".hold")


SERVICE_SOCKET = "holder.sock"  # the node's holder service, in the runtime dir


def service_path() -> Path:
    """Where the node's holder service listens: in the runtime dir, which the daemon's pod shares."""
    return runtime_dir() / SERVICE_SOCKET


def call(
    mountpoint: StrPath, request: dict[str, Any], *, timeout: float | None = 10.0,
    socket_wait: float = SOCKET_WAIT_SECONDS,
) -> dict[str, Any]:
    """Send one request to the daemon serving `mountpoint` and return its reply (any "ok"). If a FUSE
    filesystem is mounted there but no control socket answers, wait up to `socket_wait` seconds for one (a
    daemon taking the mount over)."""
    mountpoint = canonical_mountpoint(mountpoint)
    path = socket_path(mountpoint)
    sock = _connect(mountpoint, path, timeout, socket_wait)
    try:
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise DaemonError(f"the ckptfs daemon for {mountpoint} did not answer in time") from None
            if not chunk:
                break
            buf += chunk
    finally:
        sock.close()
    if not buf:
        raise DaemonError(f"the ckptfs daemon for {mountpoint} closed the connection without an answer")
    reply: dict[str, Any] = json.loads(buf)
    if reply.get("denied"):  # the daemon's own check of the caller (SO_PEERCRED)
        raise DaemonError(f"{reply['error']} ({mountpoint})")
    return reply


def _connect(mountpoint: Path, path: Path, timeout: float | None, socket_wait: float) -> socket.socket:
    waited_until = time.monotonic() + socket_wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            return sock
        except PermissionError:
            sock.close()
            raise DaemonError(
                f"permission denied: the control socket of {mountpoint} ({path}) is for root and the user"
                " running the daemon only"
            ) from None
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            mounted = _fuse_mounted(mountpoint)
            if mounted and time.monotonic() < waited_until:
                time.sleep(0.05)
                continue
            if mounted:
                raise NoDaemonError(
                    f"no ckptfs daemon is serving {mountpoint}: it is mounted, but nothing answered at its"
                    f" control socket {path} for {socket_wait:.0f} s (a daemon still starting, or a mount kept"
                    " after its daemon died: see the daemon's log or `systemctl status`)"
                ) from None
            raise NoDaemonError(
                f"no ckptfs daemon is serving {mountpoint} (no control socket at {path});"
                " is it mounted with ckptfs mount?"
            ) from None
        except BaseException:
            sock.close()
            raise


def _checked(reply: dict[str, Any], what: str) -> dict[str, Any]:
    if not reply.get("ok"):
        raise DaemonError(reply.get("error") or f"{what} failed")
    return reply


def status(mountpoint: StrPath) -> dict[str, Any]:
    """The mount's state, as `ckptfs status --json` prints it: files and bytes per state ("dirty",
    "uploading", "clean", "remote"), the queue, files open for writing, the oldest dirty age, uploads since
    start, cache use and the last error."""
    reply = _checked(call(mountpoint, {"op": "status"}), "status")
    reply.pop("ok")
    return reply


def mount_relative_paths(mountpoint: StrPath, paths: Iterable[StrPath]) -> list[str]:
    """Each path relative to the mount ("" for the mount itself). A relative path is taken as relative to
    the mountpoint (like `ckptfs flush MNT step_100`), an absolute one must lie inside it."""
    root = canonical_mountpoint(mountpoint)
    relative_paths = []
    for path in paths:
        absolute = os.path.abspath(path) if os.path.isabs(path) else root / path
        relative = os.path.relpath(absolute, root)
        if relative == ".." or relative.startswith("../"):
            raise UsageError(f"{path} is not inside {root}")
        relative_paths.append("" if relative == "." else relative)
    return relative_paths


def wait_durable(
    mountpoint: StrPath, paths: Iterable[StrPath] | None = None, *, timeout: float | None = None,
    all_nodes: bool = False,
) -> None:
    """Return once everything under `paths` (default: the whole mount) that was written before the call is
    durable in the store: each file's object is complete at its key. Files still open for writing count as
    pending, so close them first. With `all_nodes`, then also wait until everything every other node
    mounting this prefix had closed before the call is durable (its pending records are gone; see
    docs/SEMANTICS.md, multiple nodes). Raises NotDurableError (a TimeoutError) if that takes longer than
    `timeout` seconds (None: no limit) or waits for a node given up on, NoDaemonError if nothing serves the
    mountpoint."""
    relative = mount_relative_paths(mountpoint, [] if paths is None else paths)
    call_timeout = None if timeout is None else timeout + REPLY_GRACE_SECONDS
    request: dict[str, Any] = {"op": "flush", "paths": relative, "timeout": timeout}
    if all_nodes:
        request["all_nodes"] = True
    reply = call(mountpoint, request, timeout=call_timeout)
    if reply.get("ok"):
        return
    if "error" in reply:
        raise DaemonError(reply["error"])
    raise NotDurableError(timeout, reply.get("remaining_count") or 0, reply.get("remaining") or [])


def pending_nodes(mountpoint: StrPath, *, forget: str | None = None) -> dict[str, Any]:
    """The nodes with work pending in the store (this one included) and the commit markers that wait for
    them; `forget` gives up on a node first (see `ckptfs nodes --forget`)."""
    request: dict[str, Any] = {"op": "nodes"}
    if forget:
        request["forget"] = forget
    reply = _checked(call(mountpoint, request, timeout=60.0), "nodes")
    reply.pop("ok")
    return reply


def limit(
    mountpoint: StrPath, *, upload: int | str | None = None, download: int | str | None = None,
) -> dict[str, Any]:
    """Change the mount's bandwidth caps and return the caps in effect, as `ckptfs limit` prints them:
    {"upload": {...}, "download": {...}}, each with "bytes_per_second" (None: no cap) and "source" ("config",
    "timetable", "runtime", "lifted"). `upload` / `download`: bytes per second (an int, or text with a
    K/M/G suffix like "200M"), 0 or "off" for no cap; None leaves that direction as it is (so no argument
    only reads them). Transfers waiting for their turn see a change at once. It lasts until the daemon
    restarts, or until the next entry of a configured timetable (upload_limit = "08:00,50M 19:00,off")."""
    request: dict[str, Any] = {"op": "limit"}
    for name, value in (("upload", upload), ("download", download)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise UsageError(f"{name} must be bytes per second (200M, 1048576) or off, not {value!r}")
        request[name] = value
    reply = call(mountpoint, request)
    if not reply.get("ok") and reply.get("usage"):
        raise UsageError(reply["error"])
    limits: dict[str, Any] = _checked(reply, "limit")["limits"]
    return limits


def preempt(
    mountpoint: StrPath, deadline: float = 30.0, *, wait: bool = True, keep_limits: bool = False,
    reason: str = "ckptfs.preempt()",
) -> dict[str, Any] | None:
    """A preemption notice with `deadline` seconds left: the drain uploads the newest complete step first
    (its files, then its commit markers), then the next; deletes and steps still being written wait;
    bandwidth caps are lifted (not with `keep_limits`). With `wait`, return the report once every complete
    step is durable or the deadline passed: {"durable": [steps], "not_durable": {step: why}, "steps": [...],
    ...}, also written as JSON in the cache dir. Without, return None at once."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline > 0:
        raise UsageError(f"deadline must be a number of seconds > 0 (the time the node has left), not {deadline!r}")
    request = {"op": "preempt", "deadline": deadline, "wait": wait, "keep_limits": keep_limits, "reason": reason}
    reply = call(mountpoint, request, timeout=deadline + REPLY_GRACE_SECONDS + 10)
    if not reply.get("ok") and reply.get("usage"):
        raise UsageError(reply["error"])
    report: dict[str, Any] | None = _checked(reply, "preempt")["report"]
    return report


def refresh(mountpoint: StrPath) -> None:
    """Show what other nodes wrote to (or deleted from) the store now, not after refresh_interval."""
    _checked(call(mountpoint, {"op": "refresh"}, timeout=300), "refresh")



def prefetch(
    path: StrPath, *, mountpoint: StrPath | None = None, wait: bool = False, release: bool = False,
) -> dict[str, Any]:
    """Warm this node's cache with the files under `path` (a step's directory or one file) before they are
    read: many ranged GETs at once per file. They are kept from eviction until a process opens them (read
    once) or a release. `path`: inside a ckptfs mount (absolute, or relative to `mountpoint`); `mountpoint`:
    default the ckptfs mount that holds `path`. `wait`: return once every file is in the cache (else at
    once, the fetch going on in the daemon; `status()["prefetch"]` shows its progress). `release`: fetch
    nothing, let the kept files under `path` be evicted again. Returns the daemon's answer: "files",
    "to_fetch_files", "to_fetch_bytes", "fetched_files", "fetched_bytes", "failed" (or "released").
    Raises UsageError if the path is not in the mount or the cache cannot hold its files (nothing is
    fetched then), DaemonError naming the files that could not be fetched."""
    if mountpoint is None:
        mountpoint = _ckptfs_mount_of(path)
    [relative] = mount_relative_paths(mountpoint, [path])
    request: dict[str, Any] = {"op": "prefetch", "path": relative, "wait": wait, "release": release}
    # Without `wait` the daemon answers once the path is listed and its room checked.
    reply = call(mountpoint, request, timeout=None if wait else 300.0)
    if not reply.get("ok") and reply.get("usage"):
        raise UsageError(reply["error"])
    if not reply.get("ok") and reply.get("failed_count"):
        raise DaemonError(f"prefetch of {relative or '/'}: {reply['failed_count']} files could not be fetched: "
                          + "; ".join(reply["failed"]))
    reply = _checked(reply, "prefetch")
    reply.pop("ok")
    return reply


def _ckptfs_mount_of(path: StrPath) -> Path:
    """The innermost FUSE mount that holds `path` (from /proc/self/mountinfo: nothing in a mount is stat'ed)."""
    absolute = canonical_mountpoint(path)
    best: Path | None = None
    for mounted in _fuse_mountpoints():
        inside = absolute == mounted or mounted in absolute.parents
        if inside and (best is None or len(mounted.parts) > len(best.parts)):
            best = mounted
    if best is None:
        raise UsageError(f"{path} is not inside a ckptfs mount; give the mountpoint (mountpoint=...)")
    return best


@dataclass(frozen=True)
class PruneResult:
    deleted: list[str]
    """Top-level checkpoint names deleted from the mount and the store (or, with dry_run, to be deleted)."""
    kept: dict[str, str]
    """Top-level names kept, each with why (newest N, named by a pointer file, matches a keep glob)."""


def prune(mountpoint: StrPath, keep_last: int, keep: Iterable[str] = (), *, dry_run: bool = False) -> PruneResult:
    """Delete all but the newest `keep_last` top-level checkpoints from the mount and the store, keeping
    what `latest`-style pointer files name and whatever matches a `keep` glob."""
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    reply = _checked(
        call(mountpoint, {"op": "prune", "keep_last": keep_last, "keep": list(keep), "dry_run": dry_run}, timeout=600),
        "prune",
    )
    return PruneResult(deleted=list(reply["delete"]), kept=dict(reply["reasons"]))


def _wait_for_exit(pid: int, deadline: float) -> None:
    """Until process `pid` has exited (a zombie has: it holds no files or sockets) or the deadline passed."""
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
                if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.02)


def restart(mountpoint: StrPath, *, timeout: float = 120.0) -> int:
    """Replace the daemon of `mountpoint` by one started from the code installed now (an upgrade), without
    unmounting: the new daemon takes the FUSE connection and the open files over, in the same process.
    Returns once the new daemon answers; its pid."""
    mountpoint = canonical_mountpoint(mountpoint)
    before = call(mountpoint, {"op": "status"})
    reply = call(mountpoint, {"op": "restart"}, timeout=30)
    if not reply.get("ok"):
        raise DaemonError(str(reply.get("error", "the daemon refused to restart")))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            now = call(mountpoint, {"op": "status"}, timeout=10, socket_wait=0)
        except (NoDaemonError, DaemonError, OSError):
            now = {}
        if now.get("started_at", 0) > before.get("started_at", 0):
            return int(now["pid"])
        time.sleep(0.1)
    raise DaemonError(f"no daemon answered at {mountpoint} within {timeout:.0f} s of the restart; see the log")


def _fuse_mounted(mountpoint: Path) -> bool:
    """Whether a FUSE filesystem is mounted exactly at `mountpoint`, from /proc/self/mountinfo (never a
    stat of the mount itself, which could hang)."""
    return mountpoint in _fuse_mountpoints()


def _fuse_mountpoints() -> list[Path]:
    """Where FUSE filesystems are mounted, from /proc/self/mountinfo."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields, _, tail = line.partition(" - ")
                parts = fields.split()
                fstype = tail.split(" ", 1)[0]
                if len(parts) > 4 and fstype.split(".")[0] in ("fuse", "fuseblk"):
                    where = parts[4]
                    for char, code in (("\t", "\\011"), ("\n", "\\012"), (" ", "\\040"), ("\\", "\\134")):
                        where = where.replace(code, char)
                    found.append(Path(where))
    except OSError:
        return []
    return found


def unmount(mountpoint: StrPath, *, timeout: float | None = None) -> None:
    """Drain (up to `timeout` seconds; None: no limit), then unmount. Raises NotDrainedError if it unmounted
    with entries not yet in the store (they stay journaled and upload at the next mount)."""
    mountpoint = canonical_mountpoint(mountpoint)
    reply = call(mountpoint, {"op": "umount", "timeout": timeout}, timeout=None)
    # The daemon replies after unmounting, then closes its journal and lets go of its cache dir lock and
    # metrics port: wait for the kernel to show the mount gone and for the process to exit, so that a
    # mount started right after this returns finds both free.
    # (Not os.path.ismount: the daemon mounts a guard over the bare directory after its own unmount.)
    deadline = time.monotonic() + 10
    while _fuse_mounted(mountpoint) and time.monotonic() < deadline:
        time.sleep(0.05)
    if isinstance(reply.get("pid"), int):
        _wait_for_exit(reply["pid"], deadline=time.monotonic() + EXIT_WAIT_SECONDS)
    if "error" in reply:
        raise DaemonError(reply["error"])
    if not reply.get("ok"):
        raise NotDrainedError(mountpoint, reply.get("remaining_count") or 0, reply.get("cache_dir"))

