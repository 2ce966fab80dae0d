"""The tests' local HTTP servers: one threaded server on 127.0.0.1 (a free port) that the stand-ins for
cloud endpoints run on (credential endpoints, token exchanges, instance metadata, the proxies in front of
the emulators), so that each of them is only its handler.

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            self.answer(200, b"ok", "text/plain")

    with LocalHttpServer(Handler) as server:   # or server = LocalHttpServer(Handler) ... server.close()
        urllib.request.urlopen(server.url + "/path")

`forward` sends a request a handler received on to an upstream server and gives back its answer, for the
proxies that change or refuse some requests and pass the others on (tests/stsproxy.py,
test_credentials_gcs.py's BearerProxy)."""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# Headers about one connection, not the request: a proxy does not pass them on (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "expect", "te", "upgrade",
                        "transfer-encoding"})


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing (the tests' output stays the tests') and answers in one call."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def answer(self, status: int, body: bytes = b"", content_type: str | None = None, *,
               headers: Iterable[tuple[str, str]] = (), close: bool = False) -> None:
        """The whole answer: status, Content-Type if given, `headers`, Content-Length, then the body (not
        to a HEAD). `close`: the connection ends after it (a proxy's one request per connection)."""
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def request_body(self) -> bytes:
        """The request's body, read by its Content-Length (the clients here send no chunked bodies)."""
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""


class LocalHttpServer:
    """`handler` served by threads (one per connection, daemon threads: a client left hanging never holds up
    the test's end) on 127.0.0.1 at a port the kernel picks, from construction until `close()`. `tls`: the
    server speaks https with this context. The handler reaches per-test state through a closure or through
    `self.server.owner` (the `owner` given here)."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], *, tls: ssl.SSLContext | None = None,
                 owner: object = None, name: str = "localhttp") -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.server.owner = owner  # type: ignore[attr-defined]
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port: int = self.server.server_address[1]
        self.url = f"{'https' if tls is not None else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> LocalHttpServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def forward(handler: BaseHTTPRequestHandler, upstream: tuple[str, int], body: bytes, *,
            timeout: float = 120) -> tuple[int, list[tuple[str, str]], bytes]:
    """The request `handler` received (its `body` already read) sent to `upstream` with the same method,
    path and end-to-end headers; the upstream's status, end-to-end headers (without Content-Length: the
    caller may change the body) and body."""
    connection = http.client.HTTPConnection(*upstream, timeout=timeout)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        connection.request(handler.command, handler.path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        kept = [(name, value) for name, value in response.getheaders()
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length"]
        return response.status, kept, data
    finally:
        connection.close()


__all__ = ["HOP_BY_HOP", "LocalHttpServer", "QuietHandler", "forward"]
