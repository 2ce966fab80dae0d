"""The `ckptfs` command line: argv -> Config -> daemon.run(), or a call of the Python API in control/client.py (the
control socket of a running daemon), so `ckptfs flush` and `ckptfs.wait_durable()` are one code path.

Owns the dispatch of a command to its module and mapping errors to exit codes: 0 ok, 1 an error the user can
fix (one line on stderr, no traceback), 2 bad usage, 3 not everything is durable in the store yet
(flush/umount timed out). The modules, one concern each: arguments.py (the parser; flags -> Config),
launch.py (mount: in the foreground, or detached and waiting for ready; the malloc pad), logs.py (the daemon's
logging), mounts.py (umount, restart, guard, unguard, holder), show.py (status, limit, nodes: human and JSON
output), actions.py (flush, preempt, prefetch, prune, refresh).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ckptfs.cli import actions, launch, mounts, show
from ckptfs.cli.actions import EXIT_NOT_DURABLE
from ckptfs.cli.arguments import build_parser, mountpoint_from_environment
from ckptfs.errors import CkptfsError

__all__ = ["EXIT_NOT_DURABLE", "main"]

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "holder": mounts.cmd_holder,
    "mount": launch.cmd_mount, "umount": mounts.cmd_umount, "restart": mounts.cmd_restart,
    "status": show.cmd_status, "flush": actions.cmd_flush, "refresh": actions.cmd_refresh,
    "prune": actions.cmd_prune, "nodes": show.cmd_nodes, "guard": mounts.cmd_guard, "unguard": mounts.cmd_unguard,
    "limit": show.cmd_limit,
    "preempt": actions.cmd_preempt,
    "prefetch": actions.cmd_prefetch,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.restartable = argv is None  # sys.argv is this command line: the daemon may re-execute it
    try:
        if args.command in ("status", "flush", "refresh", "prune", "nodes", "limit"):
            mountpoint_from_environment(args)
        return COMMANDS[args.command](args)
    except CkptfsError as exc:
        print(f"ckptfs: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
