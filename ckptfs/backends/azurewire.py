"""AzureWire: what every request of one AzureBlobStore goes through. Owned by AzureBlobStore (azure.py),
which makes it and calls only its public methods.

It owns the azure-storage-blob clients (made on first use, from the first credential of the chain that is
set; see azure.py) with their connection pool and the SDK's one retry, the container and the key prefix
(`full`), the translation of every SDK failure into the BackendError family (through azureerrors.py, here
and nowhere else in AzureBlobStore: a request the store builds is sent through `request` or `renewing`),
and the client made anew when Azure rejects a token as expired. It knows nothing of ckptfs's layout
(markers, notes, metadata): that is the store's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import requests
import requests.adapters
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobClient, BlobPrefix, BlobServiceClient, ContainerClient, ContentSettings

from ckptfs.backends.azureerrors import is_expired_credential, mapped
from ckptfs.backends.common import CONTENT_TYPE, SdkCredentialReport
from ckptfs.errors import AuthBackendError, NotFoundBackendError

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
MAX_BLOCK_SIZE = 4000 * MiB  # Put Block, service version 2019-12-12 and later
AZURE_RETRY_BACKOFF = 1  # seconds before the SDK's own retry, +- as much at random (ExponentialRetry)


def _parse_connection_string(text: str) -> dict[str, str]:
    pairs = (part.split("=", 1) for part in text.split(";") if "=" in part)
    return {k.strip().lower(): v.strip() for k, v in pairs}


class AzureWire:
    """The client side of one container and prefix: each call one request (and the SDK's one retry), its
    failure a BackendError."""

    def __init__(self, container: str, prefix: str, *, endpoint_url: str | None, connect_timeout: float,
                 read_timeout: float, pool_size: int) -> None:
        self.container = container
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"az://{container}/{clean}" if clean else f"az://{container}"
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.pool_size = pool_size
        self.credential_source = ""  # which of the credential chain is used (for messages; never the secret)
        self.credentials = SdkCredentialReport(lambda: self.credential_source)
        self._lock = threading.Lock()
        self._container_obj: ContainerClient | None = None

    def full(self, key: str) -> str:
        """The blob name of a store key (below the prefix)."""
        return self.prefix + key

    # -- the client, made on first use -----------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        session = requests.Session()
        # The default pool holds 10 connections; parallel blocks need more (and urllib3 warns otherwise).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool_size, max_retries=0)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return {
            "transport": RequestsTransport(session=session, session_owner=False,
                                           connection_timeout=self.connect_timeout, read_timeout=self.read_timeout),
            "retry_total": 1,  # ckptfs retries on its own (per part in transfer.py)
            # The SDK's one retry comes after 0-2 s, as botocore's and GCS's first do: its default is 15 s
            # (+-3), which stalled every part that met a busy answer or a dropped connection that long.
            "initial_backoff": AZURE_RETRY_BACKOFF,
            "random_jitter_range": AZURE_RETRY_BACKOFF,
            "max_single_get_size": MAX_BLOCK_SIZE,  # a ranged read is one GET
            "connection_timeout": self.connect_timeout,
            "read_timeout": self.read_timeout,
        }

    def _make_service(self) -> BlobServiceClient:
        kwargs = self._client_kwargs()
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        account = os.environ.get("AZURE_STORAGE_ACCOUNT")
        if conn:
            self.credential_source = "AZURE_STORAGE_CONNECTION_STRING"
            if not self.endpoint_url:
                return BlobServiceClient.from_connection_string(conn, **kwargs)
            parts = _parse_connection_string(conn)
            credential: Any = None
            if parts.get("accountkey"):
                credential = {"account_name": parts.get("accountname", ""), "account_key": parts["accountkey"]}
            elif parts.get("sharedaccesssignature"):
                credential = parts["sharedaccesssignature"]
            return BlobServiceClient(self.endpoint_url, credential=credential, **kwargs)
        if not account and not self.endpoint_url:
            raise AuthBackendError(f"no Azure storage account for {self.url}")
        account_url = self.endpoint_url or f"https://{account}.blob.core.windows.net"
        key = os.environ.get("AZURE_STORAGE_KEY")
        sas = os.environ.get("AZURE_STORAGE_SAS_TOKEN")
        if key:
            self.credential_source = "AZURE_STORAGE_KEY"
            return BlobServiceClient(account_url, credential={"account_name": account or "", "account_key": key},
                                     **kwargs)
        if sas:
            self.credential_source = "AZURE_STORAGE_SAS_TOKEN"
            return BlobServiceClient(account_url, credential=sas.lstrip("?"), **kwargs)
        try:
            from azure.identity import DefaultAzureCredential
        except ImportError:
            raise AuthBackendError(
                f"no Azure credentials for {self.url}: set AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN, or install"
                " azure-identity (pip install 'ckptfs[azure]') for managed identity / az login"
            ) from None
        self.credential_source = "DefaultAzureCredential"
        return BlobServiceClient(account_url, credential=DefaultAzureCredential(), **kwargs)

    def _container(self) -> ContainerClient:
        with self._lock:
            if self._container_obj is None:
                with mapped(f"connect to {self.url}"):
                    self._container_obj = self._make_service().get_container_client(self.container)
            return self._container_obj

    def blob(self, name: str) -> BlobClient:
        """A client of the blob `name` (a full name); making it sends nothing (but the first makes the
        service client, which may fail: call it inside `request`)."""
        return self._container().get_blob_client(name)

    # -- requests ------------------------------------------------------------------------------------------

    def request(self, what: str, send: Callable[[], T]) -> T:
        """`send()`, requests built on this wire's clients, its failure a BackendError."""
        with mapped(what):
            return send()

    def renewing(self, what: str, send: Callable[[], T]) -> T:
        """`send()`, its failure a BackendError; if Azure answers that the token expired (the credential's
        cache believed it valid: a skewed clock, a token revoked), once more with a client made anew, whose
        new DefaultAzureCredential fetches a new token (the SDK's bearer policy would keep sending the old
        one until 5 minutes before the expiry it was told). Every part and the commit go on; the drain never
        sees it. Many requests that meet it at once make one new client."""
        failed_on = self._container_obj
        try:
            with mapped(what):
                return send()
        except AuthBackendError as exc:
            if not is_expired_credential(exc):
                raise
            with self._lock:
                if self._container_obj is failed_on:
                    log.info("Azure rejected the %s token as expired (%s); making the client anew",
                             self.credential_source, exc)
                    self._container_obj = None
                    self.credentials.renewals_after_rejection += 1
        with mapped(what):
            return send()

    def probe(self) -> None:
        """One listing of at most one blob below the prefix (the store's check)."""
        container = self._container()
        with mapped(f"list {self.url}"):
            pages = container.list_blobs(name_starts_with=self.prefix, results_per_page=1).by_page()
            next(pages, None)

    def upload_blob(self, name: str, data: bytes, metadata: dict[str, str] | None, what: str,
                    overwrite: bool = True, **kwargs: Any) -> dict[str, Any]:
        """One Put Blob of `data` with its MD5 for the service to check (and the token renewal)."""
        result: dict[str, Any] = self.renewing(what, lambda: self.blob(name).upload_blob(
            data, length=len(data), overwrite=overwrite, metadata=metadata, validate_content=True,
            content_settings=ContentSettings(content_type=CONTENT_TYPE), **kwargs))
        return result

    def delete_name(self, name: str, what: str) -> None:
        """Delete the blob `name` (a full name); one that is not there is fine."""
        try:
            with mapped(what):
                self.blob(name).delete_blob()
        except NotFoundBackendError:
            pass

    # -- listings --------------------------------------------------------------------------------------------

    def list_names(self, full_prefix: str) -> list[str]:
        """The names of every blob below `full_prefix`."""
        with mapped(f"list {self.url}"):
            return [b.name for b in self._container().list_blobs(name_starts_with=full_prefix)]

    def iter_blobs(self, what: str, full_prefix: str, *, metadata: bool = False) -> Iterator[Any]:
        """The blobs below `full_prefix` (their properties; with their metadata if `metadata`) as the pages
        come."""
        with mapped(what):
            yield from self._container().list_blobs(name_starts_with=full_prefix,
                                                    include=["metadata"] if metadata else None)

    def list_level(self, what: str, full_prefix: str) -> tuple[list[Any], list[str]]:
        """One level below `full_prefix` ('/' the delimiter): its blobs with their metadata, and the names of
        its prefixes, in the order listed."""
        blobs: list[Any] = []
        prefixes: list[str] = []
        with mapped(what):
            for item in self._container().walk_blobs(name_starts_with=full_prefix, include=["metadata"],
                                                     delimiter="/"):
                if isinstance(item, BlobPrefix):
                    prefixes.append(item.name)
                else:
                    blobs.append(item)
        return blobs, prefixes
