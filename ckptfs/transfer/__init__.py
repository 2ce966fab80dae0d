"""The transfer engine: one scheduler for every part transfer between the cache and the store, up and down.

Owns: part sizing, parallelism (one pool of parts in flight shared by every file, up and down, each part
under the memory budget of transfer/memory.py), priorities (a reader waiting on a range first, read-ahead next,
background uploads after, commit markers last), retries with backoff of each part, staged uploads with
resume from a journaled UploadState and the one way to abandon one (`abandon`), small files in one PUT
each, spills (the start of a file still being written, staged at a hidden key), ranged downloads, and the
bandwidth caps, one token bucket per direction across all of them.
Modules: engine.py (`Transfers`: uploads of closed files, small files, downloads), staging.py
(`Transfers.staging`: the store calls every upload is made of, retried, under the caps and the memory
budget, which the engine, its spills and its copies share), bandwidth.py (`Transfers.bandwidth`: the caps,
where each transfer takes its tokens, and why there), spills.py (`Transfers.spills`), copies.py
(`Transfers.copies`), pool.py (the worker pool of one transfer), contracts.py (what callers hand it and
get back), memory.py (the budget), leftovers.py (what interrupted uploads leave in the store, and the
sweeps), local_io.py (reading and writing the local files). Beside it: ckptfs/checksums.py (CRC32 math).

Stores (backends/) implement only primitives: one attempt each, in a worker thread. This module never
knows inodes or paths of the mount and never touches the journal: callers persist the UploadState it
reports through `progress` (called in the trio thread after the upload is opened and after every part).
Everything here runs in the trio thread except the blocking store calls and local reads.
"""

from ckptfs.transfer.bandwidth import Bandwidth, LimitNow, Timetable, rate_text, timetable_text
from ckptfs.transfer.contracts import (
           FetchedRange,
           Priority,
           PutFile,
           SmallFile,
           StagedUpload,
           TransferStats,
           plan_part_size,
)
from ckptfs.transfer.engine import Transfers

__all__ = ["Bandwidth", "FetchedRange", "LimitNow", "Priority", "PutFile", "SmallFile", "StagedUpload", "Timetable",
           "TransferStats", "Transfers", "plan_part_size", "rate_text", "timetable_text"]
