"""Checksum math, written once: the CRC32 of bytes, the 'crc32:<hex>' text every layer keeps (the journal,
object metadata, LocalStore), and the combination of the CRC32s of consecutive pieces (the parts of an
upload, the ranges of a download) into the whole object's, so that a file is never read twice to know
its checksum. Imports nothing of ckptfs: stores, the engine and the fetcher all use it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # no isal wheel for this platform
    from zlib import crc32 as _crc32


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib.crc32: every byte uploaded or downloaded is checksummed, so this is ISA-L's when the isal
    package is there (the same values, 3-4x as fast; it releases the GIL like zlib's)."""
    return _crc32(data, value)


def crc_of(checksum: str) -> int:
    """The CRC32 in a 'crc32:<hex>' checksum ('' for nothing yet: 0)."""
    return int(checksum.split(":", 1)[1], 16) if checksum else 0


def crc_text(crc: int) -> str:
    return f"crc32:{crc:08x}"


_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial (reflected bit order), as in zlib's crc32_combine."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table = []
    p = 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A+B from crc32(A), crc32(B) and len(B)."""
    p = 1 << 31  # x^0
    k = 3  # bytes -> bits
    n = len2
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def combine_crcs(pieces: Iterable[tuple[int, int]], start: int = 0) -> int:
    """The CRC32 of consecutive pieces from each one's (CRC32, length), in order, following bytes whose
    CRC32 is `start` (0: nothing before them; the CRC32 of no bytes is 0, and combining after it is the
    piece's own)."""
    whole = start
    for crc, length in pieces:
        whole = crc32_combine(whole, crc, length)
    return whole


def whole_crc(crcs: Sequence[int], part_size: int, size: int) -> int:
    """The CRC32 of a file of `size` bytes from the CRC32s of its parts of `part_size`, in order."""
    return combine_crcs((crc, min(part_size, size - index * part_size)) for index, crc in enumerate(crcs))
