"""Hypothesis state machine over admission, prefix hits, remote KV, fork, copy-on-write,
synchronous and pipelined decode rounds, bulk records, discards, finishes and cancels — on the
native scheduler and its numpy oracle side by side (``sched_twins``).

Every call runs on both and must give the same result (or the same error); after every step
everything a caller can observe must be equal (reference counts, the free stack's order, store
entries, the LRU order, every request's view and page table). On the native side: each page's
reference count equals the references that exist (request tables plus prefix entries), free +
used = total, the store's evictable count is exact, no table repeats a page, and every
request's KV read back through its table equals its reference token sequence. The arena
asserts on every write that the page is private, so a page shared by two holders is never
written without a copy. At teardown every request finishes and the pool returns to its
initial free count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sched_arena import ArenaBackend, next_token
from sched_twins import Twins

from tspd_core.ids import RequestId
from tspd_core.sched import DecodeOutputs, PoolExhausted, RequestState, page_keys

PS = 2
PAGES = 20
CAPACITY = 4
LOGICAL = 8
BASES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5])
S = RequestState
R = RequestId


class SchedulerMachine(RuleBasedStateMachine):
    with_store = True

    def __init__(self) -> None:
        super().__init__()
        self.t = Twins(PAGES, CAPACITY, LOGICAL, PS, store=self.with_store, max_entries=8)
        self.s, self.pool, self.store = self.t.s, self.t.pool, self.t.store
        self.arena = ArenaBackend(self.pool, PS)
        self.prompts: dict[str, list[int]] = {}
        self.seq: dict[str, list[int]] = {}  # tokens at KV positions, then the next input(s)
        self.inflight: list[tuple[int, Any, Any, np.ndarray]] = []  # id, slots, serials, out
        self.counter = 0

    # -- helpers ------------------------------------------------------------------------

    def _rids(self, *states: RequestState) -> list[str]:
        return sorted(r for r in self.seq if self.s.state(R(r)) in states)

    def _launch_round(self) -> None:
        batch = self.t.prepare(len(self.inflight) % 2)
        if batch is None:  # PoolExhausted or ContextFull on both
            return
        tokens = self.arena.launch(batch)
        for i, slot in enumerate(batch.items.slot.tolist()):
            rid = self.s.request_id_at(slot)
            assert rid is not None
            expected = next_token(self.seq[rid])
            assert tokens[i] == expected, f"{rid}: token {tokens[i]} != reference {expected}"
            self.seq[rid].append(int(tokens[i]))
        self.inflight.append(
            (batch.round_id, batch.items.slot.copy(), batch.items.serial.copy(), tokens)
        )

    # -- rules ----------------------------------------------------------------------------

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(1, 8),
        tail=st.lists(st.integers(10, 12), max_size=3),
        remote=st.booleans(),
        headroom=st.sampled_from([0, 0, 2]),
    )
    def admit(
        self, base: list[int], cut: int, tail: list[int], remote: bool, headroom: int
    ) -> None:
        prompt = base[:cut] + tail
        self.counter += 1
        rid = f"r{self.counter}"
        reclaimable = self.s.reclaimable_count()
        keys = page_keys(prompt, PS)
        adm = self.t.call("try_admit", R(rid), len(prompt), keys, remote_kv=remote,
                          headroom=headroom)  # fmt: skip
        if adm is None:
            need = -(-len(prompt) // PS)
            assert self.s.active_count() == CAPACITY or need + headroom > reclaimable
            return
        assert adm.prefix_tokens % PS == 0
        assert adm.prefix_tokens < len(prompt)
        assert len(adm.pages) == -(-len(prompt) // PS)
        assert self.arena.read(adm.pages, adm.prefix_tokens) == prompt[: adm.prefix_tokens]
        self.prompts[rid] = prompt
        self.seq[rid] = list(prompt[: adm.prefix_tokens])

    @rule(data=st.data())
    @precondition(lambda self: self._rids(S.PREFILL, S.AWAITING_KV))
    def complete_prompt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._rids(S.PREFILL, S.AWAITING_KV)))
        prompt = self.prompts[rid]
        done = len(self.seq[rid])
        table = self.s.page_table(R(rid))
        self.arena.write_tokens(table, prompt, done)  # local prefill or the remote write
        if self.s.state(R(rid)) is S.PREFILL:
            if len(prompt) - done > 1:
                self.t.call("advance_prefill", R(rid), len(prompt) - done - 1)
            self.t.call("mark_prefill_complete", R(rid))
        first = next_token(prompt)
        self.t.call("seed_decode_token", R(rid), first)
        self.seq[rid] = [*prompt, first]

    @rule(data=st.data())
    @precondition(lambda self: self._rids(S.DECODE) and self.s.active_count() < CAPACITY)
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._rids(S.DECODE)))
        if self.s.view(R(rid)).pending:
            return
        self.counter += 1
        child = f"r{self.counter}"
        adm = self.t.call("fork", R(rid), R(child))
        assert adm.pages.tolist() == self.s.page_table(R(rid)).tolist()
        self.prompts[child] = self.prompts[rid]
        self.seq[child] = list(self.seq[rid])

    @rule(data=st.data())
    @precondition(lambda self: self.seq)
    def ensure_writable(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seq)))
        n = self.s.num_pages(R(rid))
        page = data.draw(st.integers(0, n - 1))
        try:
            copy = self.t.call("ensure_writable", R(rid), page)
        except PoolExhausted:
            return
        if copy is not None:
            self.arena.copy(copy.src, copy.dst)
        assert self.pool.refcount(int(self.s.page_table(R(rid))[page])) == 1

    @rule(count=st.integers(1, 3), data=st.data())
    @precondition(lambda self: self._rids(S.DECODE))
    def record_tokens(self, count: int, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._rids(S.DECODE)))
        view = self.s.view(R(rid))
        if view.pending or view.num_tokens + count > LOGICAL * PS:
            return
        seq = list(self.seq[rid])
        outs = []
        for _ in range(count):
            outs.append(next_token(seq))
            seq.append(outs[-1])
        try:
            copy = self.t.call("record_tokens", R(rid), np.array(outs))
        except PoolExhausted:
            return
        if copy is not None:
            self.arena.copy(copy.src, copy.dst)
        table = self.s.page_table(R(rid))
        self.arena.write_tokens(table, seq[:-1], view.num_tokens)
        self.seq[rid] = seq

    @rule()
    @precondition(lambda self: not self.inflight)
    def synchronous_round(self) -> None:
        before = self.s.rounds_in_flight()
        self._launch_round()
        if self.inflight:
            self.commit_oldest()
        assert self.s.rounds_in_flight() == before

    @rule()
    @precondition(lambda self: len(self.inflight) < 2)
    def launch(self) -> None:
        self._launch_round()

    @rule()
    @precondition(lambda self: self.inflight)
    def commit_oldest(self) -> None:
        round_id, slots, serials, tokens = self.inflight.pop(0)
        self.t.call("commit_decode_round", round_id, DecodeOutputs(slots, serials, tokens))

    @rule(discard=st.booleans(), data=st.data())
    def prepare_then_abort(self, discard: bool, data: st.DataObject) -> None:
        free, refs = self.pool.free_count(), self.pool.refcounts.copy()
        cached = set(self.store.entries().values()) if self.store is not None else set()
        batch = self.t.prepare(len(self.inflight) % 2)
        if batch is None:
            return
        if discard and batch.size:  # the launch fails after a request was discarded
            slot = data.draw(st.sampled_from(batch.items.slot.tolist()))
            rid = self.s.request_id_at(slot)
            assert rid is not None
            self.t.call("discard_pending", rid)
            self.seq[rid] = self.seq[rid][: self.s.view(rid).num_tokens + 1]
        self.t.call("abort_decode_round", batch.round_id)
        if discard:
            return  # discarding released launched steps' pages too: the invariants check it
        # Exact restore, except prefix entries evicted to find the round's pages stay evicted.
        now = set(self.store.entries().values()) if self.store is not None else set()
        evicted = sorted(cached - now)
        refs[evicted] -= 1
        assert self.pool.free_count() == free + len(evicted)
        assert np.array_equal(self.pool.refcounts, refs)

    @rule(data=st.data())
    @precondition(lambda self: self._rids(S.DECODE))
    def discard_pending(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self._rids(S.DECODE)))
        view = self.s.view(R(rid))
        assert self.t.call("discard_pending", R(rid)) == view.pending
        self.seq[rid] = self.seq[rid][: view.num_tokens + 1]

    @rule(data=st.data())
    @precondition(lambda self: self.seq)
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seq)))  # completion or cancellation
        self.t.call("finish", R(rid))
        del self.seq[rid]

    @rule(count=st.integers(0, 4))
    @precondition(lambda self: self.store is not None)
    def evict(self, count: int) -> None:
        assert self.t.store is not None
        assert self.t.ostore is not None
        assert self.t.store.evict(count) == self.t.ostore.evict(count)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def twins_agree(self) -> None:
        self.t.check()

    @invariant()
    def references_are_exact(self) -> None:
        expected = np.zeros(PAGES + 1, dtype=np.int64)
        for rid in self.seq:
            table = self.s.page_table(R(rid))
            assert len(set(table.tolist())) == len(table), f"{rid} repeats a page"
            assert 0 not in table.tolist()
            expected[table] += 1
        cached = list(self.store.entries().values()) if self.store is not None else []
        expected[cached] += 1
        assert self.pool.refcounts.tolist() == expected.tolist()
        assert self.pool.free_count() + self.pool.used_count() == PAGES
        assert self.pool.free_count() == int(np.count_nonzero(expected[1:] == 0))
        if self.store is not None:
            assert self.store.evictable_count() == sum(1 for p in cached if expected[p] == 1)
        assert self.s.active_count() == len(self.seq)

    @invariant()
    def kv_reads_back_as_the_reference(self) -> None:
        for rid, seq in self.seq.items():
            view = self.s.view(R(rid))
            table = self.s.page_table(R(rid))
            assert self.arena.read(table, view.num_tokens) == seq[: view.num_tokens], rid

    def teardown(self) -> None:
        for rid in list(self.seq):
            self.t.call("finish", R(rid))
        while self.inflight:
            round_id, slots, serials, tokens = self.inflight.pop(0)
            outputs = DecodeOutputs(slots, serials, tokens)
            assert self.t.call("commit_decode_round", round_id, outputs).committed == 0
        cached = len(self.store) if self.store is not None else 0
        assert self.pool.free_count() + cached == PAGES
        if self.store is not None:
            assert self.t.call("reclaimable_count") == PAGES
            assert self.store.clear() == cached
        assert self.pool.free_count() == PAGES
        assert self.s.active_count() == 0


class NoStoreMachine(SchedulerMachine):
    """The same machine without a prefix store: pages come from and go to the pool alone."""

    with_store = False


for machine in (SchedulerMachine, NoStoreMachine):
    machine.TestCase.settings = settings(
        max_examples=120,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
TestScheduler = SchedulerMachine.TestCase
TestSchedulerWithoutStore = NoStoreMachine.TestCase
