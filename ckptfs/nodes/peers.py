"""The other nodes' pending records, as a commit marker of this node and `flush --all-nodes` see them:
a snapshot per marker, polled until every record of it is gone."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from ckptfs.errors import BackendError
from ckptfs.journal import Inode
from ckptfs.nodes.names import FILES_NAMED, FORGOTTEN, PENDING, TOP_FILES, parse_record_name
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

POLL_FIRST = 0.5  # a waiting marker's first look at the other nodes' records, doubling up to POLL_MAX
POLL_MAX = 10.0


@dataclass(frozen=True)
class PeerRecord:
    """Another node's pending record, as listed."""

    name: str  # pending/<node>/<gen>
    node: str
    gen: int
    host: str = ""
    entries: tuple[str, ...] = ()
    written_at: float = 0.0
    files: tuple[str, ...] = ()  # a few of the files it covered when it was written



@dataclass
class _Snapshot:
    records: frozenset[str]  # names of the records the marker waits for
    path: str


class PeerRecords:
    """The other nodes' records, as the markers of this node and `flush --all-nodes` see them."""

    def __init__(self, engine: Transfers, node: str) -> None:
        self.engine = engine
        self.store = engine.store
        self.node = node
        self.on_change: Callable[[], None] = lambda: None
        self._snapshots: dict[tuple[int, int], _Snapshot] = {}  # (inode id, seq) of a marker -> snapshot
        self._asked: dict[tuple[int, int], str] = {}  # markers waiting for their first listing -> path
        self._existing: dict[str, PeerRecord] = {}  # as of the last listing
        self._forgotten: set[str] = set()
        self._listed = 0  # listings completed
        self._listed_event = trio.Event()
        self._wanted = trio.Event()
        self._waiters = 0  # flush --all-nodes callers
        self._renames_waiting = 0  # directories' renames and rmdirs waiting (wait_for_entry)
        self._all_snapshot: frozenset[str] = frozenset()  # what the latest of them waits for
        self.last_error: str | None = None

    # -- the drain's side -----------------------------------------------------------------------------

    def blocks(self, marker: Inode) -> bool:
        """Must this closed commit marker wait for other nodes? The first call asks for a listing."""
        key = (marker.id, marker.seq)
        snapshot = self._snapshots.get(key)
        if snapshot is None:
            if key not in self._asked:
                self._asked[key] = marker.path or ""
                self._wanted.set()
            return True
        return bool(snapshot.records & self._existing.keys())

    def why(self, marker: Inode) -> str | None:
        """Why this marker still waits for other nodes, in a few words; None if it does not."""
        snapshot = self._snapshots.get((marker.id, marker.seq))
        if snapshot is None:
            return "listing the other nodes' records" if (marker.id, marker.seq) in self._asked else None
        left = snapshot.records & self._existing.keys()
        if not left:
            return None
        held = self.held_by(left)
        if held:
            return f"held: its checkpoint misses the work of {', '.join(held)}, given up on"
        return "waits for " + "; ".join(self.describe(left))

    def uploaded(self, marker: Inode) -> None:
        for key in [k for k in self._snapshots if k[0] == marker.id]:
            del self._snapshots[key]

    # -- listing --------------------------------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._asked or self._waiters or any(s.records & self._existing.keys()
                                                          for s in self._snapshots.values()))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        pause = POLL_FIRST
        while True:
            if not self._busy():
                pause = POLL_FIRST
                await self._wanted.wait()
            self._wanted = trio.Event()
            asked, self._asked = self._asked, {}
            before = self._existing.keys() & {n for s in self._snapshots.values() for n in s.records}
            try:
                await self.refresh()
            except BackendError as exc:
                self._asked = {**asked, **self._asked}
                if self.last_error is None:
                    log.warning("cross-node ordering: cannot list the other nodes' records (%s); markers wait", exc)
                self.last_error = str(exc)
            else:
                self.last_error = None
                for key, path in asked.items():
                    self._snapshots[key] = _Snapshot(self._others(), path)
                after = self._existing.keys() & {n for s in self._snapshots.values() for n in s.records}
                if asked or after != before:
                    pause = POLL_FIRST
                    self.on_change()
            with trio.move_on_after(pause):
                await self._wanted.wait()
            # A rename that waits holds the job's rename(2) (a FUSE request): look at the steady first
            # pace while one does, not the markers' backoff (measured: 1-6 s of a rename after the other
            # nodes' uploads were done, most of it the backoff's).
            pause = POLL_FIRST if self._renames_waiting else min(pause * 2, POLL_MAX)

    def _others(self) -> frozenset[str]:
        return frozenset(name for name, record in self._existing.items()
                         if record.node != self.node and record.node not in self._forgotten)

    async def refresh(self, *, entries: bool = False) -> None:
        """List every node's records (reading the bodies of new ones) and the forgotten nodes. `entries`: read
        the other nodes' bodies again too, for callers that go by the top-level entries they name (a node
        rewrites its record in place when its work reaches another entry: a body read before is stale)."""
        names = await self.engine.note_call(self.store.list_notes, PENDING)
        forgotten = await self.engine.note_call(self.store.list_notes, FORGOTTEN)
        existing: dict[str, PeerRecord] = {}
        waited = {n for s in self._snapshots.values() for n in s.records} | self._all_snapshot
        for name in names:
            parsed = parse_record_name(name)
            if parsed is None:
                continue
            known = self._existing.get(name)
            node, gen = parsed
            # A record names more of its files as its node closes them: read again while waited for.
            if (known is None or (name in waited and len(known.files) < FILES_NAMED)
                    or (entries and node != self.node)):
                known = await self._described(PeerRecord(name, node, gen))
            existing[name] = known
        self._existing = existing
        self._forgotten = {name[len(FORGOTTEN):] for name in forgotten}
        self._listed += 1
        self._listed_event.set()
        self._listed_event = trio.Event()

    async def _described(self, record: PeerRecord) -> PeerRecord:
        data = await self.engine.note_call(self.store.get_note, record.name)
        try:
            body = json.loads(data) if data else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        entries, files = body.get("entries"), body.get("files")
        return PeerRecord(record.name, record.node, record.gen, host=str(body.get("host") or ""),
                          entries=tuple(str(e) for e in entries) if isinstance(entries, list) else (),
                          written_at=float(body.get("written_at") or 0.0),
                          files=tuple(str(f) for f in files) if isinstance(files, list) else ())

    # -- waiting for every node -----------------------------------------------------------------------

    async def wait_all(self) -> None:
        """Return once every record the other nodes have now (forgotten nodes aside) is gone: everything
        they closed before this call is durable. The caller bounds it (trio.move_on_at)."""
        self._waiters += 1
        try:
            await self.refresh()
            snapshot = self._others()
            self._all_snapshot = snapshot
            self._wanted.set()  # the listing task polls while anyone waits
            while snapshot & self._existing.keys():
                if self.held_by(snapshot & self._existing.keys()):
                    raise HeldError(self.describe(snapshot & self._existing.keys()))
                await self._listed_event.wait()
        finally:
            self._waiters -= 1

    async def wait_for_entry(self, entry: str) -> None:
        """Return once every record other nodes have now that names the top-level entry `entry` (forgotten
        nodes aside) is gone: the work they had pending in it is durable (a directory's rename waits for
        it). The caller bounds it (trio.move_on_after)."""
        self._waiters += 1
        self._renames_waiting += 1
        try:
            await self.refresh(entries=True)  # a record read before may name `entry` only since
            snapshot = {name for name in self._others() if entry in self._existing[name].entries}
            self._wanted.set()  # the listing task polls while anyone waits
            while snapshot & self._existing.keys():
                await self._listed_event.wait()
        finally:
            self._waiters -= 1
            self._renames_waiting -= 1

    def pending_in(self, entry: str) -> list[str]:
        """One line per other node with work pending in the top-level entry `entry`, as of the last listing."""
        return self.describe(name for name in self._others() if entry in self._existing[name].entries)

    def waited_for(self) -> frozenset[str]:
        """The records the latest `wait_all` waited for that still exist."""
        return self._all_snapshot & self._existing.keys()

    def held_by(self, snapshot: Iterable[str]) -> list[str]:
        """Nodes forgotten since the snapshot whose records it still waits for."""
        return sorted({self._existing[n].node for n in snapshot
                       if n in self._existing and self._existing[n].node in self._forgotten})

    def describe(self, snapshot: Iterable[str]) -> list[str]:
        """One line per node a snapshot still waits for: node, host, entries, age of its oldest record."""
        by_node: dict[str, list[PeerRecord]] = {}
        for name in snapshot:
            record = self._existing.get(name)
            if record is not None:
                by_node.setdefault(record.node, []).append(record)
        lines = []
        now = time.time()
        for node, records in sorted(by_node.items()):
            entries = sorted({e for r in records for e in r.entries})
            oldest = min((r.written_at for r in records if r.written_at), default=0.0)
            host = next((r.host for r in records if r.host), "")
            files = sorted({f for r in records for f in r.files})[:FILES_NAMED]
            state = "given up on" if node in self._forgotten else "pending"
            age = f", {now - oldest:.0f} s" if oldest else ""
            example = f" (files such as {', '.join(files)})" if files else ""
            shown = ", ".join("files at the top" if e == TOP_FILES else e for e in entries) or "?"
            lines.append(f"node {node}{f' ({host})' if host else ''} {state}{age}: {shown}"
                         f"{example}")
        return lines

    def pending_entries(self) -> set[str]:
        """Top-level entries that other nodes (forgotten ones included: their work never landed) still
        have work in, as of the last listing: retention counts them as incomplete. TOP_FILES stands for
        any file at the top."""
        return {e for r in self._existing.values() if r.node != self.node for e in r.entries}

    async def forget(self, node: str) -> int:
        """Give up on `node` (lost for good): markers stop waiting for it; those that waited are held."""
        await self.refresh()
        records = [r for r in self._existing.values() if r.node == node]
        body = json.dumps({"node": node, "by": socket.gethostname(), "at": time.time()}).encode()
        await self.engine.note_call(self.store.put_note, f"{FORGOTTEN}{node}", body)
        await self.refresh()
        self.on_change()
        return len(records)

    def nodes(self) -> list[dict[str, Any]]:
        """Every node with records, as of the last listing (this one included)."""
        by_node: dict[str, list[PeerRecord]] = {}
        for record in self._existing.values():
            by_node.setdefault(record.node, []).append(record)
        return [
            {"node": node, "host": next((r.host for r in records if r.host), ""),
             "records": len(records), "entries": sorted({e for r in records for e in r.entries}),
             "files": sorted({f for r in records for f in r.files})[:FILES_NAMED],
             "oldest_written_at": min((r.written_at for r in records if r.written_at), default=None),
             "forgotten": node in self._forgotten, "this_node": node == self.node}
            for node, records in sorted(by_node.items())
        ]

    def waiting_per_node(self) -> dict[tuple[str, str], int]:
        """(node, checkpoint entry) -> how many markers of this node wait for it."""
        counts: dict[tuple[str, str], int] = {}
        for snapshot in self._snapshots.values():
            pairs = {(self._existing[n].node, entry) for n in snapshot.records & self._existing.keys()
                     for entry in (self._existing[n].entries or ("",))}
            for pair in pairs:
                counts[pair] = counts.get(pair, 0) + 1
        return counts

    def waiting_markers(self) -> list[dict[str, Any]]:
        out = []
        for snapshot in self._snapshots.values():
            left = snapshot.records & self._existing.keys()
            if left:
                out.append({"path": snapshot.path, "held_by": self.held_by(left), "waits_for": self.describe(left),
                            "nodes": sorted({self._existing[n].node for n in left})})
        for path in self._asked.values():
            out.append({"path": path, "held_by": [], "waits_for": ["(listing the other nodes' records)"],
                        "nodes": []})
        return out


class HeldError(Exception):
    """A flush --all-nodes waits for a node that was given up on: it will not finish by itself."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines
