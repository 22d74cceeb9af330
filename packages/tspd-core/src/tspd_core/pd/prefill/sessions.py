"""The D sessions a P rank serves: registrations, their routes, staging grants, rejections.

A D rank registers once per (bootstrap address, DP group, contact set) with each P rank it
contacts (wire.md §2.1); the registration carries its contract and TP place, from which this rank
plans the route between the two replicas. A session is accepted when this P rank serves that D
rank (or rendezvouses with its rank 0 as a dummy), and rejected otherwise — then every room
using it fails, and its later pre-allocations are answered with Failed.

    registration ─► known, identical: accepted again (clears a failed-session mark)
                 ├► known, different:  dropped and rejected (neither version can be trusted)
                 ├► bad contract / not served by this rank: rejected
                 └► new: sessions replaced from the same D socket are retired (a D rank that
                         woke under a fresh Mooncake session), then the session is stored,
                         and a one-page room is planned for it and thrown away (the planner's
                         first call warms its caches: 1.7 ms cold against 0.2 ms warm here,
                         3-9 ms on the demo's loaded first room, which it no longer pays)

Control thread only.
"""

from __future__ import annotations

import logging

from tspd_core.layout import CacheContract, parse_contract
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.layout.strided import plan_one_page
from tspd_core.pd.errors import FrameError
from tspd_core.pd.metrics.worker import WorkerMetrics
from tspd_core.pd.prefill.rooms import PrefillRooms
from tspd_core.pd.prefill.state import DSession
from tspd_core.pd.status import FailureCause
from tspd_core.pd.transfer.staging import StagingLink
from tspd_core.pd.wire.frames import Registration, ScatterAck, StageOffer

log = logging.getLogger(__name__)


class DSessions:
    """Accepted and rejected D sessions, and their staging grants (see the module docstring).

    ``rooms`` is where a rejected or retired session's rooms fail.
    """

    def __init__(
        self,
        contract: CacheContract,
        p_tp: int,
        p_rank: int,
        rooms: PrefillRooms,
        metrics: WorkerMetrics,
        stage_timeout_s: float,
    ) -> None:
        self.contract = contract
        self.p_tp = p_tp
        self.p_rank = p_rank
        self.rooms = rooms
        self.metrics = metrics
        self.stage_timeout_s = stage_timeout_s
        self.sessions: dict[str, DSession] = {}
        self.rejected: dict[str, tuple[str, int]] = {}  # session -> endpoint, for Failed replies
        self.links: dict[str, StagingLink] = {}  # D session -> its staging grant
        self._routes: dict[tuple[bytes, int], RoutePlan] = {}

    def get(self, session_id: str) -> DSession | None:
        return self.sessions.get(session_id)

    def rejected_endpoint(self, session_id: str) -> tuple[str, int] | None:
        """Where a rejected session's D rank listens (its pre-allocations get Failed)."""
        return self.rejected.get(session_id)

    def register(self, reg: Registration) -> None:
        """A D rank's registration (see the module docstring)."""
        known = self.sessions.get(reg.session_id)
        if known is not None:
            if known.reg != reg:
                # Neither version can be trusted any more (the arena or layout changed under
                # one session id): the session goes, its rooms fail, its later pre-allocations
                # get Failed, until it registers afresh.
                del self.sessions[reg.session_id]
                self.links.pop(reg.session_id, None)
                self._reject(reg, "a different registration for an already registered session")
            else:
                self.rooms.clear_failed_session(reg.session_id)  # acceptance clears the mark
            return
        try:
            contract = parse_contract(reg.contract)
            route = self._route(reg.contract, contract, reg.tp_size)
        except ValueError as exc:
            self._reject(reg, str(exc))
            return
        if self.p_rank in route.targets(reg.tp_rank):
            dummy = False
        elif reg.tp_rank == 0 and route.is_dummy(self.p_rank):
            dummy = True
        else:
            self._reject(reg, f"P rank {self.p_rank} sends nothing to D rank {reg.tp_rank}")
            return
        self._retire_replaced(reg)
        self.sessions[reg.session_id] = DSession(reg, contract, route, dummy)
        self.rejected.pop(reg.session_id, None)
        self.rooms.clear_failed_session(reg.session_id)
        if not dummy:
            self._warm_planner(route, contract, reg.tp_rank)
        log.debug("registered D rank %d/%d (%s)", reg.tp_rank, reg.tp_size, reg.session_id)

    def offer(self, offer: StageOffer) -> StagingLink | None:
        """A D session granted this rank staging slots (kept until the session goes): the new
        grant, or None for a session that has one already."""
        if offer.session_id not in self.sessions:
            raise FrameError(f"stage offer from unregistered session {offer.session_id}")
        if offer.session_id in self.links:
            return None
        link = self.links[offer.session_id] = StagingLink(offer, self.stage_timeout_s)
        log.debug("staging grant from %s: %s", offer.session_id, offer)
        return link

    def scattered(self, ack: ScatterAck) -> None:
        """A D session scattered one of our staged pieces: its slot is free again."""
        link = self.links.get(ack.session_id)
        if link is None or link.offer.grant != ack.grant:
            raise FrameError(f"scatter ack from {ack.session_id} for no grant of ours")
        link.complete(ack)

    def _retire_replaced(self, reg: Registration) -> None:
        """A D rank that woke up registers again under a fresh session from the same socket:
        its old session is gone (and any room still using it cannot complete)."""
        for sid, old in list(self.sessions.items()):
            if (old.reg.endpoint, old.reg.port) != (reg.endpoint, reg.port):
                continue
            del self.sessions[sid]
            self.links.pop(sid, None)
            self.rooms.clear_failed_session(sid)
            log.info("D session %s replaced by %s", sid, reg.session_id)
            why = f"D session {sid} was replaced by {reg.session_id}"
            self.rooms.fail_session(sid, why, FailureCause.REMOTE)

    def _warm_planner(self, route: RoutePlan, d_contract: CacheContract, d_rank: int) -> None:
        """Plan one page of every group to this D rank and drop the plan (best effort)."""
        try:
            plan_one_page(route, self.contract, self.p_rank, d_contract, d_rank)
        except Exception as exc:  # a layout the one-page room does not fit: no warm-up
            log.debug("planner warm-up for D rank %d skipped: %s", d_rank, exc)

    def _route(self, raw: bytes, contract: CacheContract, d_tp: int) -> RoutePlan:
        key = (raw, d_tp)
        if key not in self._routes:
            self._routes[key] = plan_routes(self.contract, self.p_tp, contract, d_tp)
        return self._routes[key]

    def _reject(self, reg: Registration, why: str) -> None:
        log.warning("rejected registration of %s (D rank %d): %s", reg.session_id, reg.tp_rank, why)
        self.metrics.message_rejected("peer")
        self.rejected[reg.session_id] = (reg.endpoint, reg.port)
        why = f"session {reg.session_id} was rejected: {why}"
        self.rooms.fail_session(reg.session_id, why, FailureCause.REJECTED)
