"""Scheduler benchmark: host time of a ragged decode round, admission, keys, bulk advance.

Rows (16-token pages throughout):

* **decode round**, 256 running requests with contexts drawn uniformly from [ctx/2, ctx) for
  ctx = 1k, 4k, 16k tokens: ``execute_decode_round`` (prepare + one backend call + commit,
  with an echo backend that costs ~nothing) and the pipelined prepare / commit pair. Baseline:
  the straightforward per-request Python loop over list-based page tables (nano-vllm style)
  doing the same work (reserve the next page, lay out items and the concatenated block
  table, check and apply outputs), checked to produce the same positions and table lengths.
  Target: ≤ 1 ms per round.
* **admission** of a 12,288-token prompt (the Mooncake trace's mean prompt, 768 pages)
  without and with a prefix hit (767 pages shared, the last recomputed). Baseline: a per-page
  loop (dict look-up, list free-list pop, per-page reference count).
* **page keys** of that prompt from token ids (BLAKE2b chain) and from trace block hashes.
* **bulk advance** by 343 tokens (the trace's mean output) in one ``record_tokens`` call
  against 343 ``record_token`` calls, and one PD request's whole scheduler life on P and D.
* **request lives** (prefix churn): admit with a prefix hit, prefill complete → insert,
  finish → release, on a full pool, so every admission also evicts — short prompts of ≤ 8
  pages (issue 22's target: no slower than a per-page loop), ≤ 64 and ≤ 256. Baselines in
  the same run: :class:`LoopScheduler`, the scheduler's calls as a straightforward per-page
  Python loop doing the same work (checks, slot heap, per-slot state, page table, an
  admission record; checked to hand out the same pages and slots), and :class:`LoopStore`,
  the store alone (dict, OrderedDict LRU, list free stack). Timed in this thread's CPU time
  (a shared machine's wall time is mostly other processes' turns). ``--breakdown``: each
  call's median; ``--only short``: these rows alone.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table

from tspd_core.ids import RequestId
from tspd_core.sched import (
    BlockPool,
    DecodeOutputs,
    DecodeRound,
    PrefixKvStore,
    RequestScheduler,
    page_keys,
    page_keys_from_block_hashes,
)

PS = 16
TARGET_ROUND_MS = 1.0
PROMPT = 12288
OUTPUT = 343


class EchoBackend:
    """A backend that costs nothing: echoes identities, samples token 7."""

    def execute_ragged(self, batch: DecodeRound, out: DecodeOutputs) -> int:
        n = batch.size
        out.slot[:n] = batch.items.slot
        out.serial[:n] = batch.items.serial
        out.token[:n] = 7
        return n


def _decoding(requests: int, ctx: int) -> RequestScheduler:
    logical = ctx // PS + 256
    pool = BlockPool(requests * logical)
    s = RequestScheduler(requests, logical, page_size=PS, pool=pool, prefixes=PrefixKvStore(pool))
    rng = np.random.default_rng(0)
    for i in range(requests):
        rid = RequestId(f"r{i}")
        s.admit(rid, int(rng.integers(ctx // 2, ctx)))
        s.mark_prefill_complete(rid)
        s.seed_decode_token(rid, 1)
    return s


class LoopRound:
    """The per-request loop baseline over Python lists (same inputs as the scheduler)."""

    def __init__(self, s: RequestScheduler) -> None:
        rids = [RequestId(f"r{i}") for i in range(s.active_count())]
        self.tables = [s.page_table(r).tolist() for r in rids]
        self.lens = [s.view(r).num_tokens for r in rids]
        self.tokens = [1] * len(rids)
        used = {p for t in self.tables for p in t}
        self.free = [p for p in range(s.pool.num_pages, 0, -1) if p not in used]

    def round(self) -> tuple[list[int], list[int]]:
        items: list[tuple[int, ...]] = []
        block_table: list[int] = []
        for slot, pages in enumerate(self.tables):
            pos = self.lens[slot]
            if pos // PS == len(pages):
                pages.append(self.free.pop())
            items.append((slot, slot + 1, pos, self.tokens[slot], len(block_table), len(pages)))
            block_table.extend(pages)
        table_np = np.array(block_table, dtype=np.int32)  # what a backend would be handed
        outputs = [(slot, serial, 7) for slot, serial, *_ in items]  # the echo backend
        if len(outputs) != len(items) or len(table_np) != sum(i[5] for i in items):
            raise RuntimeError("mismatch")
        for (slot, serial, _), item in zip(outputs, items, strict=True):
            if (slot, serial) != item[:2]:
                raise RuntimeError("mismatch")
            self.lens[slot] += 1
            self.tokens[slot] = 7
        return [i[2] for i in items], [i[5] for i in items]


def bench_round(requests: int, ctx: int, repeat: int) -> dict[str, object]:
    s = _decoding(requests, ctx)
    loop = LoopRound(s)
    items, tbl, outs = s.new_round_scratch()
    backend = EchoBackend()
    batch = s.prepare_decode_round(items, tbl)
    positions, lens = loop.round()
    assert batch.items.position.tolist() == positions
    assert batch.items.table_len.tolist() == lens
    s.commit_decode_round(batch.round_id, _echo(batch, outs))
    # Many short repeats: the best one is the least disturbed by other load on the machine.
    sync = best_of(lambda: s.execute_decode_round(backend, items, tbl, outs), 4 * repeat, 10)
    spare = s.new_round_scratch()

    def pipelined() -> None:  # step N+1 prepared before step N is committed
        first = s.prepare_decode_round(items, tbl)
        second = s.prepare_decode_round(spare[0], spare[1])
        for b in (first, second):
            s.commit_decode_round(b.round_id, _echo(b, outs))

    piped = best_of(pipelined, 4 * repeat, 5) / 2
    base = best_of(loop.round, 4 * repeat, 10)
    return {
        "requests": requests,
        "context": ctx,
        "table_entries": int(batch.block_table.size),
        "round_ms": round(sync * 1e3, 4),
        "pipelined_round_ms": round(piped * 1e3, 4),
        "loop_ms": round(base * 1e3, 4),
        "speedup": round(base / sync, 2),
        "meets_target": sync * 1e3 <= TARGET_ROUND_MS,
    }


def _echo(b: DecodeRound, outs: DecodeOutputs) -> DecodeOutputs:
    n = b.size
    outs.slot[:n], outs.serial[:n], outs.token[:n] = b.items.slot, b.items.serial, 7
    return outs.head(n)


def bench_admission(hit: bool, batch: int, repeat: int) -> dict[str, object]:
    pages = PROMPT // PS
    pool = BlockPool((batch + 2) * pages)
    store = PrefixKvStore(pool)
    s = RequestScheduler(batch, pages + 1, page_size=PS, pool=pool, prefixes=store)
    keys = page_keys(np.arange(PROMPT) % 32000, PS)
    if hit:
        s.admit(RequestId("warm"), PROMPT, keys)
        s.mark_prefill_complete(RequestId("warm"))
        s.finish(RequestId("warm"))
    rids = [RequestId(f"a{i}") for i in range(batch)]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        adm = [s.admit(rid, PROMPT, keys if hit else None) for rid in rids]
        best = min(best, (time.perf_counter() - t0) / batch)
        for rid in rids:
            s.finish(rid)
    assert adm[0].prefix_tokens == (PROMPT - PS if hit else 0)
    base = best_of(lambda: _loop_admit(keys, hit, pool.num_pages), repeat, 3)
    return {
        "prefix_hit_tokens": adm[0].prefix_tokens,
        "admit_us": round(best * 1e6, 2),
        "loop_us": round(base * 1e6, 2),
        "speedup": round(base / best, 2),
    }


def _loop_admit(keys: np.ndarray, hit: bool, num_pages: int) -> list[int]:
    # The per-page baseline: a dict keyed store, a list free list, per-page counts.
    klist = keys.tolist()
    store = {k: p + 1 for p, k in enumerate(klist)} if hit else {}
    refs = [0] * (num_pages + 1)
    free = list(range(num_pages, 0, -1))
    table: list[int] = []
    limit = (PROMPT - 1) // PS
    for i in range(PROMPT // PS + (PROMPT % PS > 0)):
        page = store.get(klist[i]) if i < limit and len(table) == i else None
        if page is None:
            page = free.pop()
        refs[page] += 1
        table.append(page)
    return table


def bench_lifecycle(repeat: int) -> list[list[object]]:
    keys = page_keys(np.arange(PROMPT) % 32000, PS)
    t_keys = best_of(lambda: page_keys(np.arange(PROMPT) % 32000, PS), repeat, 3)
    hashes = np.arange(PROMPT // 512, dtype=np.int64) + 1000
    t_hash = best_of(lambda: page_keys_from_block_hashes(hashes, 512, PS, PROMPT), repeat, 20)
    pages = (PROMPT + OUTPUT) // PS + 2
    pool = BlockPool(4 * pages)
    s = RequestScheduler(4, pages, page_size=PS, pool=pool, prefixes=PrefixKvStore(pool))
    rid = RequestId("x")

    def one(bulk: bool) -> None:
        s.admit(rid, PROMPT)
        s.mark_prefill_complete(rid)
        s.seed_decode_token(rid, 1)
        if bulk:
            s.record_tokens(rid, OUTPUT)
        else:
            for _ in range(OUTPUT):
                s.record_token(rid, 3)
        s.finish(rid)

    t_bulk = best_of(lambda: one(True), 4 * repeat, 2)
    t_each = best_of(lambda: one(False), repeat, 2)

    def pd() -> None:  # P: admit, prefill, finish; D: admit remote, seed, decode, finish
        for remote in (False, True):
            s.admit(rid, PROMPT, keys, remote_kv=remote)
            if remote:
                s.seed_decode_token(rid, 1)
                s.record_tokens(rid, OUTPUT)
            else:
                s.mark_prefill_complete(rid)
            s.finish(rid)

    t_pd = best_of(pd, 4 * repeat, 2)
    return [
        ["page_keys, 12,288 tokens", t_keys * 1e3, "", ""],
        ["keys from block hashes", t_hash * 1e3, "", ""],
        [f"record_tokens({OUTPUT}) life", t_bulk * 1e3, t_each * 1e3, t_each / t_bulk],
        ["PD life on P + D (prefix hit)", t_pd * 1e3, "", ""],
    ]


class LoopStore:
    """Per-page Python baseline of scheduler + prefix store for :func:`bench_churn`: same
    allocation order, hits and eviction order (recency stamped root-newest on release)."""

    def __init__(self, num_pages: int) -> None:
        self.page_of: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.refs = [0] * (num_pages + 1)
        self.free = list(range(num_pages, 0, -1))  # a stack, top at the end
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, oldest first
        self.tables: dict[int, list[int]] = {}
        self.hits = 0  # pages of the last admission served by the store

    def admit(self, rid: int, keys: list[int], pages: int) -> list[int]:
        hit: list[int] = []
        for key in keys[: pages - 1]:
            page = self.page_of.get(key)
            if page is None:
                break
            hit.append(page)
        for page in hit:
            self.refs[page] += 1
            self.lru.pop(page, None)
        count = pages - len(hit)
        evicted = [self.lru.popitem(last=False)[0] for _ in range(count - len(self.free))]
        for page in evicted:
            del self.page_of[self.key_of.pop(page)]
            self.refs[page] = 0
        self.free.extend(reversed(evicted))
        fresh = self.free[-count:][::-1]
        del self.free[-count:]
        for page in fresh:
            self.refs[page] = 1
        self.hits = len(hit)
        self.tables[rid] = table = hit + fresh
        return table

    def complete(self, rid: int, keys: list[int]) -> None:
        for key, page in zip(keys, self.tables[rid], strict=False):
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key], self.key_of[page] = page, key
                self.refs[page] += 1

    def finish(self, rid: int) -> None:
        table = self.tables.pop(rid)
        freed = []
        for page in table:
            self.refs[page] -= 1
            if not self.refs[page]:
                freed.append(page)
        self.free.extend(reversed(freed))
        for page in reversed(table):
            if page in self.key_of and self.refs[page] == 1:
                self.lru[page] = None


class LoopScheduler:
    """The scheduler's calls as a straightforward per-page Python loop — the same work as
    :class:`RequestScheduler` for a request's life (input checks, a slot from a min-heap,
    per-slot state, the page table, an admission record with its pages and new pages, the
    prefix store of :class:`LoopStore`), with Python lists and ints instead of numpy. The
    like-for-like baseline of :func:`bench_churn` (``LoopStore`` alone skips everything but
    the store); checked to hand out the same page ids and slots."""

    def __init__(self, capacity: int, logical_pages: int, num_pages: int) -> None:
        self.store = LoopStore(num_pages)
        self.max_context = logical_pages * PS
        self.free_slots = list(range(capacity))
        self.index: dict[str, int] = {}
        self.state = [0] * capacity
        self.prompt_len = [0] * capacity
        self.prefix_tokens = [0] * capacity
        self.kv_len = [0] * capacity
        self.serial = [0] * capacity
        self.keys: list[list[int] | None] = [None] * capacity
        self.tables = [[0] * logical_pages for _ in range(capacity)]
        self.num_pages = [0] * capacity
        self.serials = 0

    def admit(self, rid: str, prompt_len: int, keys: list[int]) -> tuple[object, ...]:
        if not isinstance(prompt_len, int) or not 1 <= prompt_len <= self.max_context:
            raise ValueError(f"bad prompt_len {prompt_len}")
        if len(keys) > prompt_len // PS:
            raise ValueError("too many keys")
        if rid in self.index:
            raise ValueError(f"{rid} is active")
        if not self.free_slots:
            raise RuntimeError("no slot")
        need = -(-prompt_len // PS)
        self.serials += 1
        pages = self.store.admit(self.serials, keys, need)  # the store keys requests by serial
        hit = self.store.hits
        slot = heapq.heappop(self.free_slots)
        self.index[rid] = slot
        self.serial[slot] = self.serials
        self.state[slot] = 2  # PREFILL
        self.prompt_len[slot] = prompt_len
        self.prefix_tokens[slot] = self.kv_len[slot] = hit * PS
        self.keys[slot] = keys or None
        self.tables[slot][:need] = pages
        self.num_pages[slot] = need
        return (rid, slot, self.serials, 2, prompt_len, hit * PS, list(pages), pages[hit:])

    def complete(self, rid: str) -> None:
        slot = self.index[rid]
        if self.state[slot] != 2:
            raise ValueError(f"{rid} is not prefilling")
        self.kv_len[slot] = self.prompt_len[slot]
        keys = self.keys[slot]
        if keys is not None:
            self.store.complete(self.serial[slot], keys)
            self.keys[slot] = None
        self.state[slot] = 3  # PREFILLED

    def finish(self, rid: str) -> None:
        slot = self.index.pop(rid)
        n = self.num_pages[slot]
        self.store.finish(self.serial[slot])
        self.tables[slot][:n] = [0] * n
        self.state[slot] = self.prompt_len[slot] = self.prefix_tokens[slot] = 0
        self.kv_len[slot] = self.serial[slot] = self.num_pages[slot] = 0
        self.keys[slot] = None
        heapq.heappush(self.free_slots, slot)


def _churn_work(n: int, tail: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    # Requests of 32 groups, each sharing a prefix of 2..tail pages, plus 1..tail own pages;
    # keys are distinct per (group, page) and per (request, page) — chained in effect.
    rng = np.random.default_rng(seed)
    shared = rng.integers(2, tail + 1, 32)
    out = []
    for i in range(n):
        g = int(rng.integers(0, 32))
        keys = [(g << 40) + j + 1 for j in range(int(shared[g]))]
        keys += [(1 << 60) + (i << 20) + j for j in range(int(rng.integers(1, tail + 1)))]
        out.append((i, keys))
    return out


def bench_churn(tail: int, requests: int, repeat: int, breakdown: bool = False) -> dict[str, Any]:
    """Request lives on a full pool (see the module docstring): the scheduler against the
    like-for-like per-page loop (:class:`LoopScheduler`) and the store-only loop
    (:class:`LoopStore`), run alternately; the best run of each, in this thread's CPU time.
    ``breakdown``: also each call's share (admit, prefill complete, finish), timed per call."""
    live = 16
    num_pages = 4 * live * 2 * tail  # room for the live requests and a cache that fills
    work = _churn_work(requests, tail)
    arrays = [np.array(k, dtype=np.uint64) for _, k in work]
    rids = [RequestId(f"c{i}") for i in range(requests)]

    def real() -> None:
        pool = BlockPool(num_pages)
        s = RequestScheduler(live + 1, 2 * tail + 1, page_size=PS, pool=pool,
                             prefixes=PrefixKvStore(pool))  # fmt: skip
        for i, arr in enumerate(arrays):
            rid = rids[i]
            s.admit(rid, len(arr) * PS, arr)
            s.mark_prefill_complete(rid)
            if i >= live:
                s.finish(rids[i - live])

    def like() -> None:
        b = LoopScheduler(live + 1, 2 * tail + 1, num_pages)
        for i, keys in work:
            rid = rids[i]
            b.admit(rid, len(keys) * PS, keys)
            b.complete(rid)
            if i >= live:
                b.finish(rids[i - live])

    def store() -> None:
        b = LoopStore(num_pages)
        for i, keys in work:
            b.admit(i, keys, len(keys))
            b.complete(i, keys)
            if i >= live:
                b.finish(i - live)

    _check_churn(work, arrays, rids, live, tail, num_pages)  # same pages and slots
    # CPU time of this thread, not wall time: on a shared machine the wall time of a 0.1 s
    # run is mostly other processes' turns, and they do not hit the three alike.
    best = {name: float("inf") for name in ("real", "like", "store")}
    for _ in range(repeat):
        for name, fn in (("real", real), ("like", like), ("store", store)):
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], (time.thread_time() - t0) / requests)
    out: dict[str, Any] = {
        "prompt_pages_max": 2 * tail,
        "life_us": round(best["real"] * 1e6, 2),
        "loop_us": round(best["like"] * 1e6, 2),
        "speedup": round(best["like"] / best["real"], 2),
        "store_loop_us": round(best["store"] * 1e6, 2),
        "vs_store_loop": round(best["store"] / best["real"], 2),
    }
    if breakdown:
        out["calls_us"] = _churn_calls(work, arrays, rids, live, tail, num_pages)
    return out


def _check_churn(
    work: list[tuple[int, list[int]]],
    arrays: list[np.ndarray],
    rids: list[RequestId],
    live: int,
    tail: int,
    num_pages: int,
) -> None:
    pool = BlockPool(num_pages)
    s = RequestScheduler(live + 1, 2 * tail + 1, page_size=PS, pool=pool,
                         prefixes=PrefixKvStore(pool))  # fmt: skip
    b = LoopScheduler(live + 1, 2 * tail + 1, num_pages)
    for (i, keys), arr in zip(work, arrays, strict=True):
        adm = s.admit(rids[i], len(keys) * PS, arr)
        rec = b.admit(rids[i], len(keys) * PS, keys)
        got = (adm.slot, adm.prefix_tokens, adm.pages.tolist(), adm.new_pages.tolist())
        assert got == (rec[1], rec[5], rec[6], rec[7]), (i, got, rec)
        s.mark_prefill_complete(rids[i])
        b.complete(rids[i])
        if i >= live:
            s.finish(rids[i - live])
            b.finish(rids[i - live])


def _churn_calls(
    work: list[tuple[int, list[int]]],
    arrays: list[np.ndarray],
    rids: list[RequestId],
    live: int,
    tail: int,
    num_pages: int,
) -> dict[str, dict[str, float]]:
    """Median µs of each call of a life, scheduler and like-for-like loop, timed one by one
    (thread CPU time)."""
    clock = time.thread_time_ns
    pool = BlockPool(num_pages)
    s = RequestScheduler(live + 1, 2 * tail + 1, page_size=PS, pool=pool,
                         prefixes=PrefixKvStore(pool))  # fmt: skip
    b = LoopScheduler(live + 1, 2 * tail + 1, num_pages)
    spent: dict[str, dict[str, list[int]]] = {
        who: {"admit": [], "complete": [], "finish": []} for who in ("scheduler", "loop")
    }

    def timed(who: str, what: str, fn: Callable[..., object], *args: object) -> None:
        t0 = clock()
        fn(*args)
        spent[who][what].append(clock() - t0)

    for (i, keys), arr in zip(work, arrays, strict=True):
        rid = rids[i]
        timed("scheduler", "admit", s.admit, rid, len(arr) * PS, arr)
        timed("loop", "admit", b.admit, rid, len(keys) * PS, keys)
        timed("scheduler", "complete", s.mark_prefill_complete, rid)
        timed("loop", "complete", b.complete, rid)
        if i >= live:
            timed("scheduler", "finish", s.finish, rids[i - live])
            timed("loop", "finish", b.finish, rids[i - live])
    return {
        who: {what: float(np.median(v)) / 1e3 for what, v in calls_.items()}
        for who, calls_ in spent.items()
    }


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_scheduler", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer contexts and repeats")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=["short"], help="only the request lives (churn)")
    parser.add_argument(
        "--breakdown", action="store_true", help="request lives: each call's median µs"
    )
    opts = parser.parse_args(args)
    n = 500 if opts.quick else 2000
    repeat = 3 if opts.quick else opts.repeat
    if opts.only == "short":
        return {"prefix_churn": _churn_table(n, repeat, opts.breakdown)}
    contexts = (1024, 4096) if opts.quick else (1024, 4096, 16384)
    rounds = [bench_round(opts.requests, ctx, repeat) for ctx in contexts]
    keys = ["requests", "context", "table_entries", "round_ms", "pipelined_round_ms", "loop_ms"]
    print(table([*keys, "speedup", "target ≤1 ms"], [
        [*(r[k] for k in keys), r["speedup"], "met" if r["meets_target"] else "MISSED"]
        for r in rounds
    ]))  # fmt: skip
    admissions = [bench_admission(hit, 16, repeat) for hit in (False, True)]
    print(table(["prefix hit tokens", "admit µs", "per-page loop µs", "speedup"], [
        [a["prefix_hit_tokens"], a["admit_us"], a["loop_us"], a["speedup"]] for a in admissions
    ]))  # fmt: skip
    life = bench_lifecycle(repeat)
    print(table(["operation", "ms", "per-token calls ms", "ratio"], life))
    churn = _churn_table(n, repeat, opts.breakdown)
    return {
        "decode_rounds": rounds,
        "admission": admissions,
        "lifecycle_ms": {row[0]: row[1] for row in life},
        "bulk_vs_per_token": life[2][3],
        "prefix_churn": churn,
        "target_round_ms": TARGET_ROUND_MS,
        "meets_targets": all(r["meets_target"] for r in rounds)
        and all(c["meets_target"] for c in churn if c["prompt_pages_max"] <= SHORT_PAGES),
    }


#: Issue 22: a request of at most this many pages lives no slower than the per-page loop.
SHORT_PAGES = 8


def _churn_table(n: int, repeat: int, breakdown: bool) -> list[dict[str, Any]]:
    churn = [bench_churn(tail, n, repeat, breakdown) for tail in (4, 32, 128)]
    for c in churn:
        c["meets_target"] = c["speedup"] >= 1.0
    print(f"request lives (admit with a prefix hit, prefill complete, finish) on a full pool; "
          f"load average {os.getloadavg()}")  # fmt: skip
    headers = ["prompt pages ≤", "life µs", "per-page loop µs", "vs loop", "target ≥1× (≤8 pages)",
               "store-only loop µs", "vs store-only"]  # fmt: skip
    print(table(headers, [
        [c["prompt_pages_max"], c["life_us"], c["loop_us"], c["speedup"],
         ("met" if c["meets_target"] else "MISSED") if c["prompt_pages_max"] <= SHORT_PAGES
         else "", c["store_loop_us"], c["vs_store_loop"]]
        for c in churn
    ]))  # fmt: skip
    if breakdown:
        rows = [
            [c["prompt_pages_max"], who, *(round(v, 2) for v in calls.values())]
            for c in churn
            for who, calls in c["calls_us"].items()
        ]
        print(table(["prompt pages ≤", "who", "admit µs", "complete µs", "finish µs"], rows))
    return churn
