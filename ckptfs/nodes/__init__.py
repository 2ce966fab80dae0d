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

from ckptfs.nodes.names import PENDING, TOP_FILES, node_id_of
from ckptfs.nodes.own import NodeRecords
from ckptfs.nodes.peers import HeldError, PeerRecords

__all__ = ["PENDING", "TOP_FILES", "HeldError", "NodeRecords", "PeerRecords", "node_id_of"]
