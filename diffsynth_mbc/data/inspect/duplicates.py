"""Near-duplicate rows, from the perceptual hashes of ``measures``. Pure numpy.

Two rows are near-duplicates when every hashed frame of one is within ``DUPLICATE_BITS`` of the same frame of
the other (first, middle and last frame of the window for videos; the picture for images). The comparison is
every row against every earlier row of its kind, vectorised: the hashes as uint64, XOR and ``np.bitwise_count``
over blocks of rows, the first frame deciding the candidates and the other frames checked for those only.
All pairs of 90,000 rows with random signatures (3 hashes each, 4 * 10^9 comparisons) take 4.8-5.9 s of one
core's time (measured on a shared 2-core machine); the cost grows with the square of the rows of one kind. Where
many rows share a first frame (clips that open alike) the other frames are compared tile-wide: 90,000 rows all
alike on the first frame and different on the others take ~20 s, 90,000 copies of one row ~2 s.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Bits (of 63) per hashed frame: re-encoded and resized copies measured 0-4 bits from their originals, a darker
# grade of the same picture 6; different pictures 20-44, one picture pillarboxed 16. 8 leaves a margin both ways
# (the distance of two hashes is always even: each has 31 of its 63 bits set).
DUPLICATE_BITS = 8
BLOCK_ROWS = 256         # rows compared at once with ...
BLOCK_COLUMNS = 4096     # ... this many earlier rows: 1M comparisons a tile (measured fastest of 128-1024 x 1K-16K)
DENSE_SHARE = 0.02       # of a tile's pairs near on the first frame: above it, compare the other frames tile-wide


def _hash_matrix(rows: list[tuple[int, tuple[str, ...]]]) -> tuple[np.ndarray, np.ndarray]:
    """(row numbers, uint64 hashes [n, frames]) of rows whose hashes are all present."""
    numbers = np.array([number for number, _ in rows], dtype=np.int64)
    digits = "".join(digest.rjust(16, "0") for _, digests in rows for digest in digests)
    hashes = np.frombuffer(bytes.fromhex(digits), dtype=">u8").astype(np.uint64)
    return numbers, hashes.reshape(len(rows), -1)


def _tile_matches(hashes: np.ndarray, rows: slice, columns: slice, limit: int, xor: np.ndarray,
                  bits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, columns, distances): each row's earliest column within ``limit`` on every frame, in one tile of
    rows x earlier columns. The first frame picks candidates; the other frames are compared for those only, or
    for the whole tile where candidates are many (a catalogue where many clips open alike)."""
    xor = xor[:rows.stop - rows.start, :columns.stop - columns.start]
    bits = bits[:rows.stop - rows.start, :columns.stop - columns.start]
    np.bitwise_xor(hashes[rows, 0, None], hashes[None, columns, 0], out=xor)
    np.bitwise_count(xor, out=bits)
    if rows.start < columns.stop:   # a tile on the diagonal: a row compares with earlier rows only
        later = np.arange(columns.start, columns.stop)[None, :] >= np.arange(rows.start, rows.stop)[:, None]
        bits[later] = 255
    near = np.flatnonzero(bits <= limit)   # (much faster than a 2-d np.nonzero)
    if len(near) > DENSE_SHARE * bits.size:
        for frame in range(1, hashes.shape[1]):
            np.bitwise_xor(hashes[rows, frame, None], hashes[None, columns, frame], out=xor)
            np.maximum(bits, np.bitwise_count(xor), out=bits)
        within = bits <= limit
        found = np.flatnonzero(within.any(axis=1))
        earliest = within[found].argmax(axis=1)
        return found + rows.start, earliest + columns.start, bits[found, earliest].astype(np.int64)
    pair_rows, pair_columns = near // bits.shape[1] + rows.start, near % bits.shape[1] + columns.start
    worst = np.bitwise_count(hashes[pair_rows] ^ hashes[pair_columns]).max(axis=1, initial=0).astype(np.int64)
    within = worst <= limit
    pair_rows, pair_columns, worst = pair_rows[within], pair_columns[within], worst[within]
    # pairs come in row-major order: each row's first pair is its earliest match
    pair_rows, firsts = np.unique(pair_rows, return_index=True)
    return pair_rows, pair_columns[firsts], worst[firsts]


def _earliest_matches(hashes: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """For each row of ``hashes`` [n, frames]: (the first earlier row within ``limit`` bits on every frame, or
    -1; that distance, the largest over frames)."""
    count = len(hashes)
    match = np.full(count, -1, dtype=np.int64)
    distance = np.zeros(count, dtype=np.int64)
    xor = np.empty((BLOCK_ROWS, BLOCK_COLUMNS), dtype=np.uint64)
    bits = np.empty((BLOCK_ROWS, BLOCK_COLUMNS), dtype=np.uint8)
    for start in range(0, count, BLOCK_ROWS):
        stop = min(count, start + BLOCK_ROWS)
        for column in range(0, stop - 1, BLOCK_COLUMNS):   # earlier rows only: columns below the block's end
            if (match[start:stop] >= 0).all():   # every row has its earliest match (a catalogue of copies)
                break
            rows, columns, worst = _tile_matches(hashes, slice(start, stop),
                                                 slice(column, min(stop - 1, column + BLOCK_COLUMNS)), limit,
                                                 xor, bits)
            unmatched = match[rows] < 0   # an earlier tile holds earlier columns
            match[rows[unmatched]], distance[rows[unmatched]] = columns[unmatched], worst[unmatched]
    return match, distance


def find_duplicates(signatures: Sequence[tuple[str, tuple[str, ...]]]) -> dict[int, tuple[int, int]]:
    """signatures[i] = (media_type, hashes of row i). Returns {i: (j, distance)} for each row i that
    near-duplicates an EARLIER row j (the earliest such row; j itself is not in the answer unless it duplicates
    something before it). Rows compare only with rows of the same media type and the same number of hashes; a row
    with any "" hash never matches. For videos every hashed frame must be within DUPLICATE_BITS (distance = the
    largest)."""
    groups: dict[tuple[str, int], list[tuple[int, tuple[str, ...]]]] = {}
    for number, (media_type, digests) in enumerate(signatures):
        if digests and all(digests):
            groups.setdefault((media_type, len(digests)), []).append((number, tuple(digests)))
    duplicates = {}
    for rows in groups.values():
        if len(rows) < 2:
            continue
        numbers, hashes = _hash_matrix(rows)
        match, distance = _earliest_matches(hashes, DUPLICATE_BITS)
        for index in np.flatnonzero(match >= 0):
            duplicates[int(numbers[index])] = (int(numbers[match[index]]), int(distance[index]))
    return dict(sorted(duplicates.items()))
