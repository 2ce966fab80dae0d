# Sourced (from the repository's root) by scripts/build-fuse.sh, which builds the patched pyfuse3, and by
# scripts/build-wheels.sh, which packs it: both must name the same build and find the same wheel.
prefix=/opt/ckptfs-fuse
pyfuse3_version=3.5.0
local_label=ckptfs8      # bump when scripts/pyfuse3-passthrough.patch changes
version=$pyfuse3_version+$local_label
patch_file=$PWD/scripts/pyfuse3-passthrough.patch
patch_sha=$(sha256sum <"$patch_file" | cut -c1-12)

# Where build-fuse.sh keeps the pyfuse3 wheel of this patch, built against the prefix's libfuse (one
# directory per build, so a clone with another patch or libfuse never takes a wheel that is not its own).
pyfuse3_wheel_dir() {
  echo "$prefix/wheels/pyfuse3-$version-$patch_sha-libfuse$(cat "$prefix/VERSION" 2>/dev/null)"
}
