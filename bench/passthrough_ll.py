"""libfuse's example daemon passthrough_ll as a benchmark anchor (issue 31): a C FUSE filesystem that, like
ckptfs, sends every request to its daemon, mirroring a directory on local disk. What it takes for a workload
is what FUSE itself costs; what ckptfs takes beyond that is its own.

The binary: by default built on first use from the Debian examples of libfuse3-dev
(/usr/share/doc/libfuse3-dev/examples/passthrough_ll.c, libfuse 3.14 on bookworm) with gcc and
`pkg-config --cflags --libs fuse3` into .build/passthrough_ll/ (git-ignored), rebuilt when the source is
newer. Another build can be given instead, e.g. libfuse 3.17's from scripts/build-fuse.sh at
.build/libfuse/build/example/passthrough_ll. It runs with its default options (cache=auto: entries and
attributes cached for 1 s, no writeback cache, multi-threaded), in the foreground as a child of the bench.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEBIAN_EXAMPLES = Path("/usr/share/doc/libfuse3-dev/examples")
BUILD_DIR = REPO / ".build" / "passthrough_ll"


class AnchorError(Exception):
    """passthrough_ll cannot be built or mounted; the message says what to install or look at."""


@dataclass(frozen=True)
class Anchor:
    binary: Path
    origin: str  # how it was obtained and which libfuse it runs on, for the bench's output and JSON


def _libfuse_version(binary: Path) -> str:
    shown = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)
    for line in (shown.stdout + shown.stderr).splitlines():
        if line.startswith("FUSE library version"):
            return line.split()[-1]
    raise AnchorError(f"{binary} --version did not name its libfuse: {(shown.stdout + shown.stderr).strip()!r}")


def build_debian_example() -> Path:
    """Compile the Debian example into BUILD_DIR unless a build at least as new as its source is there."""
    source = DEBIAN_EXAMPLES / "passthrough_ll.c"
    binary = BUILD_DIR / "passthrough_ll"
    if not source.is_file():
        raise AnchorError(f"{source} is missing: install libfuse3-dev (scripts/install.sh does), or pass the path "
                          "of a passthrough_ll build")
    if binary.is_file() and binary.stat().st_mtime >= source.stat().st_mtime:
        return binary
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True,
                           check=False)
    if flags.returncode != 0:
        raise AnchorError(f"pkg-config fuse3 failed: {flags.stderr.strip()} (install pkg-config and libfuse3-dev)")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"passthrough_ll.{os.getpid()}.tmp")  # two benches may build at once
    built = subprocess.run(["gcc", "-Wall", "-O2", f"-I{DEBIAN_EXAMPLES}", str(source), "-o", str(partial),
                            *flags.stdout.split()], capture_output=True, text=True, check=False)
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        raise AnchorError(f"gcc could not build {source}: {built.stderr.strip()[-600:]}")
    partial.replace(binary)
    return binary


def find_anchor(binary: Path | None = None) -> Anchor:
    """The given passthrough_ll build, or the Debian example built (once) into .build/."""
    if binary is None:
        built = build_debian_example()
        where = f"built from {DEBIAN_EXAMPLES}/passthrough_ll.c into {built.relative_to(REPO)}"
        return Anchor(built, f"passthrough_ll (libfuse {_libfuse_version(built)}), {where}")
    if not os.access(binary, os.X_OK):
        raise AnchorError(f"{binary} is not an executable passthrough_ll")
    return Anchor(binary, f"passthrough_ll (libfuse {_libfuse_version(binary)}) at {binary}")


@contextmanager
def mounted(anchor: Anchor, source: Path, mnt: Path, log: Path) -> Iterator[int]:
    """passthrough_ll mirroring `source` at `mnt` until the block ends; yields the daemon's pid."""
    with daemon_mounted([str(anchor.binary), "-f", "-o", f"source={source}", str(mnt)], mnt, log,
                        "passthrough_ll") as pid:
        yield pid


@contextmanager
def daemon_mounted(argv: list[str], mnt: Path, log: Path, what: str) -> Iterator[int]:
    """A FUSE daemon (`argv`, in the foreground) serving `mnt` until the block ends; yields its pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mnt):
            if proc.poll() is not None:
                raise AnchorError(f"{what} exited with {proc.returncode}: {log.read_text()[-400:]}")
            if time.monotonic() > deadline:
                raise AnchorError(f"{what} did not mount {mnt} within 30 s")
            time.sleep(0.05)
        yield proc.pid
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, check=False)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        if os.path.ismount(mnt):  # the daemon is gone, only the kernel's side is left
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True, check=False)
