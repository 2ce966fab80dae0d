"""ckptfs: a checkpoint filesystem. Writes land in a local cache at disk speed; a background drain uploads
closed files to an object store; a SQLite journal makes every step survive a crash."""

__version__ = "0.1.0"
