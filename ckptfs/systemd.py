"""sd_notify(3) without a dependency: tell systemd (a Type=notify unit) that the mount is ready, what the
daemon is doing, and that a draining stop needs more time.

The protocol is one datagram per message to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or an
abstract socket when it starts with '@'). Outside systemd the variable is unset and every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._address: str | bytes | None = None
        if address:
            # An abstract socket's name starts with a NUL byte; systemd writes it as '@'.
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send KEY=value lines (ready=1 -> READY=1). Returns False if there is no systemd to tell."""
        if self._address is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self._address)
        except OSError as exc:
            if not self._failed:  # once: a broken notify socket must not flood the log
                self._failed = True
                log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
