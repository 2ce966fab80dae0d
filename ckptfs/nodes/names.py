"""Where the nodes' records live in the store and what they are called: node ids, record names, the
top-level entry a record names for a path."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

from ckptfs.journal import Journal

PENDING = "pending/"  # pending/<node>/<gen>: a node's work not yet durable
FORGOTTEN = "forgotten/"  # forgotten/<node>: given up on by an operator (`ckptfs nodes --forget`)
FILES_NAMED = 5  # files a record names as examples of its work (status of other nodes shows them)
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


def parse_record_name(name: str) -> tuple[str, int] | None:
    parts = name[len(PENDING):].split("/")
    if len(parts) != 2 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])

