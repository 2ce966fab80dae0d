#!/bin/sh
# The image's entrypoint. It ends in exec: the daemon replaces this shell as PID 1 and gets the container's
# SIGTERM itself.
#   (no arguments), or arguments starting with "-"   ckptfs mount --foreground [ARGS]
#   a ckptfs command (mount, status, flush, ...)      ckptfs COMMAND [ARGS]  (mount: in the foreground)
#   anything else                                     that command (`podman run -it IMAGE bash`)
# /etc/ckptfs/ckptfs.toml, when it is there (a ConfigMap mounted as a file), is the config file unless
# CKPTFS_CONFIG or --config names another; CKPTFS_<KEY> variables override its keys, arguments both.
set -e
if [ -z "${CKPTFS_CONFIG:-}" ] && [ -f /etc/ckptfs/ckptfs.toml ]; then
  export CKPTFS_CONFIG=/etc/ckptfs/ckptfs.toml
fi
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
  set -- mount "$@"
fi
case "$1" in
  mount)
    # --foreground: the container lives as long as the daemon (daemon = true in a config would detach it)
    shift
    set -- ckptfs mount --foreground "$@"
    # A hostPath mount root starts empty: make the mountpoint in it, unless something is mounted there
    # already (a mount a holder keeps for this daemon to take over: looking at it would wait for a daemon).
    if [ -n "${CKPTFS_MOUNTPOINT:-}" ] &&
       ! awk -v p="$CKPTFS_MOUNTPOINT" '$5 == p {found = 1} END {exit !found}' /proc/self/mountinfo; then
      mkdir -p "$CKPTFS_MOUNTPOINT"
    fi
    ;;
  holder | umount | restart | status | flush | refresh | prune | nodes | guard | unguard)
    set -- ckptfs "$@"
    ;;
esac
exec "$@"
