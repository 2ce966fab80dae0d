#!/usr/bin/env bash
# The ckptfs container image, built without a registry: localhost/ckptfs:TAG (default: latest).
#   1. podman, runc and debootstrap (apt), and /etc/containers/containers.conf's ulimits and runtime if the
#      file is absent (root here cannot raise a hard rlimit: podman's defaults make runc fail).
#   2. the wheels: scripts/build-wheels.sh (when the checkout has it) writes dist/ckptfs-*.whl and
#      dist/pyfuse3-*manylinux*.whl (libfuse 3.17 inside); their dependencies from PyPI go to dist/deps/ (pip
#      download, for CPython 3.11 on manylinux_2_36 = bookworm), so the image's build installs offline.
#   3. the base: debootstrap --variant=minbase bookworm, kept as .build/image/bookworm-minbase.tar, imported as
#      localhost/bookworm-base:latest (each made again only when missing).
#   4. podman build --build-arg BASE=localhost/bookworm-base -f deploy/container/Containerfile . : tagged
#      TAG and build-<key>, the key a hash of the Containerfile, the entrypoint, the wheels and the base. An
#      image of the same key is only tagged again: quick when nothing changed.
# Run as root. Idempotent. Prints the image's name and size last.
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-latest}
image=localhost/ckptfs
base=localhost/bookworm-base:latest
build=.build/image
log=$build/build-image.log

die() {
  echo "error: $*" >&2
  exit 1
}
quietly() {  # $1: what the step does; the rest: the command, its output to the log (the tail shown on failure)
  local what=$1
  shift
  echo "== $what: $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    tail -n 20 "$log" >&2
    die "$what failed (log: $log)"
  fi
}
[ "$(id -u)" = 0 ] || die "build-image.sh needs root (apt, debootstrap, rootful podman)"
mkdir -p "$build"
exec 9>"$build/.lock"
flock 9  # one build at a time (test workers each ask for the image); the next finds it made
: >"$log"

# 1. The tools. runc by name keeps crun out (containers.md: podman 4.3 with runc works here).
need=()
for pkg in podman runc debootstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}"
  quietly "apt-get update" apt-get update -qq
  quietly "apt-get install ${need[*]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
conf=/etc/containers/containers.conf
if [ ! -e "$conf" ]; then
  echo "writing $conf (ulimits a root without CAP_SYS_RESOURCE can set; runc)"
  mkdir -p "$(dirname "$conf")"
  cat >"$conf" <<'CONF'
# Written by ckptfs's scripts/build-image.sh. Podman's default nofile limit (1048576) is above what root may
# set on this kind of machine (no CAP_SYS_RESOURCE): runc then fails with "error setting rlimit type 7".
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
CONF
elif ! grep -q '^ *default_ulimits' "$conf"; then
  echo "warning: $conf sets no default_ulimits: if runc fails with \"error setting rlimit\", add" \
    '[containers] default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"] to it' >&2
fi

# 2. The wheels. build-wheels.sh is quick when they are up to date and makes a stale ckptfs wheel again, so
# it runs every time it is there (an image of old code would pass for new).
if [ -e scripts/build-wheels.sh ]; then
  bash scripts/build-wheels.sh
fi
package=$(compgen -G "dist/ckptfs-*.whl" | head -1 || true)
pyfuse3=$(compgen -G "dist/pyfuse3-*manylinux*.whl" | head -1 || true)
[ -n "$package" ] && [ -n "$pyfuse3" ] ||
  die "dist/ lacks the ckptfs wheel or the manylinux pyfuse3 wheel, and scripts/build-wheels.sh is not there to make them"
[ "$(compgen -G "dist/ckptfs-*.whl" | wc -l)" = 1 ] && [ "$(compgen -G "dist/pyfuse3-*.whl" | wc -l)" = 1 ] ||
  die "dist/ has more than one ckptfs or pyfuse3 wheel: the image would not know which to install"

# Their dependencies, for the image's Python (not this machine's): CPython 3.11, manylinux up to glibc 2.36.
# pip takes only the exact platforms it is given, so every manylinux tag bookworm runs is named. Downloaded
# again only when what they depend on changed (the wheels' Requires-Dist, the pyfuse3 build).
py=.venv/bin/python
[ -x "$py" ] || py=python3
# The ckptfs wheel must be this checkout's code (else the image would pass old code for new): its RECORD's
# hashes against ckptfs/. Then its requirements, which the dependency download below depends on.
requires=$("$py" - "$package" <<'PY'
import base64, hashlib, pathlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = wheel.namelist()
    record = wheel.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
packed = {}
for line in record.splitlines():
    path, digest, _size = line.rsplit(",", 2)
    if path.startswith("ckptfs/") and path.endswith(".py"):
        packed[path] = digest
here = {}
for path in pathlib.Path("ckptfs").rglob("*.py"):
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
    here[path.as_posix()] = f"sha256={digest}"
differ = sorted(p for p in packed.keys() | here.keys() if packed.get(p) != here.get(p))
if differ:
    sys.exit(f"error: {sys.argv[1]} is not this checkout's ckptfs ({len(differ)} files differ: {', '.join(differ[:3])}"
             f"{', ...' if len(differ) > 3 else ''}): make it again (scripts/build-wheels.sh)")
print("\n".join(line for line in metadata.splitlines() if line.startswith("Requires-Dist:")))
PY
)
deps_stamp="$(printf '%s\n%s\n' "$requires" "${pyfuse3##*/}" | sha256sum | cut -c1-16) cp311 manylinux_2_36"
if [ "$(cat dist/deps/.stamp 2>/dev/null)" != "$deps_stamp" ]; then
  echo "downloading the dependency wheels into dist/deps/"
  platforms=()
  for minor in $(seq 36 -1 5); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  rm -rf dist/deps.tmp
  quietly "pip download" "$py" -m pip download -q -d dist/deps.tmp --only-binary=:all: "${platforms[@]}" \
    --python-version 3.11 --implementation cp --abi cp311 "$package[all]" "$pyfuse3"
  # the project's own wheels are installed from dist/ itself: a copy here could be a stale one later
  rm -f dist/deps.tmp/ckptfs-*.whl dist/deps.tmp/pyfuse3-*.whl
  rm -rf dist/deps && mv dist/deps.tmp dist/deps
  echo "$deps_stamp" >dist/deps/.stamp
fi

# 3. The base image.
if ! podman image exists "$base"; then
  tarball=$build/bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    # the mirror this machine's bookworm packages come from (deb822 .sources or one-line sources.list)
    mirror=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '
      /^URIs:/ {u = $2} /^Suites:/ {for (i = 2; i <= NF; i++) if ($i == "bookworm" && !m) m = u} END {print m}')
    [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && / bookworm / {for (i = 2; i <= NF; i++)
      if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null)
    mirror=${mirror:-http://deb.debian.org/debian}
    echo "debootstrapping a minimal bookworm from $mirror (about a minute)"
    rm -rf "$build/rootfs"
    quietly "debootstrap" debootstrap --variant=minbase --include=procps bookworm "$build/rootfs" "$mirror"
    # the apt lists debootstrap used are stale by the time the image builds; the Containerfile updates them
    rm -rf "$build/rootfs"/var/lib/apt/lists/* "$build/rootfs"/var/cache/apt/archives/*.deb
    # slim as debian:bookworm-slim is (debuerreotype's slimify): no docs, man pages or translations, now or
    # from the packages the Containerfile adds (about 50 MB)
    cat >"$build/rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
SLIM
    find "$build/rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    find "$build/rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
    rm -rf "$build/rootfs"/usr/share/{info,linda,locale,man}/* "$build/rootfs"/usr/share/lintian/overrides/*
    tar -C "$build/rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$build/rootfs"
  fi
  echo "importing $tarball as $base"
  quietly "podman import" podman import --change 'CMD ["/bin/bash"]' "$tarball" "$base"
fi

# 4. The image. The key covers everything the build reads: an image of the same key is this one.
key=$( (sha256sum deploy/container/Containerfile deploy/container/entrypoint.sh "$package" "$pyfuse3" dist/deps/*.whl |
  sed 's| .*/| |'; podman image inspect --format '{{.Id}}' "$base") | sha256sum | cut -c1-16)
started=$(date +%s)
previous=$(podman image inspect --format '{{.Id}}' "$image:$tag" 2>/dev/null || true)
if podman image exists "$image:build-$key"; then
  podman tag "$image:build-$key" "$image:$tag"
  echo "$image:build-$key is up to date"
else
  echo "building $image:$tag (key $key; log: $log)"
  quietly "podman build" podman build --build-arg BASE="${base%:latest}" --build-arg CONTENT_KEY="$key" \
    -t "$image:$tag" -t "$image:build-$key" -f deploy/container/Containerfile .
  echo "built in $(($(date +%s) - started)) s"
  # the images of earlier contents go (each a few hundred MB); a tag of their own (TAG) keeps one alive
  for old in $(podman images --format '{{.Repository}}:{{.Tag}}' "$image" | grep ":build-" | grep -v ":build-$key\$" || true); do
    podman rmi "$old" >/dev/null 2>&1 || true
  done
fi
# the image TAG named before, if nothing names it any more (each a few hundred MB)
if [ -n "$previous" ] && [ -z "$(podman image inspect --format '{{join .RepoTags ""}}' "$previous" 2>/dev/null)" ]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{.Size}}' "$image:$tag")
echo "image $image:$tag ($image:build-$key): $size bytes ($((size / 1048576)) MiB)"
