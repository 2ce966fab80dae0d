"""A daemon killed at any moment goes away: no thread of its own waits on its own mount. A thread blocked in a
FUSE request that the daemon has read but not answered is uninterruptible once the daemon is killed: the
process cannot finish exiting, so /dev/fuse stays open, nothing answers, and the mount and the process hang
until someone aborts the connection in /sys/fs/fuse/connections by hand."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Loaded by the daemon of this test (a sitecustomize on its PYTHONPATH: the mount command executes itself
# again): a getattr that never answers, and says when the kernel asked (the start's check that the mount is
# up is a getattr of its root).
HANGING_GETATTR = """
import os, pathlib, trio
from ckptfs.mount import adapter as fuse_ops

async def getattr_that_hangs(self, inode, ctx):
    pathlib.Path(os.environ["ASKED"]).touch()
    await trio.sleep_forever()

fuse_ops.FuseOperations.getattr = getattr_that_hangs
"""


def _connection_of(mountpoint: Path) -> str | None:
    """The FUSE connection id (the device minor) of the mount on `mountpoint`, read without touching it."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(mountpoint):
            return fields[2].split(":")[1]
    return None


def test_a_daemon_killed_while_its_start_waits_on_the_mount_exits(tmp_path: Path) -> None:
    store, cache, mnt, asked = tmp_path / "store", tmp_path / "cache", tmp_path / "mnt", tmp_path / "asked"
    store.mkdir()
    mnt.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HANGING_GETATTR)
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(tmp_path / "run"), ASKED=str(asked),
               PYTHONPATH=os.pathsep.join([str(hook), *sys.path]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptfs", "mount", f"file://{store}", str(mnt), "--cache-dir", str(cache),
         "--metrics-addr", "off", "--no-guard-mountpoint", "--no-keep-mount"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not asked.exists():
            assert proc.poll() is None, f"the daemon ended before the kernel asked: {proc.returncode}"
            assert time.monotonic() < deadline, "the kernel never asked for the root's attributes"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError("the killed daemon did not exit: a thread of it waits on its own mount") from None
    finally:
        connection = _connection_of(mnt)
        if connection is not None and proc.poll() is None:  # what it takes to end such a daemon
            controls = Path("/sys/fs/fuse/connections")
            if not (controls / connection).exists():
                subprocess.run(["mount", "-t", "fusectl", "none", str(controls)], capture_output=True, check=False)
            (controls / connection / "abort").write_text("1")
            proc.wait(timeout=30)
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
