"""What Azure Blob Storage's answers mean, for AzureBlobStore (azure.py): the one table from error codes
(x-ms-error-code) to the BackendError kinds (ERROR_CODES; codes not listed fall back on the HTTP status), the
translation of every azure-core, azure-storage-blob and azure-identity failure (never quoting a SAS or a
key; applied in one place, AzureWire in azurewire.py), and what the mount's check tells the user of one.
"""

from __future__ import annotations

import re

import requests
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)

from ckptfs.backends.common import ErrorMap
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
)

# The one table from Azure error codes (x-ms-error-code) to our classes; codes not listed fall back on the
# HTTP status (404 not found, 401/403 auth, 408/409/429/5xx transient, else permanent).
ERROR_CODES: dict[str, type[BackendError]] = {
    # worth retrying: the service is busy or broken, a condition failed because the blob changed, the data
    # was damaged on the way, a copy or lease is in progress
    **dict.fromkeys(
        ["InternalError", "ServerBusy", "OperationTimedOut", "ConditionNotMet", "Md5Mismatch", "Crc64Mismatch",
         "PendingCopyOperation", "LeaseIdMissing", "LeaseAlreadyPresent", "BlobBeingRehydrated",
         "TargetConditionNotMet", "SourceConditionNotMet", "IncrementalCopyBlobMismatch"],
        TransientBackendError,
    ),
    # the credentials: missing, wrong, expired or not allowed
    **dict.fromkeys(
        ["AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
         "AuthorizationProtocolMismatch", "AuthorizationSourceIPMismatch", "AuthorizationServiceMismatch",
         "AuthorizationResourceTypeMismatch", "InsufficientAccountPermissions", "InvalidAuthenticationInfo",
         "NoAuthenticationInformation", "KeyBasedAuthenticationNotPermitted", "CannotVerifyCopySource"],
        AuthBackendError,
    ),
    # an operator must act: no container, a disabled account, a request Azure will never accept
    **dict.fromkeys(
        ["ContainerNotFound", "ContainerBeingDeleted", "ContainerDisabled", "AccountIsDisabled",
         "InvalidResourceName", "InvalidBlobOrBlock", "InvalidBlockId", "InvalidBlockList", "RequestBodyTooLarge",
         "InvalidHeaderValue", "InvalidInput", "InvalidQueryParameterValue", "OutOfRangeInput", "InvalidRange",
         "UnsupportedHeader", "BlobArchived", "InvalidMetadata", "MetadataTooLarge", "FeatureVersionMismatch",
         "InvalidBlobType"],
        PermanentBackendError,
    ),
    **dict.fromkeys(["BlobNotFound", "ResourceNotFound"], NotFoundBackendError),
}


def error_code_of(exc: BaseException) -> tuple[str, int]:
    """(x-ms-error-code, HTTP status) of an SDK failure; ('', 0) for one without a response."""
    if isinstance(exc, BackendError):
        exc = exc.__cause__ or exc
    if not isinstance(exc, HttpResponseError):
        return "", 0
    status = int(exc.status_code or 0)
    headers = getattr(exc.response, "headers", None) if exc.response is not None else None
    code = str(headers.get("x-ms-error-code", "") or "") if headers is not None else ""
    if not code:
        value = getattr(exc, "error_code", None) or ""
        code = str(getattr(value, "value", value))  # the SDK's StorageErrorCode enum, or a plain string
    return code, status


def is_expired_credential(exc: BaseException) -> bool:
    """Did Azure reject the request because its token (or SAS) has expired? AuthenticationFailed or
    InvalidAuthenticationInfo (401/403) whose answer says so (Entra tokens: "Lifetime validation failed. The
    token is expired."; Azure tells it in AuthenticationErrorDetail)."""
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    if not isinstance(cause, HttpResponseError):
        return False
    code, status = error_code_of(cause)
    if status not in (401, 403) or code not in ("AuthenticationFailed", "InvalidAuthenticationInfo"):
        return False
    text = str(cause)
    if cause.response is not None:
        try:
            text += cause.response.text()
        except Exception:  # a streamed body already read, or not text: the message is all there is
            pass
    return "expired" in text.lower()


def _status_class(status: int) -> type[BackendError]:
    if status == 404:
        return NotFoundBackendError
    if status in (401, 403):
        return AuthBackendError
    if status >= 500 or status in (408, 409, 412, 429):
        return TransientBackendError
    return PermanentBackendError


_SAS_SIGNATURE = re.compile(r"(?i)\b(sig|AccountKey|SharedAccessSignature)=[^&;\s'\")]+")


def redact(text: str) -> str:
    """`text` without SAS signatures or account keys (transport errors quote the request URL, which
    carries the SAS when one is used)."""
    return _SAS_SIGNATURE.sub(lambda m: f"{m.group(1)}=REDACTED", text)


def translate_error(exc: BaseException, what: str) -> BackendError:
    """The BackendError that an azure-core / azure-storage-blob / azure-identity failure of `what` stands for."""
    translated = _translate(exc, what)
    if translated is not exc:
        translated.args = tuple(redact(str(a)) for a in translated.args)
    return translated


def _translate(exc: BaseException, what: str) -> BackendError:
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, HttpResponseError) and exc.status_code:
        code, status = error_code_of(exc)
        cls = ERROR_CODES.get(code) or _status_class(status)
        return cls(f"{what}: {code or 'HTTP'} {status}")
    if isinstance(exc, ClientAuthenticationError):  # azure-identity found no credential, or it was refused
        return AuthBackendError(f"{what}: {exc.message if hasattr(exc, 'message') else exc}")
    if isinstance(exc, (ServiceRequestError, ServiceResponseError, HttpResponseError,
                        requests.exceptions.RequestException, OSError)):
        return TransientBackendError(f"{what}: {type(exc).__name__}: {exc}")
    return PermanentBackendError(f"{what}: unexpected {type(exc).__name__}: {exc}")


_SDK_ERRORS = (AzureError, requests.exceptions.RequestException, OSError, ValueError)


mapped = ErrorMap(_SDK_ERRORS, translate_error)


def check_message(exc: BackendError, *, url: str, container: str, endpoint_url: str | None,
                  credential_source: str) -> str:
    """What the mount's check says of a failure: the problem and the fix."""
    where = f" at {endpoint_url}" if endpoint_url else ""
    cause = exc.__cause__
    code, status = error_code_of(exc)
    if cause is None and isinstance(exc, AuthBackendError):  # no account to talk to
        return (f"no Azure storage account for {url}: set AZURE_STORAGE_CONNECTION_STRING, or"
                " AZURE_STORAGE_ACCOUNT (with AZURE_STORAGE_KEY, AZURE_STORAGE_SAS_TOKEN or an identity)")
    if code == "ContainerNotFound" or (status == 404 and not code):
        return (f"container {container!r} does not exist{where}; create it"
                f" (az storage container create --name {container}) or fix the URL")
    if isinstance(cause, ClientAuthenticationError) and not status:
        return (f"no Azure credentials found for {url}: set AZURE_STORAGE_CONNECTION_STRING, or"
                " AZURE_STORAGE_ACCOUNT with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or use a managed /"
                " workload identity or `az login` (DefaultAzureCredential)")
    if code in ("AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"):
        return (f"cannot use {url}{where}: the credentials were rejected ({code}); check"
                f" {credential_source or 'the credentials'} (account key, SAS token expiry, identity)")
    if isinstance(exc, AuthBackendError):
        return (f"cannot use {url}{where}: access denied ({code or f'HTTP {status}'}) for the"
                f" credentials from {credential_source or 'the environment'}; check the key or SAS (Azurite"
                " answers a wrong key this way) and grant the identity 'Storage Blob Data Contributor' on the"
                " container, or use a SAS with read, add, create, write, delete and list")
    if not status and isinstance(exc, TransientBackendError):
        endpoint = endpoint_url or "the blob endpoint"
        return (f"cannot reach {endpoint} for {url}: check --endpoint-url / the connection string and the"
                " network")
    return f"cannot use {url}{where}: {exc}"
