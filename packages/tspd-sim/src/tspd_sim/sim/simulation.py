"""The simulation: builds the cluster's engines around one SimPy environment and replays a trace.

::

    arrival ──▶ router ──▶ D engine: admission queue ──(pages)──▶ P engine: queue, chunked prefill
                                                                     │ per chunk (layerwise)
                          D engine: batched decode ◀── KV arrived ◀──┴── transfer: flows on NICs

Everything runs on one thread in SimPy's deterministic event order (time, then scheduling
order), with every random choice drawn up front from one seeded generator, so a run is a
pure function of (trace, config): bit-for-bit repeatable, in any process.
"""

from __future__ import annotations

import gc
import time
from array import array
from collections.abc import Generator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import simpy
from tqdm import tqdm

from tspd_core.sched import page_keys_from_block_hashes
from tspd_sim.bins import BinGrid
from tspd_sim.cluster import GroupSpec, pages_for
from tspd_sim.errors import SimulationError
from tspd_sim.metrics import SimResult, build_result
from tspd_sim.network import Network
from tspd_sim.records import RunFiles
from tspd_sim.sim.context import EngineCtx, EngineInfo, SimConfig
from tspd_sim.sim.decode import DecodeEngine
from tspd_sim.sim.kv import EngineKv, EngineLayout, KvPlanner
from tspd_sim.sim.prefill import PrefillEngine
from tspd_sim.sim.request import SimRequest
from tspd_sim.sim.router import SideRouter
from tspd_sim.sim.transfer import TransferManager
from tspd_sim.specs import gpu_spec, model_spec
from tspd_sim.steplog import StepLog
from tspd_sim.traces import Trace

_EMPTY_KEYS = np.zeros(0, dtype=np.uint64)


class Simulation:
    """One replay of ``trace`` on ``config``. Call :meth:`run` once.

    Memory stays flat over the run: a request's state lives from its arrival to its finish
    (or rejection), when its row is written to the run's Parquet file and it is forgotten; the
    decode step logs spill to files; timelines are kept per bin.
    """

    def __init__(self, trace: Trace, config: SimConfig | None = None) -> None:
        self.trace = trace
        self.config = cfg = config or SimConfig()
        self.model = model_spec(cfg.cluster.model)
        self.tuning = cfg.cluster.tuning
        self.env = simpy.Environment()
        self.planner = KvPlanner(self.model, self.tuning)
        self.grid = BinGrid(trace.duration_s)
        #: Requests arrived and not finished (or rejected) yet, by index.
        self.live: dict[int, SimRequest] = {}
        self._in_t, self._in_n = array("d"), array("q")
        self.files: RunFiles | None = None
        self._ran = False
        self._rejected = 0
        self._rows = 0
        self.p_engines: list[PrefillEngine] = []
        self.d_engines: list[DecodeEngine] = []
        self.p_info: list[EngineInfo] = []
        self.d_info: list[EngineInfo] = []
        p_inst = self._build_side("prefill", cfg.cluster.prefill)
        d_inst = self._build_side("decode", cfg.cluster.decode)
        self.net = Network(
            self.env,
            self._nic_rates(self.p_info),
            self._nic_rates(self.d_info),
            cfg.net,
            (self._nic_latencies(self.p_info), self._nic_latencies(self.d_info)),
            self.grid,
        )
        self.transfers = TransferManager(
            self.net, self.planner, self.model.layers, self.tuning.layerwise, self._kv_landed
        )
        r = cfg.routing
        self.p_router = SideRouter(
            p_inst, r.policy, r.p_balance_abs, r.p_balance_rel, r.cache_threshold
        )
        self.d_router = SideRouter(
            d_inst, r.policy, r.d_balance_abs, r.d_balance_rel, r.cache_threshold
        )

    # ---- construction ------------------------------------------------------------------------

    def _build_side(
        self, role: str, groups: tuple[GroupSpec, ...]
    ) -> list[list[PrefillEngine | DecodeEngine]]:
        instances: list[list[PrefillEngine | DecodeEngine]] = []
        gpu_base = 0
        cal = self.config.calibration
        cfg_h = self.config.decode_horizon
        for group in groups:
            pages = pages_for(self.model, group, self.tuning)
            cost = cal.cost_model(self.model, gpu_spec(group.gpu), group.tp)
            layout = self.planner.layout(group.tp, pages)
            for _ in range(group.count):
                engines: list[PrefillEngine | DecodeEngine] = []
                for dp_rank in range(group.dp):
                    host = gpu_spec(group.gpu).host_bw
                    ctx = EngineCtx(self.env, cost, self.tuning, self.model, cfg_h, host)
                    engines.append(self._engine(role, ctx, layout, pages, gpu_base))
                    info = EngineInfo(role, len(instances), dp_rank, group, gpu_base, pages)
                    (self.p_info if role == "prefill" else self.d_info).append(info)
                    gpu_base += group.tp
                instances.append(engines)
        return instances

    def _engine(
        self, role: str, ctx: EngineCtx, layout: EngineLayout, pages: int, gpu_base: int
    ) -> PrefillEngine | DecodeEngine:
        t = self.tuning
        if role == "prefill":
            kv = EngineKv(
                pages,
                t.prefill_max_running,
                t.page_size,
                self.model.max_context,
                prefix_cache=t.prefill_prefix_cache,
                grid=self.grid,
            )
            p = PrefillEngine(ctx, kv, layout, gpu_base, self._on_chunk)
            p.index = len(self.p_engines)
            self.p_engines.append(p)
            return p
        kv = EngineKv(
            pages,
            t.decode_max_running,
            t.page_size,
            self.model.max_context,
            prefix_cache=t.decode_prefix_cache,
            grid=self.grid,
        )
        d = DecodeEngine(ctx, kv, layout, gpu_base, self._admitted, self._finished)
        d.index = len(self.d_engines)
        self.d_engines.append(d)
        return d

    def _nic_rates(self, infos: list[EngineInfo]) -> list[float]:
        override = self.config.net.nic_bw
        return [override or gpu_spec(i.group.gpu).nic_bw for i in infos for _ in range(i.group.tp)]

    def _nic_latencies(self, infos: list[EngineInfo]) -> list[float]:
        return [gpu_spec(i.group.gpu).nic_latency_s for i in infos for _ in range(i.group.tp)]

    # ---- the request path --------------------------------------------------------------------

    def _arrivals(self) -> Generator[simpy.Event, None, None]:
        t = self.trace
        rng = np.random.Generator(np.random.PCG64(self.config.seed))
        rooms = rng.integers(0, 1 << 63, size=len(t), dtype=np.int64)
        for i in range(len(t)):
            delay = float(t.arrival_s[i]) - self.env.now
            if delay > 0:
                yield self.env.timeout(delay)
            self._arrive(i, int(rooms[i]))

    def _progress(self, bar: tqdm) -> Generator[simpy.Event, None, None]:
        """Advance the bar with the count of finished requests, 200 times over the trace."""
        step = max(self.trace.duration_s / 200, 1.0)
        while (done := self._done()) < len(self.trace):
            bar.update(done - bar.n)
            bar.set_postfix_str(f"t={self.env.now:,.0f}s", refresh=False)
            yield self.env.timeout(step)

    def _arrive(self, i: int, room: int) -> None:
        t = self.trace
        inp, out = int(t.input_len[i]), int(t.output_len[i])
        keys = _EMPTY_KEYS
        if t.has_prefixes:
            keys = page_keys_from_block_hashes(
                t.hashes(i), t.block_tokens, self.tuning.page_size, inp
            )
        req = SimRequest(i, room, self.env.now, inp, out, keys)
        p = self.p_router.pick(req)
        d = self.d_router.pick(req)
        assert isinstance(p, PrefillEngine)
        assert isinstance(d, DecodeEngine)
        reason = self._reject_reason(req, p, d)
        if reason:
            req.reject = reason
            self._rejected += 1
            self._write(req)
            return
        self.live[i] = req
        req.p_engine, req.d_engine = p.index, d.index
        p.route(req)
        self.transfers.open(req, p, d)
        d.route(req)

    def _reject_reason(self, req: SimRequest, p: PrefillEngine, d: DecodeEngine) -> str:
        total = req.input_len + req.output_len - 1
        if total > d.kv.max_context:
            return f"context {total} > max {d.kv.max_context}"
        if p.kv.pages_for(req.input_len) > p.kv.num_pages:
            return "prompt larger than the P pool"
        if d.kv.pages_for(total) > d.kv.num_pages:
            return "request larger than the D pool"
        return ""

    def _finished(self, req: SimRequest) -> None:
        del self.live[req.idx]
        self._write(req)

    def _write(self, req: SimRequest) -> None:
        assert self.files is not None, "rows are written while the simulation runs"
        self.files.finished(req)
        self._rows += 1

    def _admitted(self, req: SimRequest) -> None:
        self.p_engines[req.p_engine].enqueue(req)

    def _on_chunk(self, req: SimRequest, n: int, start: float, end: float, last: bool) -> None:
        self.transfers.on_chunk(req, n, start, end, last)

    def _kv_landed(self, req: SimRequest, p: PrefillEngine, d: DecodeEngine) -> None:
        p.release(req)
        d.kv_arrived(req)

    # ---- running -------------------------------------------------------------------------------

    def run(self, progress: bool = False, out: Path | None = None) -> SimResult:
        """Replay the whole trace; return the results. ``progress`` shows a tqdm bar; the
        per-request rows are streamed to ``out/requests.parquet`` (default: a temporary
        file that lives as long as the result)."""
        if self._ran:
            raise SimulationError("a Simulation runs once; build a new one to run again")
        self._ran = True
        self.files = files = RunFiles(out)
        try:
            return self._run(files, progress)
        except BaseException:
            files.discard()
            raise

    def _run(self, files: RunFiles, progress: bool) -> SimResult:
        started = time.perf_counter()
        for i, d in enumerate(self.d_engines):
            d.log = StepLog(files.spill(i))
        self.env.process(self._arrivals())
        bar = tqdm(
            total=len(self.trace),
            unit="req",
            desc="replay",
            leave=False,
            mininterval=0.5,
            disable=not progress,
        )
        if progress:
            self.env.process(self._progress(bar))
        if self.config.sample_interval_s > 0:
            self.env.process(self._sampler())
        # The loop allocates millions of short-lived objects and makes no reference cycles
        # worth collecting: a rarer young-generation collection saves ~15 % of the run.
        thresholds = gc.get_threshold()
        gc.set_threshold(100_000, 50, 100)
        try:
            self.env.run()
        finally:
            gc.set_threshold(*thresholds)
        bar.update(len(self.trace) - bar.n)
        bar.close()
        files.close()
        self._check_drained()
        return build_result(self, time.perf_counter() - started)

    @property
    def in_system(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
        """(times, requests in the system) sampled every ``sample_interval_s``."""
        return np.asarray(self._in_t, dtype=np.float64), np.asarray(self._in_n, dtype=np.int64)

    def kvs(self) -> list[EngineKv]:
        """Every engine's KV state, P engines first."""
        return [e.kv for e in self.p_engines] + [e.kv for e in self.d_engines]

    def _done(self) -> int:
        return self._rejected + sum(d.finished for d in self.d_engines)

    def _sampler(self) -> Generator[simpy.Event, None, None]:
        """Requests in the system (arrived, not finished), counted from the engines' own
        state: every admitted, queued or preempted request sits in exactly one D engine."""
        dt = self.config.sample_interval_s
        while self._done() < len(self.trace):
            count = sum(d.waiting + d.kv.active for d in self.d_engines)
            self._in_t.append(self.env.now)
            self._in_n.append(count)
            yield self.env.timeout(dt)

    def _check_drained(self) -> None:
        """After the last event: every request finished or was rejected, every slot is free and
        every page left in use is held by a prefix store only (nothing leaked)."""
        stuck = sorted(self.live)
        if stuck or self._rows != len(self.trace):
            raise SimulationError(f"{len(stuck)} requests never finished (first: {stuck[:5]})")
        for kv in self.kvs():
            cached = len(kv.store) if kv.store is not None else 0
            if kv.active or kv.pool.used_count() != cached:
                raise SimulationError(
                    f"engine leaked state: {kv.active} active requests, "
                    f"{kv.pool.used_count()} used pages for {cached} prefix entries"
                )
