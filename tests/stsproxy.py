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

import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import parse_qs, urlsplit

from localhttp import LocalHttpServer, QuietHandler, forward

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
        self._server = LocalHttpServer(_ProxyHandler, owner=self, name="stsproxy")
        self.endpoint = self._server.url

    def __enter__(self) -> StsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

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

    def handle(self, handler: QuietHandler) -> None:
        body = handler.request_body()
        form = parse_qs(body.decode("latin-1")) if handler.command == "POST" and body else {}
        sts = form.get("Action") == ["AssumeRoleWithWebIdentity"]
        if not sts:
            signed = SIGNED_KEY.search(handler.headers.get("Authorization") or "")
            with self._lock:
                self.s3_requests += 1
            if signed and self._expired(signed.group(1)):
                with self._lock:
                    self.expired_rejections += 1
                handler.answer(400, expired_token_body(handler.path.split("?", 1)[0]), "application/xml", close=True)
                return
        status, headers, data = forward(handler, self.upstream, body)
        if sts and status == 200:
            data = self._shorten(data, form["WebIdentityToken"][0])
        handler.answer(status, data, headers=headers, close=True)

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


class _ProxyHandler(QuietHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.server.owner.handle(self)  # type: ignore[attr-defined]

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET


__all__ = ["Issued", "StsProxy"]
