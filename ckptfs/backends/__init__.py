"""Store URLs -> ObjectStore instances. The only place that decides which backend serves a URL; cloud
SDKs are imported inside the backend modules, never here, so a missing extra fails only when used."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from ckptfs.backends.base import ObjectStore
from ckptfs.errors import UsageError

SCHEMES = ("file", "s3", "gs", "az")


def open_store(url: str, *, endpoint_url: str | None = None) -> ObjectStore:
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
    raise UsageError(
        f"store URL {url!r}: the {parts.scheme}:// backend is not available in this build yet;"
        " use file:///DIR"
    )
