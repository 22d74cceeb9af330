"""BlockPool: exact ids, reference counts, deterministic reuse, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.errors import TspdError
from tspd_core.sched import BlockPool, InvalidInput, PoolExhausted


def test_fresh_pool_hands_out_ascending_ids_and_never_the_null_page() -> None:
    pool = BlockPool(5)
    assert pool.allocate(3).tolist() == [1, 2, 3]
    assert pool.allocate(2).tolist() == [4, 5]
    assert pool.free_count() == 0
    assert pool.used_count() == 5
    assert pool.try_allocate(1) is None
    assert pool.refcounts.tolist() == [0, 1, 1, 1, 1, 1]


def test_released_pages_come_back_in_release_order() -> None:
    pool = BlockPool(8)
    first = pool.allocate(4)  # 1 2 3 4
    pool.allocate(2)  # 5 6
    assert pool.decref(np.array([3, 1, 4])).tolist() == [3, 1, 4]
    assert pool.allocate(3).tolist() == [3, 1, 4]
    assert pool.allocate(2).tolist() == [7, 8]
    assert first.tolist() == [1, 2, 3, 4]


def test_shared_page_is_freed_only_by_its_last_reference() -> None:
    pool = BlockPool(4)
    pages = pool.allocate(2)
    pool.incref(pages[:1])
    assert pool.refcount(1) == 2
    assert pool.decref(pages).tolist() == [2]
    assert pool.refcount(1) == 1
    assert pool.free_count() == 3
    assert pool.decref(np.array([1])).tolist() == [1]
    assert pool.free_count() == 4


def test_exhaustion_raises_with_a_message_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(PoolExhausted, match="1 free pages of 3, 2 requested") as info:
        pool.allocate(2)
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, TspdError)
    assert pool.free_count() == 1
    assert pool.allocate(1).tolist() == [3]


@pytest.mark.parametrize(
    ("pages", "match"),
    [
        ([0], "lie in 1 .. 4"),
        ([5], "lie in 1 .. 4"),
        ([3], "are free"),
        ([1, 1], "repeat"),
        ([[1]], "1-D integer"),
        ([1.0], "1-D integer"),
    ],
)
def test_bad_page_ids_are_rejected_without_changing_counts(pages: object, match: str) -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    before = pool.refcounts.copy()
    with pytest.raises(InvalidInput, match=match):
        pool.decref(pages)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=match):
        pool.incref(pages)  # type: ignore[arg-type]
    assert np.array_equal(pool.refcounts, before)
    assert pool.free_count() == 2


def test_constructor_and_counts_validate() -> None:
    with pytest.raises(InvalidInput, match=r"num_pages must be an int in 1 .. 2\*\*31-1, got 0"):
        BlockPool(0)
    with pytest.raises(InvalidInput, match=r"cannot allocate a negative number of pages \(-1\)"):
        BlockPool(4).try_allocate(-1)
    with pytest.raises(InvalidInput, match=r"page id 0 outside 1 \.\. 4"):
        BlockPool(4).refcount(0)
    assert BlockPool(4).allocate(0).tolist() == []


def test_refcounts_view_is_read_only() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="read-only"):
        pool.refcounts[1] = 3


def test_free_unshared_frees_in_order_and_checks_its_ids() -> None:
    pool = BlockPool(8)
    pool.allocate(5)  # 1..5
    pool.free_unshared(np.array([4, 2], dtype=np.intp))
    assert pool.free_count() == 5
    assert pool.refcounts.tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 0]
    assert pool.allocate(3).tolist() == [4, 2, 6]  # like decref: back in the order given
    other = BlockPool(4)
    other.allocate(2)
    other.incref(np.array([1]))
    with pytest.raises(InvalidInput, match="more than once"):
        other.free_unshared(np.array([2, 1], dtype=np.intp))
    with pytest.raises(InvalidInput, match="are free"):
        other.free_unshared(np.array([3], dtype=np.intp))
    assert other.refcounts.tolist() == [0, 2, 1, 0, 0]
