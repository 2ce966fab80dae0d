"""Store URLs -> ObjectStore instances. The only place that decides which backend serves a URL; cloud
SDKs are imported inside the backend modules, never here, so a missing extra fails only when used."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from ckptfs.backends.base import ObjectStore
from ckptfs.errors import CkptfsError, UsageError

SCHEMES = ("file", "s3", "gs", "az")


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
    raise UsageError(
        f"store URL {url!r}: the {parts.scheme}:// backend is not available in this build yet;"
        " use file:///DIR"
    )


def _open_s3(url: str, bucket: str, path: str, endpoint_url: str | None) -> ObjectStore:
    if not bucket:
        raise UsageError(f"store URL {url!r}: name the bucket, like s3://my-bucket/run-42")
    if "@" in bucket or ":" in bucket:
        raise UsageError(f"store URL {url!r}: credentials and ports do not belong in the URL; use the AWS"
                         " credential chain and --endpoint-url")
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
