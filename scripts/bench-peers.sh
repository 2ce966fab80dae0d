#!/usr/bin/env bash
# One command for the peer benchmark (bench/peer_bench.py, issue 6): installs rclone and s3fs from Debian's
# packages and the venv with the test and bench extras (SeaweedFS, torch, matplotlib, py-spy), then runs
# every workload against local disk, ckptfs, rclone (cached, cached with 8 transfers, off) and s3fs on one
# SeaweedFS S3 server on 127.0.0.1. Run as root. Arguments go to peer_bench.py, e.g.
#   bash scripts/bench-peers.sh --scale 0.1 --runs 1        # a quick try (~250 MB checkpoints)
#   bash scripts/bench-peers.sh --runs 3 --profile bench/results   # the full run plus a py-spy profile
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for pkg in rclone s3fs fuse3; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
bash scripts/install.sh "test,bench"
exec .venv/bin/python bench/peer_bench.py "$@"
