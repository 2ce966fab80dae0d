from __future__ import annotations

import pytest
from conftest import Mount


@pytest.mark.core
def test_write_flush_umount(mount: Mount) -> None:
    (mount.mnt / "a.bin").write_bytes(b"hello" * 1000)
    mount.flush()
    assert mount.store_files() == {"a.bin": b"hello" * 1000}
    assert mount.umount().returncode == 0
