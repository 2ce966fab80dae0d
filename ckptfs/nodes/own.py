"""This node's pending records: written before the work they cover is acknowledged, deleted once it is
durable (see the package docstring)."""

from __future__ import annotations

import itertools
import json
import logging
import math
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from ckptfs.errors import BackendError
from ckptfs.journal import CLEAN, DIR, DIRTY, FILE, REMOTE, UPLOADING, Inode, Journal
from ckptfs.nodes.names import FILES_NAMED, FORGOTTEN, GEN_META, PENDING, record_name, top_entry
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)

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
CHECK_MAX = 10.0  # the check's pause doubles up to this while the store refuses records


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
        # The last generation an earlier run made: the listing of the records from before (_inherit) may end
        # after the first open of this run wrote its record (a higher generation), and must not take that one
        # for an earlier run's.
        self._earlier_gens = int(journal.get_meta(GEN_META) or 0)
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
        files = sorted(i.path for i in self.journal.names.get_many(covered).values()
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
                await self.engine.note_call(self.store.put_note, record_name(self.node, record.gen),
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
                pause = min(pause * 2, CHECK_MAX)
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
                    pause = min(pause * 2, CHECK_MAX)
                else:
                    pause = CHECK_INTERVAL

    async def _inherit(self) -> None:
        names = await self.engine.note_call(self.store.list_notes, f"{PENDING}{self.node}/")
        now = trio.current_time()
        for name in names:
            gen_text = name.rsplit("/", 1)[-1]
            # The first opens of this run do not wait for this listing: a record they wrote meanwhile is
            # listed too, and is this run's, not one from before (it would wait for every pending file).
            if gen_text.isdigit() and int(gen_text) <= self._earlier_gens:
                gen = int(gen_text)
                body = await self._read(name)
                entries = frozenset(body.get("entries") or ()) if body else frozenset()
                self._records[gen] = _Record(gen, now, now, set(entries), entries, inherited=True)
        inherited = sum(record.inherited for record in self._records.values())
        if inherited:
            log.info("cross-node ordering: %d record(s) of this node from before; they go once what this node"
                     " had pending is durable", inherited)
        forgotten = f"{FORGOTTEN}{self.node}"
        if await self.engine.note_call(self.store.get_note, forgotten) is not None:
            log.warning("this node (%s) had been given up on (ckptfs nodes --forget); it is back: markers of"
                        " other nodes wait for its records again", self.node)
            await self.engine.note_call(self.store.delete_note, forgotten)

    async def _read(self, name: str) -> dict[str, Any] | None:
        data = await self.engine.note_call(self.store.get_note, name)
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
                current = self.journal.names.get_many(batch)
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
        return bool(self._writers) or self.journal.work.has_closed_pending() or bool(self.journal.work.misplaced(1))

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
                        await self.engine.note_call(self.store.delete_note, record_name(self.node, record.gen))
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


