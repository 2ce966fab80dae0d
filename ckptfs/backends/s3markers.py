"""Who owns an S3 multipart upload: the owner markers of S3Store (s3.py), and the leftovers they find.
Owned by S3Store; it sends every request through the store's S3Wire (s3wire.py), never through the store.

ListMultipartUploads returns no metadata, so an upload cannot carry our `owner` tag itself. Instead each
multipart upload has a small marker object `<prefix>/.ckptfs-tmp.uploads/<owner>/<token>` (JSON: key,
upload id, owner). It is written before CreateMultipartUpload (without the id), rewritten with the id right
after, and deleted after complete/abort. `leftovers` reads this owner's markers and reports the uploads they
name (for a marker without id: the uploads of that key that no marker of any owner claims). So it never
aborts another node's upload, and a crash at any point leaves nothing unaccounted for.

A marker whose write failed without an answer may be in the store too, named by nobody: the store says
something is left behind, and the next sweep removes it. A create whose answer may have been lost (it
failed without an answer from the server, or the SDK sent it again) may have made an upload whose id nobody
knows. Its marker without id then stays, and the store says
something is left behind (`left_behind`): the engine's next sweep lists the leftovers, finds that upload
(unclaimed, of that key) and aborts it. So a create retried by the SDK or by the engine leaves no orphan,
and every call here is one request, one attempt (the engine retries).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from ckptfs.backends.base import TEMP_PREFIX, UploadRef
from ckptfs.backends.common import bookkeeping_body, parse_bookkeeping
from ckptfs.backends.s3errors import was_answered
from ckptfs.backends.s3wire import S3Wire
from ckptfs.errors import BackendError, NotFoundBackendError

log = logging.getLogger(__name__)

MARKER_DIR = f"{TEMP_PREFIX}uploads/"


class UploadMarkers:
    """The owner markers of one S3Store's multipart uploads, and whether a cleanup of them failed."""

    def __init__(self, wire: S3Wire, owner: str) -> None:
        self._wire = wire
        self.owner = owner
        # ObjectStore.left_behind, which S3Store reads and the engine's sweep resets through the store.
        self.left_behind = False

    def _key(self, marker: str) -> str:
        return f"{self._wire.prefix}{MARKER_DIR}{marker}"

    def begin(self, key: str, create: Callable[[], dict[str, Any]]) -> tuple[str, str]:
        """`create` (the CreateMultipartUpload of `key`) bracketed by this owner's marker; returns (upload
        id, marker name)."""
        marker = f"{self.owner}/{secrets.token_hex(8)}"
        try:
            self.put(marker, key, None)
        except BackendError as exc:
            if not was_answered(exc):  # it may have been written: the next sweep removes it (a retry writes another)
                self.left_behind = True
            raise
        try:
            response = create()
        except BackendError as exc:
            if was_answered(exc):
                self.delete(marker)
            else:  # it may have made an upload: the marker stays for the next sweep to find it
                self.left_behind = True
            raise
        upload_id = str(response["UploadId"])
        if response.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            # The SDK sent the create again: the first try, its answer lost, may have made an upload too. The
            # marker without id stays for the next sweep to find that one; this upload gets a marker of its own.
            self.left_behind = True
            marker = f"{self.owner}/{secrets.token_hex(8)}"
        try:
            self.put(marker, key, upload_id)
        except BaseException:
            self.abort_quietly(key, upload_id, marker)
            raise
        return upload_id, marker

    def put(self, marker: str, key: str, upload_id: str | None) -> None:
        body = bookkeeping_body(key=key, upload_id=upload_id, owner=self.owner)
        self._wire.put_small(f"write upload marker of {key}", self._key(marker), body)

    def delete(self, marker: str) -> None:
        """Best effort: a marker left behind is harmless, the engine's next sweep removes it."""
        try:
            self._wire.call("delete upload marker", "delete_object", Key=self._key(marker))
        except BackendError as exc:
            log.debug("could not delete upload marker %s: %s", marker, exc)
            self.left_behind = True

    def _read(self, full_key: str) -> dict[str, Any] | None:
        try:
            return parse_bookkeeping(self._wire.get_bytes("read upload marker", full_key, patient=True))
        except NotFoundBackendError:
            return None

    def abort(self, key: str, upload_id: str) -> None:
        try:
            self._wire.call(f"abort upload of {key}", "abort_multipart_upload", Key=self._wire.full(key),
                            UploadId=upload_id)
        except NotFoundBackendError:  # no such upload (any more): nothing to abort
            pass

    def abort_quietly(self, key: str, upload_id: str, marker: str) -> None:
        try:
            self.abort(key, upload_id)
        except BackendError as exc:  # the marker stays: the engine's next sweep aborts it
            log.info("could not abort the upload of %s: %s; it is removed later", key, exc)
            self.left_behind = True
            return
        self.delete(marker)

    def leftovers(self) -> list[UploadRef]:
        """This owner's markers, each with the upload it names (or, for a marker written before its
        CreateMultipartUpload answered, the uploads of that key that no marker of any owner claims)."""
        mine = f"{self._wire.prefix}{MARKER_DIR}{self.owner}/"
        found: list[UploadRef] = []
        claimed: set[str] | None = None
        for obj in self._wire.listed(mine):
            marker = obj["Key"][len(self._wire.prefix) + len(MARKER_DIR):]
            info = self._read(obj["Key"])
            if info is None:
                continue
            key, upload_id = info.get("key"), info.get("upload_id")
            if not isinstance(key, str) or not key:
                found.append(UploadRef("", "", marker))  # garbled: only the marker to remove
                continue
            if upload_id:
                found.append(UploadRef(key, str(upload_id), marker))
                continue
            if claimed is None:
                claimed = self._claimed_upload_ids()
            orphans = [u for u in self._uploads_of(key) if u not in claimed]
            found += [UploadRef(key, u, "") for u in orphans]
            found.append(UploadRef(key, "", marker))
        return found

    def _uploads_of(self, key: str) -> list[str]:
        full = self._wire.full(key)
        return [u["UploadId"] for page in self._wire.pages(f"list uploads of {key}", "list_multipart_uploads",
                                                             Prefix=full)
                for u in page.get("Uploads", []) if u["Key"] == full]

    def _claimed_upload_ids(self) -> set[str]:
        claimed = set()
        for obj in self._wire.listed(f"{self._wire.prefix}{MARKER_DIR}"):
            info = self._read(obj["Key"])
            if info and info.get("upload_id"):
                claimed.add(str(info["upload_id"]))
        return claimed
