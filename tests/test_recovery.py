"""Crash tests: kill -9 the real daemon at arbitrary moments, remount on the same cache dir, and check that
nothing whose write() returned is lost, that pending uploads resume, and that the store never shows a
partial object at a final name."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import Mount


def _read_all(root: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def _assert_no_torn_objects(m: Mount, written: dict[str, bytes], history: dict[str, set[bytes]]) -> None:
    """Every object at a final name in the store is a complete version the user wrote there."""
    for key, data in m.store_files().items():
        assert key in history, f"store has {key}, which was never written"
        assert data in history[key], f"store object {key} ({len(data)} bytes) is not a complete written version"


@pytest.mark.core
def test_kill9_at_random_moments_loses_nothing(mount_factory) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(42)
    m: Mount = mount_factory(upload_delay=0.02)
    expected: dict[str, bytes] = {}
    history: dict[str, set[bytes]] = {}
    for round_no in range(4):
        round_dir = m.mnt / f"round{round_no}"
        round_dir.mkdir()
        for i in range(6):
            data = rng.randbytes(rng.choice([0, 100, 50_000, 4_000_000]))
            name = f"round{round_no}/f{i}"
            (m.mnt / name).write_bytes(data)
            expected[name] = data
            history.setdefault(name, set()).add(data)
        # A temp-then-rename save, like torch/HF savers do.
        payload = rng.randbytes(1_000_000)
        (round_dir / "model.tmp").write_bytes(payload)
        os.replace(round_dir / "model.tmp", round_dir / "model.pt")
        expected[f"round{round_no}/model.pt"] = payload
        history.setdefault(f"round{round_no}/model.pt", set()).add(payload)
        history.setdefault(f"round{round_no}/model.tmp", set()).add(payload)
        # A file still open for writing when the daemon dies: what write() returned must survive.
        partial = open(m.mnt / f"round{round_no}" / "open.bin", "wb", buffering=0)  # noqa: SIM115
        partial.write(b"p" * 70_000)
        expected[f"round{round_no}/open.bin"] = b"p" * 70_000
        history.setdefault(f"round{round_no}/open.bin", set()).add(b"p" * 70_000)
        time.sleep(rng.uniform(0, 0.4))  # let some uploads be in flight, some done
        m.kill9()
        try:
            partial.close()
        except OSError:
            pass
        _assert_no_torn_objects(m, expected, history)
        m.start()
        assert _read_all(m.mnt) == expected
    m.flush(timeout=120)
    assert m.store_files() == expected
    assert not [p for p in m.store.rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]


@pytest.mark.core
def test_kill9_during_large_upload_then_resume(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=0)
    data = os.urandom(1 << 20) * 300  # 300 MiB: the upload takes long enough to interrupt
    (m.mnt / "big.pt").write_bytes(data)
    deadline = time.monotonic() + 30
    while os.getxattr(m.mnt / "big.pt", "user.ckptfs.state") != b"uploading":
        assert time.monotonic() < deadline, "upload never started"
        time.sleep(0.005)
    m.kill9()
    assert "big.pt" not in m.store_files(), "a partial object is visible at the final name"
    m.start()
    assert os.getxattr(m.mnt / "big.pt", "user.ckptfs.state") in (b"dirty", b"uploading")
    m.flush(timeout=120)
    assert m.store_files() == {"big.pt": data}
    assert m.status()["states"]["clean"]["files"] == 1


def test_kill9_while_a_file_being_written_is_uploaded_then_resume(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Upload while writing: the start of a large file goes to the store while the writer still has it open.
    kill -9 then: nothing at its key, and after the restart the file as written goes up whole, its staged
    start checked against the cache and used, and no staged leftovers remain."""
    m: Mount = mount_factory(upload_delay=0, extra_args=("--part-size", "8M", "--upload-while-writing", "auto"))
    data = os.urandom(1 << 20) * 40
    fd = os.open(m.mnt / "big.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # the last 16 MiB stay local (the lookahead); 8 MiB parts of the rest go up
        deadline = time.monotonic() + 30
        while m.status()["uploaded"]["spilled_bytes"] < 16 << 20:
            assert time.monotonic() < deadline, "nothing was uploaded while the file was written"
            time.sleep(0.05)
        m.kill9()
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    assert "big.pt" not in m.store_files(), "an object is visible at the key of a file still being written"
    m.start()
    m.flush(timeout=120)
    assert m.store_files() == {"big.pt": data}
    assert not [p for p in m.store.rglob("*") if ".ckptfs-tmp." in str(p) and not p.is_dir()]
    assert "uploaded big.pt (41943040 bytes, started while it was written)" in m.log.read_text()


@pytest.mark.core
def test_restart_after_clean_umount_keeps_everything(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory()
    (m.mnt / "d").mkdir()
    (m.mnt / "d" / "x").write_bytes(b"x")
    os.symlink("d/x", m.mnt / "link")
    assert m.umount().returncode == 0
    m.start()
    assert (m.mnt / "d" / "x").read_bytes() == b"x"
    assert os.readlink(m.mnt / "link") == "d/x"
    assert m.status()["states"]["clean"]["files"] == 1


@pytest.mark.core
def test_fresh_node_sees_and_reads_existing_store(mount_factory) -> None:  # type: ignore[no-untyped-def]
    writer: Mount = mount_factory("writer")
    (writer.mnt / "step_1").mkdir()
    weights = os.urandom(3_000_000)
    (writer.mnt / "step_1" / "model.pt").write_bytes(weights)
    (writer.mnt / "latest").write_text("step_1")
    assert writer.umount().returncode == 0
    reader: Mount = mount_factory("reader", start=False)
    reader.store.rmdir()
    reader.store.symlink_to(writer.store)
    reader.start()
    assert sorted(os.listdir(reader.mnt)) == ["latest", "step_1"]
    assert os.getxattr(reader.mnt / "step_1" / "model.pt", "user.ckptfs.state") == b"remote"
    assert (reader.mnt / "latest").read_text() == "step_1"
    assert (reader.mnt / "step_1" / "model.pt").read_bytes() == weights
    assert os.getxattr(reader.mnt / "step_1" / "model.pt", "user.ckptfs.state") == b"clean"


def test_an_unreadable_staged_upload_record_does_not_stop_the_mount(mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A journal row whose upload_state cannot be read (a torn or hand-edited record) is reported and
    ignored: the mount starts, serves the file, and its next upload starts afresh."""
    m: Mount = mount_factory()
    m.allowed_log_words.append("unreadable staged-upload record")
    (m.mnt / "f").write_bytes(b"one")
    assert m.umount().returncode == 0
    db = sqlite3.connect(m.cache / "journal.db")
    with db:
        torn = '{"key": "f", "parts"'
        assert db.execute("UPDATE inodes SET upload_state = ? WHERE name = 'f'", (torn,)).rowcount == 1
    db.close()
    m.start()
    assert (m.mnt / "f").read_bytes() == b"one"
    (m.mnt / "f").write_bytes(b"two")
    m.flush()
    assert m.store_files() == {"f": b"two"}
    assert "unreadable staged-upload record" in m.log.read_text()
