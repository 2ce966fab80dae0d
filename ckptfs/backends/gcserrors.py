"""What Google Cloud Storage's answers mean, for GcsStore (gcs.py): the one table from HTTP status to the
BackendError kinds (STATUS_ERRORS), the translation of every google-cloud-storage, google-auth and requests
failure (applied in one place, GcsWire in gcswire.py), and what the mount's check tells the user of one.
"""

from __future__ import annotations

import google.api_core.exceptions as gexc
import google.auth.exceptions
import requests
import urllib3.exceptions
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from ckptfs.backends.common import ErrorMap
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
)

# The one table from HTTP status to our classes; statuses not listed: >= 500 transient, else permanent.
STATUS_ERRORS: dict[int, type[BackendError]] = {
    400: PermanentBackendError,  # a request GCS will never accept (bad name, bad argument)
    401: AuthBackendError,  # missing or expired credentials
    403: AuthBackendError,  # not allowed (IAM), or billing/project problems
    404: NotFoundBackendError,  # no such object (or bucket: check() tells them apart)
    408: TransientBackendError,  # request timeout
    409: TransientBackendError,  # a concurrent change of the same object
    410: TransientBackendError,  # a resumable session expired: start the call again
    411: PermanentBackendError,
    412: TransientBackendError,  # a precondition (generation) failed: the object changed; re-read and retry
    413: PermanentBackendError,
    416: PermanentBackendError,  # a range outside the object
    429: TransientBackendError,  # rate limited
    500: TransientBackendError,
    502: TransientBackendError,
    503: TransientBackendError,
    504: TransientBackendError,
}


def _status_class(status: int) -> type[BackendError]:
    cls = STATUS_ERRORS.get(status)
    if cls is not None:
        return cls
    return TransientBackendError if status >= 500 else PermanentBackendError


def status_of(exc: BaseException) -> int:
    """The HTTP status of an SDK failure, 0 if it has none (transport, credentials)."""
    if isinstance(exc, BackendError):
        exc = exc.__cause__ or exc
    if isinstance(exc, gexc.GoogleAPICallError):
        return int(exc.code or 0)
    if isinstance(exc, InvalidResponse):
        return int(getattr(exc.response, "status_code", 0) or 0)
    return 0


def translate_error(exc: BaseException, what: str) -> BackendError:
    """The BackendError that a google-cloud-storage / google-auth / requests failure of `what` stands for."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, (gexc.GoogleAPICallError, InvalidResponse)):
        status = status_of(exc)
        message = getattr(exc, "message", None) or str(exc)
        return _status_class(status)(f"{what}: HTTP {status} ({message})")
    if isinstance(exc, gexc.RetryError):  # the SDK's own retries ran out: the last cause decides
        cause = exc.cause
        return translate_error(cause, what) if cause is not None else TransientBackendError(f"{what}: {exc}")
    if isinstance(exc, google.auth.exceptions.RefreshError):
        # A refresh failing on the network (metadata server busy) is worth retrying; a rejected one is not.
        if getattr(exc, "retryable", False):
            return TransientBackendError(f"{what}: refreshing credentials: {exc}")
        return AuthBackendError(f"{what}: refreshing credentials: {exc}")
    if isinstance(exc, google.auth.exceptions.DefaultCredentialsError):
        return AuthBackendError(f"{what}: {exc}")
    if isinstance(exc, (google.auth.exceptions.TransportError, DataCorruption, requests.exceptions.RequestException,
                        urllib3.exceptions.HTTPError, gexc.ServerError, OSError)):
        return TransientBackendError(f"{what}: {type(exc).__name__}: {exc}")
    return PermanentBackendError(f"{what}: unexpected {type(exc).__name__}: {exc}")


_SDK_ERRORS = (gexc.GoogleAPIError, InvalidResponse, DataCorruption, google.auth.exceptions.GoogleAuthError,
               requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError)


mapped = ErrorMap(_SDK_ERRORS, translate_error)


def check_message(exc: BackendError, *, url: str, bucket: str, endpoint_url: str | None) -> str:
    """What the mount's check says of a failure: the problem and the fix."""
    where = f" at {endpoint_url}" if endpoint_url else ""
    cause = exc.__cause__
    status = status_of(exc)
    if isinstance(cause, google.auth.exceptions.DefaultCredentialsError):
        return (f"no Google credentials found for {url}: set GOOGLE_APPLICATION_CREDENTIALS to a service"
                " account key file, run `gcloud auth application-default login`, or run on GCE/GKE with a"
                " service account (workload identity)")
    if isinstance(cause, google.auth.exceptions.RefreshError):
        return (f"the Google credentials for {url} were rejected ({cause}); renew them"
                " (gcloud auth application-default login) or fix GOOGLE_APPLICATION_CREDENTIALS")
    if status == 404:
        return (f"bucket {bucket!r} does not exist{where}; create it"
                f" (gcloud storage buckets create gs://{bucket}) or fix the URL")
    if status == 401:
        return (f"cannot use {url}{where}: the credentials were rejected (HTTP 401); check"
                " GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`")
    if status == 403:
        return (f"cannot use {url}{where}: access denied (HTTP 403); grant the account"
                " roles/storage.objectAdmin (or objectUser) on the bucket")
    if status == 0 and isinstance(exc, TransientBackendError):
        endpoint = endpoint_url or "storage.googleapis.com"
        return (f"cannot reach {endpoint} for {url}: check --endpoint-url / STORAGE_EMULATOR_HOST and"
                " the network")
    return f"cannot use {url}{where}: {exc}"
