"""The mount end to end on a real S3 server (SeaweedFS on 127.0.0.1): checkpoints land in the bucket as
plain objects, renames and deletes follow, and a multipart upload interrupted by kill -9 resumes from its
last finished part instead of starting over."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount, finished_parts
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401

MiB = 1 << 20


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


def _objects(server: S3Server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = server.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            if "/.ckptfs-tmp." in "/" + obj["Key"]:
                continue
            out[obj["Key"][len(prefix):]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _s3_mount(mount_factory, server: S3Server, bucket: str, *extra: str, name: str = "m") -> Mount:  # type: ignore[no-untyped-def]
    return mount_factory(  # type: ignore[no-any-return]
        name, source=f"s3://{bucket}/run-1", extra_args=("--endpoint-url", server.endpoint, *extra)
    )


def test_checkpoints_land_in_the_bucket(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    torch = pytest.importorskip("torch")
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket)
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32), "b": torch.ones(10)}
    (m.mnt / "step_1").mkdir()
    torch.save(state, m.mnt / "step_1" / "model.pt.tmp")
    os.replace(m.mnt / "step_1" / "model.pt.tmp", m.mnt / "step_1" / "model.pt")
    (m.mnt / "latest").write_text("step_1")
    (m.mnt / "scratch").write_bytes(b"x")
    m.flush()
    (m.mnt / "scratch").unlink()
    m.flush()
    objects = _objects(seaweedfs_s3, bucket, "run-1/")
    assert set(objects) == {"step_1/", "step_1/model.pt", "latest"}
    assert objects["step_1/model.pt"] == (m.mnt / "step_1" / "model.pt").read_bytes()
    assert objects["latest"] == b"step_1"
    loaded = torch.load(m.mnt / "step_1" / "model.pt")
    assert torch.equal(loaded["w"], state["w"])
    assert m.umount().returncode == 0

    # A fresh node with an empty cache sees the checkpoint and reads it back.
    fresh = _s3_mount(mount_factory, seaweedfs_s3, bucket, name="fresh")
    assert sorted(os.listdir(fresh.mnt)) == ["latest", "step_1"]
    assert torch.equal(torch.load(fresh.mnt / "step_1" / "model.pt")["w"], state["w"])


def test_upload_while_writing_on_s3_stages_at_a_hidden_key_and_copies_at_close(
    mount_factory, seaweedfs_s3: S3Server, bucket: str  # type: ignore[no-untyped-def]
) -> None:
    """`--upload-while-writing on`: S3 fixes an upload's key and metadata when it opens, so the parts of a file
    being written go to a hidden key; at close the rest follows, the whole is copied to its key with its
    metadata and the hidden object is deleted. A slow writer (a pause per 1 MiB) is seen growing."""
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket, "--upload-while-writing", "on", "--part-size", "8M")
    data = os.urandom(MiB) * 40
    with open(m.mnt / "model.pt", "wb", buffering=0) as f:
        for offset in range(0, len(data), MiB):
            f.write(data[offset:offset + MiB])
            time.sleep(0.01)
        deadline = time.monotonic() + 30
        while m.status()["uploaded"]["spilled_bytes"] < 8 * MiB:  # staged while still open
            assert time.monotonic() < deadline, "nothing was uploaded while the file was written"
            time.sleep(0.05)
        assert _objects(seaweedfs_s3, bucket, "run-1/") == {}
    m.flush()
    assert _objects(seaweedfs_s3, bucket, "run-1/") == {"model.pt": data}
    keys = [o["Key"] for o in seaweedfs_s3.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert keys == ["run-1/model.pt"], keys  # no hidden spill object left behind
    assert m.status()["states"]["clean"]["files"] == 1


def test_kill9_mid_multipart_upload_resumes(mount_factory, seaweedfs_s3: S3Server, bucket: str) -> None:
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket, "--part-size", "8M", "--transfers", "1")
    block = os.urandom(MiB)
    # 256 MiB, 32 parts: the kill comes after 8, with 24 left to resume (512 MiB in parts of 16 MiB took
    # twice the CPU, 1 GiB four times)
    with open(m.mnt / "big.bin", "wb") as f:
        for i in range(256):
            f.write(i.to_bytes(8, "big") + block[8:])
    expected = hashlib.sha256()
    for i in range(256):
        expected.update(i.to_bytes(8, "big") + block[8:])
    deadline = time.monotonic() + 120
    while (done := finished_parts(m.cache / "journal.db")) < 8:
        assert time.monotonic() < deadline, "the multipart upload never got going"
        time.sleep(0.02)
    m.kill9()
    assert "big.bin" not in _objects(seaweedfs_s3, bucket, "run-1/"), "a partial object is visible"
    m.start()
    m.flush(timeout=300)
    body = seaweedfs_s3.client().get_object(Bucket=bucket, Key="run-1/big.bin")["Body"]
    stored = hashlib.sha256()
    for chunk in iter(lambda: body.read(8 * MiB), b""):
        stored.update(chunk)
    assert stored.digest() == expected.digest()
    resumed = [line for line in m.log.read_text().splitlines() if "resuming upload of big.bin" in line]
    assert resumed, "the upload started over instead of resuming"
    # Every part journaled before the kill was kept, not uploaded again.
    assert int(resumed[-1].split(": ")[-1].split()[0]) >= done
    uploads = seaweedfs_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == [], "an abandoned multipart upload was left behind"


def test_mount_time_store_errors_are_one_clear_line(seaweedfs_s3: S3Server, tmp_path: Path) -> None:
    from conftest import ckptfs_cli

    (tmp_path / "mnt").mkdir()
    base = ["mount", "--endpoint-url", seaweedfs_s3.endpoint, "--cache-dir", str(tmp_path / "cache")]
    env = dict(os.environ, CKPTFS_RUNTIME_DIR=str(tmp_path / "run"))
    missing = ckptfs_cli(*base, "s3://no-such-bucket-here/x", str(tmp_path / "mnt"), env=env, timeout=120)
    no_keys = {k: v for k, v in env.items() if not k.startswith("AWS_")}
    no_keys.update(
        AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null", AWS_EC2_METADATA_DISABLED="true"
    )
    with s3_bucket(seaweedfs_s3) as name:
        no_credentials = ckptfs_cli(*base, f"s3://{name}", str(tmp_path / "mnt"), env=no_keys, timeout=120)
    for result, words in ((missing, ("no-such-bucket-here",)), (no_credentials, ("credentials",))):
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("ckptfs:")]
        assert len(lines) == 1, result.stderr
        for word in words:
            assert word in lines[0], lines[0]
    assert not os.path.ismount(tmp_path / "mnt")


def _vm_hwm(pid: int) -> int:
    """Peak resident set size of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_draining_four_128mib_files_at_once_keeps_the_daemon_within_its_memory_budget(
    mount_factory, seaweedfs_s3: S3Server, bucket: str
) -> None:
    """Memory is bounded by the transfer engine's budget, not by the number or size of files: four 128 MiB
    files draining at once with --memory-budget 128M (parts of at most a budget's eighth, 16 MiB: eight each).
    Files of several parts each, together several times the budget, are what this needs; four of 256 MiB
    took twice the CPU, four of 1 GiB 8 times."""
    m = _s3_mount(mount_factory, seaweedfs_s3, bucket, "--memory-budget", "128M")
    assert m.proc is not None
    baseline = _vm_hwm(m.proc.pid)  # the interpreter, pyfuse3, trio, boto3: before any transfer
    for i in range(4):
        with open(m.mnt / f"shard-{i}.bin", "wb") as f:  # sparse in the cache: quick to write, 128 MiB to upload
            f.truncate(128 * MiB)
            f.seek(128 * MiB - 5)
            f.write(b"tail!")
    m.flush(timeout=600)
    status = m.status()
    peak = _vm_hwm(m.proc.pid)
    print(f"daemon RSS {baseline / MiB:.0f} MiB before, peak {peak / MiB:.0f} MiB while draining 4 x 128 MiB;"
          f" engine peak {status['transfers']['memory_peak_bytes'] / MiB:.0f} MiB of part data")
    assert status["transfers"]["memory_peak_bytes"] <= 128 * MiB
    assert peak - baseline < 128 * MiB + 64 * MiB, f"daemon peak RSS {peak / MiB:.0f} MiB"
    for i in range(4):
        head = seaweedfs_s3.client().head_object(Bucket=bucket, Key=f"run-1/shard-{i}.bin")
        assert head["ContentLength"] == 128 * MiB
