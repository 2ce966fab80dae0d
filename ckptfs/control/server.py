"""The control socket: how `ckptfs status|flush|umount` talk to a running daemon.

One Unix socket per mount at RUNTIME_DIR/<hash of the mountpoint>.sock (0600, in a 0700 directory), found
by the CLI from the mountpoint alone, even when the mount itself hangs. Two layers keep other users out:
the file permissions, and the daemon's own check of the caller (SO_PEERCRED) on every connection, which
holds even where the socket was made reachable (a shared runtime dir, a chmod): only root and the user
the daemon runs as may ask for status, flush, refresh or unmount. The protocol is one JSON object per line
each way: {"op": "status"} -> {"ok": true, ...}. This is the server side: it runs in the daemon's nursery
and only calls the handler it is given. The client side (plain blocking sockets, no event loop) is
ckptfs/control/client.py, which the CLI and the Python API (`import ckptfs`) share.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

# Where a mount's socket lives is defined once, on the client side; the daemon binds where clients look.
from ckptfs.control.client import canonical_mountpoint as canonical_mountpoint
from ckptfs.control.client import socket_path as socket_path

log = logging.getLogger(__name__)

MAX_REQUEST = 1 << 20
# struct ucred of SO_PEERCRED: pid, uid, gid.
PEERCRED = struct.Struct("3i")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def serve(
    path: Path,
    handler: Handler,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer requests until `stop` is set; then stop accepting and return once the requests in flight
    have been answered (the caller bounds that with a timeout)."""
    _prepare_socket_path(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as connections:
            task_status.started()
            async with trio.open_nursery() as acceptor:
                acceptor.start_soon(_accept_loop, listener, connections, handler)
                await stop.wait()
                acceptor.cancel_scope.cancel()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await listener.aclose()


async def _accept_loop(listener: trio.SocketListener, connections: trio.Nursery, handler: Handler) -> None:
    while True:
        stream = await listener.accept()
        connections.start_soon(_serve_one, stream, handler)


def _peer_uid(stream: trio.SocketStream) -> int:
    creds = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    _pid, uid, _gid = PEERCRED.unpack(creds)
    return int(uid)


def allowed_uids() -> set[int]:
    """Who may use the control socket: root and the mount's owner (the user the daemon runs as)."""
    return {0, os.getuid()}


async def _serve_one(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        buf = b""
        while b"\n" not in buf:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            buf += chunk
            if len(buf) > MAX_REQUEST:
                return
        # The request is read (and not looked at) before a refusal, so the client gets the answer
        # instead of a broken pipe.
        uid = _peer_uid(stream)
        if uid not in allowed_uids():
            log.warning("control socket: refused a request from uid %d (only root and uid %d may use it)",
                        uid, os.getuid())
            reply = {"ok": False, "denied": True,
                     "error": f"permission denied: only root and uid {os.getuid()} may control this mount"}
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(json.dumps(reply).encode() + b"\n")
            return
        try:
            request = json.loads(buf.split(b"\n", 1)[0])
            if not isinstance(request, dict):
                raise ValueError("request must be an object")
            reply = await handler(request)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        except Exception as exc:
            log.exception("control request %r failed", buf[:200])
            reply = {"ok": False, "error": str(exc)}
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(json.dumps(reply).encode() + b"\n")
