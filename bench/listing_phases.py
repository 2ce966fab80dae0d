#!/usr/bin/env python3
"""The daemon's work of a fresh node's first walk, phase by phase and without FUSE (issue 31, "big trees"):
for each directory of a file:// store, the store's `list_dir`, the journal's import of it
(`apply_dir_listing`) and readdir's entries with their replies' attributes, each timed in CPU seconds of
the thread (what a shared, busy machine disturbs least). Alternate checkouts with PYTHONPATH to compare.

Run from the repo's venv:  python bench/listing_phases.py [--dirs 100] [--files 1000] [--store DIR]
(--store: a tree built by an earlier run, kept; else one is built in a scratch directory and removed).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from ckptfs.backends.local import LocalStore
from ckptfs.cache.directory import CacheDir
from ckptfs.fetch.lister import apply_dir_listing
from ckptfs.fs.listing import Listing, NothingToList
from ckptfs.journal import ROOT_ID, Journal
from ckptfs.mount import adapter as fuse_ops


def build(store: Path, dirs: int, files: int) -> None:
    for d in range(dirs):
        folder = store / f"d{d:03d}"
        folder.mkdir(parents=True)
        for f in range(files):
            (folder / f"f{f:04d}.bin").write_bytes(b"%d" % f)


def phases(store_dir: Path, scratch: Path) -> dict[str, float]:
    journal = Journal(scratch / "journal.db")
    cache = CacheDir(scratch / "cache")
    store = LocalStore(store_dir)
    listing = Listing(journal, cache, NothingToList(), None)  # type: ignore[arg-type]  # readdir needs neither
    entry = fuse_ops._entry_template(0, 30.0)
    root = journal.names.get(ROOT_ID)
    assert root is not None
    apply_dir_listing(journal, root, store.list_dir(""), now=time.time(), exact_mtimes=True,
                      vanished=lambda inode: None, warned=set(), cache=cache)
    spent = {"list_dir": 0.0, "import": 0.0, "readdir": 0.0}
    for child in journal.names.all_children(ROOT_ID):
        started = time.thread_time()
        listed = store.list_dir(child.key or "")
        listed_at = time.thread_time()
        apply_dir_listing(journal, child, listed, now=time.time(), exact_mtimes=True, vanished=lambda inode: None,
                          warned=set(), cache=cache, stored_before={}, listed_at=time.time())
        imported_at = time.thread_time()
        after, sent = 0, fuse_ops.READDIR_BATCH
        while sent == fuse_ops.READDIR_BATCH:
            sent = 0
            for _name, attr, next_id in listing.readdir(child.id, after, fuse_ops.READDIR_BATCH):
                fuse_ops._fill(entry, attr)
                after, sent = next_id, sent + 1
        done = time.thread_time()
        spent["list_dir"] += listed_at - started
        spent["import"] += imported_at - listed_at
        spent["readdir"] += done - imported_at
    journal.close()
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dirs", type=int, default=100)
    p.add_argument("--files", type=int, default=1000, help="files per directory")
    p.add_argument("--store", type=Path, help="a store directory to keep between runs (built if missing)")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckptfs-listing-phases."))
    try:
        store = args.store if args.store is not None else scratch / "store"
        if not store.exists():
            build(store, args.dirs, args.files)
        spent = phases(store, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    shown = "  ".join(f"{name} {seconds:.3f} s" for name, seconds in spent.items())
    print(f"CPU of the thread: {shown}  all {sum(spent.values()):.3f} s")


if __name__ == "__main__":
    main()
