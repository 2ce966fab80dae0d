"""The Prometheus endpoint: docs/METRICS.md and ckptfs/control/metrics.py list the same metrics, and a real mount
serves them with values that follow what happens in it."""

from __future__ import annotations

import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, Mount

from ckptfs.control.metrics import METRICS, parse_addr
from ckptfs.mount.adapter import _HAS_NOFLUSH


def test_docs_list_exactly_the_defined_metrics() -> None:
    documented = re.findall(r"^\| `(ckptfs_[a-z_]+)` \| (gauge|counter) \|", (REPO / "docs" / "METRICS.md").read_text(),
                            re.MULTILINE)
    assert sorted(documented) == sorted((m.name, m.kind) for m in METRICS)


def test_a_costly_metrics_snapshot_is_taken_less_often() -> None:
    """Summing a journal of 100k entries took a fifth of the daemon's time during a big walk, once a second."""
    from ckptfs.daemon import METRICS_INTERVAL, metrics_pause

    assert metrics_pause(0.002) == METRICS_INTERVAL
    assert metrics_pause(0.2) == pytest.approx(4.0)


def test_metrics_addr_parsing() -> None:
    assert parse_addr("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_addr("off") is None
    for bad in ("9477", "host:", "host:port", "h:70000"):
        try:
            parse_addr(bad)
        except ValueError as exc:
            assert "HOST:PORT" in str(exc)
        else:
            raise AssertionError(bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_a_mount_serves_its_metrics(mount_factory) -> None:  # type: ignore[no-untyped-def]
    port = _free_port()
    mount: Mount = mount_factory(extra_args=("--metrics-addr", f"127.0.0.1:{port}"))
    (mount.mnt / "step_1.pt").write_bytes(b"x" * 100_000)
    mount.flush()
    (mount.mnt / "step_1.pt").read_bytes()
    deadline = time.monotonic() + 10
    while True:
        values = _scrape(port)
        if values.get('ckptfs_files{state="clean"}') == 1 and values.get("ckptfs_cache_hits_total", 0) >= 1:
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.2)
    names = {key.split("{")[0] for key in values}
    for metric in METRICS:
        if not metric.labels:
            assert (metric.name + ("_total" if metric.kind == "counter" else "")) in names, metric.name
    assert values["ckptfs_uploaded_files_total"] == 1
    assert values["ckptfs_uploaded_bytes_total"] == 100_000
    if values["ckptfs_passthrough_enabled"]:  # the kernel wrote and read the cache file itself
        assert values.get('ckptfs_fuse_requests_total{op="write"}', 0) == 0
        assert values["ckptfs_passthrough_opens_total"] >= 2
    else:
        assert values['ckptfs_fuse_requests_total{op="write"}'] >= 1
    # The create's lookup of a new name is answered with a negative entry, not an error.
    assert values['ckptfs_fuse_requests_total{op="lookup"}'] >= 1
    assert values.get('ckptfs_fuse_errors_total{op="lookup"}', 0) == 0
    assert values['ckptfs_store_requests_total{op="put_object"}'] == 1  # a small file: one request
    assert values['ckptfs_transfer_bytes_total{direction="up"}'] == 100_000
    assert values["ckptfs_transfer_memory_budget_bytes"] == 256 << 20
    assert values['ckptfs_bytes{state="clean"}'] == 100_000
    assert values["ckptfs_oldest_dirty_age_seconds"] == 0


def test_a_taken_metrics_port_is_one_clear_error(mount_factory) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        mount: Mount = mount_factory(start=False, extra_args=("--metrics-addr", f"127.0.0.1:{port}"))
        result = mount.cli("mount", mount.source, str(mount.mnt), "--cache-dir", str(mount.cache), "--metrics-addr",
                           f"127.0.0.1:{port}")
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("ckptfs:")]
    assert len(lines) == 1 and "--metrics-addr" in lines[0] and "Traceback" not in result.stderr, result.stderr


def _mount_options(mnt: str) -> set[str]:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[1] == mnt:
            return set(fields[3].split(","))
    raise AssertionError(f"{mnt} is not mounted")


@pytest.mark.parametrize("cross_node", [False, True], ids=["one-node", "cross-node"])
def test_a_small_file_costs_no_needless_fuse_requests(mount_factory, cross_node: bool) -> None:  # type: ignore[no-untyped-def]
    """With the kernel's permission checks on, every create and rename made it fetch the directory's
    attributes again before the next lookup: two getattr requests of the nine of each small file saved.
    And close() sent a FLUSH that had nothing to do, with or without cross-node ordering."""
    port = _free_port()
    ordering = "--cross-node-ordering" if cross_node else "--no-cross-node-ordering"
    mount: Mount = mount_factory(extra_args=("--metrics-addr", f"127.0.0.1:{port}", ordering))
    assert "default_permissions" not in _mount_options(str(mount.mnt))
    for i in range(20):
        temp = mount.mnt / f".shard_{i}.tmp"
        temp.write_bytes(b"x" * 1000)
        temp.rename(mount.mnt / f"shard_{i}.bin")
    deadline = time.monotonic() + 10
    while (values := _scrape(port)).get('ckptfs_fuse_requests_total{op="rename"}') != 20:
        assert time.monotonic() < deadline, values
        time.sleep(0.2)
    assert values.get('ckptfs_fuse_requests_total{op="getattr"}', 0) < 5, values
    # close() waits for no FLUSH: every handle is opened with FOPEN_NOFLUSH (with the stock pyfuse3: the
    # first is answered ENOSYS, and the kernel sends no more); cross-node ordering announces a writer at
    # its open, not at its close.
    assert values.get('ckptfs_fuse_requests_total{op="flush"}', 0) == (0 if _HAS_NOFLUSH else 1), values
    # FUSE still checks execute bits itself: root may not run a file that has none.
    script = mount.mnt / "run.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    try:
        subprocess.run([str(script)], check=False)
    except PermissionError:
        pass
    else:
        raise AssertionError("a file without execute bits ran")
    script.chmod(0o755)
    assert subprocess.run([str(script)], check=False).returncode == 0


def test_a_mount_others_can_reach_has_the_kernel_check_permissions(mount_factory) -> None:  # type: ignore[no-untyped-def]
    mount: Mount = mount_factory(extra_args=("--allow-other",))
    assert {"allow_other", "default_permissions"} <= _mount_options(str(mount.mnt))
