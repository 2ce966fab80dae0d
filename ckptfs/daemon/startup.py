"""A mount's start: the checks before anything is touched (runtime dir, fusermount, the store, the mountpoint
or a connection a holder keeps), then the cache dir (locked), the metrics endpoint, the journal (bound to
its source) and its recovery, the transfer engine, and a Daemon (running.py) built on them and run; all of
it closed again, in order, when the Daemon returns (or a start fails: the guard goes back).

Owns the order of the start and what is checked before mounting; `run` is what `ckptfs mount` calls.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

import pyfuse3
import trio

from ckptfs.backends import check_store, open_store
from ckptfs.backends.base import UploadState
from ckptfs.cache.directory import CacheDir
from ckptfs.config import Config, parse_bandwidth, parse_size
from ckptfs.control.client import ensure_runtime_dir, runtime_dir
from ckptfs.control.metrics import InstrumentedStore, MetricsServer, parse_addr
from ckptfs.daemon.process import raise_open_file_limit, return_freed_part_buffers
from ckptfs.daemon.running import Daemon
from ckptfs.drain.recovery import recover
from ckptfs.errors import CkptfsError
from ckptfs.fs.handle_table import HandleTable
from ckptfs.journal import Journal, JournalError
from ckptfs.keepmount import link as holder_link
from ckptfs.keepmount.keeper import find_held_connection
from ckptfs.mount import guard
from ckptfs.mount.mountpoint import check_fusermount, check_mountpoint
from ckptfs.transfer import Transfers

log = logging.getLogger(__name__)


def _owner_tag(journal: Journal) -> str:
    """A random id of this cache dir, created once; it tags the uploads it stages in the store."""
    tag = journal.get_meta("owner")
    if tag is None:
        tag = secrets.token_hex(6)
        with journal.transaction():
            journal.set_meta("owner", tag)
    return tag


async def run(
    config: Config, ready: Callable[[], None] = lambda: None, restart_argv: list[str] | None = None
) -> int:
    """Mount and serve until stopped (or take over the mount a holder keeps for a daemon that died). Raises
    CkptfsError for anything the user must fix before mounting. `restart_argv`: the `ckptfs` arguments that
    start this daemon again (keep_mount; None: no holder)."""
    return_freed_part_buffers()
    raise_open_file_limit()
    ensure_runtime_dir(runtime_dir())  # the control socket's (and the holder's): a clear error before mounting
    check_fusermount()
    store = InstrumentedStore(open_store(config.source, endpoint_url=config.endpoint_url))
    await trio.to_thread.run_sync(check_store, store)
    # Before anything touches the mountpoint: if a holder keeps its connection, a stat would wait for a
    # daemon, and this is the one. (A daemon that cannot start fails before it attaches: its holder counts
    # that, and gives up after a few.)
    held, from_systemd = find_held_connection(config.mountpoint, pyfuse3)
    unguarded = held is None and check_mountpoint(config.mountpoint)
    try:
        return await _run_on(config, store, held, from_systemd, ready, restart_argv)
    except BaseException:
        guarded, _ = guard.availability(config.guard_mountpoint)
        if unguarded and guarded and guard.mounted_at(config.mountpoint) is None:
            guard.place(config.mountpoint)  # a start that failed before mounting: the guard goes back
        raise


async def _run_on(
    config: Config, store: InstrumentedStore, held: holder_link.Held | None, from_systemd: bool,
    ready: Callable[[], None], restart_argv: list[str] | None,
) -> int:
    cache = CacheDir(config.resolved_cache_dir())
    cache.prepare()
    cache.lock()
    metrics = _start_metrics(config.metrics_addr)
    handle_table = HandleTable(cache.root / "handles")
    try:
        try:
            journal = Journal(cache.journal_path)
        except (JournalError, OSError) as exc:
            raise CkptfsError(str(exc)) from None
        try:
            store.owner = _owner_tag(journal)
            bound = journal.get_meta("source")
            if bound is None:
                with journal.transaction():
                    journal.set_meta("source", store.url)
            elif bound != store.url:
                raise CkptfsError(
                    f"cache dir {cache.root} holds data of {bound}, not {store.url};"
                    " use another --cache-dir (or mount that source)"
                )
            log.info("ckptfs %s -> %s: %s", store.url, config.mountpoint, config.effective(cache.root))
            engine = Transfers(
                store, part_size=parse_size(config.part_size), memory_budget=parse_size(config.memory_budget),
                parts_in_flight=config.parts_in_flight,
                upload_limit=parse_bandwidth(config.upload_limit, "upload_limit"),
                download_limit=parse_bandwidth(config.download_limit, "download_limit"),
            )
            restored = handle_table.open(keep=held is not None)
            recovered = recover(journal, cache, engine, time.time(), still_open={h.inode_id for h in restored},
                                still_writing={h.inode_id for h in restored if h.writable})
            atimes = cache.scan()
            for inode_id, text in journal.work.upload_states():
                state = UploadState.parse(text)
                if state is not None and state.spilled:
                    cache.restore_spilled(inode_id, punched=state.punched, staged=state.size, sealed=not state.early)
            daemon = Daemon(config, engine, cache, journal, metrics, handle_table=handle_table, held=held,
                            restored=restored, restart_argv=restart_argv)
            daemon.recovered = recovered
            # Under systemd every connection taken over (Restart=, `ckptfs restart`) is also in its store.
            daemon.keeper.kept_by_systemd(from_systemd or (held is not None and config.keep_mount))
            cache.configure_budget(config.cache_size, config.min_free, working_room=daemon.drain.spill_room)
            daemon.evictor.start(atimes)
            code = await daemon.run(ready)
            restart = daemon.restart
        finally:
            journal.close()
    finally:
        handle_table.close()
        if metrics is not None:
            metrics.close()
        cache.unlock()
    if restart is not None:
        raise restart
    return code


def _start_metrics(addr: str) -> MetricsServer | None:
    try:
        where = parse_addr(addr)
    except ValueError as exc:
        raise CkptfsError(str(exc)) from None
    if where is None:
        return None
    try:
        return MetricsServer(*where)
    except OSError as exc:
        raise CkptfsError(
            f"cannot serve metrics on {addr}: {exc.strerror}; is another ckptfs mount using it? Give each"
            " mount its own --metrics-addr HOST:PORT, or --metrics-addr off"
        ) from None
