"""keep_mount, the daemon's side of the holder (keepmount/holder.py): attaching to the holder of a connection and
the link it keeps (`attach`, `Link`), starting a holder for a connection just mounted (`start`), handing one
to the node's holder service (`hand_to_service`), and the other ways a daemon receives a connection it takes
over (`Held`): from the daemon before in this process after `ckptfs restart` (`inherited`), or from
systemd's file descriptor store (`from_systemd`). Plain blocking sockets: the daemon calls these before its
event loop serves, or in a worker thread."""

from __future__ import annotations

import array
import base64
import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from ckptfs.control.client import holder_path, service_path
from ckptfs.errors import CkptfsError
from ckptfs.keepmount.holder import ATTACH_TIMEOUT, recv_message, spawn


class Link:
    """A daemon's attachment to the holder of its connection."""

    def __init__(self, sock: socket.socket, holder_pid: int, *, service: bool = False) -> None:
        self._sock: socket.socket | None = sock
        self.holder_pid = holder_pid
        self.service = service  # the holder belongs to the node's holder service: it starts no daemon

    def fileno(self) -> int:
        """The link's socket (readable once the holder is gone: it never sends anything), -1 once closed."""
        return self._sock.fileno() if self._sock is not None else -1

    def broken(self) -> bool:
        """The holder closed its end (it died, or its service stopped)."""
        if self._sock is None:
            return True
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        """Close a link whose holder is gone (no goodbye to say)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _say(self, op: str) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            self._sock.sendall(json.dumps({"op": op}).encode() + b"\n")
        self._sock.close()
        self._sock = None

    def release(self) -> None:
        """The mount is gone (a clean unmount): the holder lets the connection go and exits."""
        self._say("release")

    def abort(self) -> None:
        """Leave the connection aborted: the holder closes its descriptor without starting a new daemon."""
        self._say("abort")

    def handover(self) -> None:
        """Another daemon takes the connection over now: the holder waits for it instead of starting one."""
        self._say("handover")


class Held:
    """What a daemon that takes a connection over receives (from its holder, or from the daemon before in
    the same process after `ckptfs restart`; then `link` is its link to the holder, if there is one)."""

    def __init__(self, fd: int, init_request: bytes, link: Link | None) -> None:
        self.fd = fd
        self.init_request = init_request
        self.link = link


def attach(mountpoint: str | Path) -> Held | None:
    """The connection of `mountpoint` from its holder, if a holder keeps one and no daemon serves it; None
    if there is no holder. Raises CkptfsError if a live daemon is attached."""
    path = holder_path(mountpoint)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(ATTACH_TIMEOUT)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as exc:
        sock.close()
        raise CkptfsError(f"cannot reach the holder of {mountpoint}'s FUSE connection at {path}: {exc.strerror or exc}"
                          " (a runtime dir with a shorter path: $CKPTFS_RUNTIME_DIR)") from None
    try:
        sock.sendall(json.dumps({"op": "attach", "pid": os.getpid()}).encode() + b"\n")
        data, fds = recv_message(sock)
        reply: dict[str, Any] = (json.loads(data) if data
                                 else {"ok": False, "error": "the holder closed the connection"})
    except (OSError, ValueError) as exc:
        sock.close()
        raise CkptfsError(f"the holder of {mountpoint}'s FUSE connection ({path}) does not answer: {exc}; if no"
                          f" ckptfs process runs for it, remove {path} and unmount {mountpoint}") from None
    if not reply.get("ok") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise CkptfsError(str(reply.get("error", "the holder refused to hand over the connection")))
    sock.settimeout(None)
    link = Link(sock, int(reply["holder_pid"]), service=bool(reply.get("service", False)))
    return Held(fds[0], base64.b64decode(reply["init"]), link)


def attach_link(mountpoint: str | Path) -> Link | None:
    """Attach to the holder of a connection this process already has (after `ckptfs restart`)."""
    held = attach(mountpoint)
    if held is None:
        return None
    os.close(held.fd)
    return held.link


# `ckptfs restart`: the daemon before, in this same process, leaves the connection in these variables
TAKEOVER_FD_ENV = "CKPTFS_TAKEOVER_FD"
TAKEOVER_INIT_ENV = "CKPTFS_TAKEOVER_INIT"


def handover_env(fd: int, init_request: bytes) -> dict[str, str]:
    """The environment a daemon executed in this process finds the connection `fd` in."""
    return dict(os.environ, **{TAKEOVER_FD_ENV: str(fd), TAKEOVER_INIT_ENV: base64.b64encode(init_request).decode()})


def inherited() -> Held | None:
    """The connection the daemon before in this process handed over (`ckptfs restart`), if any."""
    fd_text = os.environ.pop(TAKEOVER_FD_ENV, None)
    init_text = os.environ.pop(TAKEOVER_INIT_ENV, None)
    if fd_text is None or init_text is None:
        return None
    fd = int(fd_text)
    os.set_inheritable(fd, False)
    return Held(fd, base64.b64decode(init_text), None)


# Names of the descriptors kept in systemd's file descriptor store (keep_mount under systemd)
SYSTEMD_FUSE_FD = "ckptfs-fuse"
SYSTEMD_INIT_FD = "ckptfs-init"


def init_memfd(init_request: bytes) -> int:
    """A memory file holding the INIT request, to be stored beside the connection (systemd keeps only
    descriptors)."""
    fd = os.memfd_create(SYSTEMD_INIT_FD, os.MFD_CLOEXEC)
    os.write(fd, init_request)
    return fd


def from_systemd(fds: dict[str, int]) -> Held | None:
    """The connection systemd kept for this unit (a daemon of it died and Restart= started this one)."""
    fuse_fd, init_fd = fds.get(SYSTEMD_FUSE_FD), fds.get(SYSTEMD_INIT_FD)
    if fuse_fd is None or init_fd is None:
        return None
    try:
        init_request = os.pread(init_fd, 1 << 16, 0)
    finally:
        os.close(init_fd)
    return Held(fuse_fd, init_request, None)


def start(mountpoint: Path, fd: int, init_request: bytes, *, argv: list[str]) -> Link:
    """Start the holder of a connection this daemon just mounted and attach to it. `argv`: the `ckptfs`
    arguments that start a daemon like this one (the holder runs them when this one dies)."""
    config = {
        "mountpoint": str(mountpoint), "fd": fd, "init": base64.b64encode(init_request).decode(),
        "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
    }
    spawn(config, fd, own_session=True)
    link = attach_link(mountpoint)  # (ours is the descriptor we mounted with)
    if link is None:
        raise CkptfsError(f"the holder of the FUSE connection started but {holder_path(mountpoint)} is missing")
    return link


def hand_to_service(mountpoint: Path, fd: int, init_request: bytes) -> Link | None:
    """Hand the connection `fd` to the node's holder service and attach to the holder it starts for it.
    None if no service listens; CkptfsError if one does and refuses."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(ATTACH_TIMEOUT)
    try:
        try:
            sock.connect(str(service_path()))
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        request = {"op": "hold", "mountpoint": str(mountpoint), "init": base64.b64encode(init_request).decode()}
        sock.sendmsg([json.dumps(request).encode() + b"\n"],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        data, fds = recv_message(sock)
        for extra in fds:
            os.close(extra)
        reply: dict[str, Any] = json.loads(data) if data else {"ok": False, "error": "no answer"}
    except (OSError, ValueError) as exc:
        raise CkptfsError(f"the holder service at {service_path()} does not answer: {exc}") from None
    finally:
        sock.close()
    if not reply.get("ok"):
        raise CkptfsError(f"the holder service at {service_path()} refused the connection: {reply.get('error')}")
    link = attach_link(mountpoint)
    if link is None:
        raise CkptfsError(f"the holder service took the connection but {holder_path(mountpoint)} is missing")
    return link
