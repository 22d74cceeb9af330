"""KV transfers: which pages go when, over which (P rank, D rank) links, as network flows.

The pages sent are the request's prompt pages from D's prefix length on (wire.md §5
``full_suffix``). Both block manifests come from the two schedulers' real page tables; bytes
and coalesced descriptor counts per (P rank, D rank) link come from the real layout planner
(``route_stats``) for the two engines' contracts.

Layerwise streaming (wire.md §7), tspd's default: each prefill chunk sends the manifest
positions it completed (``chunk_positions``: a page straddling a chunk boundary goes with the
later chunk, the first chunk also carries pages P had cached that D lacks, the last chunk all
that is left). A chunk's flows start once its first layer is computed (step start + step time
/ layers); the transfer cannot end before the last layer of the last chunk exists and has
crossed its link, so it ends at ``max(flows done, last step end + ideal time of one layer's
share of the last chunk's bytes)``.

Without layerwise streaming all pages go in one transfer when the last chunk's step ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tspd_core.layout import BlockManifest, chunk_positions
from tspd_sim.sim.request import SimRequest

if TYPE_CHECKING:
    from tspd_sim.network import Network
    from tspd_sim.sim.decode import DecodeEngine
    from tspd_sim.sim.kv import KvPlanner
    from tspd_sim.sim.prefill import PrefillEngine

#: One link's share of a transfer: (P rank, D rank, bytes, descriptors).
Link = tuple[int, int, int, int]


class _Transfer:
    __slots__ = ("d", "dst", "final_sent", "first", "p", "pending", "req", "src")

    def __init__(self, req: SimRequest, p: PrefillEngine, d: DecodeEngine) -> None:
        self.req, self.p, self.d = req, p, d
        self.src: BlockManifest | None = None
        self.dst: BlockManifest | None = None
        self.first = True
        self.pending = 0  # flows (and the end-of-prefill floor) not finished yet
        self.final_sent = False


class TransferManager:
    """Turns prefill chunks into network flows and reports each request's KV arrival.

    ``on_done(req, p, d)`` runs once per request, when its last byte has landed on D.
    """

    def __init__(
        self,
        net: Network,
        planner: KvPlanner,
        layers: int,
        layerwise: bool,
        on_done: Callable[[SimRequest, PrefillEngine, DecodeEngine], None],
    ) -> None:
        self.net, self.planner, self.layers, self.layerwise = net, planner, layers, layerwise
        self._on_done = on_done
        self._open: dict[int, _Transfer] = {}

    def open(self, req: SimRequest, p: PrefillEngine, d: DecodeEngine) -> None:
        """Register a routed request before its first chunk runs."""
        self._open[req.idx] = _Transfer(req, p, d)

    def on_chunk(self, req: SimRequest, n: int, start: float, end: float, last: bool) -> None:
        """A prefill step computing ``n`` more tokens of ``req`` runs over [start, end]."""
        tr = self._open[req.idx]
        if not (self.layerwise or last):
            return
        if tr.src is None:
            tr.src, tr.dst = self.planner.manifests(
                tr.p.layout,
                tr.d.layout,
                tr.p.kv.page_table(req.rid),
                tr.d.kv.page_table(req.rid),
                req.d_hit,
                req.input_len,
            )
        if self.layerwise:
            cs = req.progress - n
            positions = chunk_positions(
                tr.p.layout.contract, tr.src, cs, req.progress, first=tr.first
            )
            tr.first = False
            delay = (end - start) / self.layers
        else:
            positions, delay = None, end - start
        links = self._links(tr, positions)
        env = self.net.env
        if last:
            tr.final_sent = True
            tr.pending += 1  # the floor: the step end, plus the last layer's share if layerwise
            floor = self._floor(tr, links, end) if self.layerwise else end
            env.timeout(floor - env.now).callbacks.append(lambda _e: self._flow_done(tr))
        if links:
            tr.pending += 1  # held until the flows start
            # One event: the chunk's first layer is ready after `delay`, its first bytes land
            # one network start-up latency later.
            lat = self.net.latency(tr.p.gpu_base, tr.d.gpu_base)
            env.timeout(delay + lat).callbacks.append(lambda _e: self._send(tr, links, lat))

    def _links(self, tr: _Transfer, positions: dict[str, tuple[int, int]] | None) -> list[Link]:
        if positions is not None and all(lo == hi for lo, hi in positions.values()):
            return []
        assert tr.src is not None
        assert tr.dst is not None
        return self.planner.links(tr.p.layout, tr.d.layout, tr.src, tr.dst, positions)

    def _send(self, tr: _Transfer, links: list[Link], latency: float) -> None:
        req = tr.req
        if req.t_xfer_start != req.t_xfer_start:  # still NaN: the first bytes left then
            req.t_xfer_start = self.net.env.now - latency
        for p_rank, d_rank, nbytes, ndesc in links:
            req.xfer_bytes += nbytes
            req.xfer_desc += ndesc
            tr.pending += 1
            self.net.start_now(
                tr.p.gpu_base + p_rank,
                tr.d.gpu_base + d_rank,
                nbytes,
                ndesc,
                lambda: self._flow_done(tr),
            )
        self._flow_done(tr)  # the hold taken in on_chunk

    def _floor(self, tr: _Transfer, links: list[Link], end: float) -> float:
        """Earliest end: the last layer of the last chunk, alone on its link, after ``end``."""
        worst = 0.0
        for p_rank, d_rank, nbytes, ndesc in links:
            t = self.net.ideal_time(
                tr.p.gpu_base + p_rank,
                tr.d.gpu_base + d_rank,
                nbytes / self.layers,
                -(-ndesc // self.layers),
            )
            worst = max(worst, t)
        return end + worst

    def _flow_done(self, tr: _Transfer) -> None:
        tr.pending -= 1
        if tr.pending == 0 and tr.final_sent:
            del self._open[tr.req.idx]
            self._on_done(tr.req, tr.p, tr.d)
