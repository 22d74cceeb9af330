"""Staged pieces: which runs go straight from the arena, which are gathered, and where."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tspd_core.pd.transfer.stage_plan import PiecePlan, pieces, plan_piece


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_contiguous_sources_go_direct_short_ones_are_gathered_side_by_side() -> None:
    # Descriptors in slot order: a 3-descriptor contiguous run (300 B), two lone 10-byte
    # ones, then a 2-descriptor contiguous run (200 B).
    src = _i64(1000, 1100, 1200, 50, 70, 5000, 5100)
    lengths = _i64(100, 100, 100, 10, 10, 100, 100)
    plan = plan_piece(src, lengths, direct_min=200)
    assert [a.tolist() for a in plan.direct] == [[1000, 5000], [0, 320], [300, 200]]
    assert [a.tolist() for a in plan.gather] == [[50, 70], [10, 10]]
    # Short descriptors whose sources continue are gathered as one range.
    merged = plan_piece(_i64(0, 10, 20, 90), _i64(10, 10, 10, 10), direct_min=100)
    assert [a.tolist() for a in merged.gather] == [[0, 90], [30, 10]]
    assert [a.tolist() for a in merged.buffered] == [[0], [0], [40]]
    assert [a.tolist() for a in plan.buffered] == [[0], [300], [20]]
    assert plan.gathered_bytes == 20


def test_zero_gathers_everything_one_byte_sends_everything_direct() -> None:
    src, lengths = _i64(0, 64, 512), _i64(64, 64, 32)
    gathered = plan_piece(src, lengths, direct_min=0)
    assert gathered.direct[0].size == 0
    assert [a.tolist() for a in gathered.buffered] == [[0], [0], [160]]
    direct = plan_piece(src, lengths, direct_min=1)
    assert [a.tolist() for a in direct.direct] == [[0, 512], [0, 128], [128, 32]]
    assert direct.gathered_bytes == 0


def _apply(plan: PiecePlan, arena: np.ndarray, size: int) -> np.ndarray:
    """What D's slot holds after the piece: direct writes, the gather, the buffered writes."""
    slot = np.zeros(size, dtype=np.uint8)
    for off, at, n in zip(*plan.direct, strict=True):
        slot[at : at + n] = arena[off : off + n]
    starts, lengths = plan.gather
    buf = np.concatenate([arena[s : s + n] for s, n in zip(starts, lengths, strict=True)] or [[]])
    for off, at, n in zip(*plan.buffered, strict=True):
        slot[at : at + n] = buf[off : off + n]
    return slot


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 63), st.integers(1, 4)), max_size=30),
    st.sampled_from([0, 1, 8, 24, 1 << 20]),
)
def test_any_piece_fills_the_slot_with_its_bytes_in_descriptor_order(
    picks: list[tuple[int, int]], direct_min: int
) -> None:
    arena = np.random.default_rng(0).integers(0, 256, 64 * 8, dtype=np.uint8)
    # Descriptors of 8-byte units at chosen places (neighbours often continue, some repeat).
    src = np.array([u * 8 for u, _ in picks], dtype=np.int64)
    lengths = np.array([min(n, 64 - u) * 8 for u, n in picks], dtype=np.int64)
    plan = plan_piece(src, lengths, direct_min)
    want = np.concatenate(
        [arena[s : s + n] for s, n in zip(src, lengths, strict=True)] or [np.zeros(0, np.uint8)]
    )
    assert np.array_equal(_apply(plan, arena, int(lengths.sum())), want)
    assert plan.gathered_bytes + int(plan.direct[2].sum()) == int(lengths.sum())


def test_pieces_cut_at_the_slot_size() -> None:
    assert pieces(_i64(4, 4, 4, 8, 2), 8) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert pieces(_i64(), 8) == []
