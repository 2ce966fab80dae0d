"""The cache directory (directory.py: layout, lock, data files, space) and its evictor (evictor.py)."""
