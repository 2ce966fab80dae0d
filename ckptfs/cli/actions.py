"""The commands that ask a running daemon to act and say how it went: flush (wait until durable), preempt
(a preemption notice), prefetch, prune and refresh.
"""

from __future__ import annotations

import argparse
import json
import re

from ckptfs.cli.arguments import configured_settings
from ckptfs.config import human_size
from ckptfs.control import client
from ckptfs.errors import NotDurableError, UsageError

EXIT_NOT_DURABLE = NotDurableError.exit_code  # flush/umount timed out (NotDrainedError too)


def parse_deadline(text: str) -> float:
    """`--deadline`: seconds, with an optional unit: 30, 30s, 2m."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise UsageError(f"--deadline {text!r} is not a time: give the seconds the node has left, like 30s or 2m")
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


def cmd_preempt(args: argparse.Namespace) -> int:
    """Exit 0 when the newest complete step is durable (or no step had work), EXIT_NOT_DURABLE when not."""
    deadline = parse_deadline(args.deadline)
    if args.mountpoint is None or args.config is not None:
        configured_settings(args)
    report = client.preempt(args.mountpoint, deadline, wait=args.wait, keep_limits=args.keep_limits,
                            reason="ckptfs preempt")
    if report is None:
        print("preemption started; the report is written to the cache dir")
        return 0
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for step in report["steps"]:
            state = ("durable, published" if step["published"] else "durable") if step["durable"] else (
                f"NOT durable: {step['why']}")
            print(f"{step['step']:<30} {state}")
        if not report["steps"]:
            print("no step had work pending")
    newest = next((s for s in report["steps"] if s["complete"]), None)
    return EXIT_NOT_DURABLE if newest is not None and not newest["durable"] else 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    if args.step is None and not args.release:
        raise UsageError("name what to prefetch: ckptfs prefetch MOUNTPOINT STEP (a directory or file in the mount)")
    reply = client.prefetch(args.step or args.mountpoint, mountpoint=args.mountpoint, wait=args.wait,
                            release=args.release)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    elif args.release:
        print(f"released {reply['released']} prefetched files")
    else:
        fetched = (f"fetched {reply['fetched_files']} files ({human_size(reply['fetched_bytes'])})" if args.wait
                   else f"fetching {reply['to_fetch_files']} files ({human_size(reply['to_fetch_bytes'])}); ckptfs"
                   " status shows the progress")
        print(f"{reply['path'] or '/'}: {reply['files']} files, {reply['already_local']} in the cache already;"
              f" {fetched}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    client.wait_durable(args.mountpoint, args.paths, timeout=args.timeout, all_nodes=args.all_nodes)  # exit 3
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    result = client.prune(args.mountpoint, args.keep_last, args.keep, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for name in result.deleted:
        print(f"{verb} {name}")
    for name, why in sorted(result.kept.items()):
        print(f"kept    {name} ({why})")
    if not result.deleted:
        print(f"nothing to delete: {len(result.kept)} checkpoints kept")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    client.refresh(args.mountpoint)
    return 0
