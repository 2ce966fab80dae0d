"""The mount outlives its daemon: a small process keeps the FUSE connection, and a new daemon takes it over.

The kernel keeps a FUSE connection (and so the mount, and every request a process is waiting on) as long as
one process holds its /dev/fuse descriptor. After a daemon mounts, it starts a holder (`python -m
ckptfs.keepmount.holder`, its own session, a few MB) and hands it a duplicate of that descriptor with the kernel's INIT
request. The daemon stays attached to the holder over a Unix socket beside its control socket. When that
link breaks without a goodbye (kill -9, the OOM killer, a crash), the holder starts the daemon again with
the command line it was mounted with; the new daemon attaches, receives the descriptor, replays INIT
(pyfuse3.takeover), takes over the open handles (fs/handle_table.py), asks the kernel to send again the requests
the dead daemon had read but not answered (FUSE_NOTIFY_RESEND, Linux >= 6.9), and serves on. The training
job sees a pause, not an error. A `ckptfs mount` of the same mountpoint started by hand while no daemon is
attached takes over the same way.

Goodbyes: "release" after a clean unmount (the holder closes its descriptor and exits), "abort" when the
daemon leaves the connection aborted on purpose (the journal failed: every access then fails with ENOTCONN
instead of landing on the bare mountpoint), "handover" when a daemon gives the connection to a newer one
(an upgrade). Daemons that keep failing (MAX_START_FAILURES in a row that exit before they serve, or
MAX_QUICK_DEATHS in a row that die soon after taking over) make the holder give up: it closes the
descriptor, which aborts the connection as a daemon's death did before there was a holder.

On Kubernetes the holder must outlive the daemon's pod, so it cannot be the daemon's child: `ckptfs holder`
runs as the node's holder service (its own DaemonSet, rarely replaced, holding no store credentials) and
listens on RUNTIME_DIR/holder.sock, a hostPath directory the daemon's pod shares. A daemon that finds it
hands its connection in there instead of starting a holder of its own (`hand_to_service`); the service
starts the mount's holder as its child, which never starts a daemon (the DaemonSet does) but waits for the
next one to attach, however long that takes. A daemon whose service went away (the holder's pod replaced)
hands its connection in again once a new one listens (docs/design/keep-mount.md).

This module is the holder (`main`) and the node's holder service (`serve_node`), and the wire both sides
share; the daemon's side (`start`, `attach`, `hand_to_service`, the link) is keepmount/link.py. The holder
imports nothing of the daemon: it must stay small and must not break when the daemon's code is replaced
under it.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckptfs.control.client import holder_path, service_path
from ckptfs.errors import CkptfsError

log = logging.getLogger("ckptfs.keepmount.holder")  # also when run as __main__

RESTART_DELAY = 1.0  # seconds between a daemon's death and the start of the next
MAX_START_FAILURES = 5  # daemons in a row that exit before they serve: the holder gives up
# Daemons in a row that die within STABLE_AFTER seconds of taking over (a crash loop, say on a request the
# kernel sends again to each): the holder gives up. $CKPTFS_MAX_QUICK_RESTARTS overrides it.
MAX_QUICK_DEATHS = 10
STABLE_AFTER = 10.0
HANDOVER_WAIT = 60.0  # seconds a handed-over connection waits for its new daemon before the holder starts one
ATTACH_TIMEOUT = 10.0
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_MESSAGE = 1 << 20



def recv_message(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One newline-terminated message and the descriptors that came with it."""
    data = b""
    fds: list[int] = []
    while not data.endswith(b"\n"):
        chunk, ancillary, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_MESSAGE:
            raise OSError("message too long")
    return data, fds


def spawn(config: dict[str, Any], fd: int, *, own_session: bool) -> subprocess.Popen[bytes]:
    """Start a holder process for the connection `fd` described by `config`; return once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptfs.keepmount.holder"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        pass_fds=(fd,), start_new_session=own_session, close_fds=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(config).encode())
        proc.stdin.close()
        ready = proc.stdout.readline().strip()
        proc.stdout.close()
    except OSError as exc:
        proc.kill()
        raise CkptfsError(f"cannot start the holder of the FUSE connection: {exc}") from None
    if ready != b"ready":
        proc.wait()
        raise CkptfsError(f"the holder of the FUSE connection did not start (exit {proc.returncode})")
    return proc


# -- the node's holder service (`ckptfs holder`, Kubernetes) ---------------------------------------------




def listen(listener: socket.socket, path: Path, backlog: int) -> None:
    """Listen on the Unix socket `path` (0600, in a 0700 directory), replacing a stale socket file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(backlog)


class _Service:
    """The node's holder service: one holder process (a child) per connection handed in."""

    def __init__(self) -> None:
        self.path = service_path()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.holders: dict[str, subprocess.Popen[bytes]] = {}  # mountpoint -> its holder
        self.stopping = False

    def bind(self) -> None:
        listen(self.listener, self.path, 16)

    def run(self) -> int:
        log.info("holder service: listening on %s", self.path)
        while not self.stopping:
            with contextlib.suppress(InterruptedError):
                readable, _, _ = select.select([self.listener], [], [], 1.0)
                if readable:
                    self._accept()
            self._reap()
        log.info("holder service: stopping; %d holders end with it (a daemon still serving keeps its mount and"
                 " hands it to the next service)", len(self.holders))
        for proc in self.holders.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.holders.values():
            proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return 0

    def stop(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5)
        fds: list[int] = []
        reply: dict[str, Any]
        try:
            pid, uid, _gid = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            data, fds = recv_message(conn)
            if not data:
                return
            request = json.loads(data)
            if uid not in (0, os.getuid()):
                raise PermissionError(f"uid {uid} may not hand a connection to this service")
            if request.get("op") != "hold" or len(fds) != 1:
                raise ValueError(f"unknown request {request.get('op')!r} with {len(fds)} descriptors")
            mountpoint = str(request["mountpoint"])
            before = self.holders.pop(mountpoint, None)
            if before is not None and before.poll() is None:
                before.terminate()  # the daemon handed its connection in again: this one is the newer
                before.wait()
            config = {"mountpoint": mountpoint, "fd": fds[0], "init": str(request["init"]), "argv": None,
                      "cwd": "/", "env": dict(os.environ)}
            self.holders[mountpoint] = spawn(config, fds[0], own_session=False)
            log.info("holder service: holding the FUSE connection of %s for daemon pid %d (holder pid %d)",
                     mountpoint, pid, self.holders[mountpoint].pid)
            reply = {"ok": True, "holder_pid": self.holders[mountpoint].pid}
        except (OSError, ValueError, KeyError, CkptfsError) as exc:
            log.warning("holder service: refused a request: %s", exc)
            reply = {"ok": False, "error": str(exc)}
        finally:
            for fd in fds:
                os.close(fd)  # the holder has its own duplicate
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(reply).encode() + b"\n")
        conn.close()

    def _reap(self) -> None:
        for mountpoint, proc in list(self.holders.items()):
            if proc.poll() is not None:
                log.info("holder service: the holder of %s exited (status %d)", mountpoint, proc.returncode)
                del self.holders[mountpoint]


def serve_node() -> int:
    """`ckptfs holder`: serve as this node's holder service until SIGTERM or SIGINT."""
    service = _Service()
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    service.bind()
    return service.run()


# -- the holder process -----------------------------------------------------------------------------------


def _daemon_argv(argv: list[str]) -> list[str]:
    """A daemon started again runs in the foreground of the holder (it is the one detached)."""
    return [a for a in argv if a != "--daemon"] + ([] if "--foreground" in argv else ["--foreground"])


class _Holder:
    def __init__(self, config: dict[str, Any]) -> None:
        self.mountpoint = str(config["mountpoint"])
        self.fd: int = int(config["fd"])
        self.init = str(config["init"])
        # None: held for the node's holder service, which starts no daemon (Kubernetes starts the next one)
        self.argv = _daemon_argv(list(config["argv"])) if config["argv"] is not None else None
        self.cwd = str(config["cwd"])
        self.env = dict(config["env"])
        self.path = holder_path(self.mountpoint)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.attached: socket.socket | None = None
        self.attached_pid = 0
        self.child: subprocess.Popen[bytes] | None = None
        self.restart_at: float | None = None
        self.attached_at = 0.0
        self.start_failures = 0
        self.quick_deaths = 0
        self.max_quick_deaths = int(self.env.get("CKPTFS_MAX_QUICK_RESTARTS", MAX_QUICK_DEATHS))

    def bind(self) -> None:
        listen(self.listener, self.path, 8)

    def run(self) -> int:
        while True:
            waiting = [self.listener] + ([self.attached] if self.attached is not None else [])
            timeout = 0.5 if self.child is not None or self.restart_at is not None else None
            readable, _, _ = select.select(waiting, [], [], timeout)
            if self.listener in readable:
                self._accept()
            if self.attached is not None and self.attached in readable:
                done = self._hear_from_daemon()
                if done is not None:
                    return done
            self._reap_child()
            due = self.restart_at is not None and time.monotonic() >= self.restart_at
            if due and not self._start_daemon():
                return 1

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5)
        try:
            pid, uid, _gid = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
            data, _fds = recv_message(conn)
            if not data:  # a look at who holds the connection (tests, tools): the peer's pid says it
                conn.close()
                return
            request = json.loads(data)
            if uid not in (0, os.getuid()):
                raise PermissionError("only root and the mount's owner may take over its FUSE connection")
            if request.get("op") != "attach":
                raise ValueError(f"unknown request {request.get('op')!r}")
            if self.attached is not None:
                conn.sendall(json.dumps({"ok": False, "error": f"{self.mountpoint} is served by ckptfs pid"
                                         f" {self.attached_pid}; unmount it first (ckptfs umount"
                                         f" {self.mountpoint})"}).encode() + b"\n")
                conn.close()
                return
            reply = json.dumps({"ok": True, "init": self.init, "holder_pid": os.getpid(),
                                "service": self.argv is None}).encode() + b"\n"
            conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd]))])
        except (OSError, ValueError) as exc:
            log.warning("holder of %s: refused a request: %s", self.mountpoint, exc)
            conn.close()
            return
        conn.settimeout(None)
        self.attached, self.attached_pid = conn, int(request.get("pid", pid))
        self.attached_at = time.monotonic()
        self.restart_at = None
        self.start_failures = 0
        log.info("holder of %s: daemon pid %d serves the connection", self.mountpoint, self.attached_pid)

    def _hear_from_daemon(self) -> int | None:
        """The attached daemon said goodbye or died. Returns the holder's exit status if it is done."""
        assert self.attached is not None
        try:
            data = self.attached.recv(4096)
        except OSError:
            data = b""
        op = ""
        if data:
            with contextlib.suppress(ValueError, AttributeError):
                op = json.loads(data.split(b"\n", 1)[0]).get("op", "")
            if not op:
                return None
        self.attached.close()
        self.attached = None
        if op in ("release", "abort"):
            self._let_go()
            log.info("holder of %s: %s; exiting", self.mountpoint,
                     "unmounted" if op == "release" else "the daemon left the connection aborted")
            return 0
        if op == "handover":
            log.info("holder of %s: daemon pid %d hands the connection over", self.mountpoint, self.attached_pid)
            if self.argv is not None:
                self.restart_at = time.monotonic() + HANDOVER_WAIT
            return None
        if self.argv is None:
            log.warning("holder of %s: daemon pid %d went away; the mount stays and its requests wait for the next"
                        " daemon to take it over", self.mountpoint, self.attached_pid)
            return None
        if time.monotonic() - self.attached_at < STABLE_AFTER:
            self.quick_deaths += 1
        else:
            self.quick_deaths = 0
        if self.quick_deaths >= self.max_quick_deaths:
            return self._give_up(f"{self.quick_deaths} daemons in a row died within {STABLE_AFTER:.0f} s of"
                                 " taking over")
        log.warning("holder of %s: daemon pid %d died; the mount stays and its requests wait; starting a new"
                    " daemon in %.0f s", self.mountpoint, self.attached_pid, RESTART_DELAY)
        self.restart_at = time.monotonic() + RESTART_DELAY
        return None

    def _reap_child(self) -> None:
        if self.child is None or self.child.poll() is None:
            return
        if self.attached is None and self.restart_at is None:
            self.start_failures += 1
            log.warning("holder of %s: the daemon started to take over exited (status %d) before serving;"
                        " trying again in %.0f s", self.mountpoint, self.child.returncode, RESTART_DELAY)
            self.restart_at = time.monotonic() + RESTART_DELAY
        self.child = None

    def _give_up(self, why: str) -> int:
        log.error("holder of %s: %s; giving up: the connection is aborted (Transport endpoint is not"
                  " connected) and nothing is lost: what was written is in the cache dir; see the daemon's log,"
                  " then run `ckptfs mount` again", self.mountpoint, why)
        self._let_go()
        return 1

    def _start_daemon(self) -> bool:
        """Start a daemon that takes the connection over. False when too many failed: given up."""
        assert self.argv is not None
        if self.start_failures >= MAX_START_FAILURES:
            self._give_up(f"{self.start_failures} daemons in a row exited before serving")
            return False
        self.restart_at = None
        if self.child is not None and self.child.poll() is None:
            return True  # still starting (a long recovery); it attaches when ready
        log.info("holder of %s: starting a daemon to take the connection over", self.mountpoint)
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "ckptfs", *self.argv], cwd=self.cwd, env=self.env,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:
            log.error("holder of %s: cannot start a daemon: %s", self.mountpoint, exc)
            self.restart_at = time.monotonic() + RESTART_DELAY
        return True

    def stop(self, signum: int, _frame: object) -> None:
        """SIGTERM from the node's holder service, which stops (Kubernetes: the holder's pod deleted). A daemon
        that serves keeps its own descriptor and hands it to the next service; a mount no daemon serves is
        detached, so that its users get errors at once rather than wait for a daemon no one will start."""
        if self.attached is None:
            log.warning("holder of %s: stopping while no daemon serves it: detaching the mount", self.mountpoint)
            with contextlib.suppress(OSError):
                subprocess.run(["fusermount3", "-u", "-z", "-q", self.mountpoint], check=False, timeout=10)
        else:
            log.info("holder of %s: stopping; daemon pid %d keeps serving it", self.mountpoint, self.attached_pid)
        self._let_go()
        sys.exit(0)

    def _let_go(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.listener.close()


def main() -> int:
    # Interrupts meant for the shell that started the mount are not for the connection's keeper.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = json.loads(sys.stdin.buffer.read())
    holder = _Holder(config)
    if holder.argv is None:
        signal.signal(signal.SIGTERM, holder.stop)
    holder.bind()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    return holder.run()


if __name__ == "__main__":
    sys.exit(main())
