"""One engine's KV state: the real ``tspd_core.sched`` scheduler, block pool and prefix store.

This is the thinnest layer between the simulated engines and the real scheduler. It adds only
what the simulator needs on top:

* **output reservation** on D (optional): admission also requires the pages the request's
  output will fill to stay available, so decode never runs out of pages (no preemption is
  modelled). The reservation shrinks as the scheduler allocates those pages.
* **occupancy** (pages in use, pages held by requests) integrated over the run's timeline bins.
* **page needs of decode steps** (without the reservation): how many steps the running
  requests can take before the pool runs out (:meth:`fits`), and preemption / re-admission
  of a request (:meth:`preempt`, :meth:`readmit`, :meth:`resumed`).

Token ids are not simulated: decode is advanced by token *counts* (``record_tokens(id, n)``),
and the first token seeded on D is a placeholder id.

Ownership: one :class:`EngineKv` per engine, driven from that engine's callbacks only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.ids import RequestId
from tspd_core.layout import (
    ArenaSpec,
    AttentionKind,
    BlockManifest,
    CacheContract,
    GroupBlocks,
    build_contract,
    slot_range,
)
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.layout.stats import LinkProfile, PairCounter, link_profile
from tspd_core.sched import BlockPool, PrefixKvStore, RequestScheduler
from tspd_sim.bins import BinGrid, StepIntegral
from tspd_sim.cluster import EngineTuning
from tspd_sim.specs import ModelSpec

#: The token id seeded on D in place of P's first sampled token (ids are not simulated).
PLACEHOLDER_TOKEN = 1

#: Layout dtype of a KV element of each width (the planner prices bytes, not values).
_KV_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


class EngineKv:
    """The scheduler of one engine (one DP group) plus the simulator's bookkeeping."""

    def __init__(
        self,
        num_pages: int,
        max_running: int,
        page_size: int,
        max_context: int,
        prefix_cache: bool = True,
        grid: BinGrid | None = None,
    ) -> None:
        self.page_size = page_size
        self.pool = BlockPool(num_pages)
        self.store = PrefixKvStore(self.pool) if prefix_cache else None
        logical = -(-max_context // page_size)
        self.sched = RequestScheduler(
            max_running, logical, page_size=page_size, pool=self.pool, prefixes=self.store
        )
        self.max_context = logical * page_size
        self._reserved = 0
        self._reserve_of: dict[str, int] = {}
        #: Decoding requests: [steps not yet recorded, free token slots in held pages]. The
        #: decode engine may add steps to the first entry directly while they cross no page
        #: boundary (see :meth:`advance`); anything else goes through :meth:`advance`.
        self.decoding: dict[str, list[int]] = {}
        #: Pages in use (requests and prefix cache) and pages held by requests (used minus
        #: prefix-cache-only ones) over time, per bin of the run's timelines.
        self.occupancy = StepIntegral(grid or BinGrid(1.0), 2)
        self._last = (0, 0)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def match_tokens(self, keys: list[int], prompt_len: int) -> int:
        """Prompt tokens an admission would serve from the prefix store now (for routing).

        Binary search over ``key in store`` on the request's page keys (Python ints): the
        store's entries are prefix-closed (it evicts a chain's tail before its root, and
        inserts chains in order), so the hit is the longest stored prefix — O(log pages)
        look-ups instead of a full ``match``. A router only needs this estimate (SGLang's
        router keeps an approximate tree of its own); admissions use the store's exact
        ``match``.
        """
        limit = min(len(keys), (prompt_len - 1) // self.page_size)
        store = self.store
        if store is None or limit <= 0 or keys[0] not in store:
            return 0
        lo, hi = 1, limit  # keys[:lo] are stored; the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in store:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.page_size

    def page_table(self, rid: str) -> npt.NDArray[np.int32]:
        return self.sched.page_table(RequestId(rid))

    @property
    def active(self) -> int:
        return self.sched.active_count()

    # ---- lifecycle -------------------------------------------------------------------------------

    def try_admit(
        self,
        rid: str,
        keys: npt.NDArray[np.uint64],
        prompt_len: int,
        *,
        remote: bool,
        growth_tokens: int = 0,
        headroom: int = 0,
    ) -> int | None:
        """Admit (prompt pages now, plus a reservation for ``growth_tokens`` more tokens of
        KV later); return the prefix-hit tokens, or None when pages or slots are short.
        The reservations (this one and the outstanding ones) and ``headroom`` (pages the
        caller keeps for running requests) are the scheduler's ``headroom``: pages that must
        stay free or evictable after the admission.

        A reservation is real: once admitted, prefix-cache entries are evicted (oldest first,
        in one go) until every outstanding reservation is backed by free pages, which decode
        then fills without evicting anything. (Evicting later, page by page, would keep a few
        cold prefix entries a little longer; it is how an engine without reservations works.)
        """
        growth = self.pages_for(prompt_len + growth_tokens) - self.pages_for(prompt_len)
        adm = self.sched.try_admit(
            RequestId(rid),
            prompt_len,
            keys,
            remote_kv=remote,
            headroom=growth + self._reserved + headroom,
        )
        if adm is None:
            return None
        if growth:
            self._reserved += growth
            self._reserve_of[rid] = growth
        short = self._reserved - self.pool.free_count()
        if short > 0 and self.store is not None:
            self.store.evict(short)
        return adm.prefix_tokens

    def advance_prefill(self, rid: str, tokens: int) -> None:
        self.sched.advance_prefill(RequestId(rid), tokens)

    def prefill_done(self, rid: str) -> None:
        """All prompt KV written on P: its full pages enter P's prefix store."""
        self.sched.mark_prefill_complete(RequestId(rid))

    def kv_arrived(self, rid: str, prompt_len: int) -> None:
        """The prompt KV landed on D: the request becomes runnable; its prompt pages enter D's
        prefix store."""
        self.sched.seed_decode_token(RequestId(rid), PLACEHOLDER_TOKEN)
        self.decoding[rid] = [0, self.pages_for(prompt_len) * self.page_size - prompt_len]

    def advance(self, rid: str, steps: int) -> None:
        """``steps`` decode steps of this request ran: record their KV.

        Recording is deferred until a step needs a new page: until then a record changes
        nothing but the request's token count, so the pool (and everything routed on it) is
        exactly as if every step had been recorded, at a fraction of the calls.
        """
        lag_room = self.decoding[rid]
        lag_room[0] += steps
        lag, room = lag_room
        if lag <= room:
            return  # still inside the pages the request holds
        self.sched.record_tokens(RequestId(rid), lag)
        grown = -(-(lag - room) // self.page_size)  # the pages record_tokens allocated
        lag_room[0], lag_room[1] = 0, room + grown * self.page_size - lag
        left = self._reserve_of.get(rid, 0)
        if left:
            used = min(grown, left)
            self._reserved -= used
            self._reserve_of[rid] = left - used

    def finish(self, rid: str) -> None:
        self._reserved -= self._reserve_of.pop(rid, 0)
        self.decoding.pop(rid, None)
        self.sched.finish(RequestId(rid))

    # ---- running out of pages (no output reservation) -----------------------------------------

    def need(self, rids: list[str], steps: int) -> int:
        """Pages the next ``steps`` decode steps of ``rids`` allocate (a request whose held
        pages are full opens one at its next step, then one every ``page_size`` steps)."""
        lazy, page = self.decoding, self.page_size
        if steps == 1:
            return sum(1 for r in rids if lazy[r][0] == lazy[r][1])
        return sum(
            -((lazy[r][1] - lazy[r][0] - steps) // page)
            for r in rids
            if lazy[r][1] - lazy[r][0] < steps
        )

    def fits(self, rids: list[str], steps: int) -> int:
        """Most decode steps ``m ≤ steps`` of ``rids`` whose pages the pool (free plus
        evictable) can supply; 0 when not even the next one fits."""
        supply = self.sched.reclaimable_count()
        lazy = self.decoding
        slack = np.fromiter((lazy[r][1] - lazy[r][0] for r in rids), np.int64, len(rids))
        page = self.page_size

        def need(m: int) -> int:  # pages for m more steps: ceil((m − slack) / page) each
            return int(np.maximum(0, -((slack - m) // page)).sum())

        if need(steps) <= supply:
            return steps
        lo, hi = 0, steps  # need(lo) ≤ supply < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= supply else (lo, mid)
        return lo

    def preempt(self, rid: str) -> int:
        """Drop a decoding request's pages and slot (its KV is recomputed or was swapped out);
        return the pages it held."""
        pages = self.sched.num_pages(RequestId(rid))
        self.finish(rid)
        return pages

    def readmit(
        self, rid: str, keys: npt.NDArray[np.uint64], tokens: int, *, swap: bool, headroom: int
    ) -> tuple[int, int] | None:
        """Bring a preempted request back with pages for its ``tokens`` of KV (prompt and
        generated; the prompt's pages still in the prefix store are reused), keeping
        ``headroom`` pages free or evictable; (prefix-hit tokens, pages) or None when short.
        A swapped request waits for its KV like a remote one; a recomputed one prefills."""
        hit = self.try_admit(rid, keys, tokens, remote=swap, headroom=headroom)
        if hit is None:
            return None
        return hit, self.pages_for(tokens)

    def resumed(self, rid: str, tokens: int, hit: int, swap: bool) -> None:
        """The request's KV is back (recomputed or swapped in): it decodes again."""
        if not swap:
            self.sched.advance_prefill(RequestId(rid), tokens - hit)
            self.sched.mark_prefill_complete(RequestId(rid))
        self.kv_arrived(rid, tokens)

    def record(self, now: float) -> None:
        """Note the occupancy from ``now`` on (call after a batch of changes at one instant)."""
        used = self.pool.used_count()
        held = used - (self.store.evictable_count() if self.store is not None else 0)
        if (used, held) != self._last:  # unchanged: the step function goes on as it was
            self._last = (used, held)
            self.occupancy.set(now, [float(used), float(held)])


@dataclass(frozen=True, slots=True, eq=False)
class EngineLayout:
    """One engine's cache transfer contract (rank 0's; every rank has the same shapes)."""

    tp: int
    contract: CacheContract


class KvPlanner:
    """The real layout planner, memoised for the simulator.

    Contracts are built once per (TP, page count) and routes once per (P layout, D layout)
    pair; per request it builds the two block manifests from the schedulers' page tables and
    counts the exact bytes and coalesced descriptors of every link with the planner's per-link
    profiles (what ``route_stats`` returns).
    """

    def __init__(self, model: ModelSpec, tuning: EngineTuning) -> None:
        self.model, self.tuning = model, tuning
        self._layouts: dict[tuple[int, int], EngineLayout] = {}
        self._routes: dict[tuple[int, int], RoutePlan] = {}
        self._profiles: dict[tuple[int, int], list[tuple[int, int, LinkProfile]]] = {}

    def layout(self, tp: int, num_pages: int) -> EngineLayout:
        """The layout of an engine of ``tp`` ranks with ``num_pages`` pages per rank."""
        key = (tp, num_pages)
        if key not in self._layouts:
            self._layouts[key] = EngineLayout(tp, build_contract(self._arena(tp, num_pages)))
        return self._layouts[key]

    def _arena(self, tp: int, num_pages: int) -> ArenaSpec:
        m, t = self.model, self.tuning
        mla = m.mla
        return ArenaSpec(
            layers=m.layers,
            attention=AttentionKind.GQA if mla is None else AttentionKind.MLA,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            latent_dim=512 if mla is None else mla.kv_lora_rank,
            rope_dim=64 if mla is None else mla.qk_rope_head_dim,
            dtype=_KV_DTYPES[m.kv_bytes],
            page_size=t.page_size,
            tp_size=tp,
            page_layout=t.page_layout,
            arrangement=t.arrangement,
            num_pages=num_pages,
        )

    def route(self, p: EngineLayout, d: EngineLayout) -> RoutePlan:
        """The memoised route between two engines' layouts."""
        key = (id(p), id(d))
        route = self._routes.get(key)
        if route is None:
            route = plan_routes(p.contract, p.tp, d.contract, d.tp)
            self._routes[key] = route
        return route

    def manifests(
        self,
        p: EngineLayout,
        d: EngineLayout,
        src_table: npt.NDArray[np.int32],
        dst_table: npt.NDArray[np.int32],
        prefix_len: int,
        prompt_len: int,
    ) -> tuple[BlockManifest, BlockManifest]:
        """Source and destination manifests of one request (D's lengths on both, wire.md §5).

        The slots come from the planner's ``slot_range`` for the group's policy; the
        manifests are not re-validated (``build_manifest`` would check what the schedulers
        already guarantee: distinct, allocated page ids — tests build both ways and compare).
        """
        spec = p.contract.group_specs[0]
        slots = slot_range(spec, prefix_len, prompt_len)
        gid = spec.group_id
        src = GroupBlocks(gid, src_table[slots.start : slots.stop].astype(np.int64))
        dst = GroupBlocks(gid, dst_table[slots.start : slots.stop].astype(np.int64))
        return (
            BlockManifest((src,), prefix_len, prompt_len),
            BlockManifest((dst,), prefix_len, prompt_len),
        )

    def links(
        self,
        p: EngineLayout,
        d: EngineLayout,
        src: BlockManifest,
        dst: BlockManifest,
        positions: dict[str, tuple[int, int]] | None,
    ) -> list[tuple[int, int, int, int]]:
        """(P rank, D rank, bytes, coalesced descriptors) of every link that moves bytes.

        The planner's own count: every link's profile (``link_profile``) over one
        ``PairCounter`` of the request's page pairs, shared by the links (what
        ``route_stats`` does, without re-validating the manifests).
        """
        gid = p.contract.group_ids()[0]
        s, t = src.block_ids(gid), dst.block_ids(gid)
        if positions is not None:
            lo, hi = positions[gid]
            s, t = s[lo:hi], t[lo:hi]
        pairs = [PairCounter(s, t)]
        out = []
        for pr, dr, profile in self.profiles(p, d):
            stats = profile.count(pairs)
            if stats.nbytes:
                out.append((pr, dr, stats.nbytes, stats.descriptors))
        return out

    def profiles(self, p: EngineLayout, d: EngineLayout) -> list[tuple[int, int, LinkProfile]]:
        """Every link of the route with its profile (memoised with the route)."""
        key = (id(p), id(d))
        got = self._profiles.get(key)
        if got is None:
            route = self.route(p, d)
            got = [(int(pr), int(dr), link_profile(route, pr, dr)) for pr, dr in route.links]
            self._profiles[key] = got
        return got
