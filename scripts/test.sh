#!/usr/bin/env bash
# Install everything, then run the whole test suite: lint, type check, unit, fs-level and FUSE tests.
# Each phase prints its time when it ends, and the run a summary of them last.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase_started=$SECONDS
phase_name=
times=()
phase() {  # $1: the next phase's name ("" at the end); the one before it gets its time
  if [ -n "$phase_name" ]; then
    times+=("$(printf '%-36s %4d s' "$phase_name" $((SECONDS - phase_started)))")
    echo "-- $phase_name: $((SECONDS - phase_started)) s"
  fi
  phase_name=$1
  phase_started=$SECONDS
  [ -z "$1" ] || echo "== $1"
}
summary() {  # the phases' times, and the whole run's
  phase ""
  echo "== times"
  printf '%s\n' "${times[@]}"
  printf '%-36s %4d s\n' "total" $((SECONDS - started))
}
phase install
scripts/install.sh test
. .venv/bin/activate
# A daemon the tests start imports ckptfs anew each time: let it compile the modules once, not each time.
unset PYTHONDONTWRITEBYTECODE

# The container image the image and Kubernetes tests run (tests/test_container.py, test_kubernetes_rollout.py),
# built in the background while ruff, mypy and the first tests run: the build waits mostly on podman, the disk
# and the network (its wheels' dependencies), not on the cores, and took 2 minutes of a clean clone's run before
# everything else. The tests that need the image run scripts/build-image.sh themselves, which waits for this
# build (it holds a lock) and then finds the image made. Its output goes to .build/test-image.log, shown if it fails.
mkdir -p .build
image_log=.build/test-image.log
image_seconds=.build/test-image.seconds
rm -f "$image_seconds"
(image_started=$SECONDS; code=0; bash scripts/build-image.sh test || code=$?
 echo $((SECONDS - image_started)) >"$image_seconds"; exit "$code") >"$image_log" 2>&1 &
image_pid=$!
image_status() {  # waits for the image build and puts its time in the summary; its log and 1 if it failed
  local code=0
  wait "$image_pid" || code=$?
  times+=("$(printf '%-36s %4s s' "image (beside ruff, mypy, pytest)" "$(cat "$image_seconds" 2>/dev/null || echo '?')")")
  if [ "$code" != 0 ]; then
    cat "$image_log" >&2
    echo "error: scripts/build-image.sh failed (exit $code; its log above, also in $image_log)" >&2
  fi
  return "$code"
}

phase ruff
ruff check ckptfs tests bench
phase mypy
mypy
# The tests wait mostly on FUSE daemons, subprocesses and emulators: more workers than cores keep the cores
# busy. CKPTFS_TEST_WORKERS=0 runs them in this one process (as does `-n 0` among the arguments).
phase pytest
pytest_code=0
pytest -q -p no:cacheprovider -n "${CKPTFS_TEST_WORKERS:-4}" --dist worksteal "$@" || pytest_code=$?
phase "the image build's end"
image_code=0
image_status || image_code=$?
if [ "$pytest_code" != 0 ] || [ "$image_code" != 0 ]; then
  summary
  [ "$pytest_code" = 0 ] || exit "$pytest_code"
  exit "$image_code"
fi
# The core mount tests again with the stock pyfuse3 of PyPI (.venv-stock, made by install.sh): what a plain
# `pip install` gets must mount. Only for the whole suite: arguments pick tests of the first pass.
if [ $# -eq 0 ]; then
  phase "pytest, stock pyfuse3 (.venv-stock)"
  .venv-stock/bin/pytest -q -p no:cacheprovider -m core -n "${CKPTFS_TEST_WORKERS:-4}" --dist worksteal
fi
summary
