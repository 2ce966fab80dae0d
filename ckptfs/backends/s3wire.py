"""S3Wire: what every request of one S3Store goes through. Owned by S3Store (s3.py), which makes it and
shares it with its UploadMarkers (s3markers.py); both call only its public methods.

It owns the boto3 session and its two clients (one attempt of botocore's own, and the patient one that
listings and marker reads use), the bucket and the key prefix (`full`), the translation of every SDK
failure into the BackendError family (through s3errors.py, here and nowhere else in S3Store), and the
refresh-once of a credential the server rejects as expired (RenewingCredentials, s3creds.py). It knows
nothing of ckptfs's layout (markers, notes, metadata): that is the store's.
"""

from __future__ import annotations

import base64
import http.client
import logging
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import urllib3

from ckptfs.backends.base import RANGE_PIECE, RangeSink, piece_buffer
from ckptfs.backends.s3creds import RenewingCredentials, renewing_session
from ckptfs.backends.s3errors import is_expired_credential, mapped
from ckptfs.checksums import crc32
from ckptfs.errors import AuthBackendError, TransientBackendError

log = logging.getLogger(__name__)


def _without_userinfo(url: str | None) -> str | None:
    """The endpoint without a user:password part. S3 requests are signed with the credentials; botocore
    never uses the URL's user part, but would repeat it in every error message (and so in logs and
    `ckptfs status`). Dropped here, so the store never holds it."""
    if not url:
        return url
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    log.warning("the user:password part of the endpoint URL is ignored: S3 requests are signed with the"
                " credentials from the SDK's chain")
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


def _send_without_expect_continue(request: Any, **_: Any) -> None:
    """botocore asks for `100 Continue` before every body it sends as a stream (every PutObject), and reads
    that interim answer one byte per system call: about 50 calls per request, each giving up the GIL that
    the FUSE thread and the other uploads are waiting for (in a drain of 2,000 small files, 770,000 futex
    calls). A PutObject body is at most the multipart threshold: sending it to a server that refuses it
    costs little, so it goes at once. Expect is not a signed header."""
    request.headers.pop("Expect", None)


def crc_b64(crc: int) -> str:
    """A CRC32 as S3's x-amz-checksum-crc32 spells it."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


# A listing's next page: the request parameters that ask for it, each with the answer's field it comes from.
_NEXT_PAGE: dict[str, tuple[tuple[str, str], ...]] = {
    "list_objects_v2": (("ContinuationToken", "NextContinuationToken"),),
    "list_multipart_uploads": (("KeyMarker", "NextKeyMarker"), ("UploadIdMarker", "NextUploadIdMarker")),
    "list_parts": (("PartNumberMarker", "NextPartNumberMarker"),),
}


class S3Wire:
    """The client side of one bucket and prefix: one request per call, its failure a BackendError."""

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None,
        region: str | None,
        max_pool_connections: int,
        connect_timeout: float,
        read_timeout: float,
        session: boto3.session.Session | None,
    ) -> None:
        """`session`: see S3Store."""
        self.bucket = bucket
        clean = prefix.strip("/")
        self.prefix = f"{clean}/" if clean else ""
        self.url = f"s3://{bucket}/{clean}" if clean else f"s3://{bucket}"
        self.endpoint_url = _without_userinfo(
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        self.credentials: RenewingCredentials | None = None
        if session is None:
            # STS is asked in the bucket's region where known (regional STS endpoints, botocore's default).
            sts_region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            botocore_session, self.credentials = renewing_session(sts_region)
            session = boto3.session.Session(botocore_session=botocore_session)
        self._session = session
        self.region = region or os.environ.get("AWS_REGION") or self._session.region_name or "us-east-1"
        config = botocore.config.Config(
            region_name=self.region,
            # ckptfs retries on its own (a few times per part, forever in the drain); botocore once.
            retries={"mode": "standard", "total_max_attempts": 2},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_pool_connections,
            tcp_keepalive=True,
            s3={"addressing_style": "path" if self.endpoint_url else "auto", "payload_signing_enabled": False},
            # We send our own CRC32 with every upload and verify downloads against our own checksum.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # Public for the tests that send a request of their own (a part with a wrong CRC32) or watch headers.
        self.client = self._session.client("s3", endpoint_url=self.endpoint_url, config=config)
        self.client.meta.events.register("before-send.s3.PutObject", _send_without_expect_continue)
        # Listings and reads of upload markers ride out throttling with botocore's own retry, as GCS's
        # listings do with the SDK's: a listing of many pages, or a sweep that reads every marker, made of
        # requests that fail one time in ten would never get through whole if each made one attempt.
        self._patient_client = self._session.client(
            "s3", endpoint_url=self.endpoint_url,
            config=config.merge(botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 5})))

    def full(self, key: str) -> str:
        """The bucket key of a store key (below the prefix)."""
        return self.prefix + key

    def has_credentials(self) -> bool:
        """Does the session's credential chain find any credential at all?"""
        return self._session.get_credentials() is not None

    # -- requests: one each, its failure a BackendError ----------------------------------------------------

    def call(self, what: str, method: str, *, patient: bool = False, **kwargs: Any) -> Any:
        """One request (botocore's own retry aside: `patient`, the listings' retry), its failure a
        BackendError. A request whose credential the server rejects as expired is sent once more with a
        credential fetched anew, here and not by the caller: an upload part (or a complete) that meets an
        expired session goes on, and the drain never counts it as a failure."""
        client = self._patient_client if patient else self.client
        signed_with = self.credentials.in_use() if self.credentials is not None else None
        try:
            with mapped(what):
                return getattr(client, method)(Bucket=self.bucket, **kwargs)
        except AuthBackendError as exc:
            if not self._renewed_after(exc, signed_with):
                raise
        with mapped(what):
            return getattr(client, method)(Bucket=self.bucket, **kwargs)

    def _renewed_after(self, exc: AuthBackendError, signed_with: str | None) -> bool:
        """After `exc`: was it an expired credential, now fetched anew (so the request may go again)?"""
        if self.credentials is None or not is_expired_credential(exc):
            return False
        with mapped(f"refresh the credential after {exc}"):
            self.credentials.renew_after_rejection(signed_with, str(exc))
        return True

    def pages(self, what: str, method: str, *, patient: bool = True, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The pages of a listing, one request each (`call`: `patient` gives the listings' retry, and a page
        that meets an expired credential is sent again with a new one, whichever page it is: a listing of
        thousands of keys may outlive a session)."""
        follow = _NEXT_PAGE[method]
        args = dict(kwargs)
        seen: set[tuple[Any, ...]] = set()
        while True:
            page = self.call(what, method, patient=patient, **args)
            yield page
            if not page.get("IsTruncated"):
                return
            marks = tuple(page.get(answer) for _request, answer in follow)
            if all(mark is None for mark in marks) or marks in seen:
                raise TransientBackendError(f"{what}: the store said there is more but gave no new place to go on")
            seen.add(marks)
            for (request, _answer), mark in zip(follow, marks, strict=True):
                if mark is None:
                    args.pop(request, None)
                else:
                    args[request] = mark

    def listed(self, full_prefix: str) -> Iterator[dict[str, Any]]:
        """Every object below `full_prefix` (a full key prefix), as ListObjectsV2 lists it."""
        for page in self.pages(f"list {self.url}", "list_objects_v2", Prefix=full_prefix):
            yield from page.get("Contents", [])

    def read_body(self, what: str, body: Any, sink: RangeSink | None = None, piece_size: int = RANGE_PIECE) -> bytes:
        """The bytes of a GetObject answer's body, then the body closed: all of them, or (`sink`) handed to
        `sink` in pieces of `piece_size` and b"" returned."""
        data = b""
        try:
            if sink is None:
                with mapped(what):
                    data = body.read()
            elif (layers := _http_layers(body)) is not None:
                pooled, response = layers
                _read_into_sink(what, response, sink, piece_size)
                pooled.release_conn()  # read to its end: the connection goes back to the pool
            else:
                while True:
                    with mapped(what):
                        piece = body.read(piece_size)
                    if not piece:
                        break
                    sink(piece)
        finally:
            body.close()
        return data

    def get_bytes(self, what: str, full_key: str, *, patient: bool = False) -> bytes:
        """The whole object at `full_key` (one response is one version of it); NotFoundBackendError if none."""
        return self.read_body(what, self.call(what, "get_object", patient=patient, Key=full_key)["Body"])

    def put_small(self, what: str, full_key: str, body: bytes, **kwargs: Any) -> None:
        """One PutObject of a small body, with its CRC32 for the server to verify."""
        self.call(what, "put_object", Key=full_key, Body=body, ContentLength=len(body),
                  ChecksumCRC32=crc_b64(crc32(body)), **kwargs)


def _http_layers(body: Any) -> tuple[urllib3.HTTPResponse, http.client.HTTPResponse] | None:
    """urllib3's response under botocore's StreamingBody, and the http.client response under it, which
    reads straight into a buffer; None where that layering is not there (another botocore or urllib3), and
    the caller reads through botocore. botocore asks urllib3 not to decode the body, so these are the same
    bytes botocore's read() returns; the caller checks their count. (Two private attributes of the SDK's,
    allowed by name in tests/test_layering.py.)"""
    try:
        pooled, response = body._raw_stream, body._raw_stream._fp
    except AttributeError:
        return None
    if isinstance(pooled, urllib3.HTTPResponse) and isinstance(response, http.client.HTTPResponse):
        return pooled, response
    return None


def _read_into_sink(what: str, response: http.client.HTTPResponse, sink: RangeSink, piece_size: int) -> None:
    view = piece_buffer(piece_size)
    declared = response.getheader("Content-Length")
    total = 0
    while True:
        with mapped(what):
            got = response.readinto(view)
        if not got:
            break
        total += got
        sink(view[:got])
    # (http.client's read() raises IncompleteRead for a body cut short, its readinto() returns 0)
    if declared is not None and total != int(declared):
        raise TransientBackendError(f"{what}: the answer ended after {total} of its {declared} bytes")
