"""GCS credentials over a long run: Application Default Credentials whose token endpoint is a test server
here, and fake-gcs-server behind an https proxy that checks every bearer token (the emulator takes none; a
GcsStore sends ADC tokens only to an https endpoint). google-auth refreshes the token itself, before its
expiry and once on a 401; what this checks is that a long-lived GcsStore never keeps a frozen token (a token
revoked mid-run is replaced, and the upload goes on), and that `ckptfs status` shows the credential's
source and expiry (GcsStore.credentials)."""

from __future__ import annotations

import datetime
import json
import os
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from emulators import GcsServer, fake_gcs  # noqa: F401
from localhttp import LocalHttpServer, QuietHandler, forward
from tlscert import self_signed

from ckptfs.backends.base import ObjectMeta
from ckptfs.backends.gcs import GcsStore
from ckptfs.checksums import crc32

MiB = 1 << 20


class TokenEndpoint:
    """The STS token exchange of an external_account ADC file (workload identity federation): each refresh
    sends the subject token (the file's content, recorded here) and gets a new access token. (An
    authorized_user file cannot be used: google-auth always sends it to oauth2.googleapis.com.)"""

    def __init__(self, lifetime: int) -> None:
        self.issued: list[str] = []
        self.subject_tokens: list[str] = []
        self.revoked: set[str] = set()
        self.lifetime = lifetime
        endpoint = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                form = parse_qs(self.request_body().decode())
                endpoint.subject_tokens.append(form.get("subject_token", [""])[0])
                token = f"access-{len(endpoint.issued) + 1}"
                endpoint.issued.append(token)
                body = json.dumps({"access_token": token, "expires_in": endpoint.lifetime, "token_type": "Bearer",
                                   "issued_token_type": "urn:ietf:params:oauth:token-type:access_token"}).encode()
                self.answer(200, body, "application/json")

        self._served = LocalHttpServer(Handler)
        self.url = self._served.url + "/token"

    def close(self) -> None:
        self._served.close()


class BearerProxy:
    """https in front of the emulator: a request whose bearer token the TokenEndpoint did not issue, or
    revoked, gets GCS's 401; the others are forwarded."""

    def __init__(self, upstream: str, tokens: TokenEndpoint, context: ssl.SSLContext) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.unauthorized = 0
        proxy = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                proxy.handle(self, tokens)

            do_PUT = do_POST = do_HEAD = do_DELETE = do_PATCH = do_GET

        self._served = LocalHttpServer(Handler, tls=context)
        self.url = self._served.url

    def handle(self, handler: QuietHandler, tokens: TokenEndpoint) -> None:
        body = handler.request_body()
        token = (handler.headers.get("Authorization") or "").removeprefix("Bearer ")
        if token not in tokens.issued or token in tokens.revoked:
            self.unauthorized += 1
            answer = json.dumps({"error": {"code": 401, "status": "UNAUTHENTICATED",
                                           "message": "Request had invalid authentication credentials."}}).encode()
            handler.answer(401, answer, "application/json")
            return
        status, headers, data = forward(handler, self.upstream, body, timeout=60)
        handler.answer(status, data, headers=headers)

    def close(self) -> None:
        self._served.close()


@pytest.fixture
def adc_proxy(fake_gcs: GcsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[
        tuple[TokenEndpoint, BearerProxy]]:
    cert, key = self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    tokens = TokenEndpoint(lifetime=3600)
    proxy = BearerProxy(fake_gcs.endpoint, tokens, context)
    subject = tmp_path / "subject-token"
    subject.write_text("subject-1")
    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps({
        "type": "external_account",
        "audience": "//iam.googleapis.com/locations/global/workloadIdentityPools/ckptfs/providers/test",
        "subject_token_type": "urn:ietf:params:oauth:token-type:jwt", "token_url": tokens.url,
        "credential_source": {"file": str(subject)}}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    try:
        yield tokens, proxy
    finally:
        proxy.close()
        tokens.close()


def test_gcs_token_revoked_mid_upload_is_replaced(fake_gcs: GcsServer, adc_proxy: tuple[TokenEndpoint, BearerProxy]
                                                  ) -> None:
    """A GcsStore on workload identity federation: the first token comes from the subject token file; the
    session is revoked between two parts of an upload and the token file rewritten (the kubelet's rotation):
    google-auth meets the 401, exchanges the file's new content for a new token, and the part goes on."""
    tokens, proxy = adc_proxy
    bucket = fake_gcs.new_bucket()
    store = GcsStore(bucket, "run", endpoint_url=proxy.url)
    store.check()
    state = store.credentials.state()
    assert state.source == "adc:identity_pool", state  # google.auth.identity_pool: an external_account file
    assert state.expires_at is not None and 3500 < state.expires_at - datetime.datetime.now().timestamp() <= 3600
    parts = [os.urandom(5 * MiB), os.urandom(1000)]
    upload = store.open_upload("big.bin", ObjectMeta(0, 0o644), None)
    done = [store.put_part(upload, 1, 0, parts[0], crc32(parts[0]))]
    before = len(tokens.issued)
    tokens.revoked.update(tokens.issued)  # the session is revoked between two parts
    (Path(os.environ["GOOGLE_APPLICATION_CREDENTIALS"]).parent / "subject-token").write_text("subject-2")
    done.append(store.put_part(upload, 2, len(parts[0]), parts[1], crc32(parts[1])))
    store.complete_upload(upload, done, sum(map(len, parts)), None)
    assert proxy.unauthorized == 1 and len(tokens.issued) == before + 1, (proxy.unauthorized, tokens.issued)
    assert set(tokens.subject_tokens[:before]) == {"subject-1"}
    assert tokens.subject_tokens[before:] == ["subject-2"], "the refresh read the token file again"
    got = fake_gcs.client().bucket(bucket).blob("run/big.bin").download_as_bytes()
    assert got == b"".join(parts)
