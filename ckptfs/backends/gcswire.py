"""GcsWire: what every request of one GcsStore goes through. Owned by GcsStore (gcs.py), which makes it and
shares it with its ComposedUploads (gcsuploads.py); both call only its public methods.

It owns the google-cloud-storage client (made on first use: Application Default Credentials may ask the
metadata server) with its connection pool, the bucket and the key prefix (`full`), the CRC32C check of
every upload, the listings' retry, and the translation of every SDK failure into the BackendError family
(through gcserrors.py, here and nowhere else in GcsStore: a request the store or its uploads build is
sent through `request`). It knows nothing of ckptfs's layout (parts, notes, metadata): that is the store's.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

import google.auth
import google_crc32c
import requests.adapters
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from ckptfs.backends.common import CONTENT_TYPE, SdkCredentialReport
from ckptfs.backends.gcserrors import mapped
from ckptfs.errors import NotFoundBackendError, TransientBackendError

T = TypeVar("T")

SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
# Listings ride out throttling with the SDK's own retry; the transfer primitives make one attempt.
LIST_RETRY: Retry = DEFAULT_RETRY.with_timeout(60.0)


def _crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.Checksum(data).digest()).decode()


class GcsWire:
    """The client side of one bucket and prefix: each call one request (listings: the SDK's retry), its
    failure a BackendError."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None, connect_timeout: float,
                 read_timeout: float, pool_size: int) -> None:
        self.bucket_name = bucket
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"gs://{bucket}/{clean}" if clean else f"gs://{bucket}"
        self.endpoint_url = endpoint_url or None
        self.emulator = os.environ.get("STORAGE_EMULATOR_HOST") or None
        self.timeout = (connect_timeout, read_timeout)
        self.pool_size = pool_size
        self.credentials = SdkCredentialReport(self._credential_source)
        self._lock = threading.Lock()
        self._client_obj: storage.Client | None = None
        self._bucket_obj: storage.Bucket | None = None

    def endpoint(self) -> str | None:
        return self.endpoint_url or self.emulator

    def full(self, key: str) -> str:
        """The object name of a store key (below the prefix)."""
        return self.prefix + key

    # -- the client, made on first use (ADC may ask the metadata server) -----------------------------------

    def _make_client(self) -> storage.Client:
        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT") or None
        options: dict[str, Any] = {}
        credentials: Any = None
        if self.endpoint_url:
            options["api_endpoint"] = self.endpoint_url.rstrip("/")
            if urlsplit(self.endpoint_url).scheme == "http":  # plain http: an emulator, which takes no token
                credentials = AnonymousCredentials()
        if credentials is None and not (self.emulator and not self.endpoint_url):
            credentials, found = google.auth.default(scopes=list(SCOPES))
            project = project or found
        if credentials is not None and project is None:
            project = "<none>"  # object operations need no project
        client = storage.Client(project=project, credentials=credentials,
                                client_options=options or None)
        self.credentials.sdk_credentials = client._credentials
        # The default pool holds 10 connections; parallel parts need more (and urllib3 warns otherwise).
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=self.pool_size, max_retries=0)
        client._http.mount("https://", adapter)
        client._http.mount("http://", adapter)
        return client

    def _credential_source(self) -> str:
        """"adc:<kind>" (service_account, identity_pool: workload identity federation, compute_engine: the
        metadata server, credentials: an authorized_user ADC file, ...), or "anonymous" (an emulator)."""
        credentials = self.credentials.sdk_credentials
        if credentials is None:
            return ""
        if isinstance(credentials, AnonymousCredentials):
            return "anonymous"
        return "adc:" + type(credentials).__module__.rsplit(".", 1)[-1]

    def _bucket(self) -> storage.Bucket:
        with self._lock:
            if self._bucket_obj is None:
                with mapped(f"connect to {self.url}"):
                    self._client_obj = self._make_client()
                    self._bucket_obj = self._client_obj.bucket(self.bucket_name)
            return self._bucket_obj

    def _client(self) -> storage.Client:
        self._bucket()
        assert self._client_obj is not None
        return self._client_obj

    # -- blobs: handles, no request ------------------------------------------------------------------------

    def blob(self, name: str, generation: int | None = None) -> storage.Blob:
        """A handle on the object `name` (a full name), pinned to `generation` if given."""
        return self._bucket().blob(name, generation=generation)

    def new_blob(self, name: str, metadata: dict[str, str] | None = None) -> storage.Blob:
        """A handle on an object about to be written, with ckptfs's content type and `metadata`."""
        blob = self._bucket().blob(name)
        blob.content_type = CONTENT_TYPE
        if metadata:
            blob.metadata = metadata
        return blob

    # -- requests ------------------------------------------------------------------------------------------

    def request(self, what: str, send: Callable[[], T]) -> T:
        """`send()`, a request built on a handle of this wire, its failure a BackendError."""
        with mapped(what):
            return send()

    def probe(self) -> None:
        """One listing of at most one object below the prefix, one attempt (the store's check)."""
        bucket = self._bucket()
        with mapped(f"list {self.url}"):
            iterator = self._client().list_blobs(bucket, prefix=self.prefix, max_results=1, retry=None,
                                                 timeout=self.timeout)
            next(iter(iterator), None)

    def upload_bytes(self, blob: storage.Blob, data: bytes, what: str, **kwargs: Any) -> None:
        """One upload of `data` to `blob`, its CRC32C checked by the server and again in its answer."""
        # The CRC32C goes into the object resource of the request: GCS rejects bytes that do not match it.
        expected = _crc32c_b64(data)
        blob.crc32c = expected
        with mapped(what):
            blob.upload_from_string(data, content_type=CONTENT_TYPE, retry=None, timeout=self.timeout, **kwargs)
        # And the CRC32C the server computed, in its answer, must be ours (what an emulator that does not
        # verify the request's CRC32C still lets us check).
        if blob.crc32c and blob.crc32c != expected:
            raise TransientBackendError(f"{what}: the server stored CRC32C {blob.crc32c}, the data has {expected}"
                                        " (damaged on the way)")

    def get_blob(self, name: str, what: str, **kwargs: Any) -> storage.Blob | None:
        """The object `name` (a full name) with its metadata, or None if there is none."""
        with mapped(what):
            blob: storage.Blob | None = self._bucket().get_blob(name, retry=None, timeout=self.timeout, **kwargs)
        return blob

    def download(self, blob: storage.Blob, what: str, **kwargs: Any) -> bytes:
        """The bytes of `blob` (or a range of them: `start`, `end`), one attempt."""
        with mapped(what):
            data: bytes = blob.download_as_bytes(retry=None, timeout=self.timeout, **kwargs)
        return data

    def delete_name(self, name: str, what: str) -> None:
        """Delete the object `name` (a full name); one that is not there is fine."""
        try:
            with mapped(what):
                self._bucket().blob(name).delete(retry=None, timeout=self.timeout)
        except NotFoundBackendError:
            pass

    # -- listings --------------------------------------------------------------------------------------------

    def list_names(self, full_prefix: str, **kwargs: Any) -> list[storage.Blob]:
        """Every object below `full_prefix`, with the listings' retry."""
        with mapped(f"list {self.url}"):
            return list(self._client().list_blobs(self._bucket(), prefix=full_prefix, retry=LIST_RETRY,
                                                  timeout=self.timeout, **kwargs))

    def iter_blobs(self, what: str, full_prefix: str, *, patient: bool = True) -> Iterator[storage.Blob]:
        """The objects below `full_prefix` as the pages come (`patient`: with the listings' retry, else one
        attempt per page)."""
        with mapped(what):
            yield from self._client().list_blobs(self._bucket(), prefix=full_prefix,
                                                 retry=LIST_RETRY if patient else None, timeout=self.timeout)

    def list_level(self, what: str, full_prefix: str) -> tuple[list[storage.Blob], list[str]]:
        """One level below `full_prefix` ('/' the delimiter): its objects, and its common prefixes sorted."""
        with mapped(what):
            iterator = self._client().list_blobs(self._bucket(), prefix=full_prefix, delimiter="/", retry=LIST_RETRY,
                                                 timeout=self.timeout)
            blobs = list(iterator)
            return blobs, sorted(iterator.prefixes)
