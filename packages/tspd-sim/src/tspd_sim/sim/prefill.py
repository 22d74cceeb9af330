"""A prefill engine: one DP group of a P instance, running chunked prefill steps.

Batches form SGLang-style, first come first served: a request that was partially prefilled
continues first, then waiting requests are admitted to the real scheduler (prefix hit from
P's prefix store, all prompt pages allocated at once) and packed until the step's token budget
(``max_prefill_tokens``) is spent; the request that overflows the budget is chunked and
continues in the next step. A request that cannot be admitted (pool or slots full) blocks the
queue until a transfer drains and releases pages (head-of-line, as in the real engines).

When a request's last chunk ends it is marked prefilled (its full pages enter P's prefix store)
and its pages stay held until its KV transfer drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tspd_sim.sim.context import EngineCtx
from tspd_sim.sim.request import SimRequest

if TYPE_CHECKING:
    from tspd_sim.sim.kv import EngineKv, EngineLayout


#: One entry of a prefill step: (request, tokens computed now, context before them).
Chunk = tuple[SimRequest, int, int]


class PrefillEngine:
    """Owns one P DP group's queue and step clock; driven by SimPy callbacks."""

    def __init__(
        self,
        ctx: EngineCtx,
        kv: EngineKv,
        layout: EngineLayout,
        gpu_base: int,
        on_chunk: Callable[[SimRequest, int, float, float, bool], None],
    ) -> None:
        self.ctx, self.kv, self.layout, self.gpu_base = ctx, kv, layout, gpu_base
        self.env = ctx.env
        self.waiting: deque[SimRequest] = deque()
        self._partial: SimRequest | None = None
        self._busy = False
        #: Routing load: prompt tokens routed here whose KV has not drained to D (queued,
        #: prefilling, or prefilled and held while the transfer is in flight).
        self.load_tokens = 0
        self.steps = 0
        self.busy_s = 0.0
        self.index = -1  #: position among all P engines (set by the simulation)
        #: Called per chunk with (request, tokens, step start, step end, last?) at step start.
        self._on_chunk = on_chunk

    # ---- inputs ----------------------------------------------------------------------------------

    def route(self, req: SimRequest) -> None:
        """The router chose this engine (the request is still waiting for D's pages)."""
        self.load_tokens += req.input_len

    def enqueue(self, req: SimRequest) -> None:
        """D has admitted the request (pre-allocation received): it may be prefilled."""
        self.waiting.append(req)
        self.kick()

    def release(self, req: SimRequest) -> None:
        """The request's KV has drained to D: give its pages back and admit more work."""
        self.kv.finish(req.rid)
        self.load_tokens -= req.input_len
        self.kick()
        self.kv.record(self.env.now)

    def route_load(self) -> float:
        """The work this engine still owes (least-load routing): prompt tokens routed here
        whose KV has not drained to D. A prefilled request counts until its transfer ends, as
        it still holds P's pages and NIC; a router that dropped it at prefill end would see an
        instance with a transfer in flight as idle and send it the next request too."""
        return float(self.load_tokens)

    # ---- the step loop ---------------------------------------------------------------------------

    def kick(self) -> None:
        """Start a step if idle and there is work."""
        if self._busy:
            return
        batch = self._form_batch()
        if not batch:
            return
        now = self.env.now
        new = np.fromiter((c[1] for c in batch), dtype=np.int64, count=len(batch))
        ctx = np.fromiter((c[2] for c in batch), dtype=np.int64, count=len(batch))
        dt = self.ctx.cost.prefill_time(new, ctx)
        self._busy = True
        self.steps += 1
        self.busy_s += dt
        for req, n, _ in batch:
            req.progress += n
            req.computed += n
            req.chunks += 1
            self._on_chunk(req, n, now, now + dt, req.progress >= req.input_len)
        self.env.timeout(dt).callbacks.append(lambda _e: self._step_done(batch))
        self.kv.record(now)

    def _form_batch(self) -> list[Chunk]:
        budget = self.ctx.tuning.max_prefill_tokens
        batch: list[Chunk] = []
        if self._partial is not None:
            req = self._partial
            take = min(req.input_len - req.progress, budget)
            batch.append((req, take, req.progress))
            budget -= take
            self._partial = None if req.progress + take >= req.input_len else req
        while budget > 0 and self._partial is None and self.waiting:
            req = self.waiting[0]
            hit = self.kv.try_admit(req.rid, req.keys, req.input_len, remote=False)
            if hit is None:
                break  # pool or slots full: wait for a transfer to drain
            self.waiting.popleft()
            req.p_hit = req.progress = hit
            req.t_prefill_start = self.env.now
            take = min(req.input_len - hit, budget)
            batch.append((req, take, hit))
            budget -= take
            if hit + take < req.input_len:
                self._partial = req
        return batch

    def _step_done(self, batch: list[Chunk]) -> None:
        self._busy = False
        now = self.env.now
        for req, n, _ in batch:
            self.kv.advance_prefill(req.rid, n)
            if req.progress >= req.input_len:
                req.t_prefill_end = now
                if self.ctx.tuning.early_first_token:
                    req.t_first_token = now  # in P's answer, passed on by the router
                self.kv.prefill_done(req.rid)
        self.kick()
