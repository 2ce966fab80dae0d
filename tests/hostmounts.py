"""Commands and mounts on the host, for the tests that run containers (test_container.py,
test_kubernetes_rollout.py): a command that must succeed, the mounts at a path, and a cleanup that leaves
none below a test's directory."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; with `check`, a failure is an AssertionError carrying its output."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def mounts_at(path: Path) -> list[tuple[str, str]]:
    """(filesystem type, source) of every mount exactly at `path` in this (the host's) mount namespace,
    bottom first."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(path):
            rest = fields[fields.index("-") + 1:]
            found.append((rest[0], rest[1]))
    return found


def unmount_all_under(root: Path) -> None:
    """Every mount at or below `root`, deepest (and latest) first: a failed test must not leave one behind."""
    for _ in range(30):
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        below = [p for p in points if p == str(root) or p.startswith(f"{root}/")]
        if not below:
            return
        subprocess.run(["umount", "-l", max(below, key=len)], capture_output=True, check=False)
