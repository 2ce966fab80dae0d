"""S3 credentials that last as long as the daemon: RenewingCredentials, what S3Store's clients sign with.

Owns where an S3Store's credentials come from, when they are fetched again, and what `ckptfs status` says of
them (CredentialState). Knows nothing of the store's requests: S3Wire (s3wire.py) calls `renew_after_rejection`
when S3 answers that the credential it signed with has expired (s3errors.is_expired_credential).

botocore already refreshes web identity (IRSA) and container (EKS Pod Identity) credentials before they
expire and re-reads their token files on each refresh (1.44). Where it falls short for a process that runs
for weeks, and what is done here instead:
  - Its windows are fixed: refresh 15 minutes before the expiry (advisory), block 10 minutes before
    (mandatory), and its STS fetcher's cache counts a session within 15 minutes of its expiry as expired. A
    session of 15 minutes or less (STS's minimum is 900 s) is fetched again for every request: measured
    through tests/stsproxy.py, 85 AssumeRoleWithWebIdentity calls for 85 PutObjects with 900 s sessions
    (STS throttles such calls per account). Here the window scales with the session's lifetime: refresh
    when min(15 min, half the lifetime) is left.
  - It never refreshes because the server said so: an `ExpiredToken` (a session revoked or expired early, a
    skewed clock) is retried, if at all, with the same frozen credential. Here the store refreshes once
    and sends the request again (renew_after_rejection; one refresh however many requests met the same
    rejected key at once).
  - A credential from the environment or a credentials file (a sidecar that rewrites
    ~/.aws/credentials, `aws sts assume-role` exported) is loaded once and kept frozen. Here the whole chain
    is resolved again, files re-read, when S3 rejects it as expired, and before the expiry it carries.
  - A refresh that fails while the credential is still valid keeps it, logs a warning, and tries again
    after a pause (a tenth of the lifetime, at most 30 s) instead of on every request.
The token file is read afresh on every fetch, never by its mtime (cube-js/cube #11622: a refresh that waited
for the file's mtime uploaded for exactly one hour per pod).

Sources, the first that is set wins (the order of botocore's chain for these):
  1. web identity: AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN (IRSA; AWS_ROLE_SESSION_NAME optional):
     STS AssumeRoleWithWebIdentity, unsigned, at AWS_ENDPOINT_URL_STS if set.
  2. container: AWS_CONTAINER_CREDENTIALS_FULL_URI (EKS Pod Identity, with
     AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE) or _RELATIVE_URI (ECS), through botocore's own fetcher.
  3. everything else botocore's chain resolves (environment, profiles with assumed roles, SSO, files, the
     instance role): taken from a fresh botocore session each time.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import botocore.config
import botocore.credentials
import botocore.exceptions
import botocore.session
import botocore.utils
from botocore import UNSIGNED

from ckptfs.backends.base import CredentialState

log = logging.getLogger(__name__)

# Refresh when this much of the session is left, or half its lifetime if that is less (botocore's advisory
# window is the same 15 minutes, but fixed).
REFRESH_BEFORE = 15 * 60.0
# After a failed refresh of a credential still valid, wait this long (or a tenth of the lifetime) to retry.
RETRY_PAUSE = 30.0
# A credential this close to its expiry is not used: a request signed now may reach the server after it.
EXPIRY_MARGIN = 5.0

ENV_TOKEN_FILE = "AWS_WEB_IDENTITY_TOKEN_FILE"
ENV_ROLE_ARN = "AWS_ROLE_ARN"
ENV_SESSION_NAME = "AWS_ROLE_SESSION_NAME"
ENV_CONTAINER_FULL = "AWS_CONTAINER_CREDENTIALS_FULL_URI"
ENV_CONTAINER_RELATIVE = "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"
ENV_CONTAINER_TOKEN_FILE = "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"
ENV_CONTAINER_TOKEN = "AWS_CONTAINER_AUTHORIZATION_TOKEN"


@dataclass(frozen=True)
class Issued:
    """One credential as a source handed it out."""

    frozen: botocore.credentials.ReadOnlyCredentials
    expires_at: float | None  # wall-clock; None: it does not expire (or does not say when)
    method: str  # botocore's name of the source it came from ("env", "assume-role", ...)


Fetch = Callable[[], Issued]


def _epoch(when: datetime | str | None) -> float | None:
    if when is None:
        return None
    parsed: datetime = botocore.utils.parse_timestamp(when) if isinstance(when, str) else when
    return parsed.timestamp()


def web_identity_fetch(token_file: str, role_arn: str, session_name: str, region: str) -> Fetch:
    """AssumeRoleWithWebIdentity with the token file's current content (read on every call)."""
    sts = botocore.session.Session().create_client(
        "sts", region_name=region,
        config=botocore.config.Config(signature_version=UNSIGNED,
                                      retries={"mode": "standard", "total_max_attempts": 3}))

    def fetch() -> Issued:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise botocore.exceptions.CredentialRetrievalError(
                provider="web-identity", error_msg=f"cannot read {ENV_TOKEN_FILE} {token_file}: {exc}") from exc
        answer = sts.assume_role_with_web_identity(RoleArn=role_arn, RoleSessionName=session_name,
                                                   WebIdentityToken=token)["Credentials"]
        frozen = botocore.credentials.ReadOnlyCredentials(answer["AccessKeyId"], answer["SecretAccessKey"],
                                                          answer["SessionToken"])
        return Issued(frozen, _epoch(answer["Expiration"]), "assume-role-with-web-identity")

    return fetch


def container_fetch(environ: dict[str, str]) -> Fetch:
    """The container credentials endpoint (EKS Pod Identity, ECS), with the authorization token file read on
    every call. Through botocore's fetcher (it checks the host is the agent's or loopback, and retries), not
    its provider: the provider's credentials would refresh themselves at once below 15 minutes of life."""
    fetcher = botocore.utils.ContainerMetadataFetcher()

    def fetch() -> Issued:
        full = environ.get(ENV_CONTAINER_FULL)
        url = full or fetcher.full_url(environ[ENV_CONTAINER_RELATIVE])
        token = environ.get(ENV_CONTAINER_TOKEN)
        token_file = environ.get(ENV_CONTAINER_TOKEN_FILE)
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as exc:
                raise botocore.exceptions.CredentialRetrievalError(
                    provider="container", error_msg=f"cannot read {ENV_CONTAINER_TOKEN_FILE} {token_file}: {exc}",
                ) from exc
        try:
            answer = fetcher.retrieve_full_uri(url, headers={"Authorization": token} if token else None)
        except botocore.exceptions.MetadataRetrievalError as exc:
            raise botocore.exceptions.CredentialRetrievalError(provider="container", error_msg=str(exc)) from exc
        frozen = botocore.credentials.ReadOnlyCredentials(answer["AccessKeyId"], answer["SecretAccessKey"],
                                                          answer.get("Token"))
        return Issued(frozen, _epoch(answer.get("Expiration")), "container-role")

    return fetch


def chain_fetch(profile: str | None) -> Fetch:
    """Whatever botocore's default chain resolves now, from a fresh session (environment and files re-read)."""

    def fetch() -> Issued:
        loaded = botocore.session.Session(profile=profile).get_credentials()
        if loaded is None:
            raise botocore.exceptions.NoCredentialsError()
        return _issued_from(loaded)

    return fetch


def _issued_from(loaded: botocore.credentials.Credentials) -> Issued:
    frozen = loaded.get_frozen_credentials()
    # botocore's RefreshableCredentials keeps the expiry in _expiry_time and offers no public accessor.
    expiry = getattr(loaded, "_expiry_time", None)
    return Issued(frozen, _epoch(expiry), str(getattr(loaded, "method", "") or "unknown"))


def source_of(environ: dict[str, str], region: str, profile: str | None) -> tuple[str, Fetch]:
    """(what status calls the source, how to fetch from it) for this environment."""
    token_file, role_arn = environ.get(ENV_TOKEN_FILE), environ.get(ENV_ROLE_ARN)
    if token_file and role_arn:
        session_name = environ.get(ENV_SESSION_NAME) or f"ckptfs-{socket.gethostname()}"[:64]
        return "web-identity", web_identity_fetch(token_file, role_arn, session_name, region)
    if environ.get(ENV_CONTAINER_FULL) or environ.get(ENV_CONTAINER_RELATIVE):
        return "container", container_fetch(environ)
    return "chain", chain_fetch(profile)


class RenewingCredentials(botocore.credentials.Credentials):
    """Credentials botocore signs with (it calls get_frozen_credentials for every request), fetched again
    before they expire and when the server rejects them as expired. Thread-safe: the store's requests run in
    many worker threads; one of them refreshes, the others go on with the current credential while it is
    valid, and wait for the refresh only when it is not."""

    def __init__(self, kind: str, fetch: Fetch, *, clock: Callable[[], float] = time.time) -> None:
        # The base class's __init__ is not called: it would set (and read back) fixed keys; every read here
        # goes through get_frozen_credentials.
        self.method = kind
        self.account_id = None
        self.kind = kind
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._current: Issued | None = None
        self._refresh_at = 0.0  # wall-clock time from which a refresh is tried (inf: never by itself)
        self._fetched_at: float | None = None
        self.refreshes = 0
        self.renewals_after_rejection = 0
        self.last_error: str | None = None

    # botocore reads these on some paths (e.g. a presigned URL); all go through the same refresh.
    @property
    def access_key(self) -> str:
        return str(self.get_frozen_credentials().access_key)

    @property
    def secret_key(self) -> str:
        return str(self.get_frozen_credentials().secret_key)

    @property
    def token(self) -> str | None:
        return self.get_frozen_credentials().token

    def get_frozen_credentials(self) -> botocore.credentials.ReadOnlyCredentials:
        current = self._current
        now = self._clock()
        if current is not None and now < self._refresh_at:
            return current.frozen
        if current is not None and (current.expires_at is None or now < current.expires_at - EXPIRY_MARGIN):
            # Time to refresh, but the credential still serves: one thread refreshes, the others go on.
            if self._lock.acquire(blocking=False):
                try:
                    if self._current is current:
                        self._refresh(fatal=False)
                finally:
                    self._lock.release()
            return self._usable().frozen
        with self._lock:
            if self._current is current:
                self._refresh(fatal=True)
        return self._usable().frozen

    def _usable(self) -> Issued:
        current = self._current
        assert current is not None  # set by the first refresh, which raises if it fails
        return current

    def in_use(self) -> str | None:
        """The access key requests are signed with now (None: none fetched yet). Never fetches."""
        current = self._current
        return None if current is None else str(current.frozen.access_key)

    def renew_after_rejection(self, rejected_key: str | None, why: str) -> None:
        """The server rejected `rejected_key` as expired: fetch anew unless another request already did
        (every part in flight meets the same rejection at once). Raises if the fetch fails."""
        with self._lock:
            current = self._current
            if current is not None and str(current.frozen.access_key) != rejected_key:
                return
            log.info("the store rejected the %s credential as expired (%s); fetching it again", self.kind, why)
            self.renewals_after_rejection += 1
            self._refresh(fatal=True)

    def _refresh(self, *, fatal: bool) -> None:
        """Fetch a new credential (the lock is held). `fatal`: raise if that fails; else keep the current
        one, which is still valid, and try again after a pause."""
        try:
            issued = self._fetch()
        except Exception as exc:  # any source's failure: botocore, STS, the token file, the endpoint
            self.last_error = f"{type(exc).__name__}: {exc}"
            if fatal:
                raise
            current = self._usable()
            left = (current.expires_at or self._clock()) - self._clock()
            self._refresh_at = self._clock() + min(RETRY_PAUSE, max(1.0, left / 10))
            log.warning("refreshing the %s credential failed (%s); the current one is valid for %.0f s more,"
                        " trying again in %.0f s", self.kind, exc, left, self._refresh_at - self._clock())
            return
        now = self._clock()
        first = self._current is None
        self._current = issued
        self._fetched_at = now
        self.last_error = None
        if issued.expires_at is None:
            self._refresh_at = float("inf")
        else:
            lifetime = max(0.0, issued.expires_at - now)
            self._refresh_at = issued.expires_at - min(REFRESH_BEFORE, lifetime / 2)
        if not first:
            self.refreshes += 1
        log.log(logging.INFO if first else logging.DEBUG, "S3 credential from %s (%s)%s", self.kind, issued.method,
                "" if issued.expires_at is None else f", expires in {issued.expires_at - now:.0f} s")

    def state(self) -> CredentialState:
        """What `ckptfs status` and the metrics say of this credential (never a secret)."""
        current = self._current
        method = current.method if current is not None else ""
        source = self.kind if self.kind != "chain" else (method or "chain")
        return CredentialState(source=source, detail=method, expires_at=None if current is None else current.expires_at,
                               fetched_at=self._fetched_at, refreshes=self.refreshes,
                               renewals_after_rejection=self.renewals_after_rejection, last_error=self.last_error)


class RenewingProvider(botocore.credentials.CredentialProvider):
    """The first provider of an S3Store's botocore session: hands out its RenewingCredentials, or None when
    botocore's chain would find none (so that `check` can say so)."""

    METHOD = "ckptfs-renewing"
    CANONICAL_NAME = "ckptfs-renewing"

    def __init__(self, credentials: RenewingCredentials, environ: dict[str, str], profile: str | None) -> None:
        super().__init__()
        self._credentials = credentials
        self._environ = environ
        self._profile = profile

    def load(self) -> RenewingCredentials | None:
        chain_has_none = (self._credentials.kind == "chain"
                          and botocore.session.Session(profile=self._profile).get_credentials() is None)
        if chain_has_none:
            return None
        return self._credentials


def renewing_session(region: str, profile: str | None = None,
                     environ: dict[str, str] | None = None) -> tuple[botocore.session.Session, RenewingCredentials]:
    """A botocore session whose clients sign with RenewingCredentials from this environment."""
    env = dict(os.environ if environ is None else environ)
    kind, fetch = source_of(env, region, profile)
    credentials = RenewingCredentials(kind, fetch)
    session = botocore.session.Session(profile=profile)
    resolver: Any = session.get_component("credential_provider")
    resolver.insert_before("env", RenewingProvider(credentials, env, profile))
    return session, credentials


__all__ = ["RenewingCredentials", "renewing_session"]
