"""The writer of the crash harness (tests/crash_harness.py): a child process that performs a plan of
filesystem operations through a ckptfs mount and records each one in a log outside the mount only after it
returned, fsynced, so that the log is a lower bound of what the mount must hold after a kill -9 of the
daemon. Standard library only: it is started once or twice per round and must start fast.

Usage: python tests/crash_writer.py PLAN.json LOG.jsonl MOUNT_ROOT

The plan is a JSON list of operations; each is one system call on the mount (a write may take several
`pwrite` calls if the mount answers short writes):
  {"op": "mkdir", "path": p}                  {"op": "rmdir", "path": p}
  {"op": "mkdir", "path": p, "exist_ok": true}  (mkdir -p of one level: another node may have made it)
  {"op": "open", "path": p, "trunc": bool}    O_WRONLY|O_CREAT (|O_TRUNC); the fd is kept under p
  {"op": "write", "path": p, "offset": o, "seed": s, "size": n}   pwrite of data_for(s, n) on p's fd
                                   ("pause": seconds, on any op: sleep that long after it)
  {"op": "write_bytes", "path": p, "offset": o, "hex": h}          pwrite of bytes.fromhex(h)
  {"op": "fsync", "path": p}                  {"op": "close", "path": p}
  {"op": "truncate", "path": p, "size": n}    {"op": "unlink", "path": p}
  {"op": "rename", "src": a, "dst": b}        {"op": "read", "path": p}  (reads the whole file)
  {"op": "listdir", "path": p}
  {"op": "wait", "file": f}                   wait until the file f (outside the mount) exists: the job's
                                              barrier, opened by the harness (multi-node rounds)
  {"op": "find_dir", "path": p, "refresh": bool}  wait until the directory p (another node made it) shows in
                                              the mount: stat it every 50 ms, running `ckptfs refresh` on the
                                              mount before each try (refresh) or not (the daemon's
                                              refresh_interval lists the parent again)
  {"op": "flush", "path": p}                  `ckptfs flush MOUNT/p`: everything below p durable in the store

Log lines: {"i": index} when operation i returned; {"i": index, "upto": k} after each pwrite that wrote the
op's bytes [.., k); {"i": index, "err": errno, "upto": k} when it failed with an errno other than the ones a
dead mount gives (then the writer carries on: a full cache answers ENOSPC, and the plan goes on as a
training job would). When the mount is gone (ENOTCONN, ECONNABORTED, ENODEV) the writer stops, exit code 3.
"""

from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import sys
import time

# The errnos of a mount whose daemon died: the operation in flight may or may not have been applied.
DEAD_MOUNT = {errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV}
EXIT_MOUNT_GONE = 3
WAIT_LIMIT = 600.0  # seconds a "wait" op waits for its barrier (and a "find_dir" for its directory)
FLUSH_TIMEOUT = 240  # `ckptfs flush --timeout` of a "flush" op


def data_for(seed: int, size: int) -> bytes:
    """The bytes of a write: a function of (seed, size) only, so the harness's model regenerates them."""
    return random.Random(seed).randbytes(size)


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def record(self, entry: dict[str, int]) -> None:
        os.write(self.fd, (json.dumps(entry, separators=(",", ":")) + "\n").encode())
        os.fdatasync(self.fd)  # the log must outlive anything the harness does next (it may read it at once)


def descriptor(fds: dict[str, int], path: object) -> int:
    """The fd the plan opened for `path`; EBADF if that open failed (a full cache answers ENOSPC)."""
    if str(path) not in fds:
        raise OSError(errno.EBADF, f"{path} is not open (its open failed)")
    return fds[str(path)]


PROBE = ".crash-writer-probe"  # a name that never exists: a lookup of it always reaches the daemon


def probe(root: str) -> None:
    """Raise ENOTCONN (or ECONNABORTED) if the mount's daemon is dead. A lookup of a missing name is never
    answered from the kernel's cache (the daemon keeps no negative entries), as a stat of the root may be."""
    try:
        os.stat(os.path.join(root, PROBE))
    except FileNotFoundError:
        pass


def ckptfs_cli(root: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The ckptfs command line (the environment names the runtime dir of the mount's control socket). A daemon
    that dies meanwhile ends it (the command would wait for a control socket to come back for 10 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while True:
        try:
            out, err = proc.communicate(timeout=0.1)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            pass
        try:
            probe(root)
        except OSError:
            proc.kill()
            proc.communicate()
            raise


def find_dir(root: str, path: str, refresh: bool) -> None:
    """Wait until `path`, a directory another node made, shows in the mount (a dead mount: ENOTCONN)."""
    deadline = time.monotonic() + WAIT_LIMIT
    while True:
        try:
            if stat.S_ISDIR(os.stat(path).st_mode):
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise OSError(errno.ETIMEDOUT, f"{path} never showed in the mount")
        if refresh:
            ckptfs_cli(root, "refresh", root)
        time.sleep(0.05)


def flush(root: str, path: str) -> None:
    """`ckptfs flush` of `path`; its failure is the dead mount's (ENOTCONN) or an EIO."""
    result = ckptfs_cli(root, "flush", root, path, "--timeout", str(FLUSH_TIMEOUT))
    if result.returncode != 0:
        probe(root)  # ENOTCONN if the daemon died meanwhile
        print(f"ckptfs flush {path} exited {result.returncode}: {result.stderr.strip()}", file=sys.stderr)
        raise OSError(errno.EIO, f"ckptfs flush {path} exited {result.returncode}: {result.stderr.strip()[-200:]}")


def run(plan: list[dict[str, object]], log: Log, root: str) -> int:
    fds: dict[str, int] = {}

    def full(path: object) -> str:
        return os.path.join(root, str(path))

    for index, op in enumerate(plan):
        kind = op["op"]
        written = 0
        try:
            if kind == "mkdir":
                try:
                    os.mkdir(full(op["path"]))
                except FileExistsError:
                    if not op.get("exist_ok"):
                        raise
            elif kind == "rmdir":
                os.rmdir(full(op["path"]))
            elif kind == "open":
                flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if op["trunc"] else 0)
                fds[str(op["path"])] = os.open(full(op["path"]), flags, 0o644)
            elif kind in ("write", "write_bytes"):
                # write_bytes: fixed bytes (a commit marker's content)
                data = (data_for(int(op["seed"]), int(op["size"])) if kind == "write"  # type: ignore[call-overload]
                        else bytes.fromhex(str(op["hex"])))
                offset = int(op["offset"])  # type: ignore[call-overload]
                fd = descriptor(fds, op["path"])
                while written < len(data):
                    n = os.pwrite(fd, data[written:], offset + written)
                    if n <= 0:
                        raise OSError(errno.EIO, "pwrite wrote nothing")
                    written += n
                    if written < len(data):  # a short write: record what is in the mount already
                        log.record({"i": index, "upto": written})
            elif kind == "fsync":
                os.fsync(descriptor(fds, op["path"]))
            elif kind == "close":
                os.close(descriptor(fds, op["path"]))
                del fds[str(op["path"])]
            elif kind == "truncate":
                os.truncate(full(op["path"]), int(op["size"]))  # type: ignore[call-overload]
            elif kind == "unlink":
                os.unlink(full(op["path"]))
            elif kind == "rename":
                os.rename(full(op["src"]), full(op["dst"]))
            elif kind == "listdir":
                os.listdir(full(op["path"]))
            elif kind == "wait":
                deadline = time.monotonic() + WAIT_LIMIT
                while not os.path.exists(str(op["file"])):
                    if time.monotonic() > deadline:
                        raise OSError(errno.ETIMEDOUT, f"barrier {op['file']} never opened")
                    time.sleep(0.005)
            elif kind == "find_dir":
                find_dir(root, full(op["path"]), bool(op.get("refresh")))
            elif kind == "flush":
                flush(root, full(op["path"]))
            elif kind == "read":
                with open(full(op["path"]), "rb") as f:
                    while f.read(1 << 20):
                        pass
            else:
                raise ValueError(f"unknown operation {kind!r}")
        except OSError as exc:
            if exc.errno in DEAD_MOUNT:
                return EXIT_MOUNT_GONE
            if kind == "close":
                fds.pop(str(op["path"]), None)  # close(2) releases the fd even when it reports an error
            log.record({"i": index, "err": exc.errno or errno.EIO, "upto": written})
            continue
        log.record({"i": index})
        if op.get("pause"):  # a slow writer (a trainer copying tensors out of the GPU)
            time.sleep(float(op["pause"]))  # type: ignore[arg-type]
    for fd in fds.values():
        os.close(fd)
    return 0


def main() -> int:
    plan_path, log_path, root = sys.argv[1:4]
    with open(plan_path) as f:
        plan = json.load(f)
    return run(plan, Log(log_path), root)


if __name__ == "__main__":
    sys.exit(main())
