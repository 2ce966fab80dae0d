"""The FUSE mount itself: the pyfuse3 adapter (adapter.py), the mountpoint's lifecycle (mountpoint.py)
and the read-only guard over a mountpoint nobody serves (guard.py)."""
