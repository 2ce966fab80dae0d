"""What S3's answers mean, for S3Store (s3.py): the one table from S3 error codes to the BackendError kinds
(ERROR_CODES; codes not listed fall back on the HTTP status), the translation of every boto3, botocore and
urllib3 failure (applied in one place, S3Wire in s3wire.py), what an error says of whether the request may
have been carried out (for s3markers.py), and what the mount's check tells the user of one.
"""

from __future__ import annotations

import http.client

import botocore.exceptions
import urllib3.exceptions

from ckptfs.backends.base import BUSY_STATUSES
from ckptfs.backends.common import ErrorMap
from ckptfs.errors import (
    AuthBackendError,
    BackendError,
    NotFoundBackendError,
    PermanentBackendError,
    TransientBackendError,
    UploadGoneError,
)

# The one table from S3 error codes to our classes. Codes not listed fall back on the HTTP status.
ERROR_CODES: dict[str, type[BackendError]] = {
    # worth retrying: the server is busy or broken, the connection or the request timed out, data was
    # damaged on the way, the object changed between two requests of one transfer
    **dict.fromkeys(
        ["InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "ThrottlingException",
         "RequestThrottled", "TooManyRequests", "RequestLimitExceeded", "RequestTimeout", "RequestTimeoutException",
         "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody", "PreconditionFailed", "OperationAborted",
         "500", "502", "503", "504"],
        TransientBackendError,
    ),
    # the credentials: missing, wrong, expired or not allowed
    **dict.fromkeys(
        ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
         "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "403", "401"],
        AuthBackendError,
    ),
    # an operator must act: no bucket, wrong region, a request S3 will never accept
    **dict.fromkeys(
        ["NoSuchBucket", "InvalidBucketName", "PermanentRedirect", "AuthorizationHeaderMalformed",
         "RequestTimeTooSkewed", "InvalidArgument", "InvalidRequest", "InvalidDigest", "EntityTooLarge",
         "EntityTooSmall", "MetadataTooLarge", "KeyTooLongError", "MethodNotAllowed", "NotImplemented",
         "InvalidStorageClass", "InvalidObjectState", "InvalidPart", "InvalidPartOrder", "MalformedXML"],
        PermanentBackendError,
    ),
    **dict.fromkeys(["NoSuchKey", "NotFound", "NoSuchVersion", "404"], NotFoundBackendError),
    "NoSuchUpload": UploadGoneError,  # a staged upload aborted, completed, or expired
}


def _client_error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def translate_error(exc: BaseException, what: str) -> BackendError:
    """The BackendError that a boto3/botocore/urllib3/socket failure of `what` stands for."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = _client_error_code(exc)
        message = str(exc.response.get("Error", {}).get("Message", "") or "")
        text = f"{what}: {code or status}" + (f" ({message})" if message else "")
        cls = ERROR_CODES.get(code)
        if cls is None:
            if status >= 500 or status in (408, 409, 429):
                cls = TransientBackendError
            elif status == 404:
                cls = NotFoundBackendError
            elif status in (401, 403):
                cls = AuthBackendError
            else:
                cls = PermanentBackendError
        return cls(text)
    if isinstance(exc, (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError,
                        botocore.exceptions.CredentialRetrievalError, botocore.exceptions.NoAuthTokenError)):
        return AuthBackendError(f"{what}: {exc}")
    if isinstance(exc, (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError,
                        botocore.exceptions.IncompleteReadError, botocore.exceptions.ResponseStreamingError,
                        botocore.exceptions.ChecksumError, botocore.exceptions.FlexibleChecksumError,
                        urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)):
        # (http.client's: a body read straight from the response, s3wire.py, that ended early)
        return TransientBackendError(f"{what}: {exc}")
    if isinstance(exc, botocore.exceptions.BotoCoreError):  # configuration and parameter problems
        return PermanentBackendError(f"{what}: {exc}")
    return PermanentBackendError(f"{what}: unexpected {type(exc).__name__}: {exc}")


_SDK_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, urllib3.exceptions.HTTPError,
               http.client.HTTPException, OSError)
mapped = ErrorMap(_SDK_ERRORS, translate_error)


def is_busy(exc: BaseException) -> bool:
    """Did the server answer that it is busy (throttling or a passing server error)?"""
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    if not isinstance(cause, botocore.exceptions.ClientError):
        return False
    code, status = _client_error_code(cause)
    return status in BUSY_STATUSES or code in ("SlowDown", "Throttling")


# What S3 and STS answer for a session credential past its expiry (S3: ExpiredToken, 400; some
# S3-compatible servers and STS-fronted APIs: ExpiredTokenException, TokenRefreshRequired).
EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired"})


def is_expired_credential(exc: BaseException) -> bool:
    """Did the server reject the request because its credential has expired? Either one of EXPIRED_CODES,
    or a 400/401/403 whose message says the token or credential expired (servers that answer a bare
    AccessDenied for an expired session say so in the message)."""
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    if not isinstance(cause, botocore.exceptions.ClientError):
        return False
    code, status = _client_error_code(cause)
    if code in EXPIRED_CODES:
        return True
    message = str(cause.response.get("Error", {}).get("Message", "") or "").lower()
    return status in (400, 401, 403) and "expired" in message and ("token" in message or "credential" in message)


def was_answered(exc: BackendError) -> bool:
    """Did the server answer the request (an error), with no earlier try of it sent by the SDK? Then it
    did nothing; else (no answer, or a retry) it may have acted."""
    cause = exc.__cause__
    if not isinstance(cause, botocore.exceptions.ClientError):
        return False
    return not (cause.response or {}).get("ResponseMetadata", {}).get("RetryAttempts", 0)


def is_code(exc: BaseException, *codes: str) -> bool:
    cause = exc.__cause__ if isinstance(exc, BackendError) else exc
    return isinstance(cause, botocore.exceptions.ClientError) and _client_error_code(cause)[0] in codes


def check_message(exc: BackendError, *, url: str, bucket: str, region: str, endpoint_url: str | None) -> str:
    """What the mount's check says of a failure: the problem and the fix."""
    where = f" at {endpoint_url}" if endpoint_url else ""
    cause = exc.__cause__
    code = _client_error_code(cause)[0] if isinstance(cause, botocore.exceptions.ClientError) else ""
    if code == "NoSuchBucket":
        return (f"bucket {bucket!r} does not exist{where}; create it (aws s3 mb s3://{bucket})"
                " or fix the URL")
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
        return f"bucket {bucket!r} is in another region than {region}; set AWS_REGION to its region"
    if isinstance(cause, botocore.exceptions.CredentialRetrievalError):
        return (f"cannot get AWS credentials for {url}: {cause}; check AWS_WEB_IDENTITY_TOKEN_FILE and"
                " AWS_ROLE_ARN (IRSA), AWS_CONTAINER_CREDENTIALS_FULL_URI and its token file (EKS Pod Identity),"
                " or the profile's role, and that STS (AWS_ENDPOINT_URL_STS) is reachable")
    if isinstance(cause, botocore.exceptions.NoCredentialsError):
        return (f"no AWS credentials found for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY,"
                " or AWS_PROFILE, or run with an instance/pod role")
    if isinstance(exc, AuthBackendError):
        reason = {"InvalidAccessKeyId": "the access key is unknown to the server",
                  "SignatureDoesNotMatch": "the secret key is wrong",
                  "ExpiredToken": "the session token has expired"}.get(code, "access denied")
        return (f"cannot use {url}{where}: {reason} ({code or 'HTTP 403'}); check the credentials"
                " (AWS_PROFILE, AWS_ACCESS_KEY_ID, role) and that they may list, read and write this prefix")
    if isinstance(cause, (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError,
                          botocore.exceptions.ConnectionError, urllib3.exceptions.HTTPError, OSError)):
        endpoint = endpoint_url or f"the S3 endpoint of region {region}"
        return (f"cannot reach {endpoint} for {url}: check --endpoint-url / AWS_ENDPOINT_URL and"
                " the network")
    return f"cannot use {url}{where}: {exc}"
