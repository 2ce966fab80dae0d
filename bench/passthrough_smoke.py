"""FUSE passthrough smoke test: does a pyfuse3 built by scripts/build-fuse.sh hand a file's I/O to the kernel?

Mounts a two-file pyfuse3 filesystem on a temp dir, both files backed by files in a temp backing dir:
"pt" is opened with passthrough (the kernel reads and writes the backing file itself), "plain" the usual
way (every read and write is a request to this daemon). dd writes SIZE into each and reads it back; the
same dd on the backing dir is the baseline. Checks that the bytes land in the backing files and that the
daemon's read()/write() handlers never ran for "pt". Needs root (passthrough wants CAP_SYS_ADMIN).

    .venv/bin/python bench/passthrough_smoke.py [--size-mib 1024] [--runs 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE
FILES = {b"pt": 2, b"plain": 3}  # name -> inode
NAMES = {ino: name.decode() for name, ino in FILES.items()}


class SmokeFS(pyfuse3.Operations):
    enable_passthrough = True

    def __init__(self, backing: Path) -> None:
        super().__init__()
        self.backing = backing
        self.calls: Counter[tuple[str, str]] = Counter()  # (handler, file name) -> calls
        self.handles: dict[int, tuple[int, int | None]] = {}  # fh -> (inode, fd or None for passthrough)
        self.backing_ids: dict[int, tuple[int, int]] = {}  # inode -> (backing id, open count)
        self.next_fh = 1

    def path(self, inode: int) -> Path:
        return self.backing / NAMES[inode]

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        st = os.stat(self.backing if inode == ROOT else self.path(inode))
        for field in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blksize", "st_blocks"):
            setattr(attr, field, getattr(st, field))
        attr.st_atime_ns, attr.st_mtime_ns, attr.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        attr.st_ino = inode
        attr.attr_timeout = attr.entry_timeout = 1.0
        return attr

    async def lookup(self, parent: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent != ROOT or name not in FILES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(FILES[name])

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh, self.next_fh = self.next_fh, self.next_fh + 1
        # The kernel opens the backing file anew with the FUSE file's flags: the registered fd's mode is moot.
        fd = os.open(self.path(inode), os.O_RDWR | (flags & os.O_TRUNC))
        if NAMES[inode] == "plain":
            self.handles[fh] = (inode, fd)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False)
        # One backing id per inode while it is open: the kernel refuses (EIO) an open of an inode that is
        # already open in passthrough mode with another backing file.
        backing_id, count = self.backing_ids.get(inode, (0, 0))
        if not backing_id:
            backing_id = pyfuse3.backing_open(fd)
        os.close(fd)  # the kernel holds its own reference
        self.backing_ids[inode] = (backing_id, count + 1)
        self.handles[fh] = (inode, None)
        return pyfuse3.FileInfo(fh=fh, backing_id=backing_id)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        inode, fd = self.handles[fh]
        self.calls["read", NAMES[inode]] += 1
        assert fd is not None
        return os.pread(fd, size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        inode, fd = self.handles[fh]
        self.calls["write", NAMES[inode]] += 1
        assert fd is not None
        return os.pwrite(fd, buf, off)

    async def release(self, fh: int) -> None:
        inode, fd = self.handles.pop(fh)
        if fd is not None:
            os.close(fd)
            return
        backing_id, count = self.backing_ids[inode]
        if count > 1:
            self.backing_ids[inode] = (backing_id, count - 1)
        else:
            del self.backing_ids[inode]
            pyfuse3.backing_close(backing_id)


async def dd(src: Path, dst: Path) -> float:
    """Copy src to dst with dd bs=1M; return the seconds it took."""
    start = time.perf_counter()
    await trio.run_process(["dd", f"if={src}", f"of={dst}", "bs=1M", "status=none"])
    return time.perf_counter() - start


async def same(a: Path, b: Path) -> bool:
    return (await trio.run_process(["cmp", "-s", str(a), str(b)], check=False)).returncode == 0


async def measure(label: str, target: Path, backing: Path, fs: SmokeFS, src: Path, runs: int) -> bool:
    """dd src into target and back out, best of runs; check that backing (target's backing file) holds src."""
    write_s = read_s = float("inf")
    for _ in range(runs):
        await trio.to_thread.run_sync(os.sync)  # no dirty pages left from the last dd
        write_s = min(write_s, await dd(src, target))
        read_s = min(read_s, await dd(target, Path("/dev/null")))
    ok = await same(src, backing) and await same(src, target)
    calls = f"{fs.calls['write', target.name]:>7} / {fs.calls['read', target.name]:<7}" if target != backing else ""
    mib = (await trio.Path(src).stat()).st_size / 2**20
    print(f"{label:<22} {mib / write_s:>7.0f} {mib / read_s:>7.0f}   {calls:<17}   {'yes' if ok else 'NO'}")
    return ok


def prepare(base: Path, size: int) -> None:
    (base / "backing").mkdir()
    (base / "mnt").mkdir()
    for name in NAMES.values():
        (base / "backing" / name).touch()
    with open(base / "src", "wb") as f:  # random bytes, so that a wrong or missing block shows
        for _ in range(size // 2**20):
            f.write(os.urandom(2**20))


async def run(base: Path, size: int, runs: int) -> bool:
    backing, mnt, src = base / "backing", base / "mnt", base / "src"
    fs = SmokeFS(backing)
    pyfuse3.init(fs, str(mnt), {"fsname=passthrough_smoke"})
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            await trio.to_thread.run_sync(os.stat, mnt / "pt")  # INIT is over once a request was answered
            print(f"pyfuse3 {pyfuse3.__version__}, kernel passthrough granted: {pyfuse3.passthrough_enabled()}")
            print(f"dd bs=1M of {size / 2**20:.0f} MiB, MiB/s (best of {runs}; reads from the page cache)")
            print(f"{'':<22} {'write':>7} {'read':>7}   daemon write/read   bytes in backing file")
            ok = await measure("backing dir (direct)", backing / "direct", backing / "direct", fs, src, runs)
            ok &= await measure("FUSE passthrough", mnt / "pt", backing / "pt", fs, src, runs)
            ok &= await measure("FUSE via the daemon", mnt / "plain", backing / "plain", fs, src, runs)
            ok &= fs.calls["write", "pt"] == 0 and fs.calls["read", "pt"] == 0
            pyfuse3.terminate()
    finally:
        pyfuse3.close(unmount=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the temp dirs go (default: $TMPDIR or /tmp)")
    args = parser.parse_args()
    if not hasattr(pyfuse3, "backing_open"):
        print("this pyfuse3 has no passthrough support: run scripts/build-fuse.sh", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="passthrough-smoke-", dir=args.dir))
    try:
        prepare(base, args.size_mib * 2**20)
        ok = trio.run(run, base, args.size_mib * 2**20, args.runs)
    finally:
        shutil.rmtree(base)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
