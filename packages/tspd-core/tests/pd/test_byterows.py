"""Bulk byte-range zero / gather / scatter against a per-range reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.pd.byterows import (
    LOOP_RANGES,
    byte_rows,
    gather,
    scatter,
    split_runs,
    zero_ranges,
)


def test_rows_use_the_largest_common_size() -> None:
    g, rows = byte_rows([0, 192], [64, 128])
    assert g == 64
    assert rows.tolist() == [0, 3, 4]
    assert byte_rows([], [])[1].size == 0


def _ranges(count: int, seed: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    slots = rng.permutation(4 * count)[:count]  # disjoint 4-unit slots, random order
    lengths = rng.choice([1, 2, 4], count) * unit
    shift = rng.choice([0, 1], count) * (lengths < 4 * unit) * unit
    return (slots * 4 * unit + shift).astype(np.int64), lengths


# the memmove loop; 8-byte word rows (torch); odd-sized rows (numpy)
@pytest.mark.parametrize(
    ("count", "unit"), [(3, 128), (LOOP_RANGES + 100, 128), (LOOP_RANGES + 9, 6)]
)
def test_zero_gather_scatter_match_a_per_range_reference(count: int, unit: int) -> None:
    starts, lengths = _ranges(count, count, unit)
    arena = torch.from_numpy(np.random.default_rng(1).integers(1, 256, 16 * count * unit, np.uint8))
    ref = arena.numpy().copy()
    out = torch.empty(int(lengths.sum()) + 7, dtype=torch.uint8)
    assert gather(arena, starts, lengths, out) == int(lengths.sum())
    want = np.concatenate([ref[s : s + n] for s, n in zip(starts, lengths, strict=True)])
    assert np.array_equal(out[: want.size].numpy(), want)
    zero_ranges(arena, starts, lengths)
    for s, n in zip(starts, lengths, strict=True):
        ref[s : s + n] = 0
    assert np.array_equal(arena.numpy(), ref)
    scatter(arena, starts, lengths, out[: want.size])
    for s, n, at in zip(starts, lengths, np.cumsum(lengths) - lengths, strict=True):
        ref[s : s + n] = want[at : at + n]
    assert np.array_equal(arena.numpy(), ref)


def test_size_mismatches_are_refused() -> None:
    arena = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        gather(arena, [0], [512], torch.empty(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scatter of 100 bytes into ranges of 512"):
        scatter(arena, [0], [512], torch.empty(100, dtype=torch.uint8))


def test_split_runs_cuts_long_runs_in_order() -> None:
    src, dst, n = (np.array(v, dtype=np.int64) for v in ([0, 100], [1000, 5000], [10, 3]))
    assert [a.tolist() for a in split_runs(src, dst, n, 4)] == [
        [0, 4, 8, 100],
        [1000, 1004, 1008, 5000],
        [4, 4, 2, 3],
    ]
    same = split_runs(src, dst, n, 10)
    assert same[2] is n
