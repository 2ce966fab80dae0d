"""Store URLs -> ObjectStore instances, and the mount's patient check that the store is there. The only
place that decides which backend serves a URL; cloud SDKs are imported inside the backend modules, never
here, so a missing extra fails only when used."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from ckptfs.backends.base import ObjectStore, backoff_delays
from ckptfs.errors import CkptfsError, StoreCheckError, UsageError

log = logging.getLogger(__name__)

SCHEMES = ("file", "s3", "gs", "az")
CHECK_ATTEMPTS = 5
# A store that answers "busy" (throttling, 5xx) when the mount starts is waited for this long: it is there
# and will serve, unlike a wrong URL, endpoint or credentials, which fail after the usual attempts.
CHECK_BUSY_SECONDS = 60.0


def check_store(store: ObjectStore, *, attempts: int = CHECK_ATTEMPTS,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """The mount's check that the store is there and usable: store.check() (one attempt), tried again with
    backoff while a failure may pass (`attempts` in a row), and more rounds of that while the store answers
    that it is busy, for up to CHECK_BUSY_SECONDS. Raises the last StoreCheckError (a CkptfsError naming the
    problem and the fix)."""
    busy_until = time.monotonic() + CHECK_BUSY_SECONDS
    while True:
        delays = backoff_delays()
        for attempt in range(attempts):
            try:
                store.check()
                return
            except StoreCheckError as exc:
                if not exc.transient:
                    raise
                if attempt < attempts - 1:
                    sleep(next(delays))
                elif not exc.busy or time.monotonic() >= busy_until:
                    raise
                else:
                    log.warning("%s is busy (%s); trying again for up to %.0f s", store.url, exc, CHECK_BUSY_SECONDS)


def open_store(url: str, *, endpoint_url: str | None = None) -> ObjectStore:
    """The store for `url`."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise UsageError(
            f"unsupported store URL {url!r}: use file:///DIR, s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX]"
            " or az://CONTAINER[/PREFIX]"
        )
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"store URL {url!r}: a file URL needs an absolute path, like file:///srv/bucket")
        if not parts.path.startswith("/"):
            raise UsageError(f"store URL {url!r}: use an absolute path, like file:///srv/bucket")
        from ckptfs.backends.local import LocalStore

        return LocalStore(Path(parts.path).resolve())
    if parts.scheme == "s3":
        return _open_s3(url, parts.netloc, parts.path, endpoint_url)
    if parts.scheme == "gs":
        return _open_gcs(url, parts.netloc, parts.path, endpoint_url)
    return _open_azure(url, parts.netloc, parts.path, endpoint_url)


def _open_s3(url: str, bucket: str, path: str, endpoint_url: str | None) -> ObjectStore:
    if not bucket:
        raise UsageError(f"store URL {url!r}: name the bucket, like s3://my-bucket/run-42")
    if "@" in bucket or ":" in bucket:
        raise UsageError(f"store URL {_shown(url, bucket)!r}: credentials and ports do not belong in the URL;"
                         " use the AWS credential chain and --endpoint-url")
    try:
        from ckptfs.backends.s3 import S3Store
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in ("boto3", "botocore", "urllib3", "s3transfer"):
            raise
        raise CkptfsError(
            "the s3:// backend needs boto3, which is not installed: install ckptfs[s3]"
            " (pip install 'ckptfs[s3]')"
        ) from None
    return S3Store(bucket, path.strip("/"), endpoint_url=endpoint_url)


def _shown(url: str, netloc: str) -> str:
    """The URL as an error message may show it: a user part (which may hold a secret) replaced."""
    return url.replace(netloc, "<credentials>@" + netloc.rsplit("@", 1)[-1]) if "@" in netloc else url


def _reject_credentials(url: str, netloc: str, what: str, chain: str) -> None:
    if "@" in netloc or ":" in netloc:
        raise UsageError(f"store URL {_shown(url, netloc)!r}: credentials and ports do not belong in the URL;"
                         f" use {chain} and --endpoint-url")
    if not netloc:
        raise UsageError(f"store URL {url!r}: name the {what}, like {url.split(':', 1)[0]}://my-{what}/run-42")


def _sdk_missing(exc: ImportError, packages: tuple[str, ...], scheme: str, extra: str, sdk: str) -> CkptfsError:
    if (exc.name or "").split(".")[0] not in packages:
        raise exc
    return CkptfsError(f"the {scheme}:// backend needs {sdk}, which is not installed: install ckptfs[{extra}]"
                       f" (pip install 'ckptfs[{extra}]')")


def _open_gcs(url: str, bucket: str, path: str, endpoint_url: str | None) -> ObjectStore:
    _reject_credentials(url, bucket, "bucket", "Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS)")
    try:
        from ckptfs.backends.gcs import GcsStore
    except ImportError as exc:
        raise _sdk_missing(exc, ("google", "google_crc32c", "requests"), "gs", "gcs", "google-cloud-storage") from None
    return GcsStore(bucket, path.strip("/"), endpoint_url=endpoint_url)


def _open_azure(url: str, container: str, path: str, endpoint_url: str | None) -> ObjectStore:
    _reject_credentials(url, container, "container",
                        "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT with a key, SAS or identity")
    try:
        from ckptfs.backends.azure import AzureBlobStore
    except ImportError as exc:
        raise _sdk_missing(exc, ("azure", "requests"), "az", "azure", "azure-storage-blob") from None
    return AzureBlobStore(container, path.strip("/"), endpoint_url=endpoint_url)
