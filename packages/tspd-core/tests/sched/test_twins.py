"""The native scheduler against its numpy oracle, call for call, beyond the state machine's
small sizes: random store traffic (repeated and stored keys, cached pages, a full store, a
key map under heavy insert/evict churn), 768-page prompts with trace-derived keys through
admission, rounds and eviction, and a fork chain whose round copies one page three times."""

from __future__ import annotations

import numpy as np
import pytest
import sched_oracle as oracle
from sched_twins import Twins, comparable

from tspd_core.ids import RequestId
from tspd_core.sched import (
    BlockPool,
    DecodeOutputs,
    DecodeRound,
    PoolExhausted,
    PrefixKvStore,
    page_keys_from_block_hashes,
)

R = RequestId


def _store_state(pool: object, store: object) -> tuple[object, ...]:
    if isinstance(pool, BlockPool):
        assert isinstance(store, PrefixKvStore)
        snap, ssnap = pool._snapshot(), store._snapshot()
        free = snap["free_stack"].tolist()
        return (pool.refcounts.tolist(), free, ssnap["entries"], ssnap["lru"], len(store),
                store.evictable_count(), store.evicted_total)  # fmt: skip
    assert isinstance(pool, oracle.BlockPool)
    assert isinstance(store, oracle.PrefixKvStore)
    queue = store._queue
    pages = queue._pages[queue._head : queue._tail]
    live = store._stamp[pages] == queue._stamps[queue._head : queue._tail]
    free = pool._free[: pool.free_count()].tolist()
    return (pool.refcounts.tolist(), free, store.entries(), pages[live].tolist(), len(store),
            store.evictable_count(), store.evicted_total)  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_store_traffic_matches_the_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pages, limit = (40, 24) if seed % 2 else (64, None)
    key_space = int(rng.choice([12, 60, 1 << 62]))  # repeats and stored keys, or none
    sides = []
    for pool in (BlockPool(pages), oracle.BlockPool(pages)):
        store = (PrefixKvStore if isinstance(pool, BlockPool) else oracle.PrefixKvStore)(
            pool, limit
        )  # type: ignore[operator]
        sides.append((pool, store, []))  # the caller's held page arrays
    for step in range(400):
        op = rng.choice(["insert", "insert", "attach", "release", "evict", "clear"], p=[
            0.35, 0.15, 0.2, 0.2, 0.08, 0.02])  # fmt: skip
        n = int(rng.integers(1, 9))
        keys = rng.integers(0, key_space, n, dtype=np.uint64)
        limit = int(rng.integers(0, n + 1)) if seed % 3 else None
        again = rng.random() < 0.3  # insert pages the caller holds already (maybe cached)
        outcome = []
        for pool, store, held in sides:
            if op == "insert" and again and held:
                pages = held[step % len(held)][:n]
                outcome.append(store.insert(keys[: len(pages)], pages))
            elif op == "insert":
                fresh = pool.try_allocate(n)
                if fresh is not None:
                    held.append(fresh)
                    outcome.append(store.insert(keys, fresh))
            elif op == "attach":
                got = store.attach(keys, limit)
                held.append(got)
                outcome.append(got.tolist())
            elif op == "release" and held:
                outcome.append(store.release(held.pop(int(step % len(held)))).tolist())
            elif op == "evict":
                outcome.append(store.evict(n))
            elif op == "clear":
                outcome.append(store.clear())
        assert outcome[:1] == outcome[1:], (step, op)
        probe = rng.integers(0, key_space, 6, dtype=np.uint64)
        looks = [
            (s.match(probe).tolist(), [int(k) in s for k in probe]) for _, s, _ in sides
        ]  # fmt: skip
        assert looks[0] == looks[1], step
        assert _store_state(*sides[0][:2]) == _store_state(*sides[1][:2]), (step, op)
    assert sides[0][1].evicted_total > 20  # the key map saw real churn


def test_key_map_survives_a_hundred_thousand_evictions() -> None:
    # A small pool whose map is refilled and emptied over and over with random keys: every
    # deletion shifts probe runs back; every key must still be found, no stale one.
    pool = BlockPool(32)
    store = PrefixKvStore(pool)
    rng = np.random.default_rng(7)
    for _ in range(3200):
        keys = rng.integers(0, 1 << 64, 32, dtype=np.uint64)
        held = pool.allocate(32)
        assert store.insert(keys, held) == 32
        assert all(int(k) in store for k in keys)
        assert store.match(keys).tolist() == held.tolist()
        store.release(held)
        assert store.evict(int(rng.integers(16, 33))) >= 16
        store.clear()
        assert not any(int(k) in store for k in keys)
        assert len(store) == 0
    assert store.evicted_total == 3200 * 32


def _trace_keys(blocks: list[int], tokens: int) -> np.ndarray:
    return page_keys_from_block_hashes(np.array(blocks), 512, 16, tokens)


def test_long_prompts_rounds_and_eviction_match_the_oracle() -> None:
    t = Twins(1700, 4, 900, 16, max_entries=1200)
    rng = np.random.default_rng(3)
    shared = list(range(1000, 1024))  # 24 blocks of 512 tokens: a 768-page prefix
    live: list[str] = []
    for i in range(14):
        cut = int(rng.integers(8, 25))
        own = list(range(5000 + 100 * i, 5000 + 100 * i + int(rng.integers(0, 12))))
        tokens = min((cut + len(own)) * 512 - int(rng.integers(0, 300)), 900 * 16)
        keys = _trace_keys(shared[:cut] + own, tokens)
        rid = f"r{i}"
        adm = t.call("try_admit", R(rid), tokens, keys, remote_kv=bool(i % 2))
        if adm is None:
            t.call("finish", R(live.pop(0)))
            t.check()
            continue
        live.append(rid)
        if i % 2:
            t.call("seed_decode_token", R(rid), 1)
        else:
            t.call("mark_prefill_complete", R(rid))
            t.call("seed_decode_token", R(rid), 2)
        t.check()
        for step in range(3):
            batch = t.prepare(step % 2)
            if batch is None:
                break
            _commit_both(t, batch)
            t.check()
        t.call("record_tokens", R(rid), np.arange(int(rng.integers(1, 40))))
        if len(live) > 2:
            t.call("finish", R(live.pop(0)))
        t.check()
    stats = t.s.stats()
    assert stats.evictions > 1000
    assert stats.prefix_hit_tokens > 5 * 700 * 16
    assert stats.decode_rounds > 30


def _commit_both(t: Twins, batch: DecodeRound) -> None:
    n = batch.size
    tokens = (np.arange(n) + 3).astype(np.int32)
    outputs = DecodeOutputs(batch.items.slot.copy(), batch.items.serial.copy(), tokens)
    t.call("commit_decode_round", batch.round_id, outputs)


def test_a_fork_chain_copies_one_page_three_times_in_one_round_like_the_oracle() -> None:
    for abort in (False, True):
        t = Twins(40, 4, 8, 4)
        t.call("admit", R("a"), 6)  # pages 1 2; page 2 half full
        t.call("mark_prefill_complete", R("a"))
        t.call("seed_decode_token", R("a"), 5)
        for parent, child in (("a", "b"), ("b", "c"), ("c", "d")):
            t.call("fork", R(parent), R(child))
        t.check()
        batch = t.prepare(0)
        assert batch is not None
        assert comparable(batch.copies) == [[2, 3], [2, 4], [2, 5]]  # d, the last, keeps 2
        t.check()
        if abort:
            t.call("abort_decode_round", batch.round_id)
        else:
            _commit_both(t, batch)
        t.check()
        assert t.pool.refcounts[2] == (4 if abort else 1)


def test_a_round_short_of_pages_changes_nothing_on_either_side() -> None:
    t = Twins(3, 2, 4, 4)
    t.call("admit", R("a"), 4)  # position 4 needs page 2
    t.call("mark_prefill_complete", R("a"))
    t.call("seed_decode_token", R("a"), 1)
    t.call("admit", R("b"), 8)  # pages 2 3: none left
    t.call("mark_prefill_complete", R("b"))
    t.call("seed_decode_token", R("b"), 1)
    with pytest.raises(PoolExhausted):
        t.call("prepare_decode_round", *t.scratch[0][:2])
    t.check()
