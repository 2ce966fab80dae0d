#!/usr/bin/env bash
# Install everything, then run the whole test suite: lint, type check, unit, fs-level and FUSE tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
. .venv/bin/activate
echo "== ruff"; ruff check ckptfs tests bench
echo "== mypy"; mypy
echo "== pytest"; pytest -q -p no:cacheprovider "$@"
