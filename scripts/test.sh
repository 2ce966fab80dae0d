#!/usr/bin/env bash
# Install everything, then run the whole test suite: lint, type check, unit, fs-level and FUSE tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh test
. .venv/bin/activate
echo "== ruff"; ruff check ckptfs tests bench
echo "== mypy"; mypy
# The tests wait mostly on FUSE daemons, subprocesses and emulators: more workers than cores keep the cores
# busy. CKPTFS_TEST_WORKERS=0 runs them in this one process (as does `-n 0` among the arguments).
# A daemon the tests start imports ckptfs anew each time: let it compile the modules once, not each time.
unset PYTHONDONTWRITEBYTECODE
# The container image the image and Kubernetes tests run (tests/test_container.py, test_kubernetes_rollout.py):
# built here, before the tests start, so that no test waits for it (quick when nothing changed).
echo "== image"; bash scripts/build-image.sh test
echo "== pytest"; pytest -q -p no:cacheprovider -n "${CKPTFS_TEST_WORKERS:-4}" --dist worksteal "$@"
# The core mount tests again with the stock pyfuse3 of PyPI (.venv-stock, made by install.sh): what a plain
# `pip install` gets must mount. Only for the whole suite: arguments pick tests of the first pass.
if [ $# -eq 0 ]; then
  echo "== pytest, stock pyfuse3 (.venv-stock)"
  .venv-stock/bin/pytest -q -p no:cacheprovider -m core -n "${CKPTFS_TEST_WORKERS:-4}" --dist worksteal
fi
