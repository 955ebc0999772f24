"""The integrity trailer of hicache-io's page objects: 16 bytes after the object.

Integrity: hicache-io's own (shard-named) objects end in a 16-byte trailer, ``HIOSUM03`` and the
page object's checksum (:func:`hicache_io._native.checksum`: a multilinear hash of its 32-bit
words, fixed seed) folded with a hash of the object's key. Puts write it from the host pages; gets
check it against the bytes that landed, so changed bytes and pages stored under another key fail
their page (``INTEGRITY``). Objects without a trailer (another build, ``integrity=False``) read as
unverified, never as corrupt, and so do objects whose trailer is of an older key stream
(``HIOSUM01``, ``HIOSUM02``); sglang-named objects keep sglang's shape and are unverified too. After a get into
the host pool's memory, the pool's own item checksums of each verified page are recomputed from
the bytes that landed, and forgotten for every other page the get wrote.
"""

from typing import Any, Dict, Sequence

import numpy as np

from .. import _native

#: First word of a page object's trailer: ``HIOSUM03`` (checksum keys computed from each word's
#: position by a 32-bit mixer). Spelled once, in the native module (its local store checks it too).
TRAILER_MAGIC: int = _native.TRAILER_MAGIC
#: Bytes of a trailer: the magic, then the object's checksum bound to its key (little-endian u64s).
TRAILER_BYTES: int = _native.TRAILER_BYTES
# Trailers are held as rows of two little-endian u64 words (``[n][2]`` arrays) everywhere.
assert TRAILER_BYTES == 16, f"the native module's trailer is {TRAILER_BYTES} bytes: this code holds two 8-byte words"
#: Trailers of earlier key streams (``HIOSUM01``: 64-bit keys; ``HIOSUM02``: 32-bit keys of a
#: 64-bit mixer): read as unverified.
OLD_TRAILER_MAGICS = tuple(_native.OLD_TRAILER_MAGICS)


def name_tags(keys: Sequence[str]) -> np.ndarray:
    """64-bit tags of objects' keys (FNV-1a), folded into their checksums so that a page stored
    under another key (swapped, replayed from elsewhere) fails the check."""
    return _native.name_tags(list(keys))


def name_tag(key: str) -> int:
    return int(name_tags([key])[0])


def seal(trailers: np.ndarray, rows: Any, sums: np.ndarray, obj_keys: Sequence[str]) -> None:
    """Writes trailers ``rows`` of ``trailers`` (``[n][2]`` little-endian u64: magic, checksum
    bound to the key) for objects ``obj_keys`` of checksums ``sums``, one of each a row."""
    trailers[rows, 0] = TRAILER_MAGIC
    trailers[rows, 1] = bound(sums, obj_keys)


def sealed_rows(trailers: np.ndarray) -> np.ndarray:
    """Which trailers (``[n][2]``) are this format's (whatever checksum they hold)."""
    return trailers[:, 0] == TRAILER_MAGIC


def bound(sums: np.ndarray, obj_keys: Sequence[str]) -> np.ndarray:
    """The trailer's second word for objects ``obj_keys`` of checksums ``sums``: each checksum
    bound to its key."""
    return np.asarray(sums, dtype=np.uint64) ^ name_tags(obj_keys)


def matches(trailers: np.ndarray, sums: np.ndarray, obj_keys: Sequence[str]) -> np.ndarray:
    """Which of the trailers (``[n][2]``) are this format's and hold ``sums`` bound to ``obj_keys``."""
    return (trailers[:, 0] == TRAILER_MAGIC) & (trailers[:, 1] == bound(sums, obj_keys))


#: A get's verdict on an object (:func:`verify`'s, or a native landing's: ``HostPool._land_sealed``):
#: not read whole, verified, unverified (no trailer, or one of an earlier format), corrupt.
NOT_READ, VERIFIED, UNVERIFIED, CORRUPT = _native.SEALED_VERDICTS


def counted(verdicts: np.ndarray, ok: np.ndarray, unverified: np.ndarray, stats: Dict[str, int]) -> np.ndarray:
    """Takes a get's verdicts (one an object): counts ``verified``, ``unverified`` and ``corrupt``
    objects in ``stats``, marks ``unverified`` and fails the corrupt ones in ``ok`` (both in
    place); returns which objects are corrupt."""
    corrupt = verdicts == CORRUPT
    unverified |= verdicts == UNVERIFIED
    stats["unverified"] += int(np.count_nonzero(verdicts == UNVERIFIED))
    stats["verified"] += int(np.count_nonzero(verdicts == VERIFIED))
    stats["corrupt"] += int(np.count_nonzero(corrupt))
    ok &= ~corrupt
    return corrupt


def verify(trailers: np.ndarray, sums: np.ndarray, tags: np.ndarray, ok: np.ndarray, unverified: np.ndarray, stats: Dict[str, int]) -> np.ndarray:
    """Checks each object read whole (``ok``) and not ``unverified`` (read without a trailer)
    against its trailer (row ``j`` of ``trailers``) and ``sums``, the checksums of the bytes that
    landed, bound to the objects' keys by ``tags`` (:func:`name_tags`). An older trailer marks the
    object unverified; a mismatch fails it in ``ok``. Counts ``verified``, ``unverified`` and
    ``corrupt`` objects in ``stats``; returns which objects are corrupt. ``ok`` and
    ``unverified`` are updated in place."""
    n = len(tags)
    magic = trailers[:n, 0]
    for old in OLD_TRAILER_MAGICS:  # two compares: np.isin costs ten times as much at a batch's size
        unverified |= magic == old
    good = (magic == TRAILER_MAGIC) & (trailers[:n, 1] == (sums ^ tags))
    verdicts = np.where(ok, np.where(unverified, UNVERIFIED, np.where(good, VERIFIED, CORRUPT)), NOT_READ)
    return counted(verdicts, ok, unverified, stats)

