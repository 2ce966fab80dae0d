"""Preemption through a real mount (issue 44): `ckptfs preempt --deadline` with the store throttled to a
known rate (the upload cap, kept), SIGTERM with preempt_on_sigterm, and the clouds' notices served by a fake
metadata endpoint of ours on 127.0.0.1 (plain HTTP, as the instance's own would be)."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Mount
from localhttp import LocalHttpServer, QuietHandler

from ckptfs.cli import EXIT_NOT_DURABLE
from ckptfs.notices.preempter import REPORT_NAME

MiB = 1 << 20
SHARD = 2 * MiB
RATE = "2M"
STEP_SECONDS = 2 * SHARD / (2 * MiB)  # one step of two shards at the cap


def save_step(mnt: Path, name: str) -> None:
    (mnt / name).mkdir()
    for i in range(2):
        (mnt / name / f"shard{i}").write_bytes(bytes([i + 1]) * SHARD)
    (mnt / name / ".metadata").write_text(f"{name} done")


def wait_until(condition, seconds: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ckptfs_preempt_makes_the_newest_step_durable_within_the_deadline_at_a_known_rate(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=600, extra_args=("--upload-limit", RATE))
    m.allowed_log_words += ["preemption"]
    for name in ("step_100", "step_200", "step_300"):
        save_step(m.mnt, name)
    # Room for the newest step and part of the next at the cap: three steps need 3.4x this deadline.
    started = time.monotonic()
    done = m.cli("preempt", str(m.mnt), "--deadline", f"{STEP_SECONDS * 1.75}s", "--keep-limits", "--json",
                 timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["durable"] == ["step_300"] and report["newest_complete_step"] == "step_300"
    assert set(report["not_durable"]) == {"step_200", "step_100"}
    assert took < STEP_SECONDS * 1.75 + 5
    files = m.store_files()
    assert files["step_300/.metadata"] == b"step_300 done" and "step_100/.metadata" not in files
    assert json.loads((m.cache / REPORT_NAME).read_text())["durable"] == ["step_300"]
    status = m.status()
    assert status["preempting"] is True
    assert any("preemption report" in line and "durable step_300" in line for line in m.log.read_text().splitlines())
    # A bad deadline: one clear error, nothing asked of the daemon.
    bad = m.cli("preempt", str(m.mnt), "--deadline", "soon")
    assert bad.returncode != 0 and "--deadline 'soon' is not a time" in bad.stderr
    m.flush(timeout=60)


def test_sigterm_with_preempt_on_sigterm_is_a_notice_and_the_stop_keeps_to_its_deadline(mount_factory) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=600, extra_args=(
        "--upload-limit", RATE, "--preempt-on-sigterm", str(STEP_SECONDS * 1.75), "--preemption-keep-limits"))
    m.allowed_log_words += ["preemption", "not yet durable"]
    for name in ("step_100", "step_200", "step_300"):
        save_step(m.mnt, name)
    assert m.proc is not None
    started = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    code = m.proc.wait(timeout=60)
    took = time.monotonic() - started
    m.proc = None
    assert code == EXIT_NOT_DURABLE  # the older steps stay journaled for the next mount
    assert took < STEP_SECONDS * 1.75 + 8
    report = json.loads((m.cache / REPORT_NAME).read_text())
    assert report["reason"] == "SIGTERM" and report["durable"] == ["step_300"]
    files = m.store_files()
    assert files["step_300/.metadata"] == b"step_300 done" and "step_100/.metadata" not in files
    m.start()  # the rest resumes at the next mount
    m.flush(timeout=60)
    assert m.store_files()["step_100/.metadata"] == b"step_100 done"


class FakeMetadata:
    """The instance metadata endpoints of the three clouds, with no notice until `notice` is set."""

    def __init__(self) -> None:
        self.notice = threading.Event()
        self.asked: list[str] = []
        self._server = LocalHttpServer(_MetadataHandler, owner=self, name="metadata")
        self.url = self._server.url

    def close(self) -> None:
        self._server.close()


class _MetadataHandler(QuietHandler):
    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.answer(200, b"a-token")
        else:
            self.answer(404)

    def do_GET(self) -> None:
        metadata: FakeMetadata = self.server.owner  # type: ignore[attr-defined]
        metadata.asked.append(self.path)
        notice = metadata.notice.is_set()
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "a-token":
                self.answer(401)
            elif notice:
                at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
                self.answer(200, json.dumps({"action": "terminate", "time": at}).encode())
            else:
                self.answer(404)
        elif self.path == "/computeMetadata/v1/instance/preempted" and self.headers.get("Metadata-Flavor") == "Google":
            self.answer(200, b"TRUE" if notice else b"FALSE")
        elif self.path.startswith("/metadata/scheduledevents") and self.headers.get("Metadata") == "true":
            events = [{"EventId": "e1", "EventType": "Preempt", "NotBefore": time.strftime(
                "%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))}] if notice else []
            self.answer(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
        else:
            self.answer(404)


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    server = FakeMetadata()
    yield server
    server.close()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_the_watcher_acts_on_the_clouds_notice(mount_factory, metadata: FakeMetadata, cloud: str) -> None:  # type: ignore[no-untyped-def]
    m: Mount = mount_factory(upload_delay=600, extra_args=(
        "--preemption-notice", cloud, "--preemption-notice-url", metadata.url))
    m.env["CKPTFS_PREEMPTION_POLL"] = "0.2"
    m.allowed_log_words += ["preemption"]
    m.cleanup()
    m.start()  # again, with the poll interval in its environment
    save_step(m.mnt, "step_100")
    wait_until(lambda: len(metadata.asked) >= 2)
    assert not (m.cache / REPORT_NAME).exists() and "step_100/.metadata" not in m.store_files()
    metadata.notice.set()
    wait_until(lambda: (m.cache / REPORT_NAME).exists())
    report = json.loads((m.cache / REPORT_NAME).read_text())
    assert report["reason"].startswith(f"{cloud} notice") and report["durable"] == ["step_100"]
    assert m.store_files()["step_100/.metadata"] == b"step_100 done"
