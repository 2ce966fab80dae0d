"""The commands that show what a running daemon answers, for people or as JSON: status, limit (which also
changes the caps) and nodes; the text of a bandwidth cap and of a credential.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ckptfs.config import human_size, parse_rate
from ckptfs.control import client


def cmd_status(args: argparse.Namespace) -> int:
    status = client.status(args.mountpoint)
    if args.json:  # scripts parse this: the same object as before the Python API, "ok" included
        print(json.dumps({"ok": True, **status}, indent=2, sort_keys=True))
        return 0
    print(f"{status['source']} on {status['mountpoint']} (pid {status['pid']}, up {status['uptime_seconds']}s)")
    print(f"cache dir  {status['cache_dir']}")
    print(f"{'state':<10} {'files':>8} {'bytes':>12}")
    for state, row in status["states"].items():
        print(f"{state:<10} {row['files']:>8} {human_size(row['bytes']):>12}")
    queue = status["queue"]
    print(f"queue      {queue['uploads']} uploads, {queue['moves']} moves, {queue['deletes']} deletes"
          f" ({queue['in_flight']} in flight); {status['open_for_write']} files open for writing")
    oldest = status["oldest_dirty_age_seconds"]
    print(f"oldest dirty  {'-' if oldest is None else f'{oldest}s'}")
    uploaded = status["uploaded"]
    print(f"uploaded   {uploaded['files']} files, {human_size(uploaded['bytes'])} since start")
    cache = status["cache"]
    budget = "-" if cache["budget_bytes"] is None else human_size(cache["budget_bytes"])
    print(f"cache      {human_size(cache['used_bytes'])} used of {budget}; {cache['evicted_files']} files"
          f" evicted; {cache['waits']} writes waited for room ({cache['writes_waiting']} now)")
    if cache.get("short_of_free_space"):
        print("           its filesystem is short of min_free: files being written spill to the store;"
              " free space there or lower --min-free")
    moved = status["transfers"]
    print(f"transfers  up {moved['parts_up']} parts, {human_size(moved['up_bytes_per_second'])}/s;"
          f" down {moved['parts_down']} parts, {human_size(moved['down_bytes_per_second'])}/s;"
          f" memory {human_size(moved['memory_bytes'])} of {human_size(moved['memory_budget_bytes'])}")
    limits = status.get("limits") or {}
    for label, direction in (("bandwidth  up", "upload"), ("           down", "download")):
        if direction in limits:
            print(f"{label} {limit_text(limits[direction])}")
    credentials = status.get("credentials")
    if credentials:
        print(f"credential {credential_text(credentials)}")
    prefetched = status.get("prefetch")
    if prefetched and (prefetched["files_prefetched"] or prefetched["files_pending"] or prefetched["files_kept"]):
        print(f"prefetch   {prefetched['files_prefetched']} files ({human_size(prefetched['bytes_prefetched'])})"
              f" fetched; {prefetched['files_pending']} pending ({human_size(prefetched['bytes_pending'])} to go);"
              f" {prefetched['files_kept']} kept until read ({human_size(prefetched['bytes_kept'])});"
              f" {prefetched['failures']} failed")
    reads = status.get("reads")
    if reads is not None:
        print(f"reads      {human_size(reads['bytes_downloaded'])} downloaded in {reads['chunks_fetched']} chunks;"
              f" {reads['partial_files']} partial files ({human_size(reads['partial_bytes'])});"
              f" {reads['readers_waiting']} reads waiting; {reads['checksum_failures']} checksum failures")
    # What is on and what is off, one line each, with why (and how to get what is off)
    passthrough = status.get("passthrough")
    if passthrough:
        print(f"passthrough {passthrough['why']} ({passthrough['opens']} opens)")
    keep = status.get("keep_mount")
    if keep:
        took = f" ({keep['handles_taken_over']} open files)" if keep.get("took_over") else ""
        print(f"keep mount {keep['why']}{took}")
    if status.get("guard"):
        print(f"guard      {status['guard']['why']}")
    nodes = status.get("nodes")
    if nodes and nodes.get("cross_node_ordering"):
        unannounced = f"; records not written: {nodes['unannounced']}" if nodes.get("unannounced") else ""
        print(f"node       {nodes['node']}: {len(nodes['records'])} pending records in the store{unannounced}")
        for marker in nodes["waiting_markers"]:
            held = " (held: " + ", ".join(marker["held_by"]) + " given up on)" if marker["held_by"] else ""
            print(f"  marker {marker['path']} waits for other nodes{held}: {'; '.join(marker['waits_for'])}")
    print(f"last error {status['last_error'] or '-'}")
    if status.get("failing_count"):
        print(f"parked     {status['failing_count']} entries fail unexpectedly again and again (retried every"
              " 10 minutes; see the log):")
        for failing in status["failing"][:10]:
            print(f"  {failing['path']}: {failing['job']}: {failing['error']}")
    for held in status.get("markers_held", [])[:10]:
        print(f"held back  commit marker {held['marker']}: {held['held_by']} is failing (never published over it)")
    if status.get("preempting"):
        print("preempting the newest complete step goes first (a preemption notice came)")
    return 0


def limit_text(limit: dict[str, Any]) -> str:
    """One direction's cap for people: '8.0 MiB/s (set by ckptfs limit, until 19:00)', 'off (configured)'."""
    rate = limit.get("bytes_per_second")
    text = "off" if rate is None else f"{human_size(rate)}/s"
    source = limit.get("source")
    until = limit.get("until")
    why = {"config": "configured", "timetable": f"timetable entry {limit.get('entry')}",
           "runtime": "set by ckptfs limit", "lifted": "lifted until the daemon restarts"}.get(str(source), str(source))
    if until is not None:
        why += f", until {time.strftime('%H:%M', time.localtime(until))}"
    elif source == "runtime":
        why += ", until the daemon restarts"
    if source != "config":  # what applies again after a runtime change or at the next start
        why += f"; configured: {limit.get('configured')}"
    if limit.get("waiting"):
        why += f"; {limit['waiting']} transfers waiting for their turn"
    return f"{text} ({why})"


def cmd_limit(args: argparse.Namespace) -> int:
    for direction in ("upload", "download"):  # the daemon checks too: this only says so before connecting
        value = getattr(args, direction)
        if value is not None:
            parse_rate(value, f"--{direction}")
    limits = client.limit(args.mountpoint, upload=args.upload, download=args.download)
    if args.json:
        print(json.dumps(limits, indent=2, sort_keys=True))
        return 0
    for direction, limit in limits.items():
        print(f"{direction:<9} {limit_text(limit)}")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    reply = client.pending_nodes(args.mountpoint, forget=args.forget)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
        return 0
    if args.forget:
        print(f"forgot node {args.forget} ({reply['forgot_records']} pending records of it in the store)")
    print(f"this node  {reply['this_node']}")
    if not reply["nodes"]:
        print("no node has work pending in the store")
    for node in reply["nodes"]:
        what = " (this node)" if node["this_node"] else " (given up on)" if node["forgotten"] else ""
        since = node["oldest_written_at"]
        age = f", for {time.time() - since:.0f} s" if since else ""
        print(f"{node['node']}{what}: {node['host'] or '?'}, {node['records']} records{age}:"
              f" {', '.join(node['entries']) or '-'}")
    for marker in reply["waiting_markers"]:
        held = f" (held: {', '.join(marker['held_by'])} given up on)" if marker["held_by"] else ""
        print(f"marker {marker['path']} waits{held} for:")
        for line in marker["waits_for"]:
            print(f"  {line}")
    return 0


def credential_text(credentials: dict[str, Any]) -> str:
    """`ckptfs status`'s credential line: its source, when it expires, how often it was fetched again."""
    source = credentials["source"]
    if credentials.get("detail") and credentials["detail"] != source:
        source += f" ({credentials['detail']})"
    expires_at, left = credentials.get("expires_at"), credentials.get("expires_in_seconds")
    if expires_at is None:
        when = "does not expire" if credentials.get("fetched_at") else "not fetched yet"
    else:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at))
        when = f"expires {stamp} (in {left:.0f} s)" if (left or 0) >= 0 else f"EXPIRED at {stamp}"
    text = (f"{source}, {when}; fetched again {credentials['refreshes']} times"
            f" ({credentials['renewals_after_rejection']} after the store rejected it as expired)")
    if credentials.get("last_error"):
        text += f"; last refresh failed: {credentials['last_error']}"
    return text
