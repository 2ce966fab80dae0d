from __future__ import annotations

from conftest import Mount


def test_write_flush_umount(mount: Mount) -> None:
    (mount.mnt / "a.bin").write_bytes(b"hello" * 1000)
    mount.flush()
    assert mount.store_files() == {"a.bin": b"hello" * 1000}
    assert mount.umount().returncode == 0
