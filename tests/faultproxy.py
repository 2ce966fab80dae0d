"""A small fault-injecting HTTP proxy for S3 tests, on 127.0.0.1, in front of a real S3 server.

Point a client's endpoint at `proxy.endpoint` and it forwards every request to `upstream`, unchanged but for
hop-by-hop headers (the signature stays valid: the Host header is kept, and `Expect` and `Connection` are
not signed by SigV4). A mutable list of `Rule`s decides, per request, whether to inject a fault instead:

  - "slowdown":      answer 503 SlowDown with an S3 XML error body (nothing reaches the server)
  - "internal":      answer 500 InternalError
  - "error":         answer `status` with S3 error `code` (e.g. 403 AccessDenied)
  - "reset":         reset the connection (SO_LINGER 0) after reading the request, before forwarding
  - "reset_mid":     forward the headers and half the body, then reset both connections
  - "cut_answer":    forward the request, relay the answer's headers and half its body (by its
                     Content-Length), then close the client's connection (a download cut off mid-way)
  - "lost_response": forward the whole request, let the server answer, then reset the client's
                     connection instead of relaying the answer (the request took effect; the client
                     does not know)
  - "stall":         wait `seconds`, then forward normally

A rule applies to requests whose first line (`PUT /bucket/key?partNumber=1&uploadId=... HTTP/1.1`) matches
the regex `match` (None: all), to a `fraction` of them, at most `count` times (None: no limit); the first
rule that fires wins. Every request is recorded in `proxy.log` (request line, action).

HTTP handling: each connection carries exactly one request. The proxy reads the whole request (body by
Content-Length or chunked transfer-encoding, trailers included, which also covers botocore's aws-chunked
framing), answers `Expect: 100-continue` itself, sends the request upstream with `Connection: close`, and
relays the answer with `Connection: close`, so the client never reuses a connection and every request is
decided on its own. Connections are served by at most `max_connections` threads; `stop()` closes everything.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024
IO_TIMEOUT = 120.0
ACCEPT_POLL = 0.1
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "te", "upgrade"}
ACTIONS = {"slowdown", "internal", "error", "reset", "reset_mid", "cut_answer", "lost_response", "stall"}
ANSWERS = {"slowdown", "internal", "error"}


@dataclass
class Rule:
    action: str
    match: str | None = None  # regex searched in the request line
    fraction: float = 1.0
    count: int | None = None  # fire at most this many times
    seconds: float = 0.0  # for "stall"
    status: int = 503  # for "error"
    code: str = "ServiceUnavailable"  # for "error"
    message: str = "injected by faultproxy"
    fired: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {sorted(ACTIONS)}")
        self._regex = re.compile(self.match) if self.match else None

    def applies(self, request_line: str) -> bool:
        return (self.count is None or self.fired < self.count) and (
            self._regex is None or self._regex.search(request_line) is not None
        )


class _Closed(Exception):
    """The peer closed the connection before a whole request or answer arrived."""


class _Reader:
    """Buffered reads from a socket: up to a delimiter, or an exact length."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise _Closed()
        self.buf += chunk

    def until(self, delimiter: bytes, limit: int = MAX_HEAD) -> bytes:
        while True:
            at = self.buf.find(delimiter)
            if at >= 0:
                out = bytes(self.buf[: at + len(delimiter)])
                del self.buf[: at + len(delimiter)]
                return out
            if len(self.buf) > limit:
                raise ValueError("header section too long")
            self._fill()

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


def _parse_head(head: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return lines[0], headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _build_head(first_line: str, headers: list[tuple[str, str]]) -> bytes:
    kept = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]
    lines = [first_line, *(f"{k}: {v}" for k, v in kept), "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _read_body(reader: _Reader, headers: list[tuple[str, str]]) -> bytes:
    """The raw body of a request (framing kept: chunked bodies stay chunked)."""
    encoding = (_header(headers, "transfer-encoding") or "").lower()
    if "chunked" in encoding:
        parts = []
        while True:
            size_line = reader.until(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers (aws-chunked puts the checksum here), up to the empty line
                    line = reader.until(b"\r\n")
                    parts.append(line)
                    if line == b"\r\n":
                        return b"".join(parts)
            parts.append(reader.exact(size + 2))
    length = _header(headers, "content-length")
    return reader.exact(int(length)) if length else b""


def _abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a crashed server or a middlebox would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _close_gracefully(sock: socket.socket) -> None:
    """Send FIN, give the client a moment to read the answer, then close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(2.0)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and sock.recv(65536):
            pass
    with contextlib.suppress(OSError):
        sock.close()


def s3_error(status: int, code: str, message: str, resource: str, request_id: str, *, head: bool) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
    head_lines = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/xml",
        f"Content-Length: {len(body)}",
        f"x-amz-request-id: {request_id}",
        "Server: faultproxy",
        "Connection: close",
        "",
        "",
    ]
    return "\r\n".join(head_lines).encode() + (b"" if head else body)


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int = 0, max_connections: int = 96) -> None:
        parts = urlsplit(upstream)
        assert parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost"), upstream
        self.upstream = (parts.hostname, parts.port or 80)
        self.rules: list[Rule] = []
        self.log: deque[tuple[float, str, str]] = deque(maxlen=100_000)  # (time, request line, action)
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self.connections = 0  # accepted from clients, since start
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._active: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(ACCEPT_POLL)  # close() does not wake a blocked accept(): poll the flag
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)

    # -- control ------------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._acceptor.start()
        return self

    def set_rules(self, *rules: Rule) -> None:
        with self._lock:
            self.rules = list(rules)

    def add_rule(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def heal(self) -> None:
        self.set_rules()

    def seen(self, pattern: str, action: str | None = None) -> int:
        """How many requests so far had a first line matching `pattern` (and got `action`, if given)."""
        regex = re.compile(pattern)
        with self._lock:
            entries = list(self.log)
        return sum(1 for _, line, act in entries if regex.search(line) and (action is None or act == action))

    def stop(self) -> None:
        self._stopping.set()
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=10)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            active = list(self._active)
            threads = list(self._threads)
        for sock in active:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            if not self._slots.acquire(timeout=ACCEPT_POLL):
                continue
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:
                self._slots.release()
                return
            client.settimeout(IO_TIMEOUT)
            thread = threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn", daemon=True)
            with self._lock:
                self.connections += 1
                self._active.add(client)
                self._threads.add(thread)
            thread.start()

    def _decide(self, request_line: str) -> Rule | None:
        with self._lock:
            self.requests += 1
            chosen = None
            for rule in self.rules:
                if rule.applies(request_line) and self._rng.random() < rule.fraction:
                    rule.fired += 1
                    chosen = rule
                    break
            action = chosen.action if chosen else "forward"
            if chosen:
                self.injected[action] += 1
            self.log.append((time.monotonic(), request_line, action))
            return chosen

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            client.settimeout(IO_TIMEOUT)
            reader = _Reader(client)
            head = reader.until(b"\r\n\r\n")
            request_line, headers = _parse_head(head)
            rule = self._decide(request_line)
            action = rule.action if rule else "forward"
            expect_continue = (_header(headers, "expect") or "").lower() == "100-continue"
            if action == "reset":
                _abort(client)
                return
            if rule is not None and action in ANSWERS:
                if not expect_continue:  # the client sends its body anyway: read it before answering
                    _read_body(reader, headers)
                status, code, message = {
                    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
                    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
                }.get(action, (rule.status, rule.code, rule.message))
                method, _, rest = request_line.partition(" ")
                resource = rest.rsplit(" ", 1)[0].split("?", 1)[0]
                request_id = f"faultproxy-{self.requests}"
                client.sendall(s3_error(status, code, message, resource, request_id, head=method == "HEAD"))
                _close_gracefully(client)
                return
            if expect_continue:
                client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = _read_body(reader, headers)
            if action == "stall" and rule is not None and self._stopping.wait(rule.seconds):
                _abort(client)
                return
            upstream = socket.create_connection(self.upstream, timeout=IO_TIMEOUT)
            with self._lock:
                self._active.add(upstream)
            forward = _build_head(request_line, headers)
            if action == "reset_mid":
                upstream.sendall(forward + body[: len(body) // 2])
                _abort(upstream)
                _abort(client)
                return
            upstream.sendall(forward + body)
            answer = _Reader(upstream)
            status_line, response_headers = _parse_head(answer.until(b"\r\n\r\n"))
            if action == "lost_response":
                with contextlib.suppress(_Closed):
                    while True:
                        answer._fill()
                        answer.buf.clear()
                _abort(client)
                return
            if action == "cut_answer":
                half = int(_header(response_headers, "content-length") or 0) // 2
                client.sendall(_build_head(status_line, response_headers) + answer.exact(half))
                _close_gracefully(client)
                return
            client.sendall(_build_head(status_line, response_headers) + answer.rest())
            while True:
                chunk = upstream.recv(1 << 20)
                if not chunk:
                    break
                client.sendall(chunk)
            _close_gracefully(client)
        except (OSError, _Closed, ValueError):
            _abort(client)
        finally:
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()
            with contextlib.suppress(OSError):
                client.close()
            with self._lock:
                self._active.discard(client)
                if upstream is not None:
                    self._active.discard(upstream)
                self._threads.discard(threading.current_thread())
            self._slots.release()


__all__ = ["FaultProxy", "Rule", "s3_error"]
