"""RequestScheduler: admission, prefix hits, lifecycle, copy-on-write, errors (exact ids)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import sched_oracle as oracle

from tspd_core.errors import TspdError
from tspd_core.ids import RequestId
from tspd_core.sched import (
    BlockPool,
    CapacityFull,
    ContextFull,
    CopyOnWrite,
    DuplicateRequest,
    InvalidInput,
    PoolExhausted,
    PrefixKvStore,
    RequestScheduler,
    RequestState,
    UnknownRequest,
    WrongState,
    page_keys,
)

R = RequestId
PS = 4


def _sched(
    pages: int = 16, capacity: int = 4, logical: int = 8, store: bool = True
) -> RequestScheduler:
    pool = BlockPool(pages)
    prefixes = PrefixKvStore(pool) if store else None
    return RequestScheduler(capacity, logical, page_size=PS, pool=pool, prefixes=prefixes)


def _prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def test_admission_allocates_all_prompt_pages_in_slot_order() -> None:
    s = _sched(store=False)
    a = s.admit(R("a"), 10)
    b = s.admit(R("b"), 4)
    assert (a.slot, a.pages.tolist(), a.prefix_tokens, a.state) == (
        0, [1, 2, 3], 0, RequestState.PREFILL,
    )  # fmt: skip
    assert (b.slot, b.pages.tolist(), b.new_pages.tolist()) == (1, [4], [4])
    assert s.active_count() == 2
    assert s.free_count() == 12
    s.finish(R("a"))
    c = s.admit(R("c"), 5)
    assert (c.slot, c.pages.tolist()) == (0, [1, 2])  # lowest slot, pages reused in order
    assert c.serial not in (a.serial, b.serial)
    assert s.page_table(R("c")).tolist() == [1, 2]
    assert s.num_pages(R("c")) == 2


def test_prefix_hit_shares_whole_pages_and_recomputes_the_last_one() -> None:
    s = _sched()
    prompt = _prompt(12)
    keys = page_keys(prompt, PS)
    a = s.admit(R("a"), 12, keys)
    assert a.pages.tolist() == [1, 2, 3]
    s.mark_prefill_complete(R("a"))
    assert s.prefixes is not None
    assert s.prefixes.entries() == dict(zip(keys.tolist(), [1, 2, 3], strict=True))
    b = s.admit(R("b"), 12, keys)  # whole prompt cached: last page recomputed
    assert (b.pages.tolist(), b.prefix_tokens, b.new_pages.tolist()) == ([1, 2, 4], 8, [4])
    longer = page_keys([*prompt, 1, 2, 3, 4], PS)
    c = s.admit(R("c"), 14, longer[:3])  # 14 tokens: 3 full pages all served
    assert (c.pages.tolist(), c.prefix_tokens) == ([1, 2, 3, 5], 12)
    assert s.view(R("c")).num_tokens == 12
    assert s.pool.refcounts[1:6].tolist() == [4, 4, 3, 1, 1]
    for rid in "abc":
        s.finish(R(rid))
    assert s.pool.free_count() == 16 - 3
    assert s.prefixes.evictable_count() == 3
    stats = s.stats()
    assert (stats.prompt_tokens, stats.prefix_hit_tokens, stats.admissions) == (38, 20, 3)


def test_decode_peer_admission_waits_for_remote_kv_then_seeds() -> None:
    s = _sched()
    keys = page_keys(_prompt(12), PS)
    s.admit(R("warm"), 12, keys)
    s.mark_prefill_complete(R("warm"))
    s.finish(R("warm"))
    d = s.admit(R("d"), 12, keys, remote_kv=True)
    assert d.state is RequestState.AWAITING_KV
    assert (d.prefix_tokens, d.pages.tolist(), d.new_pages.tolist()) == (8, [1, 2, 4], [4])
    assert d.prefix_tokens % PS == 0
    assert d.prefix_tokens < d.prompt_len
    with pytest.raises(WrongState, match="AWAITING_KV"):
        s.mark_prefill_complete(R("d"))
    s.seed_decode_token(R("d"), 42)
    view = s.view(R("d"))
    assert (view.state, view.num_tokens, view.next_token) == (RequestState.DECODE, 12, 42)


def test_failed_remote_transfer_leaves_no_trace() -> None:
    s = _sched()
    keys = page_keys(_prompt(12), PS)
    s.admit(R("warm"), 12, keys)
    s.mark_prefill_complete(R("warm"))
    s.finish(R("warm"))
    assert s.prefixes is not None
    before = (s.pool.refcounts.copy(), s.prefixes.entries(), s.pool.free_count())
    s.admit(R("d"), 16, page_keys(_prompt(16, base=7), PS), remote_kv=True)
    s.finish(R("d"))  # transfer failed
    assert np.array_equal(s.pool.refcounts, before[0])
    assert s.prefixes.entries() == before[1]
    assert s.pool.free_count() == before[2]
    assert R("d") not in s
    assert s.active_count() == 0


def test_prefill_peer_holds_pages_after_prefill_until_finish() -> None:
    s = _sched(store=False)
    s.admit(R("p"), 9)
    assert s.advance_prefill(R("p"), 5) == 5
    assert s.advance_prefill(R("p"), 4) == 9
    with pytest.raises(InvalidInput, match="0 of its prompt tokens are left"):
        s.advance_prefill(R("p"), 1)
    s.mark_prefill_complete(R("p"))
    assert s.state(R("p")) is RequestState.PREFILLED
    assert s.page_table(R("p")).tolist() == [1, 2, 3]
    assert s.free_count() == 13
    s.finish(R("p"))
    assert s.free_count() == 16


def test_record_tokens_allocates_exactly_the_pages_the_tokens_need() -> None:
    s = _sched(store=False)
    s.admit(R("a"), 6)  # pages 1 2
    s.mark_prefill_complete(R("a"))
    s.seed_decode_token(R("a"), 9)
    assert s.record_tokens(R("a"), 2) is None  # positions 6, 7: still page 2
    assert s.page_table(R("a")).tolist() == [1, 2]
    s.record_tokens(R("a"), 5)  # positions 8 .. 12: pages 3, 4
    assert s.page_table(R("a")).tolist() == [1, 2, 3, 4]
    assert s.view(R("a")).num_tokens == 13
    assert s.view(R("a")).next_token is None  # counted, ids not known here
    s.record_token(R("a"), 77)
    assert s.view(R("a")).next_token == 77
    s.record_tokens(R("a"), np.array([1, 2, 3, 4]))  # positions 14 .. 17: page 5
    assert s.page_table(R("a")).tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ContextFull, match="max context of 32"):
        s.record_tokens(R("a"), 15)
    assert s.view(R("a")).num_tokens == 18


def test_fork_shares_pages_and_copy_on_write_splits_them() -> None:
    s = _sched(store=False)
    s.admit(R("a"), 6)  # pages 1 2 (page 2 half full)
    s.mark_prefill_complete(R("a"))
    child = s.fork(R("a"), R("b"))
    assert (child.slot, child.pages.tolist(), child.state) == (1, [1, 2], RequestState.PREFILLED)
    assert s.pool.refcounts[1:3].tolist() == [2, 2]
    assert s.ensure_writable(R("b"), 1) == CopyOnWrite(logical_page=1, src=2, dst=3)
    assert s.page_table(R("b")).tolist() == [1, 3]
    assert s.ensure_writable(R("a"), 1) is None  # page 2 is now a's alone
    assert s.pool.refcounts[1:4].tolist() == [2, 1, 1]
    s.seed_decode_token(R("a"), 5)
    s.seed_decode_token(R("b"), 6)
    s.finish(R("a"))
    s.finish(R("b"))
    assert s.free_count() == 16


def test_record_tokens_copies_a_shared_first_page() -> None:
    s = _sched(store=False)
    s.admit(R("a"), 6)
    s.mark_prefill_complete(R("a"))
    s.seed_decode_token(R("a"), 1)
    s.fork(R("a"), R("b"))
    # Positions 6 .. 8: page 2 is shared (copied to 4), page 3 is the new tail (allocated first).
    assert s.record_tokens(R("b"), 3) == CopyOnWrite(logical_page=1, src=2, dst=4)
    assert s.page_table(R("b")).tolist() == [1, 4, 3]
    assert s.page_table(R("a")).tolist() == [1, 2]


def test_errors_name_the_request_and_change_nothing() -> None:
    s = _sched(pages=4, capacity=2)
    s.admit(R("a"), 8)  # pages 1 2
    with pytest.raises(DuplicateRequest, match="'a' is already active") as dup:
        s.admit(R("a"), 4)
    assert isinstance(dup.value, ValueError)
    assert isinstance(dup.value, TspdError)
    with pytest.raises(PoolExhausted, match="cannot admit 'b'"):
        s.admit(R("b"), 9)
    assert s.try_admit(R("b"), 9) is None
    assert (s.active_count(), s.free_count()) == (1, 2)
    s.admit(R("b"), 1)
    with pytest.raises(CapacityFull, match="all 2 request slots"):
        s.admit(R("c"), 1)
    assert s.try_admit(R("c"), 1) is None
    with pytest.raises(UnknownRequest, match="'zz' is not active") as unknown:
        s.finish(R("zz"))
    assert isinstance(unknown.value, LookupError)
    with pytest.raises(WrongState, match="'a' is PREFILL, needs PREFILLED or AWAITING_KV"):
        s.seed_decode_token(R("a"), 3)
    with pytest.raises(InvalidInput, match=r"prompt_len must be in 1 \.\. 32"):
        s.try_admit(R("x"), 33)
    s.finish(R("b"))
    with pytest.raises(InvalidInput, match="3 page keys for a 8-token prompt"):
        s.admit(R("x"), 8, [1, 2, 3])
    with pytest.raises(InvalidInput, match="logical page 5"):
        s.ensure_writable(R("a"), 5)
    s.mark_prefill_complete(R("a"))
    with pytest.raises(InvalidInput, match="token must be"):
        s.seed_decode_token(R("a"), -1)
    assert s.state(R("a")) is RequestState.PREFILLED


def test_constructor_validates() -> None:
    pool = BlockPool(4)
    with pytest.raises(InvalidInput, match=r"capacity must be an int in 1 .. 2\*\*20, got 0"):
        RequestScheduler(0, 8, page_size=4, pool=pool)
    with pytest.raises(InvalidInput, match=r"logical_pages must be an int in 1 .. 2\*\*24, got 0"):
        RequestScheduler(1, 0, page_size=4, pool=pool)
    with pytest.raises(InvalidInput, match="page_size must be a positive int, got 0"):
        RequestScheduler(1, 8, page_size=0, pool=pool)
    with pytest.raises(InvalidInput, match="built on the scheduler's block pool"):
        RequestScheduler(1, 8, page_size=4, pool=pool, prefixes=PrefixKvStore(BlockPool(4)))


def test_pool_pressure_evicts_cold_prefix_pages() -> None:
    s = _sched(pages=6)
    keys = page_keys(_prompt(16), PS)
    s.admit(R("a"), 16, keys)  # pages 1..4
    s.mark_prefill_complete(R("a"))
    s.finish(R("a"))  # 4 cached, evictable; 2 free
    assert (s.free_count(), s.reclaimable_count()) == (2, 6)
    b = s.admit(R("b"), 20)  # 5 pages: evicts the 3 coldest (the chain's tail first)
    assert b.pages.tolist() == [4, 3, 2, 5, 6]  # just-evicted pages come out first
    assert s.prefixes is not None
    assert list(s.prefixes.entries().values()) == [1]
    assert s.stats().evictions == 3


def test_runnable_into_lists_prefill_and_decode_slots_in_order() -> None:
    s = _sched(pages=32, capacity=4)
    for rid, n in (("a", 4), ("b", 4), ("c", 4), ("d", 4)):
        s.admit(R(rid), n)
    s.mark_prefill_complete(R("b"))
    s.mark_prefill_complete(R("c"))
    s.seed_decode_token(R("c"), 1)
    out = np.zeros(4, dtype=np.int32)
    assert s.runnable_into(out) == 3
    assert out[:3].tolist() == [0, 2, 3]
    assert [s.request_id_at(int(x)) for x in out[:3]] == ["a", "c", "d"]
    with pytest.raises(InvalidInput, match="runnable_into: 3 runnable, out holds 1"):
        s.runnable_into(np.zeros(1, dtype=np.int32))


def test_headroom_keeps_pages_free_or_evictable_after_admission() -> None:
    s = _sched(pages=8)
    keys = page_keys(_prompt(8), PS)
    s.admit(R("a"), 8, keys)  # pages 1 2
    s.mark_prefill_complete(R("a"))
    s.finish(R("a"))  # both cached and evictable: 8 pages reclaimable
    # 'b' (12 tokens) hits pages 1 2, which stop being evictable, and needs 1 more: 5 left.
    assert s.try_admit(R("b"), 12, keys, headroom=6) is None
    assert (s.active_count(), s.free_count(), s.prefixes.evictable_count()) == (0, 6, 2)
    adm = s.try_admit(R("b"), 12, keys, headroom=5)
    assert adm is not None
    assert (adm.prefix_tokens, adm.pages.tolist()) == (8, [1, 2, 3])
    assert s.reclaimable_count() == 5
    with pytest.raises(InvalidInput, match="headroom must be an int >= 0"):
        s.try_admit(R("c"), 4, headroom=-1)


def _churn_log(kind: type[BlockPool] | type[oracle.BlockPool]) -> list[object]:
    """Every admission (slot, serial, prefix, pages), eviction count and free-page order of a
    churn over a small pool: prefix hits, evictions, a store that fills, mixed sizes, on the
    native scheduler (``BlockPool``) or the oracle's numpy model (``oracle.BlockPool``)."""
    native = kind is BlockPool
    pool = BlockPool(24) if native else oracle.BlockPool(24)
    store = PrefixKvStore(pool, max_entries=20) if native else oracle.PrefixKvStore(pool, 20)
    make = RequestScheduler if native else oracle.RequestScheduler
    s = make(4, 12, page_size=PS, pool=pool, prefixes=store)  # type: ignore[arg-type]
    rng = np.random.default_rng(5)
    bases = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    log: list[object] = []
    live: list[RequestId] = []
    for i in range(120):
        base = bases[int(rng.integers(0, 3))]
        prompt = (
            base[: int(rng.integers(1, 12))]
            + rng.integers(50, 99, int(rng.integers(0, 12))).tolist()
        )
        prompt = prompt[: 12 * PS]
        rid = RequestId(f"r{i}")
        adm = s.try_admit(rid, len(prompt), page_keys(np.array(prompt), PS), remote_kv=i % 5 == 0)
        if adm is None:
            s.finish(live.pop(0))
            log.append(("full", pool.free_count(), store.evicted_total))
            continue
        log.append((adm.slot, adm.serial, adm.prefix_tokens, adm.pages.tolist(),
                    adm.new_pages.tolist(), int(adm.state)))  # fmt: skip
        if i % 5 == 0:
            s.seed_decode_token(rid, 1)  # completes the prompt (remote KV)
        else:
            s.mark_prefill_complete(rid)
        live.append(rid)
        if len(live) > 3 and i % 3:  # now and then every slot stays taken: a refusal next
            s.finish(live.pop(0))
        log.append((pool.free_count(), len(store), store.evictable_count(), store.evicted_total))
    for rid in live:
        s.finish(rid)
    log.append(pool.allocate(pool.free_count()).tolist())  # the free stack's exact order
    return log


def test_churn_gives_the_oracle_s_pages_exactly() -> None:
    # The same slots, serials, prefix hits, page ids, evictions and free order as the numpy
    # model the scheduler's rules were first written in (tests/sched/sched_oracle).
    native, model = _churn_log(BlockPool), _churn_log(oracle.BlockPool)
    assert native == model
    assert sum(1 for e in native if isinstance(e, tuple) and e[0] == "full") > 0  # it filled
    assert any(isinstance(e, tuple) and len(e) == 6 and e[2] > 0 for e in native)  # prefix hits
    assert native[-2][3] > 0  # and evicted (entries dropped for room)


def test_a_dropped_scheduler_is_freed_at_once() -> None:
    # The scheduler holds the pool and the store, nothing holds it: no cycle for the garbage
    # collector to find.
    pool = BlockPool(8)
    s = RequestScheduler(2, 4, page_size=PS, pool=pool, prefixes=PrefixKvStore(pool))
    s.admit(R("a"), PS + 1)
    gone = weakref.ref(s)
    del s
    assert gone() is None
