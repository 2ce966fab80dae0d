"""An HTTP proxy in front of moto server that makes its STS sessions short and its S3 enforce them, on
127.0.0.1, for the credential tests (test_credentials.py).

moto's STS issues sessions of an hour (at least 15 minutes) and its S3 accepts any key, expired or not. This
proxy forwards everything to moto, unchanged but for two things:
  - an AssumeRoleWithWebIdentity answer gets `<Expiration>` now + `session_seconds` (time compressed: a
    session of 20 s stands for IRSA's hour), and the proxy records the token each such request carried and
    the access key and expiry it issued;
  - an S3 request signed (SigV4 `Credential=<key>/...`) with a key the proxy issued, after that key's
    expiry, is answered `400 ExpiredToken` as AWS answers it, and counted (`expired_rejections`).
`reject_key(key)` makes the S3 requests signed with one issued key fail as expired from now on (a session
revoked, or expired earlier than the client believes).

Bodies are read by Content-Length (botocore sends S3 bodies so when given their checksum); every connection
carries one request.
"""

from __future__ import annotations

import http.client
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "expect", "te", "upgrade", "transfer-encoding"}
SIGNED_KEY = re.compile(r"Credential=([^/,\s]+)/")


@dataclass(frozen=True)
class Issued:
    token: str  # the web identity token the request carried
    access_key: str
    secret_key: str
    session_token: str
    expires_at: float
    at: float


def expired_token_body(resource: str) -> bytes:
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ExpiredToken</Code>'
            "<Message>The provided token has expired.</Message>"
            f"<Resource>{resource}</Resource><RequestId>stsproxy</RequestId></Error>").encode()


class StsProxy:
    def __init__(self, upstream: str, *, session_seconds: float) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname == "127.0.0.1", upstream
        self.upstream = (parts.hostname, parts.port or 80)
        self.session_seconds = session_seconds
        self.issued: list[Issued] = []
        self.expired_rejections = 0
        self.s3_requests = 0
        self._rejected: set[str] = set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self)

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="stsproxy", daemon=True)

    def __enter__(self) -> StsProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def reject_key(self, access_key: str) -> None:
        with self._lock:
            self._rejected.add(access_key)

    def tokens(self) -> list[str]:
        with self._lock:
            return [issued.token for issued in self.issued]

    def _expired(self, access_key: str) -> bool:
        with self._lock:
            if access_key in self._rejected:
                return True
            return any(i.access_key == access_key and time.time() >= i.expires_at for i in self.issued)

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        form = parse_qs(body.decode("latin-1")) if handler.command == "POST" and body else {}
        sts = form.get("Action") == ["AssumeRoleWithWebIdentity"]
        if not sts:
            signed = SIGNED_KEY.search(handler.headers.get("Authorization") or "")
            with self._lock:
                self.s3_requests += 1
            if signed and self._expired(signed.group(1)):
                with self._lock:
                    self.expired_rejections += 1
                answer = expired_token_body(handler.path.split("?", 1)[0])
                handler.send_response(400)
                handler.send_header("Content-Type", "application/xml")
                handler.send_header("Content-Length", str(len(answer)))
                handler.send_header("Connection", "close")
                handler.end_headers()
                if handler.command != "HEAD":
                    handler.wfile.write(answer)
                handler.close_connection = True
                return
        connection = http.client.HTTPConnection(*self.upstream, timeout=120)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        connection.request(handler.command, handler.path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        if sts and response.status == 200:
            data = self._shorten(data, form["WebIdentityToken"][0])
        handler.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
        handler.close_connection = True
        connection.close()

    def _shorten(self, answer: bytes, token: str) -> bytes:
        """moto's answer with the session cut to session_seconds, and what it issued recorded."""
        text = answer.decode()
        now = time.time()
        expires_at = now + self.session_seconds
        stamp = datetime.fromtimestamp(expires_at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        text = re.sub(r"<Expiration>[^<]*</Expiration>", f"<Expiration>{stamp}</Expiration>", text)

        def field(name: str) -> str:
            found = re.search(rf"<{name}>([^<]*)</{name}>", text)
            assert found, f"no {name} in moto's AssumeRoleWithWebIdentity answer: {text[:500]}"
            return found.group(1)

        issued = Issued(token, field("AccessKeyId"), field("SecretAccessKey"), field("SessionToken"), expires_at, now)
        with self._lock:
            self.issued.append(issued)
        return text.encode()


__all__ = ["Issued", "StsProxy"]
