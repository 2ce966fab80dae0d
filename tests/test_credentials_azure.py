"""Azure credentials over a long run, on a real bearer-token path: Azurite over https with `--oauth basic`
(it checks each token's issuer, audience and lifetime, not its signature), and DefaultAzureCredential
getting its tokens from a managed identity endpoint served here (the App Service form: IDENTITY_ENDPOINT and
IDENTITY_HEADER, plain http on loopback, as on App Service itself).

The endpoint tells the client each token lasts an hour but writes a lifetime of a few seconds into the
token: Azurite then answers "AuthenticationFailed: Lifetime validation failed. The token is expired." while
the SDK's bearer policy believes the token valid (a skewed clock, a revoked session look the same). The SDK
would keep sending it; AzureBlobStore makes the client anew once and the part goes on."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators import AZURITE_ACCOUNT, AZURITE_KEY, azurite_main, free_ports, stop_process
from localhttp import LocalHttpServer, QuietHandler
from tlscert import self_signed

from ckptfs.backends.base import ObjectMeta
from ckptfs.checksums import crc32

MiB = 1 << 20
TOKEN_SECONDS = 8  # the lifetime written into each token (the client is told an hour)


def _b64(data: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


class IdentityEndpoint:
    """App Service's managed identity endpoint: GET ?resource=...&api-version=2019-08-01 with
    X-IDENTITY-HEADER answers a token."""

    def __init__(self, secret: str) -> None:
        self.issued = 0
        endpoint = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.headers.get("X-IDENTITY-HEADER") != secret:
                    self.answer(401)
                    return
                endpoint.issued += 1
                now = int(time.time())
                claims = {"aud": "https://storage.azure.com", "iss": "https://sts.windows.net/ckptfs-test/",
                          "iat": now - 1, "nbf": now - 1, "exp": now + TOKEN_SECONDS, "n": endpoint.issued}
                token = f"{_b64({'alg': 'HS256', 'typ': 'JWT'})}.{_b64(claims)}.c2lnbmF0dXJl"
                body = json.dumps({"access_token": token, "expires_on": str(now + 3600),
                                   "resource": "https://storage.azure.com", "token_type": "Bearer"}).encode()
                self.answer(200, body, "application/json")

        self._server = LocalHttpServer(Handler)
        self.url = self._server.url + "/msi/token"

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def azurite_oauth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An Azurite over https with --oauth basic; yields the account's blob endpoint."""
    cert, key = self_signed(tmp_path)
    (port,) = free_ports(1)
    data = tmp_path / "azurite"
    data.mkdir()
    args = [shutil.which("node") or "node", str(azurite_main()), "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--location", str(data), "--loose", "--skipApiVersionCheck", "--disableTelemetry", "--silent",
            "--oauth", "basic", "--cert", str(cert), "--key", str(key)]
    with open(tmp_path / "azurite.log", "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    endpoint = f"https://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    try:
        from azure.storage.blob import BlobServiceClient

        deadline = time.monotonic() + 60
        while True:
            try:
                BlobServiceClient(endpoint, credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY}
                                  ).create_container("run")
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        yield endpoint
    finally:
        stop_process(proc)


def test_azure_token_the_server_calls_expired_is_replaced(azurite_oauth: str, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from azure.storage.blob import BlobServiceClient

    from ckptfs.backends.azure import AzureBlobStore

    secret = "identity-header-secret"
    identity = IdentityEndpoint(secret)
    try:
        for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN",
                     "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET", "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE",
                     "MSI_ENDPOINT", "MSI_SECRET"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", AZURITE_ACCOUNT)
        monkeypatch.setenv("IDENTITY_ENDPOINT", identity.url)
        monkeypatch.setenv("IDENTITY_HEADER", secret)
        store = AzureBlobStore("run", "p", endpoint_url=azurite_oauth)
        store.check()
        parts = [os.urandom(5 * MiB), os.urandom(1000)]
        upload = store.open_upload("big.bin", ObjectMeta(0, 0o644), None)
        done = [store.put_part(upload, 1, 0, parts[0], crc32(parts[0]))]
        issued = identity.issued
        time.sleep(TOKEN_SECONDS + 1.5)  # the token's own lifetime passes (the client was told an hour)
        done.append(store.put_part(upload, 2, len(parts[0]), parts[1], crc32(parts[1])))
        store.complete_upload(upload, done, sum(map(len, parts)), None)
        state = store.credentials.state()
    finally:
        identity.close()
    assert identity.issued == issued + 1, "one new token, after the rejection"
    assert state.source == "DefaultAzureCredential" and state.renewals_after_rejection == 1, state
    service = BlobServiceClient(azurite_oauth, credential={"account_name": AZURITE_ACCOUNT, "account_key": AZURITE_KEY})
    assert service.get_blob_client("run", "p/big.bin").download_blob().readall() == b"".join(parts)
