"""The Config dataclass: every setting, its default and what it means; the default cache dir of a source.

Owns the settings themselves. Reading them from a file, the environment and flags, and checking each, is
loading.py's; sizes and rates are units.py's. Nothing here touches the filesystem or opens a store: checks
that need the outside world (does the store exist, is the cache dir writable) live in daemon/ and backends/.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE_ROOT = Path("/var/cache/ckptfs")
# Gateway mode without idle_upload: a file open for writing is uploaded after this many seconds without a
# write (rclone's --vfs-write-back default is 5 s too).
GATEWAY_IDLE = 5.0

DEFAULT_COMMIT_MARKERS: tuple[str, ...] = (
    "latest",
    "latest.*",
    "latest_checkpointed_iteration.txt",
    ".metadata",
    "commit_success.txt",
    "*.done",
    "COMMITTED",
)


@dataclass(frozen=True)
class Config:
    source: str
    """Where the data lives: file:///DIR, s3://bucket[/prefix], gs://..., az://...."""

    mountpoint: Path
    """An existing, empty directory to mount on."""

    cache_dir: Path | None = None
    """Local cache directory (journal and file data). Default: /var/cache/ckptfs/<name of the source>."""

    cache_size: str = "80%"
    """Cache budget: bytes with a suffix (512M, 200G) or a percentage of the cache filesystem."""

    min_free: str = "5%"
    """Free space the cache always leaves on its filesystem (bytes or a percentage of it)."""

    keep_last: int = 0
    """Retention: after each completed checkpoint keep only the newest N top-level checkpoints (0: off)."""

    keep: tuple[str, ...] = ()
    """Retention: glob patterns of top-level names never deleted by retention."""

    refresh_interval: float = 30.0
    """Seconds after which a directory's listing of the store is read again (objects other nodes wrote)."""

    dirty_wait: float = 600.0
    """Seconds a write waits for room when dirty data fills the cache, before it fails with ENOSPC."""

    upload_delay: float = 2.0
    """Seconds a closed file must stay unchanged before it is queued for upload."""

    small_file_wait: float = 10.0
    """While files keep being created, closed, renamed or removed (a save writing many small files), small
    files (up to 1 MiB) wait for a pause of 0.5 s before they upload, at most this many seconds more than
    upload_delay; 0: no wait."""

    upload_while_writing: str = "off"
    """Stage the written start of a large file while it is still open, part by part, so that it is in the
    store soon after it is closed: "auto" on stores that place a staged upload at any key with its final
    metadata (file://, gs://); "on" also on s3:// and az://, where it costs a server-side copy of the whole
    file at close; "off" (the default): only a full cache does it. It shortens the time from close to
    durable, and lengthens the save when the writer is as fast as the disk (they share it and the CPU)."""

    gateway: bool = False
    """Gateway mode, for a mount exported by an NFS server (nfs-ganesha, kernel nfsd), which keeps files open
    long after its clients closed them: files still open for writing are uploaded once idle (see
    idle_upload, 5 s unless set), 1 s after their last write once fsynced (an NFS COMMIT), and again when
    they change; `ckptfs flush` uploads them as they are instead of waiting for their close (docs/GATEWAY.md)."""

    idle_upload: float = 0.0
    """Seconds without a write after which a file still open for writing is uploaded as it is (and again
    after each later change); 0: only in gateway mode, after 5 s."""

    passthrough: str = "auto"
    """Kernel FUSE passthrough (Linux >= 6.9, a libfuse >= 3.17 build of pyfuse3, a root daemon): "auto"
    lets the kernel read and write the cache file of an open file itself, at the disk's speed, for files
    whose bytes are all local while the cache has room; it turns itself off (and says why) where it cannot
    work. "off": every read and write goes through the daemon."""

    transfers: int = 8
    """Files (or batches of small files) uploaded in parallel."""

    part_size: str = "64M"
    """Part size of staged (multipart) uploads; smaller for mid-size files so that parts go in parallel."""

    memory_budget: str = "256M"
    """Bytes of part data all transfers together may hold in memory at once (uploads and downloads)."""

    parts_in_flight: int = 16
    """Part transfers (up and down, all files together) in flight at once, within memory_budget."""

    upload_limit: str = "off"
    """Cap on the bytes per second sent to the store, all transfers together: a rate with a SIZE suffix
    ("200M"), "0" or "off" (no cap), or a timetable of local times of day ("08:00,50M 19:00,off": the last
    entry before now applies, wrapping round midnight). `ckptfs limit` changes it until the next entry."""

    download_limit: str = "off"
    """Cap on the bytes per second read from the store, as upload_limit."""

    read_ahead: str = "4M"
    """The kernel's read-ahead for the mount (its bdi read_ahead_kb): how much a sequential reader's reads
    ask for at once, in FUSE requests of up to 1 MiB; "0": leave the kernel's default (128 KiB)."""

    endpoint_url: str | None = None
    """S3-compatible endpoint (also AWS_ENDPOINT_URL)."""

    metrics_addr: str = "127.0.0.1:9477"
    """HOST:PORT for the Prometheus endpoint, or "off"."""

    drain_timeout: float = 300.0
    """Seconds SIGTERM/SIGINT waits for the drain before unmounting anyway (the rest stays journaled)."""

    preempt_on_sigterm: float = 0.0
    """Seconds: SIGTERM is a preemption notice with this deadline (docs/OPERATIONS.md, preemption): the newest
    complete step goes first, and the whole stop (drain, report, unmount) takes at most this long (and at most
    drain_timeout). 0: off, SIGTERM drains whatever is queued for up to drain_timeout."""

    preemption_notice: str = "off"
    """Watch the cloud's preemption notice and act on it by itself: aws (IMDS spot/instance-action), gcp
    (metadata instance/preempted), azure (scheduled events, Preempt), or off."""

    preemption_notice_url: str | None = None
    """The metadata endpoint the watcher asks (default: the cloud's own, 169.254.169.254 or
    metadata.google.internal); a URL of scheme http."""

    preemption_deadline: float = 25.0
    """Seconds a notice seen by the watcher leaves for the drain (shortened to the time the notice itself
    names, less PREEMPTION_MARGIN, where it names one)."""

    preemption_keep_limits: bool = False
    """Keep the bandwidth caps under a preemption notice (by default they are lifted: what is left must go as
    fast as it can)."""

    preemption_poll: float = 5.0
    """Seconds between the watcher's looks at the metadata endpoint (AWS advises every 5 s)."""

    commit_markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS
    """Glob patterns (matched against the file name) of files uploaded only after everything before them."""

    cross_node_ordering: bool = True
    """Commit markers also wait for the files other nodes (mounts of the same prefix) closed before them
    (docs/design/cross-node.md): each node keeps a small record of its pending work in the store."""

    rename_wait: float = 30.0
    """Seconds a rename or rmdir of a directory waits, with cross-node ordering, for the work other nodes have
    pending in its checkpoint (the top-level directory it is in): what they closed before it is then in the
    store and moves with it (Orbax's multi-host save renames a tmp dir every host wrote into). Past it the
    operation goes on, and what they upload there later lands under the old name (logged, and in status)."""

    keep_mount: bool = True
    """The mount outlives the daemon (keepmount/holder.py): a holder process keeps the FUSE connection, and a daemon
    that dies is started again and takes it over; the job's requests wait instead of failing."""

    keep_mount_on_stop: bool = False
    """On SIGTERM, when the node's holder service keeps the FUSE connection (`ckptfs holder`, Kubernetes),
    drain for up to drain_timeout while serving as before (writes are not refused), then leave the mount to
    the holder instead of unmounting: the next daemon (the DaemonSet's next pod) takes it over, and the job's
    requests wait meanwhile. What is not uploaded by then stays journaled in the cache dir for the next
    daemon. A daemon that starts before the service waits for it (it starts no holder of its own, which would
    die with its pod). Without a holder service SIGTERM drains and unmounts as always."""

    guard_mountpoint: bool = True
    """After a clean unmount, mount a read-only guard (a tiny tmpfs, mount/guard.py) over the mountpoint, so that a
    job that keeps saving gets EROFS instead of writing onto the disk below, never uploaded. `ckptfs mount`
    replaces the guard by itself; `ckptfs unguard MNT` removes it. Needs root."""

    allow_other: bool = False
    """Let other users access the mount (implies default_permissions)."""

    daemon: bool = False
    """Detach once the mount is live."""

    log_level: str = "INFO"
    """Python logging level name."""

    def effective(self, cache_dir: Path) -> str:
        """The effective configuration, one line, for the log (config holds no secrets; an endpoint URL's
        user:password part, if any, is dropped)."""
        fields = dataclasses.asdict(self)
        fields["cache_dir"] = str(cache_dir)
        if self.endpoint_url:
            parts = urllib.parse.urlsplit(self.endpoint_url)
            fields["endpoint_url"] = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")
                                                    if parts.hostname else parts.netloc).geturl()
        fields.pop("source")
        fields.pop("mountpoint")
        fields["commit_markers"] = ",".join(self.commit_markers)
        fields["keep"] = ",".join(self.keep)
        return ", ".join(f"{key} {value}" for key, value in fields.items())

    @property
    def open_upload_idle(self) -> float | None:
        """Seconds of idleness after which a file open for writing is uploaded; None: never (not a gateway)."""
        if self.idle_upload > 0:
            return self.idle_upload
        return GATEWAY_IDLE if self.gateway else None

    def resolved_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else default_cache_dir(self.source)


def default_cache_root() -> Path:
    """/var/cache/ckptfs for root; for another user, who cannot write there, their own cache directory
    ($XDG_CACHE_HOME/ckptfs, else ~/.cache/ckptfs)."""
    if os.geteuid() == 0:
        return DEFAULT_CACHE_ROOT
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "ckptfs"
    return Path.home() / ".cache" / "ckptfs"


def default_cache_dir(source: str) -> Path:
    """A readable, collision-free directory name for a source URL, under default_cache_root()."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", source).strip("-")[:80]
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]
    return default_cache_root() / f"{readable}-{digest}"
