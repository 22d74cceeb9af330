"""Bulk byte-range zero / gather / scatter against a per-range reference."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tspd_core.pd.transfer import _rowcopy, byterows
from tspd_core.pd.transfer.byterows import (
    LOOP_RANGES,
    byte_rows,
    gather,
    scatter,
    split_runs,
    stretches,
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


# the memmove loop (a few ranges; more, but long ones); 8-byte word rows (torch); odd-sized
# rows (numpy)
@pytest.mark.parametrize(
    ("count", "unit"),
    [(3, 128), (LOOP_RANGES + 100, 4096), (LOOP_RANGES + 100, 128), (LOOP_RANGES + 9, 6)],
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


def _greedy_stretches(starts: list[int], lengths: list[int]) -> list[tuple[int, int, int]]:
    """The definition, one range at a time: (first, count, stride)."""
    out: list[list[int]] = []
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        if out and lengths[out[-1][0]] == n:
            first, count, stride = out[-1]
            step = s - starts[i - 1]
            if count == 1 or step == stride:
                out[-1] = [first, count + 1, step]
                continue
        out.append([i, 1, 0])
    return [(f, c, st) for f, c, st in out]


@given(
    st.lists(st.tuples(st.sampled_from([-96, 32, 64, 96]), st.sampled_from([16, 32])), max_size=40)
)
def test_stretches_match_the_one_range_at_a_time_definition(steps: list[tuple[int, int]]) -> None:
    starts = np.cumsum([1000] + [s for s, _ in steps[1:]]).astype(np.int64) if steps else []
    lengths = np.array([n for _, n in steps], dtype=np.int64)
    found = stretches(np.asarray(starts, dtype=np.int64), lengths)
    assert found is not None
    got = list(zip(*(a.tolist() for a in found), strict=True))
    assert got == _greedy_stretches(list(np.asarray(starts).tolist()), lengths.tolist())


def test_stretches_give_up_past_the_limit() -> None:
    starts = np.array([0, 100, 150, 400, 410, 1000], dtype=np.int64)
    lengths = np.full(6, 10, dtype=np.int64)
    found = stretches(starts, lengths)
    assert found is not None
    assert [a.tolist() for a in found] == [[0, 2, 4], [2, 2, 2], [100, 250, 590]]
    assert stretches(starts, lengths, limit=1) is None


def test_regular_ranges_scatter_and_gather_as_strided_views() -> None:
    # A P rank's halves of 32 pages of 2 fields, as re-slicing TP 2 -> TP 1 scatters them:
    # 64-byte halves every 128 bytes, field after field, plus a short irregular tail.
    rng = np.random.default_rng(3)
    arena = torch.from_numpy(rng.integers(1, 256, 1 << 14, np.uint8))
    half = [f * 8192 + p * 128 + 64 for f in range(2) for p in range(32)]
    starts = np.array([*half, 13000, 13500, 15000], dtype=np.int64)
    lengths = np.array([64] * 64 + [8, 24, 64], dtype=np.int64)
    found = stretches(starts, lengths)
    assert found is not None
    assert [a.tolist() for a in found] == [
        [0, 32, 64, 65, 66],
        [32, 32, 1, 1, 1],
        [128, 128, 0, 0, 0],
    ]
    ref = arena.numpy().copy()
    out = torch.empty(int(lengths.sum()), dtype=torch.uint8)
    assert byterows._strided(arena, starts, lengths, out, to_arena=False)  # the path taken
    out.zero_()
    gather(arena, starts, lengths, out)
    want = np.concatenate([ref[s : s + n] for s, n in zip(starts, lengths, strict=True)])
    assert np.array_equal(out.numpy(), want)
    data = torch.from_numpy(rng.integers(0, 256, out.numel(), np.uint8))
    scatter(arena, starts, lengths, data)
    for s, n, at in zip(starts, lengths, np.cumsum(lengths) - lengths, strict=True):
        ref[s : s + n] = data.numpy()[at : at + n]
    assert np.array_equal(arena.numpy(), ref)


def test_long_stretches_scatter_as_strided_views_short_ones_by_rows() -> None:
    # 512 token rows of 1 KiB every 2 KiB (a P rank's half of D's NHD rows): one 512 KiB
    # stretch, scattered by one strided copy; 16-row stretches (16 KiB) go by the row index.
    rng = np.random.default_rng(4)
    arena = torch.from_numpy(rng.integers(0, 256, 4 << 20, np.uint8))
    long_starts = np.arange(512, dtype=np.int64) * 2048 + 1024
    short_starts = (rng.permutation(64)[:32, None] * 32768 + np.arange(16) * 2048).ravel()
    for starts in (long_starts, short_starts.astype(np.int64) + (2 << 20)):
        lengths = np.full(starts.size, 1024, dtype=np.int64)
        data = torch.from_numpy(rng.integers(0, 256, int(lengths.sum()), np.uint8))
        ref = arena.numpy().copy()
        for s, at in zip(starts.tolist(), range(0, data.numel(), 1024), strict=True):
            ref[s : s + 1024] = data.numpy()[at : at + 1024]
        probe = torch.zeros_like(arena)
        took_strided = byterows._strided(probe, starts, lengths, data, to_arena=True)
        assert took_strided == (starts is long_starts)
        scatter(arena, starts, lengths, data)
        assert np.array_equal(arena.numpy(), ref)


@pytest.mark.parametrize("stream", [True, False])
def test_native_row_copies_match_a_per_row_reference(stream: bool) -> None:
    # Lengths around the streamed copy's 16- and 64-byte steps, destinations at every
    # alignment: the head, body and tail of each row all land exactly, nothing else moves.
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 1 << 16, np.uint8)
    for length in (0, 1, 15, 16, 17, 63, 64, 65, 129, 1000):
        for offset in (0, 1, 7, 15):
            dst = rng.integers(0, 256, 1 << 16, np.uint8)
            ref = dst.copy()
            step = length + 40 + offset
            for i in range(9):
                ref[offset + i * step : offset + i * step + length] = src[
                    i * length : (i + 1) * length
                ]
            _rowcopy.copy_strided(
                dst.ctypes.data + offset, step, src.ctypes.data, length, 9, length, stream
            )
            assert np.array_equal(dst, ref), (length, offset)
        rows = rng.permutation(40)[:9].astype(np.int64)
        dst = rng.integers(0, 256, 41 * max(length, 1), np.uint8)
        ref = dst.copy()
        for i, r in enumerate(rows.tolist()):
            ref[r * length : (r + 1) * length] = src[i * length : (i + 1) * length]
        _rowcopy.copy_rows(dst.ctypes.data, rows.ctypes.data, src.ctypes.data, 9, length, stream)
        assert np.array_equal(dst, ref), length
    with pytest.raises(ValueError, match="-1 rows"):
        _rowcopy.copy_strided(src.ctypes.data, 0, src.ctypes.data, 0, -1, 1, stream)


def test_x86_64_scatters_with_streaming_stores() -> None:
    assert (platform.machine() in ("x86_64", "AMD64")) == _rowcopy.STREAMS


@pytest.mark.parametrize("strided", [True, False])
def test_large_scatters_stream_into_the_arena_exactly(
    strided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above STREAM_BYTES a scatter writes with streaming stores, by stretches or by rows.
    monkeypatch.setattr(byterows, "STREAM_BYTES", 1 << 16)
    rng = np.random.default_rng(6)
    arena = torch.from_numpy(rng.integers(0, 256, 4 << 20, np.uint8))
    if strided:
        starts = np.arange(512, dtype=np.int64) * 2048 + 1024
    else:
        starts = (rng.permutation(64)[:32, None] * 32768 + np.arange(16) * 2048).ravel()
    starts = starts.astype(np.int64)
    lengths = np.full(starts.size, 1024, dtype=np.int64)
    data = torch.from_numpy(rng.integers(0, 256, int(lengths.sum()), np.uint8))
    ref = arena.numpy().copy()
    for s, at in zip(starts.tolist(), range(0, data.numel(), 1024), strict=True):
        ref[s : s + 1024] = data.numpy()[at : at + 1024]
    assert byterows._strided(torch.zeros_like(arena), starts, lengths, data, True) == strided
    scatter(arena, starts, lengths, data)
    assert np.array_equal(arena.numpy(), ref)


@pytest.mark.parametrize("count", [512, 40, 3])  # by stretches; by rows; by memmove
def test_a_scatter_past_the_arena_is_refused_and_writes_nothing(count: int) -> None:
    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    # 1 KiB rows every 2 KiB, the last one reaching 1 KiB past the arena's end
    starts = np.arange(count, dtype=np.int64) * 2048 + (1 << 20) - (count - 1) * 2048
    if count == 40:
        starts = np.random.default_rng(7).permutation(starts)
    lengths = np.full(count, 1024, dtype=np.int64)
    with pytest.raises(ValueError, match="outside the 1048576-byte arena"):
        scatter(arena, starts, lengths, torch.ones(int(lengths.sum()), dtype=torch.uint8))
    assert int(arena.sum()) == 0


def test_the_row_copies_were_built_from_the_source_beside_them() -> None:
    # The module's import ran sched/_build's check against the .pyx next to it.
    here = Path(_rowcopy.__file__ or "").parent
    assert here == Path(byterows.__file__).parent
    assert (here / "_rowcopy.pyx").is_file()


def test_strided_tensors_are_refused_before_any_copy() -> None:
    arena = torch.zeros(1 << 12, dtype=torch.uint8)
    data = torch.ones(256, dtype=torch.uint8)[::2]  # 128 bytes, every other one
    with pytest.raises(ValueError, match="contiguous"):
        scatter(arena, [0], [128], data)
    with pytest.raises(ValueError, match="contiguous"):
        gather(arena, [0], [128], torch.zeros(256, dtype=torch.uint8)[::2])
    assert int(arena.sum()) == 0
