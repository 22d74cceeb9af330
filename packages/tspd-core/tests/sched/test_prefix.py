"""PrefixKvStore: exact matches, references, LRU order (tails first), capacity, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.sched import BlockPool, InvalidInput, PrefixKvStore


def _store(pages: int = 8, max_entries: int | None = None) -> tuple[BlockPool, PrefixKvStore]:
    pool = BlockPool(pages)
    return pool, PrefixKvStore(pool, max_entries)


def test_insert_then_attach_shares_pages_and_counts_references() -> None:
    pool, store = _store()
    held = pool.allocate(3)  # 1 2 3, held by a request
    assert store.insert([10, 11, 12], held) == 3
    assert store.entries() == {10: 1, 11: 2, 12: 3}
    assert pool.refcounts[1:4].tolist() == [2, 2, 2]
    assert store.evictable_count() == 0
    got = store.attach([10, 11, 99, 12])
    assert got.tolist() == [1, 2]  # stops at the first missing key
    assert pool.refcounts[1:4].tolist() == [3, 3, 2]
    assert store.release(held).tolist() == []
    assert store.evictable_count() == 1  # page 3: only the store holds it
    assert store.release(got).tolist() == []
    assert store.evictable_count() == 3
    assert pool.free_count() == 5


def test_match_takes_no_reference_and_respects_limit() -> None:
    pool, store = _store()
    held = pool.allocate(3)
    store.insert([1, 2, 3], held)
    assert store.match([1, 2, 3], limit=2).tolist() == [1, 2]
    assert store.match([7]).tolist() == []
    assert pool.refcounts[1:4].tolist() == [2, 2, 2]


def test_eviction_takes_tails_of_the_least_recent_chain_first() -> None:
    pool, store = _store(8)
    a = pool.allocate(3)  # chain A: pages 1 2 3
    b = pool.allocate(2)  # chain B: pages 4 5
    store.insert([100, 101, 102], a)
    store.insert([200, 201], b)
    store.release(a)  # A released first: older
    store.release(b)
    assert store.evictable_count() == 5
    assert store.evict(2) == 2
    assert sorted(store.entries()) == [100, 200, 201]  # A's tail (102, then 101) went first
    assert pool.free_count() == 3 + 2
    assert pool.allocate(2).tolist() == [3, 2]  # pages come back in eviction order
    assert store.evict(10) == 3
    assert store.entries() == {}


def test_reused_entry_is_not_evicted_and_refreshes_its_recency() -> None:
    pool, store = _store(8)
    a, b = pool.allocate(2), pool.allocate(2)  # A = 1 2, B = 3 4
    store.insert([1, 2], a)
    store.insert([3, 4], b)
    store.release(a)
    store.release(b)
    again = store.attach([1, 2])  # A in use: not evictable
    assert store.evictable_count() == 2
    assert store.evict(4) == 2
    assert store.entries() == {1: 1, 2: 2}
    store.release(again)  # A is now the most recent and evictable again
    assert store.evictable_count() == 2
    assert store.evict(1) == 1
    assert store.entries() == {1: 1}


def test_capacity_bound_evicts_lru_then_truncates_in_chain_order() -> None:
    pool, store = _store(8, max_entries=3)
    a = pool.allocate(2)
    store.insert([1, 2], a)
    store.release(a)
    b = pool.allocate(3)  # pages 3 4 5
    assert store.insert([7, 8, 9], b) == 3  # made room by evicting A (2 entries)
    assert store.entries() == {7: 3, 8: 4, 9: 5}
    c = pool.allocate(2)
    assert store.insert([20, 21], c) == 0  # full, nothing evictable: stays private
    assert pool.refcounts[c].tolist() == [1, 1]
    assert (20 in store, 21 in store, len(store)) == (False, False, 3)
    assert store.match([20, 21]).tolist() == []
    store.release(b)
    assert store.insert([21, 20], c) == 2  # room again: both keys, pages as given now
    assert store.entries() == {7: 3, 21: 2, 20: 1}  # c = [2, 1]: A's pages, evicted tail first


def test_existing_keys_and_cached_pages_are_not_duplicated() -> None:
    pool, store = _store(8)
    a = pool.allocate(2)
    store.insert([1, 2], a)
    other = pool.allocate(2)  # same prefix computed again privately
    assert store.insert([1, 2], other) == 0
    assert store.insert([5, 6], a) == 0  # pages already cached under other keys
    assert store.insert([9, 9], other) == 1  # a key repeated in one call is added once
    assert store.entries() == {1: 1, 2: 2, 9: 3}


def test_queue_compaction_keeps_lru_order_under_churn() -> None:
    pool, store = _store(4)
    held = pool.allocate(4)
    store.insert([1, 2, 3, 4], held)
    store.release(held)
    for _ in range(200):  # each cycle re-queues four pages: forces compaction
        again = store.attach([1, 2, 3, 4])
        store.release(again)
    assert store.evictable_count() == 4
    assert store.evict(1) == 1
    assert sorted(store.entries()) == [1, 2, 3]
    assert store.clear() == 3
    assert pool.free_count() == 4


@pytest.mark.parametrize("keys", [[-1], [1.5], [[1, 2]], np.array([1.0])])
def test_bad_keys_are_rejected(keys: object) -> None:
    _, store = _store()
    with pytest.raises(InvalidInput, match="keys"):
        store.match(keys)  # type: ignore[arg-type]


def test_insert_rejects_mismatched_lengths() -> None:
    pool, store = _store()
    with pytest.raises(InvalidInput, match="2 keys but 1 pages"):
        store.insert([1, 2], pool.allocate(1))
    with pytest.raises(InvalidInput, match="max_entries must be >= 0, got -1"):
        PrefixKvStore(pool, -1)


def test_match_spans_runs_inserted_by_different_requests() -> None:
    pool, store = _store(12)
    a = pool.allocate(3)  # first request: keys 1 2 3 -> pages 1 2 3
    store.insert([1, 2, 3], a)
    b = pool.allocate(3)  # second request hit 1 2 3, computed 4 5 6 itself -> pages 4 5 6
    assert store.insert([1, 2, 3, 4, 5, 6], np.concatenate([a, b])) == 3
    assert store.match([1, 2, 3, 4, 5, 6, 7]).tolist() == [1, 2, 3, 4, 5, 6]
    assert store.match([1, 2, 3, 4, 9, 6]).tolist() == [1, 2, 3, 4]  # diverges inside a run
    assert store.match([2, 3]).tolist() == [2, 3]  # a run entered in the middle
    store.release(np.concatenate([a, b]))
    assert store.evict(2) == 2  # the tail: keys 6 then 5
    assert store.match([1, 2, 3, 4, 5, 6]).tolist() == [1, 2, 3, 4]
    c = pool.allocate(2)  # pages 5 6 reused for a different chain
    store.insert([1, 2, 3, 4, 50, 60], np.array([1, 2, 3, 4, *c.tolist()]))
    assert store.match([1, 2, 3, 4, 5, 6]).tolist() == [1, 2, 3, 4]  # stale run not trusted
    assert store.match([1, 2, 3, 4, 50, 60]).tolist() == [1, 2, 3, 4, *c.tolist()]


def test_untrusted_calls_validate_page_ids() -> None:
    pool, store = _store(4)
    held = pool.allocate(2)
    with pytest.raises(InvalidInput, match="repeat"):
        store.insert([1, 2], [held[0], held[0]])
    with pytest.raises(InvalidInput, match="are free"):
        store.acquire(np.array([4], dtype=np.int32))
    assert store.entries() == {}
    assert (1 in store, 2 in store, len(store)) == (False, False, 0)
    assert pool.refcounts.tolist() == [0, 1, 1, 0, 0]
    assert store.insert([2, 1], held) == 2  # the failed call left nothing behind
    assert store.entries() == {2: 1, 1: 2}


def test_evicted_keys_read_as_missing_even_when_their_page_is_cached_again() -> None:
    pool, store = _store(8)
    a = pool.allocate(3)  # 1 2 3
    store.insert([10, 11, 12], a)
    store.release(a)
    assert store.evict(2) == 2  # 12 (page 3), then 11 (page 2)
    assert (10 in store, 11 in store, 12 in store) == (True, False, False)
    assert len(store) == 1
    assert store.entries() == {10: 1}
    b = pool.allocate(2)
    assert b.tolist() == [3, 2]  # back in eviction order
    # Page 2 now holds key 99: key 11's old entry names a cached page, under another key.
    assert store.insert([99, 98], b[::-1].copy()) == 2
    assert 11 not in store
    assert store.match([10, 11]).tolist() == [1]
    c = pool.allocate(2)  # 4 5
    assert store.insert([10, 11, 12], np.array([1, *c.tolist()])) == 2  # 10 is stored
    assert store.entries() == {10: 1, 99: 2, 98: 3, 11: 4, 12: 5}
    assert store.match([10, 11, 12]).tolist() == [1, 4, 5]
    assert len(store) == 5


@pytest.mark.parametrize("pages", [[1.0], [[1]], ["a"]])
def test_store_calls_refuse_non_integer_page_ids(pages: object) -> None:
    pool, store = _store(4)
    held = pool.allocate(1)
    store.insert([1], held)
    for call in (store.acquire, store.release):
        with pytest.raises(InvalidInput, match="1-D integer array"):
            call(pages)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"1-D integer array|1 keys but 1 pages"):
        store.insert([2], pages)  # type: ignore[arg-type]
    assert pool.refcounts.tolist() == [0, 2, 0, 0, 0]
    assert store.entries() == {1: 1}
