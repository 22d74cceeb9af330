"""Misuse, performed: each raises the package's error and changes nothing (the whole native
state, pool's and store's included, compared before and after), never a crash or a quiet
corruption. Also every public door to the native memory: the views callers get are read-only
all the way down, and the objects cannot be re-initialised, copied or have counters set."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import numpy as np
import pytest
from sched_twins import same

from tspd_core.ids import RequestId
from tspd_core.sched import (
    BackendMismatch,
    BlockPool,
    ContextFull,
    DecodeOutputs,
    InvalidInput,
    PoolExhausted,
    PrefixKvStore,
    RequestScheduler,
    SchedulerError,
    UnknownRequest,
    WrongState,
    page_keys,
)

R = RequestId
PS = 4


def _sched(pages: int = 16, capacity: int = 4, logical: int = 8) -> RequestScheduler:
    pool = BlockPool(pages)
    return RequestScheduler(
        capacity, logical, page_size=PS, pool=pool, prefixes=PrefixKvStore(pool)
    )


def _decoding(s: RequestScheduler, rid: str, prompt: list[int]) -> None:
    s.admit(R(rid), len(prompt), page_keys(prompt, PS))
    s.mark_prefill_complete(R(rid))
    s.seed_decode_token(R(rid), 1)


def _refused(
    s: RequestScheduler, error: type[SchedulerError], match: str, call: Callable[[], object]
) -> None:
    before = s._snapshot()
    with pytest.raises(error, match=match):
        call()
    assert same(s._snapshot(), before)


def test_a_double_finish_raises_and_changes_nothing() -> None:
    s = _sched()
    _decoding(s, "a", list(range(9)))
    s.finish(R("a"))
    _refused(s, UnknownRequest, "'a' is not active", lambda: s.finish(R("a")))
    _decoding(s, "b", list(range(9)))  # the slot and pages are sound afterwards
    assert s.page_table(R("b")).tolist() == [1, 2, 3]  # the hit, then 3 off the stack's top


def test_a_stale_serial_or_slot_in_outputs_is_rejected_whole() -> None:
    s = _sched()
    _decoding(s, "a", [1, 2, 3])
    _decoding(s, "b", [4, 5, 6])
    items, table, _ = s.new_round_scratch()
    batch = s.prepare_decode_round(items, table)
    slots, serials = batch.items.slot.copy(), batch.items.serial.copy()
    tokens = np.array([7, 8], dtype=np.int32)
    s.finish(R("a"))
    _decoding(s, "c", [9, 9])  # slot 0 again, a new serial
    stale = DecodeOutputs(slots, serials - 1, tokens)
    _refused(
        s,
        BackendMismatch,
        r"output row 0 is \(slot 0, serial",
        lambda: s.commit_decode_round(1, stale),
    )
    moved = DecodeOutputs(np.array([1, 0], dtype=np.int32), serials, tokens)
    _refused(
        s,
        BackendMismatch,
        "outputs must follow item order",
        lambda: s.commit_decode_round(1, moved),
    )
    floats = DecodeOutputs(slots, serials, np.array([7.0, 8.0]))
    _refused(
        s,
        BackendMismatch,
        "output token must be 2 integers",
        lambda: s.commit_decode_round(1, floats),
    )
    short = DecodeOutputs(slots[:1], serials[:1], tokens[:1])
    _refused(s, BackendMismatch, "1 outputs for 2 items", lambda: s.commit_decode_round(1, short))
    result = s.commit_decode_round(1, DecodeOutputs(slots, serials, tokens))
    assert (result.committed, result.dropped) == (1, 1)  # a's row: finished since, dropped
    assert s.view(R("c")).num_tokens == 2
    for slot in (-1, 4, 2**70, 1.0):
        _refused(s, InvalidInput, "outside 0 .. 3", lambda slot=slot: s.request_id_at(slot))  # type: ignore[misc]


def test_scribbling_on_a_round_s_scratch_cannot_change_what_commit_accepts() -> None:
    s = _sched()
    _decoding(s, "a", [1, 2, 3])
    items, table, _ = s.new_round_scratch()
    batch = s.prepare_decode_round(items, table)
    items.slot[0], items.serial[0] = 3, 999  # the caller's memory: the record is the scheduler's
    table[:] = 0
    outputs = DecodeOutputs(items.slot[:1], items.serial[:1], np.array([5], dtype=np.int32))
    _refused(s, BackendMismatch, "expected \\(slot 0", lambda: s.commit_decode_round(1, outputs))
    assert (
        s.commit_decode_round(
            batch.round_id, DecodeOutputs(np.array([0], np.int32), np.array([1]), np.array([5]))
        ).committed
        == 1
    )
    assert s.page_table(R("a")).tolist() == [1]


def test_releasing_a_page_twice_raises_and_changes_nothing() -> None:
    s = _sched()
    pool, store = s.pool, s.prefixes
    assert store is not None
    _decoding(s, "a", list(range(9)))  # pages 1 2 3; 1 2 cached
    s.finish(R("a"))  # 1 2 evictable, 3 free
    got = store.attach(page_keys(list(range(9)), PS))
    assert got.tolist() == [1, 2]
    assert store.release(got).tolist() == []
    # The store's own reference is not the caller's to give back: freeing it would leave an
    # entry on a free page.
    _refused(s, InvalidInput, "carry no reference of the caller's", lambda: store.release(got))
    mine = pool.allocate(2)  # 3 4, the caller's
    assert pool.decref(mine).tolist() == [3, 4]
    _refused(s, InvalidInput, r"pages \[3, 4\] are free", lambda: pool.decref(mine))
    _refused(s, InvalidInput, "are free", lambda: pool.free_unshared(mine))
    _refused(s, InvalidInput, "are free", lambda: store.release(mine))


def test_a_scheduler_s_and_the_store_s_references_are_not_the_caller_s() -> None:
    s = _sched()
    pool, store = s.pool, s.prefixes
    assert store is not None
    _decoding(s, "a", list(range(10)))  # pages 1 2 3 (1 2 cached)
    table = s.page_table(R("a")).copy()
    # The request's page 3 carries only the scheduler's reference: a caller cannot drop it,
    # so the page cannot be freed (and handed to someone else) under the request.
    for call in (pool.decref, pool.free_unshared, store.release):
        _refused(s, InvalidInput, "carry no reference of the caller's", lambda c=call: c(table[2:]))  # type: ignore[misc]
    # Entries move only through the store, which keeps recency and the evictable count.
    _refused(s, InvalidInput, "prefix-store entries", lambda: pool.incref(table[:1]))
    _refused(s, InvalidInput, "prefix-store entries", lambda: pool.decref(table[:2]))
    store.acquire(table[:1])  # the sanctioned way: a reference of the caller's
    assert store.release(table[:1]).tolist() == []
    s.finish(R("a"))
    assert (pool.free_count(), store.evictable_count()) == (14, 2)


@pytest.mark.parametrize("pages", [[0], [17], [-1], [2**63], [1, 1]])
def test_out_of_range_or_repeated_page_ids_are_refused_everywhere(pages: list[int]) -> None:
    s = _sched()
    pool, store = s.pool, s.prefixes
    assert store is not None
    pool.allocate(2)
    ids = np.array(pages, dtype=np.uint64 if pages[0] >= 2**63 else np.int64)
    match = "repeat" if pages == [1, 1] else r"lie in 1 \.\. 16"
    calls: list[Callable[[], object]] = [
        lambda: pool.incref(ids), lambda: pool.decref(ids), lambda: pool.free_unshared(ids),
        lambda: store.acquire(ids), lambda: store.release(ids),
        lambda: store.insert(np.arange(len(ids)), ids),
    ]  # fmt: skip
    for call in calls:
        _refused(s, InvalidInput, match, call)
    if pages != [1, 1]:
        _refused(s, InvalidInput, r"lie in 1 \.\. 16", lambda: store.is_cached(ids))
        _refused(s, InvalidInput, r"page id .* outside 1 \.\. 16", lambda: pool.refcount(pages[0]))


def test_a_partly_bad_call_changes_nothing() -> None:
    s = _sched()
    pool, store = s.pool, s.prefixes
    assert store is not None
    held = pool.allocate(3)
    bad = np.array([*held.tolist(), 99])
    for call in (pool.incref, pool.decref, store.acquire, store.release):
        _refused(s, InvalidInput, "lie in", lambda c=call: c(bad))  # type: ignore[misc]
    _refused(s, InvalidInput, "lie in", lambda: store.insert([1, 2, 3, 4], bad))
    assert len(store) == 0


def test_shortages_and_bad_input_leave_the_scheduler_as_it_was() -> None:
    s = _sched(pages=6, capacity=2, logical=4)
    _decoding(s, "a", list(range(13)))  # 4 pages, 3 cached
    _refused(s, PoolExhausted, "cannot admit 'b'", lambda: s.admit(R("b"), 16))
    _refused(s, InvalidInput, "prompt_len must be in 1 .. 16", lambda: s.admit(R("b"), 2**70))
    _refused(s, InvalidInput, "page keys", lambda: s.admit(R("b"), 4, [[1]]))
    _refused(s, InvalidInput, "headroom", lambda: s.try_admit(R("b"), 4, headroom=-1))
    assert s.try_admit(R("b"), 4, headroom=2**70) is None  # a shortage, not an overflow
    _refused(s, ContextFull, "exceed the max context of 16", lambda: s.record_tokens(R("a"), 2**70))
    _refused(s, InvalidInput, "cannot record -1", lambda: s.record_tokens(R("a"), -1))
    _refused(s, InvalidInput, "logical page -1", lambda: s.ensure_writable(R("a"), -1))
    _refused(s, InvalidInput, "logical page", lambda: s.ensure_writable(R("a"), 2**70))
    _refused(s, WrongState, "is DECODE, needs PREFILL", lambda: s.advance_prefill(R("a"), 1))
    s.fork(R("a"), R("b"))  # b shares a's four pages; pages 5 and 6 are free
    assert s.record_tokens(R("b"), 1) is not None  # position 13: page 4 copied to page 5
    s.finish(R("b"))
    items, table, _ = s.new_round_scratch()
    wrong = [
        (items, table.astype(np.int64)),
        (items, table[::2]),
        (type(items)(*(c.astype(np.int64) for c in (items.slot, items.serial, items.position,
            items.token, items.token_on_host, items.feed_row, items.table_offset,
            items.table_len))), table),
    ]  # fmt: skip
    for it, tb in wrong:
        _refused(s, InvalidInput, "scratch", lambda it=it, tb=tb: s.prepare_decode_round(it, tb))  # type: ignore[misc]
    _refused(
        s, InvalidInput, "scratch holds 0", lambda: s.prepare_decode_round(items.head(0), table)
    )


def test_undoing_a_round_whose_copy_source_was_freed_since_is_refused() -> None:
    s = _sched()
    _decoding(s, "a", [1, 2, 3, 4, 5, 6])  # pages 1 2; page 2 half full
    s.fork(R("a"), R("b"))
    items, table, _ = s.new_round_scratch()
    batch = s.prepare_decode_round(items, table)
    assert batch.copies.tolist() == [[2, 3]]  # a copies page 2 to 3; b keeps page 2
    s.finish(R("b"))  # page 2 freed: a's uncopied source is gone
    s.pool.allocate(1)  # ... and handed to someone else
    _refused(
        s, WrongState, "cannot be undone: page 2", lambda: s.abort_decode_round(batch.round_id)
    )
    s.finish(R("a"))  # the way out; then the round has nothing left to revert
    s.abort_decode_round(batch.round_id)
    assert s.rounds_in_flight() == 0


def test_the_views_callers_get_are_read_only_all_the_way_down() -> None:
    s = _sched()
    _decoding(s, "a", list(range(9)))
    before = s._snapshot()
    for view in (s.pool.refcounts, s.page_table(R("a"))):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 5
        with pytest.raises(ValueError, match="WRITEABLE"):
            view.flags.writeable = True
        base = view.base
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview)
        assert base.readonly
        for door in (base, base.obj):  # the memory itself lends no writable buffer either
            raw = np.frombuffer(door, dtype=np.uint8)
            with pytest.raises(ValueError, match="read-only"):
                raw[0] = 1
    snap = s._snapshot()  # copies: writing them touches nothing
    snap["tables"][:] = 7
    snap["pool"]["refcounts"][:] = 7
    assert same(s._snapshot(), before)
    adm = s.admit(R("b"), 5)
    adm.pages[:] = 0  # a copy too
    assert s.page_table(R("b")).tolist() == [4, 5]


def test_counters_cannot_be_set_and_objects_cannot_be_reinitialised_or_copied() -> None:
    s = _sched()
    pool, store = s.pool, s.prefixes
    assert store is not None
    _decoding(s, "a", list(range(9)))
    before = s._snapshot()
    for obj, name in ((pool, "num_pages"), (pool, "top"), (store, "evicted_total"),
                      (store, "max_entries"), (s, "capacity"), (s, "pool"), (s, "prefixes"),
                      (s, "page_size"), (s, "max_context")):  # fmt: skip
        with pytest.raises(AttributeError):
            setattr(obj, name, 1)
    pool.__init__(3)  # type: ignore[misc]  # (object.__init__: the state is set once, natively)
    store.__init__(BlockPool(3))  # type: ignore[misc]
    s.__init__(1, 1, page_size=1, pool=BlockPool(1))  # type: ignore[misc]
    for obj in (pool, store, s):
        with pytest.raises(TypeError):
            copy.copy(obj)
        with pytest.raises(TypeError):
            pickle.dumps(obj)
    with pytest.raises(InvalidInput, match="already has a prefix store"):
        PrefixKvStore(pool)
    assert same(s._snapshot(), before)


def test_construction_refuses_what_it_cannot_build_on() -> None:
    pool = BlockPool(4)
    with pytest.raises(InvalidInput, match="built on a BlockPool"):
        PrefixKvStore(object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="pool must be a BlockPool"):
        RequestScheduler(1, 4, page_size=4, pool=object())  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="below 2\\*\\*31 tokens"):
        RequestScheduler(1, 1 << 24, page_size=1 << 8, pool=pool)
    with pytest.raises(InvalidInput, match="page count must be an int"):
        pool.try_allocate(1.0)  # type: ignore[arg-type]
    store = PrefixKvStore(pool)
    with pytest.raises(InvalidInput, match="evict: count must be an int"):
        store.evict("1")  # type: ignore[arg-type]
    assert ("a" in store, -1 in store, 2**64 in store, 1 in store) == (False, False, False, False)


def test_the_scheduler_s_other_refusals_change_nothing() -> None:
    s = _sched(pages=4, capacity=3, logical=4)
    _decoding(s, "a", list(range(8)))  # pages 1 2, both cached
    assert s.slot_of(R("a")) == 0
    assert s.prefixes is not None
    assert s.prefixes.is_cached(np.array([1, 2, 3])).tolist() == [True, True, False]
    s.fork(R("a"), R("b"))
    extra = s.pool.allocate(2)  # nothing left: the pages below cannot be had
    _refused(s, PoolExhausted, "'b' needs 1 pages, 0 free", lambda: s.record_tokens(R("b"), 1))
    _refused(s, PoolExhausted, "copy-on-write for 'b'", lambda: s.ensure_writable(R("b"), 1))
    _refused(s, InvalidInput, "count or 1-D int array", lambda: s.record_tokens(R("b"), [[1]]))
    _refused(s, InvalidInput, "token ids must lie", lambda: s.record_tokens(R("b"), [-3]))
    _refused(s, InvalidInput, "token ids must lie", lambda: s.record_tokens(R("b"), [2**40]))
    s.finish(R("b"))
    s.pool.decref(extra)
    items, table, _ = s.new_round_scratch()
    s.prepare_decode_round(items, table)
    _refused(s, WrongState, "fork after commit", lambda: s.fork(R("a"), R("c")))
    flags = type(items)(*(getattr(items, f) for f in items.__dataclass_fields__))
    object.__setattr__(flags, "token_on_host", items.token_on_host.astype(np.int8))
    _refused(s, InvalidInput, "token_on_host is int8", lambda: s.prepare_decode_round(flags, table))


def test_the_scheduler_s_memory_lends_no_writable_buffer() -> None:
    s = _sched()
    memory = s.pool.refcounts.base.obj  # the native array behind the read-only view
    with pytest.raises(TypeError, match="read-write"):  # (our BufferError, retold by io)
        io.BytesIO(b"\x01\x02\x03\x04").readinto(memory)
    assert s.pool.refcounts.tolist() == [0] * 17
