"""The extent pool: first fit, coalescing, quarantine and exact accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tspd_core.epd.pool import BufferPool, Extent
from tspd_core.pd.errors import ConfigError, UsageError


def test_first_fit_and_coalescing() -> None:
    pool = BufferPool(8 * 64, block_bytes=64)
    a = pool.allocate(100)
    b = pool.allocate(64)
    c = pool.allocate(1)
    assert (a, b, c) == (Extent(0, 2, 100), Extent(2, 1, 64), Extent(3, 1, 1))
    assert pool.allocate(5 * 64) is None  # 4 blocks left
    pool.free(b)
    assert pool.allocate(2 * 64) == Extent(4, 2, 128)  # the 1-block hole is too small
    pool.free(a)
    assert pool.allocate(3 * 64) == Extent(0, 3, 192)  # a's and b's blocks merged
    assert pool.stats().free_blocks == 8 - 3 - 1 - 2


def test_views_and_pointers_are_the_extents_bytes() -> None:
    pool = BufferPool(4 * 64, block_bytes=64)
    pool.allocate(64)
    e = pool.allocate(70)
    assert e is not None
    assert pool.ptr(e, 6) == pool.base_ptr + 64 + 6
    pool.view(e, 6, 4).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert pool.tensor[64 + 6 : 64 + 10].tolist() == [1, 2, 3, 4]
    with pytest.raises(UsageError, match="outside"):
        pool.view(e, 100, 40)
    assert pool.tensor.is_shared()


def test_zero_byte_extent_holds_nothing() -> None:
    pool = BufferPool(64, block_bytes=64)
    empty = pool.allocate(0)
    assert empty == Extent(0, 0, 0)
    pool.free(empty)
    pool.quarantine(1, empty, 0.0)
    assert pool.stats().free_blocks == 1
    assert not pool.is_held(1)


def test_quarantine_holds_blocks_until_lift_or_deadline() -> None:
    pool = BufferPool(4 * 64, block_bytes=64)
    a, b = pool.allocate(128), pool.allocate(128)
    assert a is not None
    assert b is not None
    pool.quarantine(11, a, deadline=10.0)
    pool.quarantine(12, b, deadline=20.0)
    s = pool.stats()
    assert (s.free_blocks, s.used_blocks, s.quarantined_blocks, s.quarantined_extents) == (
        0,
        0,
        4,
        2,
    )
    assert pool.allocate(64) is None  # a quarantined extent is never handed out
    assert pool.sweep(9.9) == 0
    assert pool.sweep(10.0) == 1
    assert pool.stats().free_blocks == 2
    assert pool.lift(12)
    assert not pool.lift(12)
    assert pool.stats().free_blocks == 4


def test_misuse_is_refused() -> None:
    pool = BufferPool(4 * 64, block_bytes=64)
    a = pool.allocate(64)
    assert a is not None
    pool.free(a)
    with pytest.raises(UsageError, match="not a live extent"):
        pool.free(a)
    with pytest.raises(UsageError, match="not a live extent"):
        pool.quarantine(1, a, 0.0)
    b = pool.allocate(64)
    assert b is not None
    pool.quarantine(1, b, 5.0)
    with pytest.raises(UsageError, match="already holding"):
        pool.quarantine(1, b, 5.0)
    with pytest.raises(UsageError, match="cannot allocate -1"):
        pool.allocate(-1)
    with pytest.raises(ConfigError, match="multiple of 64"):
        BufferPool(1024, block_bytes=100)
    with pytest.raises(ConfigError, match="holds no"):
        BufferPool(63, block_bytes=64)
    assert pool.fits(4 * 64)
    assert not pool.fits(4 * 64 + 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "hold", "lift"]), st.integers(0, 400))))
def test_accounting_is_exact_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    """Live extents never overlap, and everything returns to the free runs at the end."""
    pool = BufferPool(16 * 64, block_bytes=64)
    live: list[Extent] = []
    held: dict[int, Extent] = {}
    for op, n in ops:
        if op == "alloc":
            e = pool.allocate(n)
            if e is not None and e.blocks:
                live.append(e)
        elif op == "free" and live:
            pool.free(live.pop(n % len(live)))
        elif op == "hold" and live:
            e = live.pop(n % len(live))
            pool.quarantine(n, e, 1.0) if n not in held else pool.free(e)
            held.setdefault(n, e)
        elif op == "lift" and held:
            key = sorted(held)[n % len(held)]
            assert pool.lift(key)
            del held[key]
        blocks = sorted(
            b for e in [*live, *held.values()] for b in range(e.start, e.start + e.blocks)
        )
        assert len(blocks) == len(set(blocks))
        s = pool.stats()
        assert s.free_blocks + s.used_blocks + s.quarantined_blocks == 16
        assert s.quarantined_blocks == sum(e.blocks for e in held.values())
    for e in live:
        pool.free(e)
    assert pool.sweep(1.0) == len(held)
    assert pool.stats().free_blocks == 16
    assert pool.allocate(16 * 64) == Extent(0, 16, 1024)
