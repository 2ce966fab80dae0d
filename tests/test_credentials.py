"""S3 credentials over a long run (ckptfs/backends/s3creds.py): refreshed before they expire with the token
file read afresh, and a request that meets an expired credential refreshed once and sent again, so that no
upload fails and no part is lost. Real servers only: SeaweedFS behind the fault proxy (tests/faultproxy.py)
answering ExpiredToken once per part; moto's STS and S3 behind tests/stsproxy.py, which cuts its sessions to
seconds and makes its S3 reject expired keys; a container credentials endpoint (EKS Pod Identity) served here.

Time compression: moto's sessions last an hour and its S3 never checks them, so stsproxy rewrites every
AssumeRoleWithWebIdentity answer's Expiration to 12 s from now (IRSA's hour, 300 times faster) and answers
ExpiredToken to any S3 request signed with a key past it. ckptfs's refresh window scales with the lifetime
(half of it, at most 15 minutes), so a run of 45 s spans four sessions with a fetch every 6 s and no request
ever signed with an expired key; botocore's own provider, with its fixed 15-minute window, would call STS
once per request (measured: 218 calls for 218 PutObjects)."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest
from conftest import Mount
from emulators import S3Server, free_ports, moto_s3, s3_bucket, seaweedfs_s3  # noqa: F401
from faultproxy import FaultProxy, Rule
from localhttp import LocalHttpServer, QuietHandler
from stsproxy import StsProxy

from ckptfs.backends.base import ObjectMeta
from ckptfs.backends.s3 import S3Store
from ckptfs.checksums import crc32

MiB = 1 << 20
ROLE_ARN = "arn:aws:iam::123456789012:role/ckptfs-test"
# The long web-identity run: sessions of SESSION_SECONDS (an hour compressed), RUN_SECONDS of writing (four of them).
SESSION_SECONDS = 12
RUN_SECONDS = 45
STATIC_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def _expired_once(match: str) -> Rule:
    return Rule("error", match=match, count=1, status=400, code="ExpiredToken",
                message="The provided token has expired.")


@pytest.fixture
def weed_bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


@pytest.fixture
def moto_bucket(moto_s3: S3Server) -> Iterator[str]:
    with s3_bucket(moto_s3) as name:
        yield name


def test_expired_token_once_per_part_every_part_lands(seaweedfs_s3: S3Server, weed_bucket: str) -> None:
    """Every request of a multipart upload (its create, each part, its complete) first meets ExpiredToken:
    each is refreshed once and sent again inside the store, and the object is whole."""
    parts = [os.urandom(5 * MiB) for _ in range(3)] + [os.urandom(1234)]
    with FaultProxy(seaweedfs_s3.endpoint) as proxy:
        rules = [proxy.add_rule(_expired_once(r"^POST \S*\?uploads"))]
        rules += [proxy.add_rule(_expired_once(rf"^PUT \S*[?&]partNumber={n}(&|\s)")) for n in range(1, len(parts) + 1)]
        rules.append(proxy.add_rule(_expired_once(r"^POST \S*\?uploadId=")))
        store = S3Store(weed_bucket, "run", endpoint_url=proxy.endpoint)
        upload = store.open_upload("big.bin", ObjectMeta(0, 0o644), None)
        done = [store.put_part(upload, n, 0, data, crc32(data)) for n, data in enumerate(parts, 1)]
        store.complete_upload(upload, done, sum(map(len, parts)), None)
    assert [rule.fired for rule in rules] == [1] * len(rules), "every injected ExpiredToken was met"
    assert store.credentials is not None
    assert store.credentials.state().renewals_after_rejection == len(rules)
    whole = seaweedfs_s3.client().get_object(Bucket=weed_bucket, Key="run/big.bin")["Body"].read()
    assert hashlib.sha256(whole).digest() == hashlib.sha256(b"".join(parts)).digest()


def test_expired_token_on_a_later_page_of_a_listing_goes_on_from_that_page(seaweedfs_s3: S3Server,
                                                                          weed_bucket: str) -> None:
    """A listing of thousands of keys may outlive its session. Before, only a first page that met an expired
    credential was asked again; a later one failed the whole listing (a readdir's EIO, a sweep put off).
    Now each page is renewed and sent again like any request, and the listing goes on where it was."""
    client = seaweedfs_s3.client()
    for i in range(5):
        client.put_object(Bucket=weed_bucket, Key=f"run/p/{i}", Body=b"x")
    for _ in range(3):
        client.create_multipart_upload(Bucket=weed_bucket, Key="run/staged")
    with FaultProxy(seaweedfs_s3.endpoint) as proxy:
        store = S3Store(weed_bucket, "run", endpoint_url=proxy.endpoint)
        later_object_page = proxy.add_rule(_expired_once(r"^GET \S*continuation-token="))
        keys = [obj["Key"] for page in store.wire.pages("list", "list_objects_v2", Prefix="run/p/", MaxKeys=2)
                for obj in page.get("Contents", [])]
        later_uploads_page = proxy.add_rule(_expired_once(r"^GET \S*upload-id-marker="))
        uploads = [upload["UploadId"] for page in store.wire.pages(
            "list uploads", "list_multipart_uploads", Prefix="run/staged", MaxUploads=1)
            for upload in page.get("Uploads", [])]
    assert later_object_page.fired == 1 and later_uploads_page.fired == 1
    assert keys == [f"run/p/{i}" for i in range(5)]
    assert len(set(uploads)) == 3
    assert store.credentials is not None and store.credentials.state().renewals_after_rejection == 2


def test_drain_through_expired_tokens_counts_no_failure(seaweedfs_s3: S3Server, weed_bucket: str,
                                                        mount_factory: Any) -> None:
    """A mount whose store answers ExpiredToken to the first request of every part: the drain uploads
    everything without one failed attempt, and status names the credential and its rejections."""
    data = os.urandom(21 * MiB)
    with FaultProxy(seaweedfs_s3.endpoint) as proxy:
        rules = [proxy.add_rule(_expired_once(rf"^PUT \S*[?&]partNumber={n}(&|\s)")) for n in range(1, 6)]
        rules.append(proxy.add_rule(_expired_once(r"^POST \S*\?uploadId=")))
        rules.append(proxy.add_rule(_expired_once(r"^PUT \S*/small\.bin ")))
        m: Mount = mount_factory("m", source=f"s3://{weed_bucket}/run",
                                 extra_args=("--endpoint-url", proxy.endpoint, "--part-size", "5M"))
        (m.mnt / "big.bin").write_bytes(data)
        (m.mnt / "small.bin").write_bytes(b"small")
        m.flush(timeout=120)
        status = m.status()
        m.umount()
    assert all(rule.fired == 1 for rule in rules), [(rule.match, rule.fired) for rule in rules]
    assert status["errors"] == 0, status["last_error"]
    assert status["credentials"]["source"] == "env"
    assert status["credentials"]["renewals_after_rejection"] == len(rules)
    client = seaweedfs_s3.client()
    assert client.get_object(Bucket=weed_bucket, Key="run/big.bin")["Body"].read() == data
    assert client.get_object(Bucket=weed_bucket, Key="run/small.bin")["Body"].read() == b"small"


def _wait_for_metric(port: int, series: str, timeout: float = 10) -> float:
    """The value of one series on the mount's metrics endpoint, once it is there (published every second)."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
        assert time.monotonic() < deadline, f"{series} not served:\n{text}"
        time.sleep(0.2)


def _web_identity_env(env: dict[str, str], token_file: Path, sts_endpoint: str) -> dict[str, str]:
    out = {k: v for k, v in env.items() if k not in STATIC_KEYS}
    out.update(AWS_WEB_IDENTITY_TOKEN_FILE=str(token_file), AWS_ROLE_ARN=ROLE_ARN,
               AWS_ROLE_SESSION_NAME="ckptfs-test", AWS_ENDPOINT_URL_STS=sts_endpoint)
    return out


def test_web_identity_session_revoked_is_fetched_again(moto_s3: S3Server, moto_bucket: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 rejects the current session as expired before its time: the store fetches a new one (one STS
    call for the requests that met the rejection) and the write goes on."""
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    with StsProxy(moto_s3.endpoint, session_seconds=3600) as proxy:
        for name, value in _web_identity_env(dict(os.environ), token_file, proxy.endpoint).items():
            monkeypatch.setenv(name, value)
        for name in STATIC_KEYS:
            monkeypatch.delenv(name, raising=False)
        store = S3Store(moto_bucket, "run", endpoint_url=proxy.endpoint)
        store.put_object("a", b"a", ObjectMeta(0, 0o644), "")
        assert len(proxy.issued) == 1
        proxy.reject_key(proxy.issued[0].access_key)
        token_file.write_text("token-2")
        store.put_object("b", b"b", ObjectMeta(0, 0o644), "")
        state = store.credentials.state() if store.credentials else None
    assert proxy.expired_rejections == 1, "the revoked session was met"
    assert proxy.tokens() == ["token-1", "token-2"], "the refresh read the token file again"
    assert state is not None and state.source == "web-identity" and state.renewals_after_rejection == 1
    assert moto_s3.client().get_object(Bucket=moto_bucket, Key="run/b")["Body"].read() == b"b"


def test_web_identity_drain_spans_sessions_with_token_rewritten(moto_s3: S3Server, moto_bucket: str,
                                                                  tmp_path: Path, mount_factory: Any) -> None:
    """The time-compressed long run: 12 s sessions whose expiry S3 enforces, files written and drained for
    45 s (four sessions), the token file rewritten half way. Every file lands, no upload attempt fails,
    and the STS requests after the rewrite carry the new token."""
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    (metrics_port,) = free_ports(1)
    with StsProxy(moto_s3.endpoint, session_seconds=SESSION_SECONDS) as proxy:
        m: Mount = mount_factory("m", start=False, source=f"s3://{moto_bucket}/run", upload_delay=0.0,
                                 extra_args=("--endpoint-url", proxy.endpoint, "--part-size", "5M",
                                             "--metrics-addr", f"127.0.0.1:{metrics_port}"))
        m.env = _web_identity_env(m.env, token_file, proxy.endpoint)
        m.start()
        written: dict[str, bytes] = {}
        started = time.monotonic()
        rewritten_at = None
        n = 0
        while time.monotonic() - started < RUN_SECONDS:
            if rewritten_at is None and time.monotonic() - started > RUN_SECONDS / 2:
                token_file.write_text("token-2")  # kubelet rotates the projected token: same path, new content
                rewritten_at = time.time()
            data = os.urandom(12 * MiB if n % 10 == 0 else 256 * 1024)
            (m.mnt / f"f{n}.bin").write_bytes(data)
            written[f"f{n}.bin"] = data
            n += 1
            time.sleep(0.5)
        m.flush(timeout=120)
        status = m.status()
        human = m.cli("status", str(m.mnt)).stdout
        expiry = _wait_for_metric(metrics_port, 'ckptfs_credential_expiry_timestamp_seconds{source="web-identity"}')
        m.umount()
        elapsed = time.monotonic() - started
        first = proxy.issued[0]
    assert rewritten_at is not None
    assert status["errors"] == 0, status["last_error"]
    # The metric shows the expiry of a session the proxy issued (a refresh may have followed its scrape).
    assert min(abs(expiry - issued.expires_at) for issued in proxy.issued[-3:]) < 1, expiry
    credentials = status["credentials"]
    assert credentials["source"] == "web-identity" and credentials["refreshes"] >= 3, credentials
    assert "credential web-identity" in human and "expires" in human, human
    # Fetched ahead of every expiry (half the session), never per request, and never too late.
    assert len(proxy.issued) <= elapsed / (SESSION_SECONDS / 2) + 3, (len(proxy.issued), proxy.s3_requests, elapsed)
    assert proxy.expired_rejections == 0 and credentials["renewals_after_rejection"] == 0
    before = [i.token for i in proxy.issued if i.at < rewritten_at]
    after = [i.token for i in proxy.issued if i.at > rewritten_at]
    assert before and set(before) == {"token-1"}
    assert after and set(after) == {"token-2"}, "every refresh after the rewrite sent the new token"
    # The proxy does enforce expiry: the first session, long past, is refused.
    with StsProxy(moto_s3.endpoint, session_seconds=SESSION_SECONDS) as check:
        check.issued.append(first)
        stale = boto3.client("s3", endpoint_url=check.endpoint, region_name="us-east-1",
                             aws_access_key_id=first.access_key, aws_secret_access_key=first.secret_key,
                             aws_session_token=first.session_token)
        with pytest.raises(botocore.exceptions.ClientError, match="ExpiredToken"):
            stale.list_objects_v2(Bucket=moto_bucket)
    client = moto_s3.client()
    for name, data in written.items():
        assert client.get_object(Bucket=moto_bucket, Key=f"run/{name}")["Body"].read() == data, name


class _ContainerEndpoint:
    """The EKS Pod Identity agent, as far as a client sees it: GET with `Authorization: <token>` answers
    a JSON credential that expires `lifetime` seconds later; a wrong token gets 401."""

    def __init__(self, token_file: Path, lifetime: float) -> None:
        self.token_file = token_file
        self.lifetime = lifetime
        self.tokens: list[str] = []
        endpoint = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                token = self.headers.get("Authorization") or ""
                endpoint.tokens.append(token)
                if token != endpoint.token_file.read_text():
                    self.answer(401)
                    return
                n = len(endpoint.tokens)
                expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + endpoint.lifetime))
                body = json.dumps({"AccessKeyId": f"ASIAPOD{n:08d}", "SecretAccessKey": f"secret{n}",
                                   "Token": f"session{n}", "Expiration": expires}).encode()
                self.answer(200, body, "application/json")

        self._server = LocalHttpServer(Handler)
        self.url = self._server.url + "/v1/credentials"

    def close(self) -> None:
        self._server.close()


def test_pod_identity_refreshes_and_rereads_its_token_file(moto_s3: S3Server, moto_bucket: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """EKS Pod Identity (AWS_CONTAINER_CREDENTIALS_FULL_URI + AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE) with
    8 s credentials: a store used for 20 s fetches new ones before each expiry, and after the token file
    is rewritten the endpoint only ever sees the new token."""
    token_file = tmp_path / "pod-token"
    token_file.write_text("pod-token-1")
    endpoint = _ContainerEndpoint(token_file, lifetime=8)
    try:
        for name in STATIC_KEYS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", endpoint.url)
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
        store = S3Store(moto_bucket, "run", endpoint_url=moto_s3.endpoint)
        started = time.monotonic()
        rewritten_after = None
        n = 0
        while time.monotonic() - started < 20:
            if rewritten_after is None and time.monotonic() - started > 10:
                token_file.write_text("pod-token-2")
                rewritten_after = len(endpoint.tokens)
            store.put_object(f"p{n}", b"x", ObjectMeta(0, 0o644), "")
            n += 1
            time.sleep(0.2)
        assert store.credentials is not None
        state = store.credentials.state()
        elapsed = time.monotonic() - started
    finally:
        endpoint.close()
    # One fetch per half lifetime (4 s), not one per request (n of them).
    assert len(endpoint.tokens) <= elapsed / 4 + 3 < n, (len(endpoint.tokens), n)
    assert state.source == "container" and state.refreshes >= 3, state
    assert state.expires_at is not None and state.expires_at > time.time()
    assert rewritten_after is not None and endpoint.tokens[rewritten_after:], "fetched after the rewrite"
    assert set(endpoint.tokens[:rewritten_after]) == {"pod-token-1"}
    assert set(endpoint.tokens[rewritten_after:]) == {"pod-token-2"}


# -- the refresh policy of RenewingCredentials, on its own clock (no server, no SDK involved) ----------------


class _Source:
    """A credential source: each fetch hands out key-<n> valid for `lifetime` seconds of `now()`, or fails
    while `down`."""

    def __init__(self, clock: list[float], lifetime: float) -> None:
        self.clock = clock
        self.lifetime = lifetime
        self.fetches = 0
        self.down = False

    def __call__(self) -> Any:
        from botocore.credentials import ReadOnlyCredentials

        from ckptfs.backends.s3creds import Issued

        if self.down:
            raise ConnectionError("STS unreachable")
        self.fetches += 1
        return Issued(ReadOnlyCredentials(f"key-{self.fetches}", "secret", "token"), self.clock[0] + self.lifetime,
                      "assume-role-with-web-identity")


def _renewing(lifetime: float) -> tuple[Any, _Source, list[float]]:
    from ckptfs.backends.s3creds import RenewingCredentials

    clock = [1_000_000.0]
    source = _Source(clock, lifetime)
    return RenewingCredentials("web-identity", source, clock=lambda: clock[0]), source, clock


@pytest.mark.parametrize(("lifetime", "refresh_after"), [(3600.0, 2700.0), (900.0, 450.0), (20.0, 10.0)])
def test_refreshed_when_half_the_lifetime_or_15_minutes_is_left(lifetime: float, refresh_after: float) -> None:
    credentials, source, clock = _renewing(lifetime)
    assert credentials.get_frozen_credentials().access_key == "key-1"
    for _ in range(100):  # requests before the refresh point reuse the credential: no fetch per request
        credentials.get_frozen_credentials()
    clock[0] += refresh_after - 0.5
    assert credentials.get_frozen_credentials().access_key == "key-1" and source.fetches == 1
    clock[0] += 1.0
    assert credentials.get_frozen_credentials().access_key == "key-2" and credentials.refreshes == 1


def test_a_failed_refresh_keeps_the_valid_credential_and_tries_again_later(caplog: pytest.LogCaptureFixture) -> None:
    credentials, source, clock = _renewing(20.0)
    credentials.get_frozen_credentials()
    source.down = True
    clock[0] += 11.0  # past the refresh point, 9 s left
    assert credentials.get_frozen_credentials().access_key == "key-1"
    assert "refreshing the web-identity credential failed" in caplog.text
    assert credentials.state().last_error is not None
    calls = source.fetches
    assert credentials.get_frozen_credentials().access_key == "key-1"  # within the pause: no new attempt
    source.down = False
    clock[0] += 1.0  # the pause (a tenth of what was left, at least 1 s) is over
    assert credentials.get_frozen_credentials().access_key == "key-2" and source.fetches == calls + 1
    assert credentials.state().last_error is None


def test_an_expired_credential_is_never_used() -> None:
    """Within EXPIRY_MARGIN of its expiry, a credential that cannot be refreshed fails the request instead
    of signing it with a key the server will refuse."""
    credentials, source, clock = _renewing(20.0)
    credentials.get_frozen_credentials()
    source.down = True
    clock[0] += 16.0
    with pytest.raises(ConnectionError):
        credentials.get_frozen_credentials()


def test_many_rejections_of_one_key_make_one_fetch() -> None:
    credentials, source, _clock = _renewing(3600.0)
    credentials.get_frozen_credentials()
    credentials.renew_after_rejection("key-1", "ExpiredToken")
    credentials.renew_after_rejection("key-1", "ExpiredToken")  # a part that was signed with key-1 too
    assert source.fetches == 2 and credentials.state().renewals_after_rejection == 1
    credentials.renew_after_rejection("key-2", "ExpiredToken")
    assert source.fetches == 3


def test_a_token_file_that_cannot_be_read_is_named_at_mount(moto_s3: S3Server, moto_bucket: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptfs.errors import StoreCheckError

    missing = tmp_path / "no-such-token"
    for name, value in _web_identity_env(dict(os.environ), missing, moto_s3.endpoint).items():
        monkeypatch.setenv(name, value)
    for name in STATIC_KEYS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StoreCheckError, match=rf"cannot get AWS credentials .*{missing}.*AWS_WEB_IDENTITY_TOKEN_FILE"):
        S3Store(moto_bucket, "run", endpoint_url=moto_s3.endpoint).check()
