"""What a staged piece writes into D's slot, and from where: P's arena or P's gather buffer.

A staged piece fills one slot of D's staging memory with its descriptors' bytes back to back
(D scatters them in the same order). Where the *source* side of consecutive descriptors is
contiguous, there is nothing to gather: re-slicing P TP 2 -> D TP 1 with a contiguous block
table, each P rank's half-pages of a field lie end to end in its arena (only D's side is
strided). So a piece is planned as source runs (descriptors merged while their sources
continue); long runs are written straight from the arena, and only the short ones are gathered
into P's buffer, where neighbours land side by side and go out as one write::

    descriptors (src)   [a][a+16K][a+32K]...[a+4M-16K] [x] [y] [z] [b][b+16K]...
    source runs          └──── 4 MiB: from the arena ──┘ └─ short ┘ └── from the arena ──
    slot (D)            [.................. piece bytes in descriptor order ..............]
    P buffer                                            [x y z]  (one gather, one write)

All functions are pure numpy over offsets; the caller adds the bases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

#: A source run at least this long is written from the arena instead of gathered (measured
#: here: Mooncake moves 256 KiB descriptors at ~1.2 GB/s, near its 2 MiB best).
DIRECT_RUN_BYTES = 256 << 10


@dataclass(frozen=True, slots=True, eq=False)
class PiecePlan:
    """One staged piece: writes from the arena and from the gather buffer into the slot."""

    #: Long source runs: (arena offset, slot offset, length).
    direct: tuple[I64, I64, I64]
    #: Source runs to gather back to back into the buffer: (arena offset, length) — the
    #: short descriptors merged where their sources continue (fewer ranges to copy: a page of
    #: 16 token rows of a head slice is one 16 KiB range, not 16 of 1 KiB).
    gather: tuple[I64, I64]
    #: Gathered stretches: (buffer offset, slot offset, length).
    buffered: tuple[I64, I64, I64]

    @property
    def gathered_bytes(self) -> int:
        return int(self.gather[1].sum())


def plan_piece(src: I64, lengths: I64, direct_min: int = DIRECT_RUN_BYTES) -> PiecePlan:
    """Plan the piece whose descriptors (in slot order) read ``src[i]``, ``lengths[i]``.

    Source runs of at least ``direct_min`` bytes go straight from the arena; 0 gathers all.
    """
    n = src.size
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return PiecePlan((z, z, z), (z, z), (z, z, z))
    slot = np.cumsum(lengths) - lengths
    opens = np.ones(n, dtype=bool)
    opens[1:] = src[1:] != src[:-1] + lengths[:-1]
    heads = np.flatnonzero(opens)
    run_len = np.add.reduceat(lengths, heads)
    long_run = (run_len >= direct_min) if direct_min > 0 else np.zeros(heads.size, dtype=bool)
    direct = (src[heads][long_run], slot[heads][long_run], run_len[long_run])
    short = ~np.repeat(long_run, np.diff(np.append(heads, n)))
    gather = (src[heads][~long_run], run_len[~long_run])
    return PiecePlan(direct, gather, _stretches_of(short, slot, lengths))


def _stretches_of(short: npt.NDArray[np.bool_], slot: I64, lengths: I64) -> tuple[I64, I64, I64]:
    """The gathered descriptors' maximal neighbour groups: (buffer offset, slot offset, bytes).

    Neighbouring descriptors are adjacent in the slot, and gathered back to back they are
    adjacent in the buffer too, so each group is one write."""
    idx = np.flatnonzero(short)
    if idx.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    starts = np.flatnonzero(np.diff(idx, prepend=-2) != 1)  # group heads, in gathered order
    sizes = np.add.reduceat(lengths[idx], starts)
    return np.cumsum(sizes) - sizes, slot[idx[starts]], sizes


def pieces(lengths: I64, limit: int) -> list[tuple[int, int]]:
    """Consecutive descriptor ranges of at most ``limit`` bytes each (every length <= limit)."""
    end = np.cumsum(lengths)
    out, lo = [], 0
    while lo < lengths.size:
        before = int(end[lo] - lengths[lo])
        hi = int(np.searchsorted(end, before + limit, side="right"))
        out.append((lo, hi))
        lo = hi
    return out
