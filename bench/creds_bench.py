#!/usr/bin/env python3
"""Credentials benchmark (issue 44, part 3): what keeping a web identity (IRSA) credential fresh costs, with
botocore's own provider and with ckptfs's RenewingCredentials (ckptfs/backends/s3creds.py), side by side.

moto server on 127.0.0.1 serves STS and S3; tests/stsproxy.py in front of it cuts each session to
--session seconds (moto issues an hour) and makes S3 refuse expired keys. Each client makes --requests small
PutObjects, one after another, through the proxy with AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN set:
  botocore   a boto3 client from a plain boto3 Session (botocore's AssumeRoleWithWebIdentityProvider)
  ckptfs     S3Store.put_object (RenewingCredentials)
Reported per client: STS calls, requests that failed, requests refused as expired, and the median time of
a request; the order alternates over --rounds, with `sync` and a pause before each run. The machine is
shared with other work: times are noisy, the STS counts are not.

Run from the repo's venv with the test extra installed:  python bench/creds_bench.py [--session 900]
JSON in bench/results/creds_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from emulators import free_ports  # noqa: E402
from stsproxy import StsProxy  # noqa: E402

ROLE_ARN = "arn:aws:iam::123456789012:role/ckptfs-bench"


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    (port,) = free_ports(1)
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                          aws_secret_access_key="bench")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket="creds-bench")
            return proc, endpoint
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def run(kind: str, moto: str, session: float, requests: int, token_file: Path) -> dict[str, Any]:
    import boto3

    from ckptfs.backends.base import ObjectMeta
    from ckptfs.backends.s3 import S3Store

    with StsProxy(moto, session_seconds=session) as proxy:
        os.environ["AWS_ENDPOINT_URL_STS"] = proxy.endpoint
        if kind == "botocore":
            client = boto3.session.Session().client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1")

            def put(n: int) -> None:
                client.put_object(Bucket="creds-bench", Key=f"{kind}/{n}", Body=b"x")
        else:
            store = S3Store("creds-bench", kind, endpoint_url=proxy.endpoint, region="us-east-1")

            def put(n: int) -> None:
                store.put_object(str(n), b"x", ObjectMeta(0, 0o644), "")
        times, failed = [], 0
        for n in range(requests):
            started = time.perf_counter()
            try:
                put(n)
            except Exception:
                failed += 1
            times.append(time.perf_counter() - started)
        return {"client": kind, "sts_calls": len(proxy.issued), "requests": requests, "failed": failed,
                "refused_expired": proxy.expired_rejections,
                "median_request_ms": round(statistics.median(times) * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--session", type=float, default=900.0, help="session lifetime in seconds (default 900)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pause", type=float, default=2.0)
    args = parser.parse_args()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(name, None)
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text("bench-token")
        os.environ.update(AWS_WEB_IDENTITY_TOKEN_FILE=str(token_file), AWS_ROLE_ARN=ROLE_ARN, AWS_REGION="us-east-1",
                          AWS_EC2_METADATA_DISABLED="true")
        proc, moto = start_moto()
        results = []
        try:
            for round_ in range(args.rounds):
                order = ["botocore", "ckptfs"] if round_ % 2 == 0 else ["ckptfs", "botocore"]
                for kind in order:
                    subprocess.run(["sync"], check=False)
                    time.sleep(args.pause)
                    result = run(kind, moto, args.session, args.requests, token_file)
                    result["round"] = round_
                    results.append(result)
                    print(json.dumps(result))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    for kind in ("botocore", "ckptfs"):
        rows = [r for r in results if r["client"] == kind]
        calls = sum(r["sts_calls"] for r in rows)
        total = sum(r["requests"] for r in rows)
        print(f"{kind:9s} {args.session:.0f} s sessions: {calls} STS calls for {total} requests"
              f" ({calls / total:.3f} per request), {sum(r['failed'] for r in rows)} failed, median request"
              f" {statistics.median(r['median_request_ms'] for r in rows):.2f} ms")
    out = REPO / "bench" / "results" / "creds_bench.json"
    out.write_text(json.dumps({"session_seconds": args.session, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
