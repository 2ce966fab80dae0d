#!/usr/bin/env python3
"""dd of 2 GiB (bs=1M, no fsync) into a plain directory, a ckptfs mount and libfuse's passthrough_hp, measured
so that the ratio can be trusted (issue 46): dd's own time swings from under a second to 8 s on this host with
the page cache's state, so before every timed run the disk is synced, the page cache dropped and the machine
left quiet for --pause seconds; the three run in an order that rotates each round; and the ratios are taken
per round (a round: one run of each, back to back), not only between medians.

All three live on the same filesystem under --dir: the plain directory, ckptfs's cache dir and file:// store
(the drain held off: --upload-delay 100000), passthrough_hp's source directory. Each output is checked
(size) and deleted before the next run. Needs root (drop_caches, passthrough) and passthrough_hp
(scripts/install.sh builds it into /opt/ckptfs-fuse/bin).

Run from the repo's venv:  python bench/dd_bench.py [--rounds 6] [--size 2G] [--dir /var/tmp]
Results: a table on stdout, JSON in bench/results/dd_bench.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

from passthrough_bench import DEFAULT_HP, MIB, Session, Target, parse_size, rotated, timed

REPO = Path(__file__).resolve().parent.parent
CONTENDERS = ("plain", "ckptfs", "hp")


def dd(path: Path, count: int) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "status=none"], check=True)


TRACING = Path("/sys/kernel/tracing")
THROTTLE_EVENT = TRACING / "events" / "writeback" / "balance_dirty_pages" / "enable"


# /proc/vmstat counters that say how the kernel found memory for the pages dd dirtied: reclaim by the writer
# itself (direct), by kswapd, compaction, and pages written back meanwhile.
VMSTAT_KEYS = ("pgscan_direct", "pgsteal_direct", "allocstall_normal", "allocstall_movable", "pgscan_kswapd",
               "pgsteal_kswapd", "compact_stall", "pgalloc_normal", "pgfree", "nr_written", "pgmajfault")


def vmstat() -> dict[str, int]:
    return {key: int(value) for key, value in (line.split() for line in Path("/proc/vmstat").read_text().splitlines())}


@contextlib.contextmanager
def dirty_throttling(found: dict[str, Any]) -> Iterator[None]:
    """Trace the kernel's dirty-page throttling (writeback:balance_dirty_pages: a writer made to pause
    because too much of memory is dirty) while the block runs; `found` gets the number of pauses, their
    total in ms, per bdi, and the dirty pages and limit at the first one."""
    (TRACING / "trace").write_text("")
    before = vmstat()
    THROTTLE_EVENT.write_text("1")
    try:
        yield
    finally:
        THROTTLE_EVENT.write_text("0")
    after = vmstat()
    found["vmstat"] = {key: after[key] - before.get(key, 0) for key in VMSTAT_KEYS if key in after}
    events = [line for line in (TRACING / "trace").read_text().splitlines() if "balance_dirty_pages:" in line]
    fields = [dict(kv.split("=", 1) for kv in line.split(": ", 2)[-1].split() if "=" in kv) for line in events]
    found["pauses"] = len(events)
    found["paused_ms"] = sum(int(f.get("pause", "0")) for f in fields if int(f.get("pause", "0")) > 0)
    found["bdis"] = sorted({line.split("bdi ", 1)[1].split(":", 1)[0] for line in events if "bdi " in line})
    if fields:
        found["first"] = {key: fields[0].get(key) for key in ("limit", "setpoint", "dirty", "wb_dirty")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rounds", type=int, default=6, help="rounds of plain, ckptfs and passthrough_hp (6)")
    p.add_argument("--size", type=parse_size, default=2 << 30, help="bytes dd writes, bs=1M (2G)")
    p.add_argument("--pause", type=float, default=3.0, help="seconds of quiet after sync and drop_caches (3)")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="scratch parent on the disk (/var/tmp)")
    p.add_argument("--passthrough-hp", type=Path, default=DEFAULT_HP)
    p.add_argument("--trace", action="store_true",
                   help="trace the kernel's dirty-page throttling (tracefs) and reclaim (/proc/vmstat) during each dd")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "dd_bench.json")
    args = p.parse_args(argv)
    # what passthrough_bench's Session reads
    args.hp_arg, args.ckptfs_arg, args.tmpfs_size = [], [], "8G"
    if os.geteuid() != 0 or not os.access(args.passthrough_hp, os.X_OK):
        print("dd_bench: run as root, with passthrough_hp built (scripts/install.sh)", file=sys.stderr)
        return 1
    count = args.size // MIB
    session = Session(args)
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    cpu: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    traces: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    started = time.time()
    try:
        root = session.work / "disk"
        root.mkdir()
        with session.target("plain", root) as plain, session.target("ckptfs", root) as mount, \
                session.target("hp", root) as hp:
            targets: dict[str, Target] = {"plain": plain, "ckptfs": mount, "hp": hp}
            for index in range(args.rounds):
                for name in rotated(list(CONTENDERS), index):
                    target = targets[name]
                    path = target.dir / "dd.bin"
                    throttled: dict[str, Any] = {}
                    with dirty_throttling(throttled) if args.trace else contextlib.nullcontext():
                        took, daemon_cpu, _ = timed(target, args.pause, partial(dd, path, count), drop=True)
                    traces[name].append(throttled)
                    if path.stat().st_size != count * MIB:
                        raise RuntimeError(f"{path} has {path.stat().st_size} bytes")
                    path.unlink()
                    seconds[name].append(took)
                    cpu[name].append(daemon_cpu)
                    print(f"round {index + 1}/{args.rounds} {name:<7} {took:6.2f}s  daemon CPU {daemon_cpu:5.2f}s"
                          + (f"  throttled {throttled['pauses']}x {throttled['paused_ms']} ms {throttled['bdis']}"
                             f"  vmstat {throttled['vmstat']}" if args.trace else ""), flush=True)
    finally:
        session.cleanup()
    per_round = {name: [round(s / p, 3) for s, p in zip(seconds[name], seconds["plain"], strict=True)]
                 for name in ("ckptfs", "hp")}
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print()
    print(f"dd bs=1M count={count} (no fsync), {args.rounds} rounds, page cache dropped before each run:")
    print("| contender | median s | runs s | per-round ratio to plain | median of those |")
    print("| --- | ---: | --- | --- | ---: |")
    for name in CONTENDERS:
        ratios = per_round.get(name)
        print(f"| {name} | {medians[name]:.2f} | {', '.join(f'{s:.2f}' for s in seconds[name])} | "
              f"{', '.join(f'{r:.2f}' for r in ratios) if ratios else '-'} | "
              f"{statistics.median(ratios) if ratios else 1.0:.2f} |")
    result = {
        "benchmark": "dd_bench", "taken_at": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "bytes": count * MIB, "rounds": args.rounds, "pause_s": args.pause, "scratch_parent": str(args.dir),
        "order": "plain, ckptfs, passthrough_hp rotating by one place per round; sync + drop_caches + pause "
                 "before every timed run; each output checked and deleted before the next",
        "seconds": seconds, "daemon_cpu_s": cpu, "ratio_to_plain_per_round": per_round,
        "dirty_throttling": traces if args.trace else None,
        "median_ratio_to_plain": {name: statistics.median(values) for name, values in per_round.items()},
        "kernel": os.uname().release,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
