"""Streaming reads of files that exist only in the store ('remote'): a read waits only for its own chunks.

Owns, per remote inode being read, a `Stream`: a partial file in CACHE_DIR/tmp, created sparse at the
object's size, and the in-memory record (trio thread only) of which chunks of it are present. A chunk is
`engine.download_part_size` bytes (16 MiB). `read(offset, size)` is served by pread once the chunks it
covers are present; a missing chunk is fetched first (Priority.READ), and a reader that continues where
its last read ended (sequential) gets a growing window of chunks fetched ahead in parallel
(Priority.READAHEAD). Every reader of an inode shares its one Stream: a chunk is fetched once and its
waiters wait on it.

Versions: all chunks of a Stream come from one version of the object: the first answer's etag is passed
as `if_match` to every later range. An ObjectChangedError (another node replaced the object) fails the
Stream's reads with ESTALE, logged once, and the next open starts a new Stream.

Verification: when every chunk is present at once, their CRC32s (combined in order) must equal the
journal's checksum (or the one in the object's metadata); then the partial file is renamed to the inode's
data file and the journal marks it clean: from there it is an ordinary cached file. On a mismatch the
data is dropped, an ERROR logged, and reads fail with EIO. A file never completely present stays 'remote':
its reads are served from chunks of the pinned version, each the bytes the store sent for that range.

Space: a chunk is reserved in the cache budget (cache.reserve) before it is fetched and stays charged
while present. When the cache is over budget the evictor (through the `PartialFiles` hooks below) drops
partial files no handle has open, least recently used first, and punches out present chunks that are not
near any reader's position; they are fetched again if read later. So a file larger than the whole cache
can be read. `fetch()` (open for writing, truncate: whatever needs the whole content) fetches every chunk,
verifies and returns once the file is clean.

Tasks: chunk fetches run in the Fetcher's own nursery (`run`, started by the daemon) so that a fetch
shared by several readers outlives the request that started it. Without the service (tools, some tests)
a read fetches its missing chunks itself and nothing is read ahead.

Modules: stream.py (a Stream: one version of one remote inode, partly present; a Reader: one handle's
position and read-ahead window), partials.py (every partial file in the cache: the Streams new opens use,
dropping and punching them for room: the evictor's hooks), fetcher.py (the Fetcher: fetching chunks,
pinning the version, following moves, verifying and adopting a complete file, whole-file fetches).

Never touches FUSE or the namespace; the journal only to adopt a verified file (finish_fetch).
"""

from ckptfs.fetch.fetcher import Fetcher, FetchStats
from ckptfs.fetch.stream import Reader, Stream

__all__ = ["FetchStats", "Fetcher", "Reader", "Stream"]
