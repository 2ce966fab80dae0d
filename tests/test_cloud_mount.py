"""The mount end to end on the gs:// and az:// emulators (fake-gcs-server and Azurite on 127.0.0.1):
torch.save through the mount, flush, the object is in the bucket with the right bytes and metadata, and a
fresh node with an empty cache reads it back."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from conftest import Mount
from emulators import AzuriteServer, GcsServer, azurite, fake_gcs  # noqa: F401

MiB = 1 << 20


def _gcs_source(server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> tuple[str, tuple[str, ...], Callable]:
    bucket = server.new_bucket()
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    client = server.client()

    def objects() -> dict[str, bytes]:
        return {b.name[len("run-1/"):]: b.download_as_bytes() for b in client.list_blobs(bucket, prefix="run-1/")
                if "/.ckptfs-tmp." not in "/" + b.name}

    return f"gs://{bucket}/run-1", ("--endpoint-url", server.endpoint), objects


def _azure_source(server: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> tuple[str, tuple[str, ...], Callable]:
    for name in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string)
    container = server.new_container()
    client = server.service().get_container_client(container)

    def objects() -> dict[str, bytes]:
        return {b.name[len("run-1/"):]: client.download_blob(b.name).readall()
                for b in client.list_blobs(name_starts_with="run-1/") if "/.ckptfs-tmp." not in "/" + b.name}

    return f"az://{container}/run-1", (), objects


@pytest.mark.parametrize("store", ["gs", "az"])
def test_checkpoints_land_in_the_bucket_and_a_fresh_node_reads_them(
    mount_factory, store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    torch = pytest.importorskip("torch")
    if store == "gs":
        source, extra, objects = _gcs_source(request.getfixturevalue("fake_gcs"), monkeypatch)
    else:
        source, extra, objects = _azure_source(request.getfixturevalue("azurite"), monkeypatch)
    # Small parts so the 12 MiB tensor is a staged, multi-part upload.
    m: Mount = mount_factory("m", source=source, extra_args=(*extra, "--part-size", "5M"))
    state = {"w": torch.arange(3 * MiB, dtype=torch.float32), "b": torch.ones(10)}
    (m.mnt / "step_1").mkdir()
    torch.save(state, m.mnt / "step_1" / "model.pt.tmp")
    os.replace(m.mnt / "step_1" / "model.pt.tmp", m.mnt / "step_1" / "model.pt")
    (m.mnt / "latest").write_text("step_1")
    os.symlink("step_1/model.pt", m.mnt / "model.pt")
    m.flush()
    got = objects()
    assert set(got) == {"step_1/", "step_1/model.pt", "latest", "model.pt"}
    assert got["step_1/model.pt"] == (m.mnt / "step_1" / "model.pt").read_bytes()
    assert got["latest"] == b"step_1"
    assert m.umount().returncode == 0

    fresh: Mount = mount_factory("fresh", source=source, extra_args=extra)
    assert sorted(os.listdir(fresh.mnt)) == ["latest", "model.pt", "step_1"]
    assert os.readlink(fresh.mnt / "model.pt") == "step_1/model.pt"
    assert torch.equal(torch.load(fresh.mnt / "step_1" / "model.pt")["w"], state["w"])
    assert (fresh.mnt / "latest").read_text() == "step_1"
    assert fresh.umount().returncode == 0


def test_mount_time_store_errors_are_one_clear_line(fake_gcs: GcsServer, azurite: AzuriteServer,
                                                    tmp_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import ckptfs_cli

    (tmp_path / "mnt").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "GOOGLE_", "STORAGE_EMULATOR"))}
    env["CKPTFS_RUNTIME_DIR"] = str(tmp_path / "run")
    cache = ("--cache-dir", str(tmp_path / "cache"))
    mnt = str(tmp_path / "mnt")
    gs_missing = ckptfs_cli("mount", *cache, "--endpoint-url", fake_gcs.endpoint, "gs://no-such-bucket/x", mnt,
                            env=env)
    az_missing = ckptfs_cli("mount", *cache, "az://no-such-container/x", mnt,
                            env=dict(env, AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string))
    az_nothing = ckptfs_cli("mount", *cache, "az://c/x", mnt, env=env)
    gs_in_url = ckptfs_cli("mount", *cache, "gs://user:secret@bucket/x", mnt, env=env)
    for result, code, words in ((gs_missing, 1, ("no-such-bucket", "gcloud storage buckets create")),
                                (az_missing, 1, ("no-such-container", "az storage container create")),
                                (az_nothing, 1, ("AZURE_STORAGE_ACCOUNT",)),
                                (gs_in_url, 2, ("credentials",))):
        assert result.returncode == code, result.stderr
        assert "Traceback" not in result.stderr
        lines = [line for line in result.stderr.splitlines() if line.startswith("ckptfs:")]
        assert len(lines) == 1, result.stderr
        assert all(word in lines[0] for word in words), lines[0]
        assert "secret" not in result.stderr and "Eby8vdM02" not in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")
