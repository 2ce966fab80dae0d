"""The mount beyond one daemon's life (keep_mount): the holder process, the daemon's link to it,
the FUSE connection handed over and taken over, and systemd's file descriptor store."""
