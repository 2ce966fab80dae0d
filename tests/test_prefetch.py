"""Prefetch (issue 44, part 4): `ckptfs prefetch MOUNTPOINT STEP` on a fresh node fetches the step's files into
the cache and keeps them from eviction until they are read or released; a step the cache cannot hold is
refused before a byte is fetched; and 100 processes that stat and open one checkpoint's files on a fresh
node, while launchers prefetch it, cost the store one listing per directory (counted at the store's door: a
proxy in front of SeaweedFS)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Mount
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401
from faultproxy import FaultProxy

import ckptfs
from ckptfs.errors import UsageError

MiB = 1 << 20


def _state(path: Path) -> str:
    """The file's state (clean: in the cache; remote: only in the store). A getxattr opens nothing."""
    return os.getxattr(path, "user.ckptfs.state").decode()


def _written_by_another_node(mount_factory: Any) -> Path:
    """A store holding step_1 (3 files of 8 MiB) and step_2 (3 of 16 MiB), written by a node now gone."""
    writer: Mount = mount_factory("writer")
    for step, size in (("step_1", 8), ("step_2", 16)):
        (writer.mnt / step).mkdir()
        for i in range(3):
            (writer.mnt / step / f"shard_{i}.bin").write_bytes(os.urandom(MiB) * size)
    writer.flush()
    assert writer.umount().returncode == 0
    return writer.store


def _prefetch(mount: Mount, *args: str) -> subprocess.CompletedProcess[str]:
    return mount.cli("prefetch", str(mount.mnt), *args)


def test_a_prefetched_step_stays_in_the_cache_until_read_or_released(mount_factory: Any) -> None:
    store = _written_by_another_node(mount_factory)
    node: Mount = mount_factory("fresh", source=f"file://{store}", extra_args=("--cache-size", "64M"))
    step_1 = [node.mnt / "step_1" / f"shard_{i}.bin" for i in range(3)]

    done = _prefetch(node, "step_1", "--wait", "--json")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert (reply["files"], reply["fetched_files"], reply["fetched_bytes"]) == (3, 3, 24 * MiB)
    assert [_state(p) for p in step_1] == ["clean"] * 3
    prefetch = node.status()["prefetch"]
    assert prefetch["files_prefetched"] == 3 and prefetch["bytes_prefetched"] == 24 * MiB
    assert (prefetch["files_kept"], prefetch["bytes_kept"], prefetch["files_pending"]) == (3, 24 * MiB, 0)

    # Reading step_2 whole (48 MiB) needs room in the 64 MiB cache: step_1, the least recently used, would go
    # first; kept, it stays, and step_2's own files make the room.
    for i in range(3):
        with open(node.mnt / "step_2" / f"shard_{i}.bin", "rb") as f:
            while f.read(4 * MiB):
                pass
    assert node.status()["cache"]["evicted_files"] >= 1
    assert [_state(p) for p in step_1] == ["clean"] * 3

    # A file read once is no longer kept; a release lets the rest go.
    with open(step_1[0], "rb") as f:
        f.read(1)
    assert node.status()["prefetch"]["files_kept"] == 2
    released = _prefetch(node, "--release")
    assert released.returncode == 0, released.stderr
    assert released.stdout.strip() == "released 2 prefetched files"
    assert node.status()["prefetch"]["files_kept"] == 0


def test_a_restarted_daemon_keeps_what_was_prefetched_and_not_yet_read(mount_factory: Any) -> None:
    """Before, the keep was not journaled: a daemon restarted between a prefetch and the job's restart (an
    upgrade, a crash) let the prefetched step be evicted first, to be fetched again when the job read it."""
    store = _written_by_another_node(mount_factory)
    node: Mount = mount_factory("fresh", source=f"file://{store}", extra_args=("--cache-size", "64M"))
    step_1 = [node.mnt / "step_1" / f"shard_{i}.bin" for i in range(3)]
    done = _prefetch(node, "step_1", "--wait")
    assert done.returncode == 0, done.stderr
    with open(step_1[0], "rb") as f:  # read once: no longer kept
        f.read(1)
    assert node.status()["prefetch"]["files_kept"] == 2
    node.kill9()  # the end of a keep is recorded by the evictor's next round: the kill may come first
    node.start()
    assert node.status()["prefetch"]["files_kept"] in (2, 3)
    for i in range(3):  # 48 MiB more in a 64 MiB cache: the kept files stay, the others make the room
        with open(node.mnt / "step_2" / f"shard_{i}.bin", "rb") as f:
            while f.read(4 * MiB):
                pass
    assert node.status()["cache"]["evicted_files"] >= 1
    assert [_state(p) for p in step_1[1:]] == ["clean"] * 2


def test_a_prefetch_the_cache_cannot_hold_is_refused_before_anything_is_fetched(mount_factory: Any) -> None:
    store = _written_by_another_node(mount_factory)
    node: Mount = mount_factory("fresh", source=f"file://{store}", extra_args=("--cache-size", "40M"))
    too_big = _prefetch(node, "step_2", "--wait")  # 48 MiB in a 40 MiB cache
    assert too_big.returncode == 2
    assert "more than the cache can hold" in too_big.stderr and "raise cache_size" in too_big.stderr, too_big.stderr
    assert node.status()["reads"]["bytes_downloaded"] == 0

    assert _prefetch(node, "step_1", "--wait").returncode == 0  # 24 MiB, kept
    # 16 MiB more fit in the budget (38 MiB: 95 %) alone, not beside step_1's 24 MiB kept: refused.
    second = _prefetch(node, "step_2/shard_0.bin", "--wait")
    assert second.returncode == 2, second.stdout
    assert "ckptfs prefetch --release" in second.stderr, second.stderr
    status = node.status()
    assert status["cache"]["evicted_files"] == 0 and status["reads"]["bytes_downloaded"] == 24 * MiB
    assert [_state(node.mnt / "step_1" / f"shard_{i}.bin") for i in range(3)] == ["clean"] * 3

    # Released, step_1 may go: the same prefetch now runs (in the background) and evicts what it needs.
    assert _prefetch(node, "--release").returncode == 0
    started = _prefetch(node, "step_2/shard_0.bin", "--json")
    assert started.returncode == 0, started.stderr
    assert json.loads(started.stdout)["to_fetch_bytes"] == 16 * MiB
    deadline = time.monotonic() + 60
    while node.status()["prefetch"]["files_prefetched"] < 4:
        assert time.monotonic() < deadline, node.status()["prefetch"]
        time.sleep(0.05)
    assert _state(node.mnt / "step_2" / "shard_0.bin") == "clean"
    # 40 MiB in the cache now, above its high-water mark: the evictor's next round takes step_1's files.
    while node.status()["cache"]["evicted_files"] < 1:
        assert time.monotonic() < deadline, node.status()["cache"]
        time.sleep(0.05)
    assert _state(node.mnt / "step_2" / "shard_0.bin") == "clean"


def test_the_python_api_finds_the_mount_of_a_path(mount_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _written_by_another_node(mount_factory)
    node: Mount = mount_factory("fresh", source=f"file://{store}")
    monkeypatch.setenv("CKPTFS_RUNTIME_DIR", str(node.runtime))
    reply = ckptfs.prefetch(node.mnt / "step_1" / "shard_2.bin", wait=True)
    assert (reply["path"], reply["fetched_files"]) == ("step_1/shard_2.bin", 1)
    assert _state(node.mnt / "step_1" / "shard_2.bin") == "clean"
    with pytest.raises(UsageError, match="there is no step_9"):
        ckptfs.prefetch(node.mnt / "step_9")
    with pytest.raises(UsageError, match="not inside a ckptfs mount"):
        ckptfs.prefetch(node.root)


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


# One rank of a restart: waits for the start signal, then stats and opens every file of the checkpoint, each
# rank starting at another file (its own shard first): the kernel makes concurrent lookups of one name wait
# for each other, so only lookups of different names reach the daemon at once.
RANK = """
import os, sys, time
go, rank, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
while not os.path.exists(go):
    time.sleep(0.005)
for path in files[rank % len(files):] + files[:rank % len(files)]:
    os.stat(path)
    with open(path, "rb") as f:
        f.read(1)
"""
RANKS = 100
# A launcher that prefetches the checkpoint as the ranks start: its listings run beside theirs, not behind
# the kernel's lock of a directory (which makes lookups in one directory take turns).
PREFETCHER = """
import os, sys, time
import ckptfs
go, step = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
ckptfs.prefetch(step, wait=True)
"""
PREFETCHERS = 4


def test_a_hundred_ranks_opening_one_checkpoint_list_each_directory_once(
    mount_factory: Any, bucket: str, seaweedfs_s3: S3Server
) -> None:
    client = seaweedfs_s3.client()
    keys = ["step_1000/metadata.json"] + [f"step_1000/{part}/shard_{i}.bin" for part in ("model", "optim")
                                           for i in range(8)]
    for key in keys:
        client.put_object(Bucket=bucket, Key=f"run-1/{key}", Body=os.urandom(4096))
    with FaultProxy(seaweedfs_s3.endpoint) as proxy:
        node: Mount = mount_factory("fresh", source=f"s3://{bucket}/run-1",
                                    extra_args=("--endpoint-url", proxy.endpoint, "--refresh-interval", "3600"))
        go = node.root / "go"
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(go), str(rank), *(str(node.mnt / k) for k in keys)])
                 for rank in range(RANKS)]
        step = str(node.mnt / "step_1000")
        ranks += [subprocess.Popen([sys.executable, "-c", PREFETCHER, str(go), step], env=node.env)
                  for _ in range(PREFETCHERS)]
        time.sleep(1)  # (not asserted on: most ranks are waiting for the signal by then, the rest join late)
        go.touch()
        assert [rank.wait(timeout=300) for rank in ranks] == [0] * (RANKS + PREFETCHERS)
        # A directory's listing: ListObjectsV2 with delimiter "/" (the start-up probe and the sweeps of ckptfs's
        # own hidden prefixes list without one).
        queries = [urllib.parse.parse_qs(urllib.parse.urlsplit(line.split()[1]).query)
                   for _, line, _ in list(proxy.log) if line.startswith("GET ")]
        listings = collections.Counter(query["prefix"][0] for query in queries
                                       if query.get("list-type") == ["2"] and query.get("delimiter") == ["/"])
        prefetched = node.status()["prefetch"]["files_prefetched"]
        node.umount()  # before the proxy stops: a daemon whose store went away logs its sweeps' failures
    assert set(listings) >= {"run-1/step_1000/", "run-1/step_1000/model/", "run-1/step_1000/optim/"}, listings
    assert max(listings.values()) <= 1, listings
    assert prefetched >= len(keys)


def test_the_kept_files_recorded_in_the_journal_come_back_if_their_cache_file_did(tmp_path: Path,
                                                                                   caplog: Any) -> None:
    from ckptfs.cache.evictor import KEPT_META, KeptFiles
    from ckptfs.journal import Journal

    journal = Journal(tmp_path / "journal.db")
    kept = KeptFiles()
    kept.update([3, 5, 8])
    kept.save(journal)
    kept.discard(5)
    kept.discard(42)  # never kept: nothing to record
    assert kept.changed
    kept.save(journal)
    assert not kept.changed
    restarted = KeptFiles()
    restarted.load(journal, cached=[3, 5, 7])  # 8's cache file is gone
    assert restarted == {3} and restarted.changed  # the next round records what is left
    journal.set_meta(KEPT_META, "not json")
    with caplog.at_level("WARNING"):
        unreadable = KeptFiles()
        unreadable.load(journal, cached=[3])
    assert unreadable == set() and "unreadable" in caplog.text
    journal.close()
