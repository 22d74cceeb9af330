"""Ragged decode rounds: exact batches, exact tokens, batch checks, pipelining, rollback."""

from __future__ import annotations

from typing import Any

import pytest
from sched_arena import ArenaBackend, next_token
from sched_twins import same

from tspd_core.ids import RequestId
from tspd_core.sched import (
    BackendMismatch,
    BlockPool,
    ContextFull,
    DecodeOutputs,
    DecodeRound,
    InvalidInput,
    PoolExhausted,
    PrefixKvStore,
    RequestScheduler,
    WrongState,
    page_keys,
)

R = RequestId
PS = 4


class Engine:
    """Scheduler + arena backend + scratch, with a prefill helper and reference sequences."""

    def __init__(self, pages: int = 32, capacity: int = 4, logical: int = 8) -> None:
        self.pool = BlockPool(pages)
        self.store = PrefixKvStore(self.pool)
        self.s = RequestScheduler(
            capacity, logical, page_size=PS, pool=self.pool, prefixes=self.store
        )
        self.backend = ArenaBackend(self.pool, PS)
        self.items, self.table, self.outs = self.s.new_round_scratch()
        self.seqs: dict[str, list[int]] = {}

    def start(self, rid: str, prompt: list[int]) -> None:
        adm = self.s.admit(R(rid), len(prompt), page_keys(prompt, PS))
        self.backend.write_tokens(adm.pages, prompt, adm.prefix_tokens)
        self.s.mark_prefill_complete(R(rid))
        first = next_token(prompt)
        self.s.seed_decode_token(R(rid), first)
        self.seqs[rid] = [*prompt, first]

    def expect_step(self, *rids: str) -> None:
        for rid in rids:
            self.seqs[rid].append(next_token(self.seqs[rid]))

    def snapshot(self) -> dict[str, Any]:
        snap = self.s._snapshot()
        snap["in_flight"] = self.s.rounds_in_flight()
        return snap


def test_round_lays_out_slot_order_tables_and_reserves_the_next_page() -> None:
    e = Engine()
    e.start("a", list(range(1, 5)))  # 4 tokens: page 1 full; next position 4 needs a page
    e.start("b", list(range(7, 13)))  # 6 tokens: pages 2 3; position 6 fits page 3
    batch = e.s.prepare_decode_round(e.items, e.table)
    it = batch.items
    assert batch.round_id == 1
    assert it.slot.tolist() == [0, 1]
    assert it.position.tolist() == [4, 6]
    assert it.token.tolist() == [e.seqs["a"][-1], e.seqs["b"][-1]]
    assert it.token_on_host.tolist() == [True, True]
    assert it.table_offset.tolist() == [0, 2]
    assert it.table_len.tolist() == [2, 2]
    assert batch.block_table.tolist() == [1, 4, 2, 3]  # page 4 reserved for a's position 4
    assert batch.copies.shape == (0, 2)
    assert batch.new_pages == 1
    assert e.s.view(R("a")).pending == 1
    assert e.s.view(R("a")).next_token is None  # in flight
    tokens = e.backend.launch(batch)
    outs = DecodeOutputs(it.slot.copy(), it.serial.copy(), tokens)
    assert e.s.commit_decode_round(1, outs).committed == 2
    e.expect_step("a", "b")
    assert e.s.view(R("a")).next_token == e.seqs["a"][-1]
    assert e.s.view(R("b")).num_tokens == 7


def test_synchronous_rounds_produce_the_reference_tokens() -> None:
    e = Engine()
    e.start("a", list(range(1, 10)))
    e.start("b", list(range(1, 10)))  # same prompt: shares pages 1 2 with a
    e.start("c", [5, 5, 5])
    for _ in range(9):
        result = e.s.execute_decode_round(e.backend, e.items, e.table, e.outs)
        assert (result.committed, result.dropped) == (3, 0)
        e.expect_step("a", "b", "c")
    assert e.backend.calls == 9
    for rid in "abc":
        table = e.s.page_table(R(rid))
        view = e.s.view(R(rid))
        assert e.backend.read(table, view.num_tokens) == e.seqs[rid][:-1]
        assert view.next_token == e.seqs[rid][-1]
    assert e.s.page_table(R("a")).tolist()[:2] == e.s.page_table(R("b")).tolist()[:2]


def test_pipelined_rounds_feed_the_previous_rows_output() -> None:
    e = Engine()
    e.start("a", [1, 2, 3])
    e.start("b", [4, 5])
    r1 = e.s.prepare_decode_round(e.items, e.table)
    t1 = e.backend.launch(r1)
    keep1 = (r1.items.slot.copy(), r1.items.serial.copy())
    items2, table2, _ = e.s.new_round_scratch()  # double buffer: r1's views stay intact
    r2 = e.s.prepare_decode_round(items2, table2)
    assert r2.items.token_on_host.tolist() == [False, False]
    assert r2.items.feed_row.tolist() == [0, 1]
    assert r2.items.position.tolist() == [4, 3]
    assert e.s.view(R("a")).pending == 2
    t2 = e.backend.launch(r2)
    with pytest.raises(WrongState, match="round 1 is the oldest"):
        e.s.commit_decode_round(2, DecodeOutputs(r2.items.slot, r2.items.serial, t2))
    e.s.commit_decode_round(1, DecodeOutputs(*keep1, t1))
    e.s.commit_decode_round(2, DecodeOutputs(r2.items.slot, r2.items.serial, t2))
    e.expect_step("a", "b")
    e.expect_step("a", "b")
    assert e.s.view(R("a")).next_token == e.seqs["a"][-1]
    assert e.s.view(R("b")).next_token == e.seqs["b"][-1]
    assert e.s.view(R("a")).num_tokens == 5


def test_eos_with_next_step_in_flight_releases_its_reserved_page() -> None:
    e = Engine()
    e.start("a", [1, 2, 3])  # pages 1; positions 3 then 4 (page 2 reserved by step 2)
    e.start("b", [9, 9, 9, 9, 9, 9])
    r1 = e.s.prepare_decode_round(e.items, e.table)
    t1 = e.backend.launch(r1)
    out1 = DecodeOutputs(r1.items.slot.copy(), r1.items.serial.copy(), t1)
    items2, table2, _ = e.s.new_round_scratch()
    r2 = e.s.prepare_decode_round(items2, table2)
    e.backend.launch(r2)
    assert e.s.page_table(R("a")).tolist() == [1, 4]  # b holds 2 3
    e.s.commit_decode_round(1, out1)  # a hits EOS at step 1
    free_before = e.pool.free_count()
    assert e.s.discard_pending(R("a")) == 1
    assert e.s.page_table(R("a")).tolist() == [1]
    assert e.pool.free_count() == free_before + 1
    result = e.s.commit_decode_round(2, DecodeOutputs(r2.items.slot, r2.items.serial, t1))
    assert (result.committed, result.dropped) == (1, 1)
    assert e.s.view(R("a")).num_tokens == 4
    e.s.finish(R("a"))
    e.s.finish(R("b"))
    assert e.pool.free_count() == 32 - len(e.store)


def test_finish_with_steps_in_flight_drops_their_outputs_even_if_the_slot_is_reused() -> None:
    e = Engine()
    e.start("a", [1, 2])
    r1 = e.s.prepare_decode_round(e.items, e.table)
    t1 = e.backend.launch(r1)
    e.s.finish(R("a"))
    e.start("z", [3, 4])  # takes slot 0 again with a new serial
    result = e.s.commit_decode_round(r1.round_id, DecodeOutputs(r1.items.slot, r1.items.serial, t1))
    assert (result.committed, result.dropped) == (0, 1)
    assert e.s.view(R("z")).num_tokens == 2


@pytest.mark.parametrize("fault", ["count", "order", "serial", "token", "raise", "written"])
def test_mismatched_backend_batch_is_rejected_and_state_is_unchanged(fault: str) -> None:
    e = Engine()
    e.start("a", [1, 2, 3, 4])  # next position needs a new page
    e.start("b", [5, 6, 7])
    e.s.fork(R("b"), R("c"))  # b and c share a half-full page: the round copies on write
    before = e.snapshot()

    class Faulty(ArenaBackend):
        def execute_ragged(self, batch: DecodeRound, out: DecodeOutputs) -> int:
            n = super().execute_ragged(batch, out)
            if fault == "count":
                return n - 1
            if fault == "order":
                out.slot[:2] = out.slot[:2][::-1].copy()
                out.serial[:2] = out.serial[:2][::-1].copy()
            if fault == "serial":
                out.serial[1] += 100
            if fault == "token":
                out.token[2] = -5
            if fault == "raise":
                raise OSError("device lost")
            if fault == "written":
                return "3"  # type: ignore[return-value]
            return n

    backend = Faulty(e.pool, PS)
    expected, message = {
        "count": (BackendMismatch, r"round \d+: backend wrote 2 outputs for 3 items"),
        "order": (BackendMismatch, r"output row 0 is \(slot \d+, serial \d+\), expected"),
        "serial": (BackendMismatch, r"output row 1 is \(slot \d+, serial \d+\), expected"),
        "token": (BackendMismatch, r"output row 2 has token -5, outside 0 .. 2\*\*31-1"),
        "raise": (OSError, "device lost"),
        "written": (BackendMismatch, r"backend wrote '3' outputs for 3 items"),
    }[fault]
    with pytest.raises(expected, match=message):
        e.s.execute_decode_round(backend, e.items, e.table, e.outs)
    assert backend.calls == 1
    assert same(e.snapshot(), before)
    result = e.s.execute_decode_round(e.backend, e.items, e.table, e.outs)  # still works
    assert result.committed == 3
    assert e.s.stats().cow_copies == 1


def test_copy_on_write_in_a_round_after_fork() -> None:
    e = Engine()
    e.start("a", [1, 2, 3, 4, 5, 6])  # pages 1 2; page 2 half full
    e.s.fork(R("a"), R("b"))
    batch = e.s.prepare_decode_round(e.items, e.table)
    assert batch.copies.tolist() == [[2, 3]]  # a (slot 0) copies first; b then owns page 2
    assert batch.block_table.tolist() == [1, 3, 1, 2]
    tokens = e.backend.launch(batch)
    e.s.commit_decode_round(1, DecodeOutputs(batch.items.slot, batch.items.serial, tokens))
    assert tokens[0] == tokens[1]  # same history, same token
    assert e.pool.refcounts[1:4].tolist() == [3, 1, 1]  # page 1: a, b and the store


def test_abort_newest_round_restores_pages_and_rows() -> None:
    e = Engine()
    e.start("a", [1, 2, 3, 4])
    before = e.snapshot()
    batch = e.s.prepare_decode_round(e.items, e.table)
    with pytest.raises(WrongState, match=r"newest round in flight \(1\)"):
        e.s.abort_decode_round(7)
    e.s.abort_decode_round(batch.round_id)
    assert same(e.snapshot(), before)
    with pytest.raises(WrongState, match="no decode round is in flight"):
        e.s.commit_decode_round(batch.round_id, e.outs.head(1))


def test_round_errors_change_nothing() -> None:
    e = Engine(pages=2, logical=2)  # max context 8
    e.start("a", [1, 2, 3, 4])  # page 1 (cached); position 4 needs a new page
    e.start("b", [1, 2, 3, 4, 5, 6, 7])  # prefix hit on page 1, plus page 2
    before = e.snapshot()
    with pytest.raises(PoolExhausted, match="needs 1 new pages, 0 free or evictable"):
        e.s.prepare_decode_round(e.items, e.table)
    assert same(e.snapshot(), before)
    e.s.finish(R("a"))
    e.s.record_token(R("b"), 3)  # position 7: b is now at 8 tokens, the max context
    with pytest.raises(ContextFull, match="'b' reached the max context of 8"):
        e.s.prepare_decode_round(e.items, e.table)
    e.s.finish(R("b"))
    e.start("c", [1])
    with pytest.raises(InvalidInput, match="scratch holds 0"):
        e.s.prepare_decode_round(e.items.head(0), e.table)
    e.s.record_tokens(R("c"), 2)
    with pytest.raises(WrongState, match="without a known input token"):
        e.s.prepare_decode_round(e.items, e.table)
    assert e.s.rounds_in_flight() == 0


def test_no_decode_requests_means_no_backend_call() -> None:
    e = Engine()
    e.s.admit(R("a"), 4)
    result = e.s.execute_decode_round(e.backend, e.items, e.table, e.outs)
    assert (result.committed, result.dropped, e.backend.calls) == (0, 0, 0)
    assert e.s.rounds_in_flight() == 0
    e.start("b", [1])
    e.s.prepare_decode_round(e.items, e.table)
    with pytest.raises(WrongState, match="pipelined rounds are in flight"):
        e.s.execute_decode_round(e.backend, e.items, e.table, e.outs)
    with pytest.raises(WrongState, match="in flight"):
        e.s.record_tokens(R("b"), 1)


def test_abort_after_discard_points_back_at_the_uncopied_source() -> None:
    e = Engine()
    e.start("a", [1, 2, 3, 4, 5, 6])  # pages 1 2; page 2 half full
    e.s.fork(R("a"), R("b"))
    e.seqs["b"] = list(e.seqs["a"])
    batch = e.s.prepare_decode_round(e.items, e.table)
    assert batch.copies.tolist() == [[2, 3]]  # a would copy page 2 to 3 ... never launched
    assert e.s.discard_pending(R("a")) == 1
    assert e.s.page_table(R("a")).tolist() == [1, 3]  # the copy sits below a's committed end
    e.s.abort_decode_round(batch.round_id)
    assert e.s.page_table(R("a")).tolist() == [1, 2]  # back on the source; 3 was garbage
    assert e.pool.refcounts[1:4].tolist() == [3, 2, 0]
    for _ in range(3):
        e.s.execute_decode_round(e.backend, e.items, e.table, e.outs)
        e.expect_step("a", "b")
    for rid in "ab":
        view = e.s.view(R(rid))
        assert e.backend.read(e.s.page_table(R(rid)), view.num_tokens) == e.seqs[rid][:-1]
        assert view.next_token == e.seqs[rid][-1]
