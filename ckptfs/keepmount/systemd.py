"""sd_notify(3) without a dependency: tell systemd (a Type=notify unit) that the mount is ready, what the
daemon is doing, and that a draining stop needs more time; and its file descriptor store (FDSTORE=1), which
keeps the FUSE connection while the unit's daemon dies and is started again (Restart=): the next one gets
the descriptors as sd_listen_fds_with_names(3) describes (LISTEN_FDS, LISTEN_FDNAMES, from fd 3 on).

The protocol is one datagram per message to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or an
abstract socket when it starts with '@'). Outside systemd the variable is unset and every call is a no-op.
"""

from __future__ import annotations

import array
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

    def store_fd(self, name: str, fd: int) -> bool:
        """Keep `fd` in the unit's file descriptor store under `name` (needs FileDescriptorStoreMax=)."""
        if self._address is None:
            return False
        message = f"FDSTORE=1\nFDNAME={name}".encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0,
                               self._address)
        except OSError as exc:
            log.warning("cannot store a descriptor with systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), exc)
            return False
        return True

    def remove_fds(self, name: str) -> bool:
        """Drop what the store keeps under `name`."""
        return self.notify(fdstoreremove=1, fdname=name)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listen_fds() -> dict[str, int]:
    """The descriptors systemd passed to this process, by name (sd_listen_fds_with_names), taken out of the
    environment so that no child takes them for its own; {} outside systemd."""
    pid = os.environ.pop("LISTEN_PID", None)
    count = os.environ.pop("LISTEN_FDS", None)
    names = os.environ.pop("LISTEN_FDNAMES", "")
    if pid is None or count is None or not pid.isdigit() or int(pid) != os.getpid():
        return {}
    found = {}
    for index, name in enumerate(names.split(":")[: int(count)] if names else []):
        fd = 3 + index  # SD_LISTEN_FDS_START
        os.set_inheritable(fd, False)
        found[name] = fd
    return found
