"""A decode engine: one DP group of a D instance — admission queue, then batched decode steps.

**Admission** (first come first served, with back-pressure): a routed request waits until the
real scheduler admits it as "awaiting remote KV" (prefix pages from D's prefix store attached,
the rest of the prompt's pages allocated, and — by default — the pages its output will need
kept in reserve). Only then is it handed to P (its pre-allocation reached P), so a full D pool
holds P back, exactly like the PD handshake does.

**Rounds** (``EngineTuning.decode_rounds``, on by default: tspd's engine works so): a D
engine that works in rounds takes new requests and landed KV only between two steps — a
request routed to it while a step runs is admitted at the step's end, and a request whose KV
lands sends its first token on with the end of its first decode step (the round that seeds
it runs that step, and the engine sends a round's outputs when it ends). Off, both happen at
once, and the first token leaves D as its KV lands. With ``EngineTuning.early_first_token``
(the default) the first token left P already; the rounds still set when a request joins.

**Decode in macro-steps**: between two changes of the batch (a request joins when its KV
arrives, or finishes), every step runs the same sequences with contexts growing by one token
each, so the cost model prices k steps at once (``decode_times``) and one wake-up is scheduled
at the k-th step's end, where k is the fewest steps any running request has left. A request
whose KV arrives mid-macro-step joins at the next step boundary: the macro-step is cut there.
At each boundary the scheduler advances every running request by the steps done in bulk
(``record`` of n tokens: pages allocated as they fill), so its state is exact at boundaries.

**Out of pages** (only without the output reservation): a macro-step is also cut before the
first step whose pages the pool cannot supply (a step's pages are its at its start: a request
admitted while the step runs cannot take them), and at that boundary the engine preempts
(:mod:`tspd_sim.sim.preempt`). While preempted requests wait, the engine steps one step at a
time, trying at every boundary to bring them back, exactly as a step-by-step engine would.

Every committed step's end time is logged (:class:`~tspd_sim.steplog.StepLog`); a
request's token times are slices of that log (token 2 at its first step's end, token
``output_len`` at its last), so no per-token event exists anywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tspd_sim.sim.context import EngineCtx
from tspd_sim.sim.preempt import Comeback, Preemption, next_page
from tspd_sim.sim.request import SimRequest
from tspd_sim.steplog import StepLog

if TYPE_CHECKING:
    from tspd_sim.sim.kv import EngineKv, EngineLayout


class DecodeEngine:
    """Owns one D DP group's admission queue, batch and step clock; driven by SimPy callbacks."""

    def __init__(
        self,
        ctx: EngineCtx,
        kv: EngineKv,
        layout: EngineLayout,
        gpu_base: int,
        on_admitted: Callable[[SimRequest], None],
        on_finished: Callable[[SimRequest], None] = lambda _r: None,
    ) -> None:
        self.ctx, self.kv, self.layout, self.gpu_base = ctx, kv, layout, gpu_base
        self.env = ctx.env
        self._on_admitted = on_admitted
        self._on_finished = on_finished
        self.queue: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._joining: list[SimRequest] = []
        #: None with the output reservation: decode never runs out of pages then.
        self.preempt = None if ctx.tuning.reserve_output else Preemption(ctx, kv, layout.tp)
        self._ends: npt.NDArray[np.float64] = np.zeros(0)
        self._version = 0
        self._t0 = 0.0
        self._done = 0  #: steps of the running macro-step already committed
        self._busy = False  #: a decode macro-step or a restore / swap-out step is in flight
        self._restore_pages = 0  #: pages the first step after a restore opens for it
        self._first_weight = 0  #: gap weight of the next committed run's first step
        self._last_end = 0.0  #: end of the last committed decode step
        self.log = StepLog()
        self.n_steps = 0
        self.busy_s = 0.0
        #: Routing load: requests routed here and not finished.
        self.load = 0
        self.finished = 0
        self.index = -1  #: position among all D engines (set by the simulation)

    # ---- admission -------------------------------------------------------------------------------

    def route(self, req: SimRequest) -> None:
        """The router chose this engine: queue for admission (with ``decode_rounds``, at the
        next step boundary while a step runs)."""
        self.load += 1
        self.queue.append(req)
        if self.ctx.tuning.decode_rounds and self._stepping():
            self._cut(self.env.now)  # the boundary's wake-up admits it
            return
        self.try_admit()

    def _stepping(self) -> bool:
        """A decode step of a running batch is in flight now."""
        return self._busy and bool(self.running) and self._done < len(self._ends)

    def route_load(self) -> float:
        """Requests routed here and not finished (least-load routing)."""
        return float(self.load)

    @property
    def waiting(self) -> int:
        """Requests here that hold no slot: queued for admission or preempted."""
        return len(self.queue) + (len(self.preempt.waiting) if self.preempt else 0)

    def try_admit(self) -> None:
        """Admit queued requests in order while pages and slots allow (never ahead of a
        preempted request, and never into the pages running requests need, see
        :meth:`_keep`)."""
        self.sync()
        if self.preempt is not None and self.preempt.waiting:
            return
        keep = self._keep()
        admitted = False
        while self.queue:
            req = self.queue[0]
            growth = req.output_len - 1 if self.ctx.tuning.reserve_output else 0
            hit = self.kv.try_admit(
                req.rid, req.keys, req.input_len, remote=True, growth_tokens=growth, headroom=keep
            )
            if hit is None:
                break
            admitted = True
            self.queue.popleft()
            req.d_hit = hit
            req.t_d_admit = self.env.now
            self._on_admitted(req)
        if admitted and self.preempt is not None:
            self._refit()
        self.kv.record(self.env.now)

    def _keep(self) -> int:
        """Pages an admission must leave free or evictable (0 with the reservation, which
        covers them): those of the decode step running now — a step's pages are its from its
        start, though the scheduler is told lazily — and of the next step of every running or
        joining request (running requests come first, as in vLLM's scheduler)."""
        if self.preempt is None:
            return 0
        stepping = self._busy and self._done < len(self._ends)
        running = self.kv.need([r.rid for r in self.running], 2 if stepping else 1)
        joining = self.kv.need([r.rid for r in self._joining], 1)
        return running + joining + self._restore_pages

    def _refit(self) -> None:
        """After an admission took pages: cut the macro-step before the first step whose
        pages are no longer there."""
        left = len(self._ends) - self._done
        if self._busy and left > 1:
            fit = self.kv.fits([r.rid for r in self.running], left)
            if fit < left:
                self._cut_at(self._done + max(fit, 1))

    # ---- KV arrival and the batch ----------------------------------------------------------

    def kv_arrived(self, req: SimRequest) -> None:
        """The request's KV and first token landed: join the batch at the next step boundary."""
        now = self.env.now
        rounds = self.ctx.tuning.decode_rounds
        from_p = self.ctx.tuning.early_first_token  # (then it left P already)
        self.sync()
        req.t_kv = now
        if not rounds and not from_p:
            req.t_first_token = now
        self.kv.kv_arrived(req.rid, req.input_len)
        if req.output_len == 1:
            # In rounds, a lone first token goes out at the next step boundary (the round that
            # seeds it steps the others' batch; the end of that step is not modelled).
            done = float(self._ends[self._done]) if rounds and self._stepping() else now
            if not from_p:
                req.t_first_token = done
            self._finish(req, done)
            self.try_admit()
            return
        req.steps_left = req.output_len - 1
        req.ctx = req.input_len + 1
        self._joining.append(req)
        if not self._busy:
            self._start()
        elif len(self._ends):
            self._cut(now)

    def _start(self) -> None:
        """At a step boundary: join, bring preempted requests back or preempt, then run the
        next macro-step."""
        fresh = self._joining
        self.running.extend(fresh)
        self._joining = []
        pre = self.preempt
        if pre is not None:
            if pre.waiting:
                back, seconds = pre.comeback(self.running)
                if back:
                    self._pause(seconds, back)
                    return
            stall = pre.make_room(self.running, self._last_end)
            if stall > 0:
                self._pause(stall, [])
                return
        if not self.running:
            return
        k = min(min(r.steps_left for r in self.running), self.ctx.horizon)
        if pre is not None:
            k = 1 if pre.waiting else self.kv.fits([r.rid for r in self.running], k)
            # Joined before a pause, or preempted again since: whoever has not stepped yet.
            fresh = [r for r in self.running if r.seg_start < 0]
        self._run(k, fresh)

    def _run(self, k: int, fresh: list[SimRequest]) -> None:
        """Run the next ``k`` steps of the batch; ``fresh`` requests take their first step
        since they joined or came back."""
        b = len(self.running)
        ctx_sum = sum(r.ctx for r in self.running)
        times = self.ctx.cost.decode_times(b, ctx_sum, k)
        self._t0 = self.env.now
        self._ends = self._t0 + np.cumsum(times)
        self._done = 0
        for req in fresh:
            self._begin_run(req)
        self._first_weight = b - len(fresh)
        self._version += 1
        self._busy = True
        self._arm(k)

    def _begin_run(self, req: SimRequest) -> None:
        """The request takes its first step since it joined or came back."""
        req.seg_start = self.n_steps
        first = float(self._ends[0])
        if req.join_step < 0:
            req.join_step = self.n_steps
            req.t_first_step = first
            if self.ctx.tuning.decode_rounds and not self.ctx.tuning.early_first_token:
                req.t_first_token = first  # the round that seeds it runs this step
        else:
            assert req.gaps is not None, "a request that ran before was preempted"
            req.gaps.append(first - req.t_last_token)

    def _pause(self, seconds: float, back: list[Comeback]) -> None:
        """A restore (recompute or swap-in of ``back``) or swap-out step: the batch waits."""
        self._busy = True
        self._restore_pages = next_page(back, self.kv.page_size)
        self._ends = np.zeros(0)
        self._version += 1
        self.busy_s += seconds
        version = self._version
        self.env.timeout(seconds).callbacks.append(lambda _e: self._paused(version, back))

    def _paused(self, version: int, back: list[Comeback]) -> None:
        assert version == self._version, "a pause is never cut"
        self._busy = False
        self._restore_pages = 0
        if back:
            assert self.preempt is not None
            self.preempt.restored(back)
            # Ahead of requests whose KV landed meanwhile: those are the newer, and the first
            # to lose their pages if the next step needs more.
            self._joining[:0] = [req for req, *_ in back]
        self.try_admit()
        self._start()
        self.kv.record(self.env.now)

    def _arm(self, n: int) -> None:
        version = self._version
        delay = float(self._ends[n - 1]) - self.env.now
        self.env.timeout(max(delay, 0.0)).callbacks.append(lambda _e: self._wake(version, n))

    def _cut(self, t: float) -> None:
        """End the running macro-step at the first step boundary at or after ``t``."""
        self._cut_at(int(np.searchsorted(self._ends, t, side="left")) + 1)

    def _cut_at(self, steps: int) -> None:
        """End the running macro-step after its first ``steps`` steps."""
        if steps < len(self._ends):
            self._ends = self._ends[:steps]
            self._version += 1
            self._arm(steps)

    def sync(self) -> None:
        """Commit the steps of the running macro-step that have ended by now, so the scheduler
        (and its pool) is exactly where a step-by-step engine would be before anything else
        touches it (an admission, a KV arrival)."""
        if self.running and len(self._ends):
            upto = int(np.searchsorted(self._ends, self.env.now, side="right"))
            self._commit(min(upto, len(self._ends)))

    def _commit(self, upto: int) -> None:
        """Record steps ``_done .. upto`` of the running macro-step for every running request."""
        n = upto - self._done
        if n <= 0:
            return
        self.log.append(self._ends[self._done : upto], len(self.running), self._first_weight)
        self._first_weight = len(self.running)
        self.n_steps += n
        self._done = upto
        self._record(n)
        for req in self.running:
            req.steps_left -= n
            req.ctx += n

    def _record(self, n: int) -> None:
        """Record n steps of every running request in the scheduler, allocating pages in the
        order a step-by-step engine would: by step, then by batch position."""
        kv, running, page = self.kv, self.running, self.kv.page_size
        lazy = kv.decoding  # rid -> [steps not recorded, free slots in held pages]
        needs: list[tuple[int, int]] = []
        for i, req in enumerate(running):
            lag, room = lazy[req.rid]
            first = room - lag + 1  # the step that needs the request's next page
            if first <= n:
                needs.extend((step, i) for step in range(first, n + 1, page))
        done = [0] * len(running)
        if needs:
            needs.sort()
            for step, i in needs:
                kv.advance(running[i].rid, step - done[i])
                done[i] = step
        for i, req in enumerate(running):
            lazy[req.rid][0] += n - done[i]  # no page boundary left: only the count moves

    def _wake(self, version: int, n: int) -> None:
        if version != self._version:
            return  # superseded by a cut
        self._commit(n)
        end = float(self._ends[n - 1])
        self._last_end = end
        self.busy_s += end - self._t0
        self._busy = False
        still: list[SimRequest] = []
        for req in self.running:
            if req.steps_left == 0:
                self._finish(req, end)
            else:
                still.append(req)
        self.running = still
        self.try_admit()
        self._start()
        self.kv.record(self.env.now)

    def _finish(self, req: SimRequest, t: float) -> None:
        req.t_finish = t
        if req.segments is not None and req.seg_start >= 0:
            done = sum(n for _, n in req.segments)
            req.segments.append((req.seg_start, req.output_len - 1 - done))
        self.kv.finish(req.rid)
        self.load -= 1
        self.finished += 1
        self._on_finished(req)
