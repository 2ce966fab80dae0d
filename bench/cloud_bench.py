#!/usr/bin/env python3
"""GCS and Azure benchmark: a checkpoint through ckptfs against the cloud SDK's own tuned transfer, on the
emulators the tests use (fake-gcs-server and Azurite on 127.0.0.1, started here).

For each store, --runs times, interleaved (the order of the two ways alternating from one run to the next),
one file of --size bytes (1 GiB) of random data, each timed write and restore starting with the disk quiet
(`sync`, then a pause; after the mount for ckptfs):

  ckptfs   a fresh mount (fresh cache dir, default options): copy the file in 1 MiB writes, `ckptfs flush`
           until the object is committed (write, durable); then a second mount on a fresh cache dir reads
           it back (restore: a fresh node resuming). Peak daemon RSS (VmHWM) of both.
  sdk      the same copy to local disk, then the SDK's parallel transfer: Azure upload_blob /
           download_blob with max_concurrency=8; GCS transfer_manager's sliced upload (XML multipart,
           64 MiB parts, 8 workers) where the emulator serves it, else upload_from_filename, and
           download_chunks_concurrently (8 workers).

Ratios are medians measured side by side in one run: ckptfs durable / (local write + SDK upload), ckptfs
restore / SDK download. Both emulators are single processes that burn CPU on every byte (fake-gcs keeps
objects in memory, Azurite writes extents to disk) on a 2-core machine shared with the client: they bound
both ways alike, so the ratios say more than the absolute times, and neither says what a real bucket does.
JSON in bench/results/cloud_bench.json.

Run from the repo's venv with the test extra installed:  python bench/cloud_bench.py [--size 1G] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from emulators import AzuriteServer, GcsServer, start_azurite, start_fake_gcs  # noqa: E402
from s3_drain_bench import (  # noqa: E402
    MIB,
    ckptfs,
    copy_all,
    make_source,
    parse_size,
    peak_rss,
    quiet_disk,
    rotated,
    write_report,
)

DEFAULT_JSON = REPO / "bench" / "results" / "cloud_bench.json"
WORKERS = 8
SDK_PART = 64 * MIB


@dataclass
class Target:
    """One store: where ckptfs mounts it and how the SDK moves a file to and from it."""

    name: str
    source: str  # the ckptfs URL of the benchmark's prefix, without the per-run tag
    mount_args: tuple[str, ...]
    env: dict[str, str]
    upload: Callable[[Path, str], None]  # local file -> key
    download: Callable[[str, Path], None]  # key -> local file
    size_of: Callable[[str], int]
    delete: Callable[[str], None]  # fake-gcs holds objects in memory: each run removes its own


def gcs_target(server: GcsServer) -> Target:
    from google.cloud.storage import transfer_manager

    client = server.client()
    bucket = client.bucket(server.new_bucket())

    def sliced_upload(path: Path, key: str) -> None:
        transfer_manager.upload_chunks_concurrently(str(path), bucket.blob(key), chunk_size=SDK_PART,
                                                    max_workers=WORKERS, worker_type=transfer_manager.THREAD)

    def whole_upload(path: Path, key: str) -> None:
        bucket.blob(key).upload_from_filename(str(path))

    upload = sliced_upload
    with tempfile.NamedTemporaryFile() as probe:
        probe.write(b"probe")
        probe.flush()
        try:
            sliced_upload(Path(probe.name), "probe")
        except Exception as exc:  # an emulator without the XML multipart API: the SDK's plain upload it is
            print(f"gcs: sliced upload unavailable ({type(exc).__name__}); the SDK way is upload_from_filename",
                  flush=True)
            upload = whole_upload

    def download(key: str, path: Path) -> None:
        transfer_manager.download_chunks_concurrently(bucket.blob(key), str(path), chunk_size=SDK_PART,
                                                      max_workers=WORKERS, worker_type=transfer_manager.THREAD)

    def size_of(key: str) -> int:
        blob = bucket.get_blob(key)
        return -1 if blob is None else int(blob.size)

    def delete(key: str) -> None:
        bucket.delete_blob(key)

    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    return Target("gcs", f"gs://{bucket.name}", ("--endpoint-url", server.endpoint), env, upload, download, size_of,
                  delete)


def azure_target(server: AzuriteServer) -> Target:
    container = server.service().get_container_client(server.new_container())

    def upload(path: Path, key: str) -> None:
        with open(path, "rb") as f:
            container.upload_blob(key, f, overwrite=True, max_concurrency=WORKERS)

    def download(key: str, path: Path) -> None:
        with open(path, "wb") as f:
            container.download_blob(key, max_concurrency=WORKERS).readinto(f)

    def size_of(key: str) -> int:
        return int(container.get_blob_client(key).get_blob_properties().size)

    def delete(key: str) -> None:
        container.delete_blob(key)

    env = {k: v for k, v in os.environ.items()
           if k not in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")}
    env["AZURE_STORAGE_CONNECTION_STRING"] = server.connection_string
    return Target("azure", f"az://{container.container_name}", (), env, upload, download, size_of, delete)


def read_all(path: Path) -> None:
    buffer = bytearray(MIB)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


def run_ckptfs(target: Target, source: Path, root: Path, tag: str) -> dict[str, float]:
    env = dict(target.env, CKPTFS_RUNTIME_DIR=str(root / "run"))
    url = f"{target.source}/ckptfs-{tag}"
    times: dict[str, float] = {}
    for phase in ("write", "restore"):
        mnt, cache = root / f"mnt-{tag}-{phase}", root / f"cache-{tag}-{phase}"
        mnt.mkdir()
        ckptfs("mount", "--no-guard-mountpoint",
               url, str(mnt), "--cache-dir", str(cache), *target.mount_args, "--metrics-addr", "off",
               "--daemon", env=env)
        try:
            pid = json.loads(ckptfs("status", str(mnt), "--json", env=env).stdout)["pid"]
            quiet_disk()
            started = time.perf_counter()
            if phase == "write":
                copy_all([source], mnt)
                times["write"] = time.perf_counter() - started
                ckptfs("flush", str(mnt), "--timeout", "900", env=env, timeout=960)
                times["durable"] = time.perf_counter() - started
            else:
                read_all(mnt / source.name)
                times["restore"] = time.perf_counter() - started
            times[f"{phase} peak_rss_mib"] = peak_rss(pid) / MIB
        finally:
            subprocess.run([sys.executable, "-m", "ckptfs", "umount", str(mnt), "--timeout", "120"], env=env,
                           capture_output=True, timeout=300, check=False)
            shutil.rmtree(cache, ignore_errors=True)
    size = target.size_of(f"ckptfs-{tag}/{source.name}")
    assert size == source.stat().st_size, f"{target.name}: object is {size} bytes, not {source.stat().st_size}"
    target.delete(f"ckptfs-{tag}/{source.name}")
    return times


def run_sdk(target: Target, source: Path, root: Path, tag: str) -> dict[str, float]:
    local = root / f"local-{tag}"
    local.mkdir()
    key = f"sdk-{tag}/{source.name}"
    try:
        quiet_disk()
        started = time.perf_counter()
        copy_all([source], local)
        written = time.perf_counter()
        target.upload(local / source.name, key)
        durable = time.perf_counter()
        (local / source.name).unlink()
        quiet_disk()
        started_restore = time.perf_counter()
        target.download(key, local / "restored")
        read_all(local / "restored")
        restored = time.perf_counter()
    finally:
        shutil.rmtree(local, ignore_errors=True)
    target.delete(key)
    return {"write": written - started, "durable": durable - started, "restore": restored - started_restore}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=1 << 30, help="bytes of the checkpoint (1G)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--stores", default="gcs,azure", help="comma-separated: gcs, azure")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = p.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]

    root = Path(tempfile.mkdtemp(prefix="ckptfs-cloud-bench.", dir=args.dir))
    servers: list[Any] = []
    results: dict[str, list[float]] = {}
    try:
        targets = []
        if "gcs" in stores:
            servers.append(gcs := start_fake_gcs(root / "fake-gcs"))
            targets.append(gcs_target(gcs))
        if "azure" in stores:
            servers.append(azure := start_azurite(root / "azurite"))
            targets.append(azure_target(azure))
        source = root / "checkpoint.bin"
        make_source(source, args.size)
        for run in range(args.runs):
            for target in targets:
                for way, fn in rotated([("sdk", run_sdk), ("ckptfs", run_ckptfs)], run):
                    times = fn(target, source, root, f"{target.name}-{way}-{run}")
                    for name, value in times.items():
                        results.setdefault(f"{target.name} {way} {name}", []).append(value)
                    shown = "  ".join(f"{k} {v:7.2f}" for k, v in times.items())
                    print(f"run {run + 1}/{args.runs} {target.name:<5} {way:<6} {shown}", flush=True)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)

    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nmedians of {args.runs} interleaved runs, one {args.size / MIB:.0f} MiB file, emulators on 127.0.0.1"
          " (CPU-bound on this machine: ratios, not absolute times)")
    for name, value in medians.items():
        print(f"  {name:<36} {value:8.2f}")
    ratios: dict[str, float] = {}
    for target in targets:
        n = target.name
        ratios[f"{n}: ckptfs durable / local write + sdk upload"] = medians[f"{n} ckptfs durable"] / medians[
            f"{n} sdk durable"]
        ratios[f"{n}: ckptfs write / local write"] = medians[f"{n} ckptfs write"] / medians[f"{n} sdk write"]
        ratios[f"{n}: ckptfs restore / sdk download"] = medians[f"{n} ckptfs restore"] / medians[
            f"{n} sdk restore"]
    for name, value in ratios.items():
        print(f"  {name:<48} {value:5.2f}x")
    write_report(args.json, {"size_bytes": args.size, "runs": args.runs}, results, medians, ratios)


if __name__ == "__main__":
    main()
