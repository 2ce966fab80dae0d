#!/usr/bin/env bash
# Kernel FUSE passthrough for ckptfs: libfuse 3.17 (bookworm's 3.14 cannot do it), built from Debian trixie's
# fuse3 source package into a private prefix, and pyfuse3 built against it with scripts/pyfuse3-passthrough.patch.
# Run as root by scripts/install.sh once .venv exists; idempotent, and quick when done (a clone with a new
# .venv reuses the prefix's libfuse and pyfuse3 wheel). If anything fails it prints one warning and leaves the
# stock pyfuse3 (on the system's libfuse3.so.3): it never fails the install.
#
#   prefix /opt/ckptfs-fuse: lib/libfuse3.so.4 and lib/pkgconfig/fuse3.pc, include/fuse3/,
#          bin/passthrough_hp (libfuse's passthrough example, a benchmark anchor), wheels/ (pyfuse3 builds).
#          No ldconfig entry: the system's fuse3 tools keep libfuse3.so.3. Outside the prefix it adds bookworm's
#          meson and ninja-build, and /etc/apt/sources.list.d/ckptfs-trixie-src.sources (deb-src only, so no
#          trixie binary package can come in).
#   .build/ (git-ignored): libfuse/ (source; build/example/passthrough_hp), pyfuse3/, build-fuse.log
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
# prefix, pyfuse3_version, version, patch_file, patch_sha, pyfuse3_wheel_dir: shared with build-wheels.sh
source scripts/fuse-build-vars.sh
pyfuse3_sha256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
cython_version=3.2.4     # the Cython that generated the C in pyfuse3 3.5.0's sdist
build=$repo/.build
log=$build/build-fuse.log
py=$repo/.venv/bin/python
stamp=$repo/.venv/.ckptfs-fuse
stamp_line="pyfuse3 $version patch $patch_sha prefix $prefix"

is_done() {
  [ "$(cat "$stamp" 2>/dev/null)" = "$stamp_line" ] &&
    [ -e "$prefix/lib/libfuse3.so.4" ] &&
    "$py" -c 'import pyfuse3, sys; sys.exit(not getattr(pyfuse3, "PASSTHROUGH_BUILD", False))' 2>/dev/null
}

fallback() {  # $1: why. One warning; a patched pyfuse3 left from an earlier run goes back to the stock one.
  echo "warning: FUSE passthrough is off: $1; ckptfs uses the stock pyfuse3 on the system libfuse 3.14" \
    "(log: .build/build-fuse.log)" >&2
  rm -f "$stamp"
  local installed
  installed=$("$py" -c 'import importlib.metadata as m; print(m.version("pyfuse3"))' 2>/dev/null || true)
  if [[ "$installed" == *+* ]]; then
    "$py" -m pip install -q --force-reinstall --no-deps "pyfuse3==$pyfuse3_version" >>"$log" 2>&1 || true
  fi
  exit 0
}

step() { echo "$1" >"$build/step"; echo "== $1"; }

get_libfuse_source() {
  step "getting the libfuse 3.17 source (Debian trixie's fuse3 source package)"
  local list=/etc/apt/sources.list.d/ckptfs-trixie-src.sources mirror
  if [ ! -e "$list" ]; then
    # the mirror that serves this machine's bookworm packages (deb822 .sources or one-line sources.list)
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
      /^URIs:/ {u = $2} /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == "bookworm" && !m) m = u} END {print m}')
    [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && / bookworm / {for (i = 2; i <= NF; i++)
      if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null)
    printf 'Types: deb-src\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
      "${mirror:-http://deb.debian.org/debian}" /usr/share/keyrings/debian-archive-keyring.gpg >"$list"
  fi
  apt-cache showsrc fuse3 2>/dev/null | grep -q '^Version: 3\.17\.' || apt-get update -qq
  rm -rf "$build/src" && mkdir -p "$build/src"
  (cd "$build/src" && apt-get source -qq -o APT::Sandbox::User=root fuse3/trixie)
  local dir
  dir=$(find "$build/src" -mindepth 1 -maxdepth 1 -type d -name 'fuse3-*' | head -1)
  case "${dir##*/fuse3-}" in
    3.17.*) ;;
    *) echo "trixie's fuse3 source is ${dir##*/}, not 3.17" >&2; exit 1 ;;
  esac
  rm -rf "$build/libfuse" && mv "$dir" "$build/libfuse"
}

build_libfuse() {
  step "installing the build tools"
  local need=() pkg
  for pkg in dpkg-dev meson ninja-build pkg-config gcc g++ patch; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
  [ -e "$build/libfuse/meson.build" ] || get_libfuse_source
  local libver
  libver=$(sed -n "s/^ *version: *'\([0-9.]*\)'.*/\1/p" "$build/libfuse/meson.build" | head -1)
  step "building libfuse $libver into $prefix"
  [ -e "$build/libfuse/build/build.ninja" ] ||
    meson setup "$build/libfuse/build" "$build/libfuse" --prefix="$prefix" --libdir=lib \
      -Dutils=false -Dexamples=true -Dtests=false -Duseroot=false -Dinitscriptdir=
  ninja -C "$build/libfuse/build"
  meson install -C "$build/libfuse/build" --no-rebuild --quiet
  # its RUNPATH ($ORIGIN/../lib) finds the prefix's libfuse3.so.4 from bin/ too
  install -D -m 755 "$build/libfuse/build/example/passthrough_hp" "$prefix/bin/passthrough_hp"
  echo "$libver" >"$prefix/VERSION"
}

build_pyfuse3() {
  local libver wheels
  libver=$(cat "$prefix/VERSION")
  wheels=$(pyfuse3_wheel_dir)
  if ! compgen -G "$wheels/pyfuse3-*.whl" >/dev/null; then
    step "getting the pyfuse3 $pyfuse3_version sdist"
    mkdir -p "$build/dl"
    echo "pyfuse3==$pyfuse3_version --hash=sha256:$pyfuse3_sha256" >"$build/pyfuse3-requirement.txt"
    "$py" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$build/pyfuse3-requirement.txt" \
      -d "$build/dl"
    step "patching pyfuse3 $pyfuse3_version with scripts/pyfuse3-passthrough.patch"
    rm -rf "$build/pyfuse3" && mkdir -p "$build/pyfuse3"
    tar xzf "$build/dl/pyfuse3-$pyfuse3_version.tar.gz" -C "$build/pyfuse3" --strip-components=1
    patch -p1 -s -d "$build/pyfuse3" <"$patch_file"
    step "building pyfuse3 $version against libfuse $libver"
    echo "Cython==$cython_version" >"$build/pyfuse3-build-constraints.txt"
    rm -rf "$wheels.tmp"
    PKG_CONFIG_PATH="$prefix/lib/pkgconfig" LDFLAGS="-Wl,-rpath,$prefix/lib" \
      SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PYFUSE3="$version" \
      "$py" -m pip wheel --no-deps --build-constraint "$build/pyfuse3-build-constraints.txt" \
      -w "$wheels.tmp" "$build/pyfuse3"
    mv "$wheels.tmp" "$wheels"
  fi
  step "installing pyfuse3 $version"
  "$py" -m pip install -q --force-reinstall --no-deps "$wheels"/pyfuse3-*.whl
  "$py" -m pip install -q "$wheels"/pyfuse3-*.whl  # its dependencies (trio), in a new .venv
  step "checking that pyfuse3 loads $prefix/lib/libfuse3.so.4"
  local so libs
  so=$("$py" -c 'import pyfuse3; assert pyfuse3.PASSTHROUGH_BUILD; print(pyfuse3.__file__)')
  libs=$(ldd "$so")
  echo "$libs"
  if [[ "$libs" != *"libfuse3.so.4 => $prefix/lib/libfuse3.so.4"* || "$libs" == *libfuse3.so.3* ]]; then
    echo "$so does not load $prefix/lib/libfuse3.so.4" >&2
    exit 1
  fi
}

mkdir -p "$build"
[ "$(id -u)" = 0 ] || fallback "building it needs root"
[ -x "$py" ] || fallback ".venv does not exist yet"
is_done && exit 0
mkdir -p "$prefix" 2>/dev/null || fallback "cannot create $prefix"
exec 9>"$prefix/.lock"
flock 9  # one build at a time per machine (the prefix is shared by every clone)
is_done && exit 0
echo "setting up FUSE passthrough: libfuse 3.17 in $prefix, pyfuse3 $version (log: .build/build-fuse.log)"
: >"$log"
rm -f "$build/step"
rc=0
(
  set -euo pipefail
  if [ ! -e "$prefix/lib/libfuse3.so.4" ] || [ ! -x "$prefix/bin/passthrough_hp" ] ||
    ! grep -q '^3\.17\.' "$prefix/VERSION" 2>/dev/null; then
    build_libfuse
  fi
  build_pyfuse3
) >>"$log" 2>&1 &
wait $! || rc=$?
[ "$rc" = 0 ] || fallback "$(cat "$build/step" 2>/dev/null || echo "the build") failed"
echo "$stamp_line" >"$stamp"
echo "FUSE passthrough support built: pyfuse3 $version on libfuse $(cat "$prefix/VERSION") ($prefix)"
