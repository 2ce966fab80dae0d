"""The mount end to end on the gs:// and az:// emulators (fake-gcs-server and Azurite on 127.0.0.1):
torch.save, DCP and safetensors through the mount, flush, the objects are in the bucket with the right bytes,
and a fresh node with an empty cache reads them back; a kill -9 in the middle of a staged upload resumes
from the last finished part."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable

import pytest
from conftest import Mount, finished_parts
from emulators import AzuriteServer, GcsServer, azurite, fake_gcs  # noqa: F401
from waiting import wait_until

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
    source, extra, objects = _source(store, request, monkeypatch)
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


def _source(store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
            ) -> tuple[str, tuple[str, ...], Callable]:
    if store == "gs":
        return _gcs_source(request.getfixturevalue("fake_gcs"), monkeypatch)
    return _azure_source(request.getfixturevalue("azurite"), monkeypatch)


@pytest.mark.parametrize("store", ["gs", "az"])
def test_dcp_and_safetensors_saved_on_one_node_load_on_a_fresh_one(
    mount_factory, store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    source, extra, objects = _source(store, request, monkeypatch)
    m: Mount = mount_factory("m", source=source, extra_args=(*extra, "--part-size", "5M"))
    state = {"w": torch.randn(1536, 1024), "step": torch.tensor(42)}  # 6 MiB: two parts
    tensors = {"embed": torch.randn(100, 64), "half": torch.randn(3, 5).to(torch.bfloat16)}
    (m.mnt / "step_42").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(m.mnt / "step_42" / "dcp")), no_dist=True)
    safetensors_torch.save_file(tensors, m.mnt / "step_42" / "model.safetensors", metadata={"format": "pt"})
    m.flush()
    names = sorted(os.listdir(m.mnt / "step_42" / "dcp"))
    got = objects()
    for name in names:
        assert got[f"step_42/dcp/{name}"] == (m.mnt / "step_42" / "dcp" / name).read_bytes(), name
    assert ".metadata" in names and not any(".tmp" in key for key in got), sorted(got)
    assert m.umount().returncode == 0

    fresh: Mount = mount_factory("fresh", source=source, extra_args=extra)
    target = {"w": torch.zeros(1536, 1024), "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(fresh.mnt / "step_42" / "dcp")), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and int(target["step"]) == 42
    loaded = safetensors_torch.load_file(fresh.mnt / "step_42" / "model.safetensors")  # mmap reads
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert fresh.umount().returncode == 0


@pytest.mark.parametrize("store", ["gs", "az"])
def test_kill9_mid_staged_upload_resumes_from_the_last_finished_part(
    mount_factory, store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    source, extra, objects = _source(store, request, monkeypatch)
    # One part in flight at a time: when the journal has 4 parts, at most the 5th is on its way and the upload
    # cannot be completed at the kill (with 16 parts in flight, all of them could be in the store while the
    # journal had 4, and the kill came after the upload's completion: a whole object, taken for a partial one).
    m: Mount = mount_factory("m", source=source, extra_args=(*extra, "--part-size", "5M", "--transfers", "1",
                                                              "--parts-in-flight", "1"))
    block = os.urandom(MiB)
    expected = hashlib.sha256()
    # 80 MiB, 16 parts: the kill comes after 4, with 12 left to resume (32 parts took twice the CPU, most of it
    # the emulators', and resumed the same way)
    with open(m.mnt / "big.bin", "wb") as f:
        for i in range(80):
            chunk = i.to_bytes(8, "big") + block[8:]
            f.write(chunk)
            expected.update(chunk)
    done = wait_until(lambda: finished_parts(m.cache / "journal.db"), done=lambda n: n >= 4, timeout=120,
                      what="4 parts of the staged upload journaled")
    m.kill9()  # stops the daemon at once, then kills it
    killed_at = finished_parts(m.cache / "journal.db")
    assert 4 <= killed_at < 16, f"the kill was not mid-upload: {killed_at} of 16 parts journaled"
    visible = objects().get("big.bin")
    if visible is not None:
        whole = len(visible) == 80 * MiB and hashlib.sha256(visible).digest() == expected.digest()
        raise AssertionError(f"an object is visible at the key after a kill mid-upload ({killed_at} of 16 parts "
                             f"journaled): {len(visible)} bytes, {'whole' if whole else 'PARTIAL'}")
    m.start()
    m.flush(timeout=300)
    assert hashlib.sha256(objects()["big.bin"]).digest() == expected.digest()
    resumed = [line for line in m.log.read_text().splitlines() if "resuming upload of big.bin" in line]
    assert resumed, "the upload started over instead of resuming"
    assert int(resumed[-1].split(": ")[-1].split()[0]) >= done  # every part journaled before the kill was kept
