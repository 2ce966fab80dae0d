#!/usr/bin/env bash
# Install ckptfs with its test extra (scripts/install.sh test), then run the randomized crash-and-fault
# harness (tests/crash_harness.py, docs/design/crash-harness.md) with the given arguments, niced.
# Examples:  scripts/crash-harness.sh --rounds 1000 --seed 1 --store file
#            scripts/crash-harness.sh --rounds 100 --seed 2 --store seaweedfs --faults
#            scripts/crash-harness.sh --rounds 100 --seed 3 --store file --keep-mount   (kills taken over)
#            scripts/crash-harness.sh --seed 1 --store file --round 17 --rounds 1 --keep   (replay one round)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
[ "$(id -u)" = 0 ] || { echo "error: run as root (FUSE mounts, and tmpfs for --full-cache)" >&2; exit 1; }
exec nice .venv/bin/python -m tests.crash_harness "$@"
