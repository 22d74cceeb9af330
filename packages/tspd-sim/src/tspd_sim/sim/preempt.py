"""Preemption on a decode engine whose pages run out (only without the output reservation).

When the next decode step cannot get its pages (free or evictable), the engine preempts the
request that joined the batch last (vLLM's order: the newest running request loses), one at a
time until the step fits, and brings preempted requests back first come first served (by
arrival) as soon as their pages fit again, before it admits any new request. Two policies:

* ``recompute`` (vLLM's and SGLang's default): the request's pages are dropped; when it comes
  back, **D** prefills its prompt and the tokens it generated so far again (the part of the
  prompt still in D's prefix store is reused), as one prefill step priced by D's own cost
  model, before the next decode step. Recomputing on D rather than sending the request back to
  P is what the engines do (a preemption is a local decision of the decode engine's scheduler),
  and it needs no second transfer, no new pre-allocation and no generated tokens on P; D's
  prefix store usually still holds the prompt's pages, so only the generated part and the
  prompt's tail are computed.
* ``swap``: the request's KV is copied to host memory over the host link (PCIe) before its
  pages are reused — the engine stalls for ``bytes per rank / host_bw`` (every rank copies its
  own share over its own link) — and copied back when it returns (pages still in the prefix
  store are reused, the rest copied). Host memory is assumed large enough.

A preempted request keeps its place in the request's token count: it has generated what it
generated, and resumes decoding where it stopped (the recompute does not emit a token; the next
decode step does). The engine's batch waits while a recompute or a swap runs: one step at a
time, as in an engine that does not mix prefill chunks into decode batches.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np

from tspd_sim.sim.context import EngineCtx
from tspd_sim.sim.request import SimRequest

if TYPE_CHECKING:
    from tspd_sim.sim.kv import EngineKv

#: A request coming back: (request, KV tokens, prefix-hit tokens, pages).
Comeback = tuple[SimRequest, int, int, int]


class Preemption:
    """The preempted requests of one decode engine and the policy that brings them back.

    Owned by the :class:`~tspd_sim.sim.decode.DecodeEngine`; every call happens at one of its
    step boundaries (no step in flight)."""

    def __init__(self, ctx: EngineCtx, kv: EngineKv, tp: int) -> None:
        self.ctx, self.kv = ctx, kv
        self.swap = ctx.tuning.preemption == "swap"
        #: KV bytes of one page on one rank (what one rank's host link carries per page).
        self.page_bytes = ctx.model.kv_bytes_per_token(tp) * kv.page_size
        self.tp = tp
        #: Preempted requests waiting to come back, in arrival order.
        self.waiting: list[SimRequest] = []
        self.count = 0  #: preemptions on this engine

    def make_room(self, running: list[SimRequest], last_end: float) -> float:
        """Preempt the newest running requests until the next step's pages fit; remove them
        from ``running``; return the seconds the engine stalls to swap them out (0 for
        recompute). ``last_end`` is the end of the engine's last decode step."""
        kv = self.kv
        stall = 0.0
        while running and kv.need([r.rid for r in running], 1) > kv.sched.reclaimable_count():
            req = running.pop()
            _close_run(req, last_end)
            pages = kv.preempt(req.rid)
            req.preemptions += 1
            self.count += 1
            if self.swap:
                stall += pages * self.page_bytes / self.ctx.host_bw
                req.swap_bytes += pages * self.page_bytes * self.tp
            bisect.insort(self.waiting, req, key=_arrival)
        return stall

    def comeback(self, running: list[SimRequest]) -> tuple[list[Comeback], float]:
        """Re-admit the waiting requests, oldest first, while their pages fit with the next
        step of ``running`` (and their own next step) still supplied; the seconds of the step
        that restores their KV (a prefill on D, or a copy from host)."""
        kv, page = self.kv, self.kv.page_size
        keep = kv.need([r.rid for r in running], 1)
        back: list[Comeback] = []
        while self.waiting:
            req = self.waiting[0]
            tokens = req.ctx - 1  # the prompt and every token but the newest have KV
            own = next_page([(req, tokens, 0, 0)], page)
            got = kv.readmit(req.rid, req.keys, tokens, swap=self.swap, headroom=keep + own)
            if got is None:
                break
            self.waiting.pop(0)
            keep += own
            back.append((req, tokens, got[0], got[1]))
        if not back:
            return back, 0.0
        return back, self._restore_seconds(back)

    def _restore_seconds(self, back: list[Comeback]) -> float:
        if self.swap:
            page = self.kv.page_size
            pages = sum(n - hit // page for _, _, hit, n in back)
            return pages * self.page_bytes / self.ctx.host_bw
        new = np.array([tokens - hit for _, tokens, hit, _ in back], dtype=np.int64)
        ctx = np.array([hit for _, _, hit, _ in back], dtype=np.int64)
        return self.ctx.cost.prefill_time(new, ctx)

    def restored(self, back: list[Comeback]) -> None:
        """The restore step ended: the requests decode again (they rejoin the batch)."""
        page = self.kv.page_size
        for req, tokens, hit, pages in back:
            self.kv.resumed(req.rid, tokens, hit, self.swap)
            if self.swap:
                req.swap_bytes += (pages - hit // page) * self.page_bytes * self.tp
            else:
                req.recomputed += tokens - hit


def next_page(back: list[Comeback], page: int) -> int:
    """Pages the first step of requests coming back opens (KV ending on a page boundary)."""
    return sum(1 for _, tokens, _, _ in back if tokens % page == 0)


def _arrival(req: SimRequest) -> int:
    return req.idx


def _close_run(req: SimRequest, last_end: float) -> None:
    """End the request's current run of decode steps at a preemption (a run that has not
    taken a step yet leaves nothing)."""
    if req.segments is None:
        req.segments, req.gaps = [], []
    if req.seg_start >= 0:
        steps = req.output_len - 1 - req.steps_left - sum(n for _, n in req.segments)
        req.segments.append((req.seg_start, steps))
        req.t_last_token = last_end
    req.seg_start = -1
