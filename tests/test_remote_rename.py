"""Namespace changes to entries this node has never looked into (remote-only: in the store, written by
another node or an earlier cache, not yet listed here). Two mounts on one store, each with its own cache
dir: node A writes, node B renames, deletes or swaps, and what node B shows after a restart (clean umount
or kill -9) and what the store holds must agree. Runs on file:// and on SeaweedFS."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Mount, file_store_objects
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401

Store = Callable[[], dict[str, bytes]]


@pytest.fixture(params=["file", "s3"])
def two_nodes(request: pytest.FixtureRequest, mount_factory, tmp_path: Path) -> Iterator[tuple[Mount, Mount, Store]]:  # type: ignore[no-untyped-def]
    """Node A (mounted) and node B (built, not started) on one store, and a reader of the store's files."""
    if request.param == "file":
        shared = tmp_path / "shared"
        shared.mkdir()

        def make(name: str, start: bool) -> Mount:
            return mount_factory(name, start=start, source=f"file://{shared}")  # type: ignore[no-any-return]

        def store() -> dict[str, bytes]:
            return file_store_objects(shared)

        yield make("a", True), make("b", False), store
        return
    server: S3Server = request.getfixturevalue("seaweedfs_s3")
    with s3_bucket(server) as bucket:

        def make_s3(name: str, start: bool) -> Mount:
            return mount_factory(  # type: ignore[no-any-return]
                name, start=start, source=f"s3://{bucket}/run", extra_args=("--endpoint-url", server.endpoint)
            )

        def s3_store() -> dict[str, bytes]:
            client = server.client()
            out = {}
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="run/"):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len("run/"):]
                    if key.endswith("/") or "/.ckptfs-tmp." in "/" + key:
                        continue  # directory markers and upload leftovers are not files
                    out[key] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            return out

        yield make_s3("a", True), make_s3("b", False), s3_store


def _write_tree(node: Mount, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = node.mnt / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    node.flush()
    assert node.umount().returncode == 0


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _restart(node: Mount, how: str) -> None:
    if how == "umount":
        assert node.umount().returncode == 0
    else:
        node.kill9()
    node.start()


S0 = {"s0/f0": b"zero", "s0/f1": b"one", "s0/sub/f2": b"two"}


@pytest.mark.parametrize("how", ["umount", "kill9"])
def test_rename_of_an_unlisted_remote_directory_brings_its_whole_subtree(
    two_nodes: tuple[Mount, Mount, Store], how: str
) -> None:
    node_a, node_b, store = two_nodes
    _write_tree(node_a, S0)
    node_b.start()
    os.rename(node_b.mnt / "s0", node_b.mnt / "s0_renamed")  # node B never looked into s0
    renamed = {k.replace("s0/", "s0_renamed/", 1): v for k, v in S0.items()}
    assert _tree(node_b.mnt) == renamed  # in the mount at once
    _restart(node_b, how)
    assert _tree(node_b.mnt) == renamed
    node_b.flush()
    assert store() == renamed
    assert sorted(os.listdir(node_b.mnt)) == ["s0_renamed"]


def test_directory_renamed_twice_and_into_an_unlisted_directory(two_nodes: tuple[Mount, Mount, Store]) -> None:
    node_a, node_b, store = two_nodes
    _write_tree(node_a, {**S0, "d/old": b"old"})
    node_b.start()
    os.rename(node_b.mnt / "s0", node_b.mnt / "s1")
    os.rename(node_b.mnt / "s1", node_b.mnt / "d" / "s2")  # d: remote-only, never listed either
    expected = {"d/old": b"old", **{k.replace("s0/", "d/s2/", 1): v for k, v in S0.items()}}
    assert _tree(node_b.mnt) == expected
    _restart(node_b, "kill9")
    node_b.flush()
    assert store() == expected
    assert _tree(node_b.mnt) == expected


def test_remote_only_file_renamed_and_deleted(two_nodes: tuple[Mount, Mount, Store]) -> None:
    node_a, node_b, store = two_nodes
    _write_tree(node_a, {"d/keep": b"k", "d/gone": b"g", "e/moved": b"m"})
    node_b.start()
    os.rename(node_b.mnt / "e" / "moved", node_b.mnt / "d" / "moved_here")
    (node_b.mnt / "d" / "gone").unlink()
    expected = {"d/keep": b"k", "d/moved_here": b"m"}
    _restart(node_b, "kill9")
    node_b.flush()
    assert store() == expected
    assert _tree(node_b.mnt) == expected


def test_swap_of_two_remote_only_files(two_nodes: tuple[Mount, Mount, Store]) -> None:
    node_a, node_b, store = two_nodes
    _write_tree(node_a, {"x": b"content of x", "y": b"content of y"})
    node_b.start()
    os.rename(node_b.mnt / "x", node_b.mnt / "t")
    os.rename(node_b.mnt / "y", node_b.mnt / "x")
    os.rename(node_b.mnt / "t", node_b.mnt / "y")
    node_b.flush(timeout=20)  # the two moves wait for each other's key unless the cycle is broken
    expected = {"x": b"content of y", "y": b"content of x"}
    assert store() == expected
    _restart(node_b, "umount")
    assert _tree(node_b.mnt) == expected


def test_rmdir_of_an_unlisted_non_empty_remote_directory_is_enotempty(two_nodes: tuple[Mount, Mount, Store]) -> None:
    node_a, node_b, store = two_nodes
    _write_tree(node_a, {**S0, "empty_target/x": b"x"})
    node_b.start()
    with pytest.raises(OSError) as raised:
        os.rmdir(node_b.mnt / "s0")
    assert raised.value.errno == errno.ENOTEMPTY
    # A rename over a non-empty remote directory is refused the same way.
    os.mkdir(node_b.mnt / "new")
    with pytest.raises(OSError) as raised:
        os.rename(node_b.mnt / "new", node_b.mnt / "empty_target")
    assert raised.value.errno == errno.ENOTEMPTY
    node_b.flush()
    assert store() == {**S0, "empty_target/x": b"x"}


def test_rename_of_a_big_unlisted_tree_moves_every_object(mount_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """More entries than one listing page (1000), three levels deep, written behind the mount's back:
    after the rename, a kill -9 and the drain, every object is under the new name and none under the old."""
    shared = tmp_path / "shared"
    expected = {}
    for rel in [f"big/many/f{i:04d}" for i in range(1200)] + ["big/a/b/c/deep", "big/top"]:
        (shared / rel).parent.mkdir(parents=True, exist_ok=True)
        (shared / rel).write_bytes(rel.encode())
        expected[rel.replace("big/", "moved/", 1)] = rel.encode()
    node: Mount = mount_factory("b", source=f"file://{shared}")
    os.rename(node.mnt / "big", node.mnt / "moved")
    node.kill9()
    node.start()
    node.flush(timeout=120)
    assert _tree(shared) == expected
    assert _tree(node.mnt) == expected


@pytest.fixture(params=["file", "s3"])
def foreign_tree(request: pytest.FixtureRequest, mount_factory, tmp_path: Path) -> Iterator[Callable[[str], Mount]]:  # type: ignore[no-untyped-def]
    """Objects written by another tool, without directory markers (`aws s3 cp`, `gsutil cp`), and a
    builder of mounts on them."""
    tree = {"old_step/shard-0": b"zero", "old_step/optim/shard-1": b"one", "step.tmp/shard-0": b"new"}
    if request.param == "file":
        shared = tmp_path / "shared"
        for rel, data in tree.items():
            (shared / rel).parent.mkdir(parents=True, exist_ok=True)
            (shared / rel).write_bytes(data)
        yield lambda name: mount_factory(name, source=f"file://{shared}")  # type: ignore[no-any-return]
        return
    server: S3Server = request.getfixturevalue("seaweedfs_s3")
    with s3_bucket(server) as bucket:
        client = server.client()
        for rel, data in tree.items():
            client.put_object(Bucket=bucket, Key=f"run/{rel}", Body=data)
        yield lambda name: mount_factory(  # type: ignore[no-any-return]
            name, source=f"s3://{bucket}/run", extra_args=("--endpoint-url", server.endpoint)
        )


def test_directories_without_markers_removed_or_renamed_are_gone_for_every_node(
    foreign_tree: Callable[[str], Mount],
) -> None:
    """SeaweedFS keeps an emptied folder, and lists it, until the folder's own key is deleted, marker or
    no marker: `rm -r` or `mv` of a directory that never had a marker left it behind for every other node
    (crash harness, SeaweedFS seed 7200 rounds 78 and 191: "fresh node: directory step_00002 should not
    exist"). Retention deleting old steps uploaded by another tool is the everyday case."""
    node = foreign_tree("b")
    shutil.rmtree(node.mnt / "old_step")
    os.rename(node.mnt / "step.tmp", node.mnt / "step")
    node.flush()
    fresh = foreign_tree("fresh")
    assert sorted(os.listdir(fresh.mnt)) == ["step"]
    assert _tree(fresh.mnt) == {"step/shard-0": b"new"}
