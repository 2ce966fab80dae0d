"""Cross-node ordering of commit markers, through the store itself (docs/design/cross-node.md).

Many nodes, each with its own mount of one prefix, write one checkpoint; after the job's barrier one node
writes the commit marker. The marker must reach the store only after every file that any node closed
before it is durable. The store is the only thing the nodes share, so they tell each other through it:

- `NodeRecords` (every node): while this node has work that is not durable yet (a file open for writing
  or closed after writing, a new directory or symlink, a rename), a *pending record* of it exists in the
  store, written before the open for writing, mkdir, symlink or rename returns (so before the file's
  close), and deleted once that work is durable. Records have generations (`pending/<node>/<gen>`, a key
  never reused): an entry is covered by the record current when it was announced, which is deleted only
  when everything it covers is durable. A busy node starts a new generation now and then (which takes
  over the files still open for writing), so that an old one can go while new work keeps coming.
- `PeerRecords` (the node holding a marker): once a marker has closed, it lists the other nodes' records
  (a *snapshot*; whatever closed before the barrier was announced before it) and uploads the marker only
  when every record of the snapshot is gone. The listing is taken after the marker closed, so it holds
  the records of everything the barrier ordered before it; records made later are not waited for.

Nodes can be given up on (`forgotten/<node>`): a snapshot leaves out nodes forgotten before it, and a
marker whose snapshot holds a record of a node forgotten later is held, never uploaded by itself (the
checkpoint is not complete); if that node comes back and drains, its records go and the marker lands.

Costs: a node writes one record (one PUT) when work begins after a quiet spell, one more when work lands in
another top-level entry or after ROTATE_AFTER seconds of continuous work, and deletes each (one DELETE)
once its work is durable; the marker's node lists the records once per marker, and polls while it waits.
Everything here runs in the trio thread; the store is reached only through the transfer engine.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from ckptfs.backends.base import BackendError
from ckptfs.journal import CLEAN, DIR, DIRTY, FILE, REMOTE, UPLOADING, Inode, Journal
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

PENDING = "pending/"  # pending/<node>/<gen>: a node's work not yet durable
FORGOTTEN = "forgotten/"  # forgotten/<node>: given up on by an operator (`ckptfs nodes --forget`)
# A record with nothing left to cover goes after this much quiet, so that a save's next close reuses it.
LINGER = 2.0
# A record that has covered work for this long is succeeded by a new one: the old one can then go once
# its own work is durable, though this node keeps writing.
ROTATE_AFTER = 10.0
# How long a close waits for its record to reach the store before it returns anyway (the store is down
# or refuses writes; status and the log say that the cross-node guarantee is weakened meanwhile).
ANNOUNCE_WAIT = 5.0
CHECK_INTERVAL = 0.5  # how often this node's records are checked for being done
CHECK_BATCH = 256  # covered entries read from the journal at once by a check
FILES_NAMED = 5  # files a record names as examples of its work (status of other nodes shows them)
POLL_FIRST = 0.5  # a waiting marker's first look at the other nodes' records, doubling up to POLL_MAX
POLL_MAX = 10.0
GEN_WIDTH = 12
NODE_META = "node_id"
GEN_META = "node_gen"
_NODE_CHARS = re.compile(r"[^A-Za-z0-9.-]+")


def new_node_id(host: str, suffix: str) -> str:
    """A key-safe id: the host name (what an operator recognises) and a random part (two cache dirs on one
    host, or a host that was re-imaged, are two nodes)."""
    name = _NODE_CHARS.sub("-", host).strip("-.")[:40] or "node"
    return f"{name}-{suffix}"


def node_id_of(journal: Journal, make_suffix: Callable[[], str]) -> str:
    """This cache dir's node id, made and kept in the journal at the first mount."""
    node = journal.get_meta(NODE_META)
    if node is None:
        node = new_node_id(socket.gethostname(), make_suffix())
        with journal.transaction():
            journal.set_meta(NODE_META, node)
    return node


def record_name(node: str, gen: int) -> str:
    return f"{PENDING}{node}/{gen:0{GEN_WIDTH}d}"


TOP_FILES = "*"  # the entry name of work on files and symlinks at the top of the mount


def top_entry(path: str, *, directory: bool) -> str:
    """What a record names of an entry's work: the top-level directory it is in (what retention counts as
    one checkpoint), or TOP_FILES for files at the top (2,000 files saved at the top must not cost a
    record rewrite each)."""
    top, slash, _ = path.partition("/")
    return top if slash or directory else TOP_FILES


def _pending(inode: Inode | None, writing: bool) -> bool:
    """Is this covered entry's work still to reach the store? A file counts while a writer has it open
    (`writing`: its close will be covered by the record that covers it now) and while it is dirty and
    closed. A renamed entry counts until its object is moved."""
    if writing:
        return True
    if inode is None or inode.path is None:
        return False  # removed: deletes are not ordered (as on one node)
    if inode.state in (DIRTY, UPLOADING):
        return inode.kind != FILE or inode.closed_at is not None
    if inode.state in (CLEAN, REMOTE) and inode.remote_key is not None:
        return inode.remote_key != (inode.path + "/" if inode.kind == DIR else inode.path)
    return False


@dataclass
class _Record:
    gen: int
    started: float  # trio time
    last_cover: float
    names: set[str] = field(default_factory=set)  # top-level entries of the work it covers
    published: frozenset[str] | None = None  # the names its body in the store lists; None: not written yet
    inherited: bool = False  # left by an earlier run of this node: covers whatever is pending
    retiring: bool = False  # being deleted: covers nothing new
    files_named: int = 0  # files its body names as examples (rewritten in the background up to FILES_NAMED)
    rewrites: int = 0  # times its body was written again to name more files
    sample_stale: bool = False  # it covers a file its body does not name yet, and names fewer than FILES_NAMED


class NodeRecords:
    """This node's pending records in the store (see the module docstring)."""

    def __init__(self, journal: Journal, engine: Transfers, node: str, *, host: str | None = None) -> None:
        self.journal = journal
        self.engine = engine
        self.store = engine.store
        self.node = node
        self.host = host or socket.gethostname()
        self._records: dict[int, _Record] = {}
        self._current: _Record | None = None
        # Generation -> the entries whose work it covers (an entry is in the newest that covered it).
        self._covered: dict[int, set[int]] = {}
        self._gen_of: dict[int, int] = {}  # inode id -> its generation in _covered
        self._writers: dict[int, int] = {}  # inode id -> handles open for writing (covered at their open)
        self._lock = trio.Lock()  # one write or delete of this node's records at a time
        self._tidying = trio.Lock()
        self._check = trio.Event()
        # Set while a record could not be written: closes then go on without it (cross-node order weakened).
        self.unannounced: str | None = None
        self.announce_failures = 0
        self._store_refusals = 0  # record writes and deletes the store refused (the checker backs off)
        self.records_written = 0
        self.records_deleted = 0

    # -- the FUSE side ----------------------------------------------------------------------------------

    async def cover(self, inode_id: int, path: str, *, directory: bool = False, writer: bool = False) -> None:
        """Before an open for writing (`writer`: the file's close is then covered until its release), a
        mkdir, symlink or rename returns: make sure a record of this node that covers it is in the store.
        Costs nothing once the current record lists the entry's top-level name; else one PUT (once per
        quiet spell and per checkpoint, typically). Covering at the open, not at close(), spares every
        close() a FLUSH request to the daemon."""
        now = trio.current_time()
        record = self._current
        if record is None or record.retiring:
            record = self._new_record(now)
            self._current = record
        self._repoint(inode_id, record.gen)
        if writer:
            self._writers[inode_id] = self._writers.get(inode_id, 0) + 1
        record.last_cover = now
        name = top_entry(path, directory=directory)
        record.names.add(name)
        if record.published is not None and name in record.published:
            if writer and record.files_named < FILES_NAMED and record.rewrites < FILES_NAMED:
                record.sample_stale = True  # named by a rewrite in the background, not before open() returns
                self._check.set()
            return
        if self.unannounced is not None:
            # The store refused or did not answer the last write of a record: no open waits for it again
            # (a store that is down would cost every file ANNOUNCE_WAIT); the checker writes it meanwhile.
            self._check.set()
            return
        with trio.move_on_after(ANNOUNCE_WAIT) as waited:
            await self._publish(record)
        if waited.cancelled_caught and self.unannounced is None:
            self._announce_failed(f"the store did not answer within {ANNOUNCE_WAIT:.0f} s")

    def _repoint(self, inode_id: int, gen: int) -> None:
        previous = self._gen_of.get(inode_id)
        if previous == gen:
            return
        if previous is not None:
            self._covered[previous].discard(inode_id)
        self._gen_of[inode_id] = gen
        self._covered.setdefault(gen, set()).add(inode_id)

    def released(self, inode_id: int) -> None:
        """A handle open for writing was released; the journal has recorded the close (the last writer's)."""
        left = self._writers.get(inode_id, 0) - 1
        if left > 0:
            self._writers[inode_id] = left
        else:
            self._writers.pop(inode_id, None)

    # -- records ------------------------------------------------------------------------------------------

    def _new_record(self, now: float) -> _Record:
        """A new generation, counted in the journal before its record is written: a key is never reused,
        also after a crash between the two."""
        gen = int(self.journal.get_meta(GEN_META) or 0) + 1
        with self.journal.transaction():
            self.journal.set_meta(GEN_META, str(gen))
        record = _Record(gen, started=now, last_cover=now)
        self._records[gen] = record
        return record

    def _body(self, record: _Record, names: Iterable[str]) -> bytes:
        """What an operator on another node sees: who, since when, which checkpoints, a few of the files."""
        covered = list(itertools.islice(self._covered.get(record.gen, ()), 4 * FILES_NAMED))
        files = sorted(i.path for i in self.journal.get_many(covered).values()
                       if i.path is not None and i.kind == FILE)[:FILES_NAMED]
        record.files_named = len(files)
        return json.dumps({
            "node": self.node, "host": self.host, "gen": record.gen, "written_at": time.time(),
            "entries": sorted(names), "files": files,
        }).encode()

    async def _publish(self, record: _Record) -> None:
        async with self._lock:
            names = frozenset(record.names)
            if record.retiring or (record.published is not None and names <= record.published
                                   and not record.sample_stale):
                return
            if record.sample_stale:
                record.rewrites += 1
            record.sample_stale = False
            try:
                await self.engine.call(self.store.put_note, record_name(self.node, record.gen),
                                       self._body(record, names))
            except BackendError as exc:
                self._announce_failed(str(exc))
                self._check.set()  # the checker writes it again
                return
            record.published = names
            self.records_written += 1
            if self.unannounced is not None:
                log.info("cross-node ordering: records reach the store again")
                self.unannounced = None

    def _announce_failed(self, why: str) -> None:
        self.announce_failures += 1
        self._store_refusals += 1
        if self.unannounced is None:
            log.warning("cross-node ordering: cannot write this node's pending record to the store (%s); closes"
                        " go on without it, so another node's commit marker may not wait for this node's"
                        " files until it is written", why)
        self.unannounced = why

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take over the records an earlier run of this node left, then delete records whose work is
        durable, succeed long-lived ones, and write those that could not be written yet."""
        task_status.started()
        pause = CHECK_INTERVAL
        while True:  # the store may be unreachable at the mount: records made meanwhile get later gens
            try:
                await self._inherit()
                break
            except BackendError as exc:
                log.warning("cross-node ordering: cannot list this node's records from before (%s); trying"
                            " again in %.0f s", exc, pause)
                await trio.sleep(pause)
                pause = min(pause * 2, POLL_MAX)
        pause = CHECK_INTERVAL
        while True:
            with trio.move_on_after(CHECK_INTERVAL):
                await self._check.wait()
            self._check = trio.Event()
            if self._records:
                refused = self._store_refusals
                await self.tidy()
                if self._store_refusals > refused:
                    # The store refused a write or delete: ask it again after a pause that doubles, not at
                    # once (each failure asks for a check again)
                    await trio.sleep(pause)
                    pause = min(pause * 2, POLL_MAX)
                else:
                    pause = CHECK_INTERVAL

    async def _inherit(self) -> None:
        names = await self.engine.call(self.store.list_notes, f"{PENDING}{self.node}/")
        now = trio.current_time()
        for name in names:
            gen_text = name.rsplit("/", 1)[-1]
            if gen_text.isdigit():
                gen = int(gen_text)
                body = await self._read(name)
                entries = frozenset(body.get("entries") or ()) if body else frozenset()
                self._records[gen] = _Record(gen, now, now, set(entries), entries, inherited=True)
        if self._records:
            log.info("cross-node ordering: %d record(s) of this node from before; they go once what this node"
                     " had pending is durable", len(self._records))
        forgotten = f"{FORGOTTEN}{self.node}"
        if await self.engine.call(self.store.get_note, forgotten) is not None:
            log.warning("this node (%s) had been given up on (ckptfs nodes --forget); it is back: markers of"
                        " other nodes wait for its records again", self.node)
            await self.engine.call(self.store.delete_note, forgotten)

    async def _read(self, name: str) -> dict[str, Any] | None:
        data = await self.engine.call(self.store.get_note, name)
        try:
            body = json.loads(data) if data else None
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def _oldest_pending(self) -> float:
        """The lowest generation that still covers pending work (math.inf: none), forgetting covered
        entries that are done. Reads a batch at a time and stops at the first pending entry: a save of
        100,000 small files costs one batch per check, not the whole set."""
        for gen in sorted(self._covered):
            entries = self._covered[gen]
            size = 8  # pending entries are usually found in the first few: read more only as needed
            while entries:
                batch = list(itertools.islice(entries, size))
                size = min(size * 4, CHECK_BATCH)
                current = self.journal.get_many(batch)
                pending = False
                for inode_id in batch:
                    if _pending(current.get(inode_id), inode_id in self._writers):
                        pending = True
                    else:
                        entries.discard(inode_id)
                        del self._gen_of[inode_id]
                if pending:
                    return gen
            del self._covered[gen]
        return math.inf

    def _anything_pending(self) -> bool:
        """What a record of an earlier run covers: the daemon before the restart knew, this one does not."""
        return bool(self._writers) or self.journal.has_closed_pending() or bool(self.journal.misplaced(1))

    def _done(self, *, final: bool = False) -> list[_Record]:
        """Records whose work is all durable, marked retiring (no cover joins them from now). Synchronous:
        a cover that comes after this either finds the record retiring or was counted as pending."""
        now = trio.current_time()
        oldest = self._oldest_pending()
        done = []
        for gen in sorted(self._records):
            record = self._records[gen]
            if gen >= oldest or (record.inherited and self._anything_pending()):
                break
            if record is self._current and not final and now - record.last_cover < LINGER:
                break
            record.retiring = True
            if record is self._current:
                self._current = None
            done.append(record)
        return done

    async def tidy(self, *, final: bool = False) -> None:
        """Delete the records that are done; write the ones not written yet; succeed a long-lived one.
        One at a time: the checker and a flush both call it."""
        async with self._tidying:
            await self._tidy(final=final)

    async def _tidy(self, *, final: bool) -> None:
        for record in self._done(final=final):
            async with self._lock:
                if record.published is not None or record.inherited:
                    try:
                        await self.engine.call(self.store.delete_note, record_name(self.node, record.gen))
                    except BackendError as exc:
                        record.retiring = False  # tried again at the next check
                        self._store_refusals += 1
                        log.debug("cannot delete pending record %d: %s", record.gen, exc)
                        self._check.set()
                        return
                    self.records_deleted += 1
                self._records.pop(record.gen, None)
        for record in list(self._records.values()):
            if not record.retiring and record.names and (record.published is None or record.sample_stale
                                                         or not record.names <= record.published):
                await self._publish(record)
        current = self._current
        now = trio.current_time()
        if (not final and current is not None and current.published is not None
                and now - current.started >= ROTATE_AFTER and self._oldest_pending() <= current.gen):
            successor = self._new_record(now)
            successor.names = set(current.names)  # what is still open for writing there closes under it
            await self._publish(successor)
            if successor.published is not None and self._current is current:
                self._current = successor
                # Files still open for writing close under the successor: the old record can go once the
                # work closed under it is durable, however long a writer (a log) keeps its file open.
                for inode_id in self._writers:
                    self._repoint(inode_id, successor.gen)
            elif successor.published is None:
                self._records.pop(successor.gen, None)

    async def retire_all(self) -> bool:
        """At a clean unmount, after the drain: delete every record if nothing is pending. True if none left."""
        await self.tidy(final=True)
        return not self._records

    def status(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "records": [{"gen": r.gen, "entries": sorted(r.names), "written": r.published is not None,
                         "from_before": r.inherited} for r in sorted(self._records.values(), key=lambda r: r.gen)],
            "unannounced": self.unannounced,
        }


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


def _parse_record(name: str) -> tuple[str, int] | None:
    parts = name[len(PENDING):].split("/")
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


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
            pause = min(pause * 2, POLL_MAX)

    def _others(self) -> frozenset[str]:
        return frozenset(name for name, record in self._existing.items()
                         if record.node != self.node and record.node not in self._forgotten)

    async def refresh(self) -> None:
        """List every node's records (reading the bodies of new ones) and the forgotten nodes."""
        names = await self.engine.call(self.store.list_notes, PENDING)
        forgotten = await self.engine.call(self.store.list_notes, FORGOTTEN)
        existing: dict[str, PeerRecord] = {}
        waited = {n for s in self._snapshots.values() for n in s.records} | self._all_snapshot
        for name in names:
            parsed = _parse_record(name)
            if parsed is None:
                continue
            known = self._existing.get(name)
            # A record names more of its files as its node closes them: read again while waited for.
            if known is None or (name in waited and len(known.files) < FILES_NAMED):
                node, gen = parsed
                known = await self._described(PeerRecord(name, node, gen))
            existing[name] = known
        self._existing = existing
        self._forgotten = {name[len(FORGOTTEN):] for name in forgotten}
        self._listed += 1
        self._listed_event.set()
        self._listed_event = trio.Event()

    async def _described(self, record: PeerRecord) -> PeerRecord:
        data = await self.engine.call(self.store.get_note, record.name)
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
        await self.engine.call(self.store.put_note, f"{FORGOTTEN}{node}", body)
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
