"""The S3 drain under injected faults: a real mount of s3://bucket/prefix whose endpoint is a fault proxy
(tests/faultproxy.py) in front of SeaweedFS on 127.0.0.1. The proxy throttles (503 SlowDown), fails
(500 InternalError, 403 AccessDenied), resets connections before, during and after a request, and stalls.
Whatever it does, nothing written is lost: every file ends up in the bucket (read directly from SeaweedFS,
never through the proxy) byte for byte, no torn object ever appears at a final key, and no multipart upload
is left behind. Gaps found in ckptfs are the tests marked xfail(strict=True), each with the reason."""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import Mount
from emulators import S3Server, s3_bucket, seaweedfs_s3  # noqa: F401
from faultproxy import FaultProxy, Rule
from waiting import mount_drain_had_its_chance, wait_until

from ckptfs.backends.base import RANGE_PIECE
from ckptfs.backends.s3 import S3Store
from ckptfs.errors import BackendError, TransientBackendError

MiB = 1 << 20
PREFIX = "run-1/"
STATE_XATTR = "user.ckptfs.state"
# What the daemon logs, at WARNING, for a store call that failed and will be retried.
RETRY_WARNING = "retrying in"


@pytest.fixture
def bucket(seaweedfs_s3: S3Server) -> Iterator[str]:
    with s3_bucket(seaweedfs_s3) as name:
        yield name


@pytest.fixture
def proxy(seaweedfs_s3: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(seaweedfs_s3.endpoint, seed=int.from_bytes(os.urandom(4), "big")) as fp:
        yield fp


@pytest.fixture
def s3_mount(proxy: FaultProxy, bucket: str, mount_factory) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    """make(*extra_args, name="m") -> a started Mount of s3://bucket/run-1 through the proxy. Requested after
    the proxy, so mounts are unmounted before the proxy stops; the proxy is healed first, so that a test that
    failed mid-fault does not leave its daemon draining into a wall."""

    def make(*extra: str, name: str = "m") -> Mount:
        mount: Mount = mount_factory(
            name, source=f"s3://{bucket}/{PREFIX}", extra_args=("--endpoint-url", proxy.endpoint, *extra)
        )
        return mount

    yield make
    proxy.heal()


def _stop_leaving_an_upload_behind(m: Mount, server: S3Server, bucket: str) -> None:
    """before.bin written and flushed, the mount stopped, and what a kill -9 right after opening an upload
    leaves in the store: an upload of lost.bin by this cache dir that its journal never heard of."""
    (m.mnt / "before.bin").write_bytes(b"written before the stop")
    m.flush(timeout=60)
    m.umount()
    with sqlite3.connect(m.cache / "journal.db") as db:
        owner = db.execute("SELECT value FROM meta WHERE key = 'owner'").fetchone()[0]
    S3Store(bucket, PREFIX.rstrip("/"), endpoint_url=server.endpoint, owner=owner).open_upload("lost.bin", None, None)


def _objects(server: S3Server, bucket: str) -> dict[str, bytes]:
    """Every object under PREFIX but the store's own bookkeeping, read directly from SeaweedFS."""
    client = server.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX):
        for obj in page.get("Contents", []):
            if "/.ckptfs-tmp." in "/" + obj["Key"]:
                continue
            out[obj["Key"][len(PREFIX):]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _multipart_uploads(server: S3Server, bucket: str) -> list[str]:
    uploads = server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return [u["Key"] for u in uploads]


def _state(path: Path) -> str:
    return os.getxattr(path, STATE_XATTR).decode()


def _write_checkpoint(mnt: Path) -> dict[str, bytes]:
    """A mix of what a training job writes: small files (one PUT), files just above and well above the
    multipart threshold (8 MiB) with 5 MiB parts, a torch.save, nested directories. Returns path -> bytes."""
    torch = pytest.importorskip("torch")
    files = {
        "latest": b"step_7\n",
        "step_7/config.json": b'{"lr": 0.001}\n' * 50,
        "step_7/rng.bin": os.urandom(300 * 1024),
        "step_7/optim.bin": os.urandom(7 * MiB),  # below the multipart threshold: one PUT of 7 MiB
        "step_7/shard-0.bin": os.urandom(30 * MiB),  # 6 parts of 5 MiB
        "step_7/shard-1.bin": os.urandom(12 * MiB + 4321),  # 3 parts, a short tail
    }
    (mnt / "step_7").mkdir()
    for rel, data in files.items():
        if rel != "latest":
            (mnt / rel).write_bytes(data)
    state = {"w": torch.randn(2 * MiB), "b": torch.arange(1000)}
    torch.save(state, mnt / "step_7" / "model.pt")
    files["step_7/model.pt"] = (mnt / "step_7" / "model.pt").read_bytes()
    (mnt / "latest").write_bytes(files["latest"])  # a commit marker: uploaded after the rest
    return files


def _assert_durable(server: S3Server, bucket: str, mount: Mount, files: dict[str, bytes], proxy: FaultProxy) -> None:
    stored = _objects(server, bucket)
    dirs = {rel.rsplit("/", 1)[0] + "/" for rel in files if "/" in rel}
    assert set(stored) == set(files) | dirs, sorted(set(stored) ^ (set(files) | dirs))
    for rel, data in files.items():
        assert hashlib.sha256(stored[rel]).hexdigest() == hashlib.sha256(data).hexdigest(), rel
        assert _state(mount.mnt / rel) == "clean", rel
    leftovers = _multipart_uploads(server, bucket)
    creates = [f"{action}: {line}" for _, line, action in proxy.log if re.search(r"^POST \S+\?uploads ", line)]
    assert leftovers == [], "multipart uploads were left behind; the creates:\n" + "\n".join(creates)
    status = mount.status()
    assert status["states"]["dirty"]["files"] == 0 and status["states"]["uploading"]["files"] == 0, status
    assert status["queue"]["uploads"] == 0, status


# -- the proxy itself ---------------------------------------------------------------------------------------


def test_proxy_forwards_each_request_whole(seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str) -> None:
    """Sanity of the harness: requests pass unchanged (signatures stay valid, bodies intact, 100-continue
    answered), faults are injected by rule, count and pattern, and a HEAD error has no body."""
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client(
        "s3", endpoint_url=proxy.endpoint, region_name="us-east-1",
        config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"mode": "standard",
                                                                               "total_max_attempts": 1}),
    )
    data = os.urandom(6 * MiB)
    client.put_object(Bucket=bucket, Key="a", Body=data)
    assert client.get_object(Bucket=bucket, Key="a")["Body"].read() == data
    proxy.set_rules(Rule("slowdown", match=r"^PUT ", count=1), Rule("error", match=r"^HEAD ", status=403,
                                                                    code="AccessDenied"))
    with pytest.raises(botocore.exceptions.ClientError, match="SlowDown"):
        client.put_object(Bucket=bucket, Key="b", Body=data)
    client.put_object(Bucket=bucket, Key="b", Body=b"b")  # the rule's count is used up
    with pytest.raises(botocore.exceptions.ClientError, match="403"):
        client.head_object(Bucket=bucket, Key="a")
    for action in ("reset", "reset_mid", "lost_response"):
        proxy.set_rules(Rule(action, match=r"^PUT "))
        with pytest.raises(botocore.exceptions.ConnectionClosedError):
            client.put_object(Bucket=bucket, Key=action, Body=data)
    proxy.heal()
    # "lost_response" reached the server; "reset" and "reset_mid" did not
    assert set(_keys(seaweedfs_s3, bucket)) == {"a", "b", "lost_response"}
    assert proxy.seen(r"^PUT /\S+/b ", "slowdown") == 1


def _keys(server: S3Server, bucket: str) -> list[str]:
    return [o["Key"] for o in server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_proxy_frames_chunked_requests() -> None:
    """Chunked bodies with trailers (the framing of botocore's aws-chunked uploads) are read to their end
    and forwarded as they are."""
    import http.server
    import socket

    received: list[bytes] = []

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            raw = b""
            while not raw.endswith(b"0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n"):
                raw += self.rfile.read1(65536)
            received.append(raw)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_address[1]}") as fp:
            body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-amz-checksum-crc32:AAAAAA==\r\n\r\n"
            with socket.create_connection(("127.0.0.1", fp.port), timeout=10) as sock:
                sock.sendall(b"PUT /b/k HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                             b"Content-Encoding: aws-chunked\r\nExpect: 100-continue\r\n\r\n")
                assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
                sock.sendall(body)
                answer = b""
                while chunk := sock.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.") and b" 200 " in answer.split(b"\r\n")[0]
            assert b"\r\nConnection: close\r\n" in answer and answer.endswith(b"\r\n\r\nok")
            assert received == [body]
    finally:
        server.shutdown()
        server.server_close()


def _sockets_to(port: int) -> set[int]:
    """The inodes of this process's TCP sockets connected to 127.0.0.1:port."""
    inodes = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            inodes.add(int(fields[9]))
    mine = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}
    return {inode for inode in inodes if f"socket:[{inode}]" in mine}


def test_ranged_gets_into_a_sink_reuse_their_connection_and_a_cut_body_is_transient(
    seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    """The S3 store reads a range's body straight into a buffer it reuses (s3wire.py): the connection goes
    back to botocore's pool once the body is read to its end (the next range uses it), and a body cut off
    mid-way is a transient failure the engine retries, not an http.client error it does not know."""
    data = os.urandom(4 * RANGE_PIECE + 123)
    seaweedfs_s3.client().put_object(Bucket=bucket, Key="r/big", Body=data)
    got = bytearray()

    def sink(piece: bytes | memoryview) -> None:
        got.extend(piece)

    direct = S3Store(bucket, "r", endpoint_url=seaweedfs_s3.endpoint)
    port = int(seaweedfs_s3.endpoint.rsplit(":", 1)[1].rstrip("/"))
    used = []
    for _ in range(3):
        got.clear()
        direct.get_range("big", 0, len(data), sink=sink)
        assert got == data
        used.append(_sockets_to(port))
    assert len(used[0]) == 1 and used[0] == used[1] == used[2], used

    proxied = S3Store(bucket, "r", endpoint_url=proxy.endpoint)
    rule = proxy.add_rule(Rule("cut_answer", match=r"^GET \S*/r/big ", count=1))
    with pytest.raises(TransientBackendError):
        proxied.get_range("big", 0, len(data), sink=sink)
    assert rule.fired == 1
    got.clear()
    proxied.get_range("big", 0, len(data), sink=sink)
    assert got == data


# -- the drain under faults ---------------------------------------------------------------------------------


def test_throttling_storm_loses_nothing(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                        bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append(RETRY_WARNING)
    # Half of all requests, and surely the first tries of one PUT and of some parts (botocore retries once,
    # the transfer engine a few more times: those retries are counted whatever the dice say).
    proxy.set_rules(
        Rule("slowdown", match=r"^PUT \S+/latest ", count=2),
        Rule("slowdown", match=r"^PUT \S+partNumber=", count=3),
        Rule("slowdown", fraction=0.5),
    )
    files = _write_checkpoint(m.mnt)
    m.flush(timeout=150)
    proxy.heal()
    assert proxy.injected["slowdown"] >= 10, proxy.injected
    _assert_durable(seaweedfs_s3, bucket, m, files, proxy)
    status = m.status()
    assert status["transfers"]["retries"] > 0, status
    assert status["errors"] == 0 or "SlowDown" in (status["last_error"] or ""), status
    assert status["uploaded"]["files"] >= len(files), status
    assert proxy.seen(r"^PUT \S+partNumber=", "slowdown") > 0, "no part upload was throttled"


def test_resets_and_500s_lose_nothing(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                      bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append(RETRY_WARNING)
    proxy.set_rules(
        # Surely each kind at least once; the first two tries of one PUT fail, so the drain sees an error.
        Rule("reset", match=r"^PUT \S+/latest ", count=1),
        Rule("internal", match=r"^PUT \S+/latest ", count=1),
        Rule("reset_mid", match=r"^PUT \S+partNumber=", count=2),
        # then the dice
        Rule("reset_mid", match=r"^PUT \S+partNumber=", fraction=0.25),  # mid-body, during part uploads
        Rule("reset", fraction=0.1),
        # A create has no body: reset "mid-request" it reaches the server and its answer is lost
        # (test_lost_create_multipart_answer_leaves_no_upload covers that alone).
        Rule("reset_mid", match=r"^(?!POST \S+\?uploads )", fraction=0.1),
        Rule("internal", fraction=0.25),
    )
    files = _write_checkpoint(m.mnt)
    m.flush(timeout=150)
    proxy.heal()
    for action in ("reset", "reset_mid", "internal"):
        assert proxy.injected[action] > 0, proxy.injected
    _assert_durable(seaweedfs_s3, bucket, m, files, proxy)
    status = m.status()
    assert status["transfers"]["retries"] + status["errors"] > 0, status  # retried by the engine or the drain


def test_lost_responses_lose_nothing(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                     bucket: str) -> None:
    """Requests that reach the server but whose answer never comes back (the connection drops after the
    server acted): retried part uploads, PUTs, completes and deletes must all be idempotent. Creates of
    multipart uploads are spared here (see the next test)."""
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append(RETRY_WARNING)
    proxy.set_rules(
        Rule("lost_response", match=r"^PUT \S+partNumber=", count=1),
        Rule("lost_response", match=r"^POST \S+\?uploadId=", count=1),
        Rule("lost_response", match=r"^(PUT|POST \S+\?uploadId=|DELETE) ", fraction=0.3),
    )
    files = _write_checkpoint(m.mnt)
    (m.mnt / "scratch").write_bytes(b"gone soon")
    m.flush(timeout=150)
    (m.mnt / "scratch").unlink()
    m.flush(timeout=150)
    proxy.heal()
    assert proxy.seen(r"^POST \S+\?uploadId=", "lost_response") > 0
    assert proxy.seen(r"^PUT \S+partNumber=", "lost_response") > 0
    _assert_durable(seaweedfs_s3, bucket, m, files, proxy)


def test_lost_create_multipart_answer_leaves_no_upload(s3_mount, seaweedfs_s3: S3Server,
                                                       proxy: FaultProxy, bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append(RETRY_WARNING)
    proxy.set_rules(Rule("lost_response", match=r"^POST \S+\?uploads ", count=1))
    data = os.urandom(12 * MiB)
    (m.mnt / "big.bin").write_bytes(data)
    m.flush(timeout=60)
    assert proxy.seen(r"^POST \S+\?uploads ", "lost_response") == 1
    assert _objects(seaweedfs_s3, bucket) == {"big.bin": data}
    # A restart (which aborts what interrupted uploads left) does not find it either.
    assert m.umount().returncode == 0
    m.start()
    m.flush(timeout=60)
    assert _multipart_uploads(seaweedfs_s3, bucket) == [], "an orphaned multipart upload was left behind"


def test_stalled_requests_complete(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                   bucket: str) -> None:
    """Slow answers (shorter than S3Store's 60 s read timeout, which is fixed and too long for a test) hold
    up nothing but themselves: the upload completes, correct, without errors."""
    m = s3_mount("--part-size", "5M")
    proxy.set_rules(
        Rule("stall", match=r"^PUT \S+partNumber=", count=1, seconds=2),
        Rule("stall", match=r"^PUT \S+partNumber=", fraction=0.5, seconds=2),
        Rule("stall", match=r"^POST \S+\?uploadId=", seconds=1),
        Rule("stall", match=r"^PUT ", fraction=0.3, seconds=1),
    )
    files = {"a.bin": os.urandom(30 * MiB), "b.bin": os.urandom(MiB), "c.bin": os.urandom(2000)}
    for rel, data in files.items():
        (m.mnt / rel).write_bytes(data)
    started = time.monotonic()
    m.flush(timeout=120)
    proxy.heal()
    assert proxy.injected["stall"] >= 2, proxy.injected
    assert time.monotonic() - started >= 1
    _assert_durable(seaweedfs_s3, bucket, m, files, proxy)
    assert m.status()["errors"] == 0


@pytest.mark.serial  # the other uploads within 8 s
def test_a_stalled_upload_does_not_hold_up_others(s3_mount, seaweedfs_s3: S3Server,
                                                  proxy: FaultProxy, bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    proxy.set_rules(Rule("stall", match=r"^PUT \S+/slow\.bin ", count=1, seconds=10))
    files = {"slow.bin": os.urandom(MiB)}
    (m.mnt / "slow.bin").write_bytes(files["slow.bin"])
    wait_until(lambda: proxy.seen(r"^PUT \S+/slow\.bin ", "stall") == 1, timeout=10, what="the stalled PUT")
    started = time.monotonic()
    others = {f"other-{i}.bin": os.urandom(200_000 * (i + 1)) for i in range(5)}
    others["other-big.bin"] = os.urandom(12 * MiB)  # multipart
    for name, data in others.items():
        (m.mnt / name).write_bytes(data)
    m.flush(*others, timeout=60)
    assert time.monotonic() - started < 8, "uploads waited for the stalled one"
    assert _state(m.mnt / "slow.bin") == "uploading"
    m.flush(timeout=60)
    _assert_durable(seaweedfs_s3, bucket, m, files | others, proxy)
    assert m.status()["errors"] == 0


def test_permanent_error_keeps_data_dirty_until_healed(s3_mount, seaweedfs_s3: S3Server,
                                                       proxy: FaultProxy, bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append("AccessDenied")  # the one ERROR line per failing operation
    proxy.set_rules(Rule("error", match=r"^PUT ", status=403, code="AccessDenied", message="Access Denied"))
    small, big = os.urandom(100_000), os.urandom(12 * MiB)
    (m.mnt / "small.bin").write_bytes(small)
    (m.mnt / "big.bin").write_bytes(big)
    wait_until(lambda: "AccessDenied" in (m.status()["last_error"] or ""),
               timeout=30, what="the error to show in status")
    wait_until(lambda: all(_state(m.mnt / n) == "dirty" for n in ("small.bin", "big.bin")),
               timeout=10, what="dirty files")
    status = m.status()
    pending = status["states"]["dirty"]["files"] + status["states"]["uploading"]["files"]  # a retry may be on
    assert status["errors"] > 0 and pending == 2, status
    assert "Access Denied" in status["last_error"] or "AccessDenied" in status["last_error"]
    assert status["states"]["clean"]["files"] == 0

    # The mount keeps working locally: reads, writes, renames, deletes.
    assert (m.mnt / "big.bin").read_bytes() == big
    (m.mnt / "more.bin").write_bytes(b"more")
    os.rename(m.mnt / "small.bin", m.mnt / "renamed.bin")
    (m.mnt / "gone.bin").write_bytes(b"x")
    (m.mnt / "gone.bin").unlink()
    assert sorted(os.listdir(m.mnt)) == ["big.bin", "more.bin", "renamed.bin"]
    assert (m.mnt / "renamed.bin").read_bytes() == small
    since = time.time()
    result = m.cli("flush", str(m.mnt), "--timeout", "2", timeout=60)
    assert result.returncode != 0, "flush claimed durability while every PUT was denied"
    mount_drain_had_its_chance(m.status, since=since, what="upload anything while every PUT is denied")
    assert _objects(seaweedfs_s3, bucket) == {}
    for name in ("big.bin", "more.bin", "renamed.bin"):
        assert _state(m.mnt / name) in ("dirty", "uploading"), name

    # Reported once per failing operation, not once per retry.
    errors = [line.split(" ERROR ", 1)[1] for line in m.log.read_text().splitlines() if " ERROR " in line]
    assert errors and all("AccessDenied" in e for e in errors), errors
    assert len(errors) == len(set(errors)), errors

    proxy.heal()
    m.flush(timeout=120)
    assert _objects(seaweedfs_s3, bucket) == {"big.bin": big, "more.bin": b"more", "renamed.bin": small}
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    for name in ("big.bin", "more.bin", "renamed.bin"):
        assert _state(m.mnt / name) == "clean", name


def test_access_denied_mid_multipart_resumes_after_heal(s3_mount, seaweedfs_s3: S3Server,
                                                        proxy: FaultProxy, bucket: str) -> None:
    """Permission lost between CreateMultipartUpload and the parts: the staged upload is kept, and once
    access is back it continues from the parts already there and completes."""
    m = s3_mount("--part-size", "5M")
    m.allowed_log_words.append("AccessDenied")
    denied = Rule("error", match=r"^PUT \S+partNumber=([3-9]|\d\d) ", status=403, code="AccessDenied",
                  message="Access Denied")
    proxy.set_rules(denied)
    data = os.urandom(30 * MiB)  # parts 1 and 2 go through, 3 to 6 are denied
    (m.mnt / "big.bin").write_bytes(data)
    wait_until(lambda: "AccessDenied" in (m.status()["last_error"] or ""),
               timeout=30, what="the error to show in status")
    assert denied.fired > 0
    assert _state(m.mnt / "big.bin") in ("dirty", "uploading")
    assert _objects(seaweedfs_s3, bucket) == {}
    proxy.heal()
    m.flush(timeout=120)
    assert _objects(seaweedfs_s3, bucket) == {"big.bin": data}
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    assert any("resuming upload of big.bin" in line for line in m.log.read_text().splitlines())
    # every part went through once; no upload started over
    assert proxy.seen(r"^POST \S+/big\.bin\?uploads ") == 1


class _BucketWatcher:
    """Lists the bucket directly, as often as it can, and remembers every key it ever saw."""

    def __init__(self, server: S3Server, bucket: str) -> None:
        self.client = server.client()
        self.bucket = bucket
        self.seen: set[str] = set()
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for obj in self.client.list_objects_v2(Bucket=self.bucket, Prefix=PREFIX).get("Contents", []):
                self.seen.add(obj["Key"][len(PREFIX):])
            self.scans += 1
            self._stop.wait(0.02)

    def __enter__(self) -> _BucketWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_rename_during_multipart_upload(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                        bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    proxy.set_rules(Rule("stall", match=r"^PUT \S+/ckpt/big\.bin\?\S*partNumber=", seconds=0.5))
    data = os.urandom(30 * MiB)  # 6 parts, 4 in flight: the upload takes over a second
    (m.mnt / "ckpt").mkdir()
    with _BucketWatcher(seaweedfs_s3, bucket) as watcher:
        (m.mnt / "ckpt" / "big.bin").write_bytes(data)
        wait_until(lambda: proxy.seen(r"^PUT \S+/ckpt/big\.bin\?\S*partNumber=") > 0,
                   timeout=30, what="the first part upload")
        assert _state(m.mnt / "ckpt" / "big.bin") == "uploading"
        os.rename(m.mnt / "ckpt" / "big.bin", m.mnt / "ckpt" / "final.bin")
        renamed_at = time.monotonic()
        m.flush(timeout=90)
        proxy.heal()
        time.sleep(0.2)
    assert watcher.scans > 10
    assert proxy.seen(r"^PUT \S+/ckpt/big\.bin\?\S*partNumber=", "stall") > 0, "no part of the old name was stalled"
    assert "ckpt/big.bin" not in watcher.seen, "the object appeared under its old name"
    assert _objects(seaweedfs_s3, bucket) == {"ckpt/": b"", "ckpt/final.bin": data}
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    # The rename landed while parts of the old name were in flight, and the new name was uploaded after.
    old_parts = [t for t, line, _ in proxy.log if re.search(r"^PUT \S+/ckpt/big\.bin\?\S*partNumber=", line)]
    new_parts = [t for t, line, _ in proxy.log if re.search(r"^PUT \S+/ckpt/final\.bin\?\S*partNumber=", line)]
    assert min(old_parts) < renamed_at < max(old_parts) + 0.5, "the rename did not land mid-upload"
    assert new_parts and min(new_parts) > renamed_at
    assert _state(m.mnt / "ckpt" / "final.bin") == "clean"


def test_dcp_save_through_faults_and_load_on_fresh_mount(s3_mount, seaweedfs_s3: S3Server,
                                                         proxy: FaultProxy, bucket: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    m = s3_mount()
    m.allowed_log_words.append(RETRY_WARNING)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    state = {"model": model.state_dict(), "step": torch.tensor(7)}
    ckpt = m.mnt / "dcp" / "step-7"
    ckpt.mkdir(parents=True)
    proxy.set_rules(Rule("slowdown", fraction=0.3), Rule("reset", fraction=0.1), Rule("internal", fraction=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt), single_file_per_rank=False,
                                                            thread_count=2), no_dist=True)
    names = sorted(os.listdir(ckpt))
    distcp = [n for n in names if n.endswith(".distcp")]
    assert ".metadata" in names and len(distcp) >= 3, names
    m.flush(timeout=120)
    proxy.heal()
    assert sum(proxy.injected.values()) > 0, "no fault was injected"
    stored = _objects(seaweedfs_s3, bucket)
    for name in names:
        assert stored[f"dcp/step-7/{name}"] == (ckpt / name).read_bytes(), name
    assert set(stored) == {"dcp/", "dcp/step-7/"} | {f"dcp/step-7/{n}" for n in names}
    # .metadata is a commit marker: its first upload attempt came after every data file had landed.
    forwarded = [(t, line) for t, line, action in proxy.log if action == "forward" and line.startswith("PUT ")]
    marker_first = min(t for t, line, _ in proxy.log if line.startswith("PUT ") and "/.metadata " in line)
    data_last = max(t for t, line in forwarded if ".distcp " in line)
    assert marker_first > data_last
    assert m.umount().returncode == 0

    # A new node (empty cache) loads the checkpoint from the bucket through its own mount.
    fresh = s3_mount(name="fresh")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": torch.tensor(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(fresh.mnt / "dcp" / "step-7")), no_dist=True)
    for key, value in state["model"].items():
        assert torch.equal(target["model"][key], value), key
    assert int(target["step"]) == 7


def test_fresh_mount_reads_through_throttling(s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy,
                                              bucket: str) -> None:
    m = s3_mount("--part-size", "5M")
    data = os.urandom(12 * MiB)
    (m.mnt / "model.bin").write_bytes(data)
    m.flush(timeout=60)
    assert m.umount().returncode == 0
    fresh = s3_mount("--part-size", "5M", name="fresh")
    fresh.allowed_log_words += ["cannot fetch", "fetch of model.bin failed"]
    throttled = Rule("slowdown", match=r"^GET /\S+/model\.bin ", count=2)
    proxy.set_rules(throttled)
    assert (fresh.mnt / "model.bin").read_bytes() == data
    assert throttled.fired == 2, "the reads were not throttled"


def test_mount_rides_out_throttling_at_start(s3_mount, proxy: FaultProxy) -> None:
    throttled = Rule("slowdown", match=r"^GET \S+list-type=2", count=2)
    proxy.set_rules(throttled)
    m = s3_mount()
    assert throttled.fired == 2, "the start's listings were not throttled"
    (m.mnt / "a").write_bytes(b"a")
    m.flush(timeout=30)


def test_mount_waits_out_a_store_that_throttles_every_try_of_its_first_listing(s3_mount, proxy: FaultProxy) -> None:
    """The start's check of the store gave up after its few retries (a second or two) under a 503 storm,
    and the mount failed with "cannot use s3://...: SlowDown" (crash harness, SeaweedFS with faults, seed
    10500 round 14). A store that answers "busy" is there: the check waits for it (up to a minute)."""
    storm = Rule("slowdown", match=r"^GET \S+list-type=2", count=24)
    proxy.set_rules(storm)
    m = s3_mount()
    m.allowed_log_words += ["is busy"]
    assert storm.fired == 24
    (m.mnt / "a").write_bytes(b"a")
    m.flush(timeout=30)


def test_mount_starts_when_the_cleanup_of_old_uploads_keeps_failing(s3_mount, seaweedfs_s3: S3Server,
                                                                     proxy: FaultProxy, bucket: str) -> None:
    """Removing the last run's interrupted uploads is housekeeping: a store failing it for longer than the
    retries last must not keep the mount from starting (the crash harness saw a daemon exit on a 500 storm
    right after a kill -9); the leftovers are removed at a later start."""
    m = s3_mount("--part-size", "5M")
    (m.mnt / "before.bin").write_bytes(b"written before the kill")
    m.flush(timeout=60)
    m.kill9()
    rule = Rule("internal", match=r"^GET \S+prefix=[^ &]*ckptfs-tmp\.uploads")
    proxy.set_rules(rule)
    m.start()
    m.allowed_log_words += ["cannot remove the"]  # at the start, and again at the flush
    (m.mnt / "after.bin").write_bytes(b"written after the start")
    # The data is durable within seconds; the flush's sweep is then refused until the flush's deadline.
    m.flush(timeout=15)
    assert rule.fired > 0
    assert "cannot remove the interrupted uploads" in m.log.read_text()
    proxy.heal()
    stored = _objects(seaweedfs_s3, bucket)
    assert stored == {"before.bin": b"written before the kill", "after.bin": b"written after the start"}


def test_the_mount_serves_while_the_start_up_sweep_of_leftovers_waits_for_the_store(
    s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    """The start listed the last run's leftovers before the mount served: under throttling it waited out
    botocore's and the engine's retries of that listing (27 s, test_leftovers_the_start_could_not_remove_...).
    Now the drain sweeps in the background: the mount serves at once (writes, reads, and listings, which do
    not wait for the sweep), the drain's own store calls wait for its listing, and a flush for the sweep."""
    stall = 25.0
    m = s3_mount("--part-size", "5M", "--refresh-interval", "1")
    _stop_leaving_an_upload_behind(m, seaweedfs_s3, bucket)
    # Another node's object, which this node sees only when it lists the root again.
    seaweedfs_s3.client().put_object(Bucket=bucket, Key=f"{PREFIX}other.bin", Body=b"theirs")
    held = Rule("stall", match=r"^GET \S+prefix=[^ &]*ckptfs-tmp\.uploads", count=1, seconds=stall)
    proxy.set_rules(held)
    started = time.monotonic()
    m.start()
    (m.mnt / "after.bin").write_bytes(b"written while the sweep waits")
    assert (m.mnt / "before.bin").read_bytes() == b"written before the stop"
    time.sleep(1.1)  # the root's listing is stale (--refresh-interval 1): the next access lists it again
    assert "other.bin" in os.listdir(m.mnt)
    served = time.monotonic() - started
    assert held.fired == 1 and served < stall, f"the mount served only after {served:.1f} s"
    m.flush(timeout=120)  # waits for the start-up sweep
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    assert [key for key in _keys(seaweedfs_s3, bucket) if ".ckptfs-tmp." in key] == []
    assert _objects(seaweedfs_s3, bucket) == {"before.bin": b"written before the stop", "other.bin": b"theirs",
                                              "after.bin": b"written while the sweep waits"}
    assert "removed 1 leftovers of uploads interrupted by the last stop" in m.log.read_text()


def test_leftovers_the_start_could_not_remove_are_gone_after_the_next_flush(
    s3_mount, seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    """The start-up cleanup met a 503 storm and gave up; `ckptfs flush` then left the killed run's upload
    (and its marker) in the store until the next start (crash harness, SeaweedFS with faults, seed 10400
    round 51). Now the flush sweeps them, sparing what the running daemon has staged itself."""
    m = s3_mount("--part-size", "5M")
    _stop_leaving_an_upload_behind(m, seaweedfs_s3, bucket)
    assert _multipart_uploads(seaweedfs_s3, bucket) == [f"{PREFIX}lost.bin"]
    storm = Rule("error", match=r"ckptfs-tmp\.uploads", code="SlowDown")
    proxy.set_rules(storm)
    m.start()
    m.allowed_log_words += ["cannot remove the interrupted uploads"]
    # The start-up sweep runs in the background: the storm outlasts its retries before the proxy heals.
    wait_until(lambda: "cannot remove the interrupted uploads" in m.log.read_text(), timeout=120,
               what="the daemon to log that it cannot remove the interrupted uploads")
    assert storm.fired > 0
    proxy.heal()
    big = os.urandom(12 * MiB)  # staged in parts while the sweep runs: it must survive it
    (m.mnt / "after.bin").write_bytes(big)
    m.flush(timeout=60)
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    assert [key for key in _keys(seaweedfs_s3, bucket) if ".ckptfs-tmp." in key] == []
    stored = _objects(seaweedfs_s3, bucket)
    assert stored == {"before.bin": b"written before the stop", "after.bin": big}


def test_an_upload_marker_whose_write_lost_its_answer_is_swept_at_the_flush(
    seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    """The write of a multipart upload's owner marker took effect but its answer was lost; the engine's retry
    wrote another marker, and nothing said the first was left behind, so no sweep ran and a flush left it in
    the store (crash harness, SeaweedFS with lost answers, seed 9442 round 29). Now the store says so."""
    # Both tries of the SDK (it sends a request once more itself) lose their answers.
    lost = Rule("lost_response", match=r"^PUT \S+ckptfs-tmp\.uploads", count=2)
    proxy.set_rules(lost)
    store = S3Store(bucket, PREFIX.rstrip("/"), endpoint_url=proxy.endpoint, owner="o")
    with pytest.raises(BackendError):
        store.open_upload("a.bin", None, None)
    assert lost.fired == 2
    markers = [key for key in _keys(seaweedfs_s3, bucket) if ".ckptfs-tmp.uploads/o/" in key]
    assert len(markers) == 1, markers  # written, though the client never heard so
    assert store.left_behind  # so the engine sweeps (Leftovers.due), at the latest at the next flush
    for ref in store.list_leftovers():
        store.abort_upload(ref)
    assert [key for key in _keys(seaweedfs_s3, bucket) if ".ckptfs-tmp." in key] == []


async def test_a_marker_whose_delete_fails_during_the_flush_sweep_is_swept_again_before_it_ends(
    seaweedfs_s3: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    """The sweep at the end of a flush aborted a killed run's upload, but the delete of its owner marker met a
    503 (best effort, one request): the sweep counted the upload removed and the flush ended with the marker
    in the store (crash harness, SeaweedFS with faults, seed 822 round 3). Now a sweep during which a cleanup
    failed is asked again within the flush's bound."""
    from store_targets import engine

    owner = "o"
    S3Store(bucket, PREFIX.rstrip("/"), endpoint_url=seaweedfs_s3.endpoint, owner=owner).open_upload(
        "lost.bin", None, None)  # what a kill -9 right after opening an upload leaves
    # Both tries of the SDK's one request: the marker's delete fails once, as the wire sees it.
    refused = Rule("error", match=r"^DELETE \S+ckptfs-tmp\.uploads/", code="SlowDown", count=2)
    proxy.set_rules(refused)
    transfers = engine(S3Store(bucket, PREFIX.rstrip("/"), endpoint_url=proxy.endpoint, owner=owner))
    transfers.leftovers.hold_until_swept()  # as recovery does: a sweep is due
    with trio.fail_after(60):
        await transfers.leftovers.sweep_in_background(refused_retry_until=trio.current_time() + 30)
    assert refused.fired == 2
    assert _multipart_uploads(seaweedfs_s3, bucket) == []
    assert [key for key in _keys(seaweedfs_s3, bucket) if ".ckptfs-tmp." in key] == []
    assert not transfers.leftovers.due
