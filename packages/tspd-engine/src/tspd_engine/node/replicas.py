"""A serving node: the engine replicas behind one HTTP endpoint, and its role in PD.

A node runs ``dp`` replicas of one engine config (each a TP group of rank processes). Its
role decides what a request with a room (``pd``) becomes: PREFILL_ONLY on a prefill node,
REMOTE_DECODE on a decode node; a request without a room is generated here (colocated).

Dispatch: a PD prefill goes to replica ``room % dp`` (D picks the P replica the same way:
wire.md §6.4), everything else to the replica with the fewest requests in flight.

Admission: a node holds at most ``NodeInfo.max_queued_requests`` requests (running and queued
together, over its replicas); one more is refused with :class:`NodeBusyError` before it
reaches an engine, so a burst of clients costs queueing here, not a node that stops answering.

Rooms it will not serve (a prefill node): D takes its half of a PD request at the same time as
P and registers the room with P's transfer workers (its pre-allocation), then keeps the pages
until P's workers end the room. A room P refuses at its door (:meth:`Node.refused`) or that a
router aborts before P took its request (``/abort`` with the room) is therefore failed on the
ranks of replica ``room % dp`` (:meth:`Node.fail_room`, a
:class:`~tspd_engine.frames.RoomAbort` through rank 0's intake): their workers push Failed to D
at once, instead of at the bootstrap timeout. A room a request of the replica holds is never
failed this way (the rank leaves it alone), and the node passes on at most
:data:`ROOM_ABORTS_PER_S` a second (each leaves a tombstone in the workers for the bootstrap
timeout), remembering the last :data:`FAILED_ROOMS` so a router's abort after the node's own
refusal is not sent twice.

Liveness and readiness (``/health``, ``/ready``): :meth:`Node.health` reads every replica's
signs of life (:mod:`tspd_engine.rank.pulse`: rank processes running, each rank's pulse
thread beating, no engine iteration stuck for minutes) without asking the engine loop, so a
replica in a long prefill round is alive and a stopped or dead one is not; :meth:`Node.busy`
says whether it can take more.

Threading: every method may be called from any thread (the endpoint runs the blocking ones,
``stats``, ``probe``, ``peer_metrics``, in worker threads); the in-flight table and the failed
rooms are guarded by one lock.

Metrics: ``stats`` asks each replica's rank 0 for its engine counters (a query answered
between two rounds); ``peer_metrics`` scrapes every rank's PD transfer peer through its
metrics responder (``tspd_engine.pdlink.peer_metrics``), which never involves the engine loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from tspd_engine.errors import EngineDeadError, NodeBusyError
from tspd_engine.frames import PdTarget, RequestMode, SamplingParams
from tspd_engine.node.allow import BootstrapAllowlist
from tspd_engine.pdlink.peer_metrics import SCRAPE_TIMEOUT_S, PeerScraper, merge
from tspd_engine.rank.client import EngineClient, RequestStream
from tspd_serving.errors import RequestError

log = logging.getLogger(__name__)


class NodeRole(StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What a node tells routers and operators about itself (``GET /info``)."""

    role: NodeRole = NodeRole.COLOCATED
    model: str = "tspd-tiny"
    tp: int = 1
    dp: int = 1
    #: A prefill node's bootstrap server, ``host:port`` (the router hands it to D nodes).
    bootstrap: str | None = None
    #: Whether that server lives in this node's process (it dies with the node: wire.md §3).
    bootstrap_hosted: bool = False
    page_size: int = 0
    num_pages: int = 0
    max_model_len: int = 0
    vocab_size: int = 0
    #: Requests the node holds at most, running and queued (0: no bound).
    max_queued_requests: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"role": self.role.value}


#: What a node holds by default per request each replica runs at once (``max_running``): one
#: batch running and one waiting for its slots. More only lengthens the queue a request waits
#: in; fewer leaves slots idle while the next requests travel.
HELD_PER_RUNNING = 2
#: Seconds between two probes of the replicas' counters (the endpoint's background loop).
PROBE_INTERVAL_S = 1.0
#: Seconds a refused client is told to wait (``Retry-After``): a slot frees as soon as any
#: request ends, which on a full node happens many times a second.
RETRY_AFTER_S = 1
#: PD prefills remembered after their answer (see :meth:`Node.abort`); older ones are forgotten.
ANSWERED_PREFILLS = 4096
#: Rooms a prefill node remembers having failed (:meth:`Node.fail_room`): a second failure of
#: one is not sent again (the router's abort after the node's own refusal).
FAILED_ROOMS = 4096
#: Room failures a node passes to its engines per second at most, in bursts of as many. Each
#: leaves a tombstone in the P workers until the bootstrap timeout (so that a late
#: pre-allocation of the room is answered Failed): without a bound, a flood of ``/abort``
#: calls would grow them without one too. Past it, a D's pages wait for the timeout as before.
ROOM_ABORTS_PER_S = 1000
#: Seconds between two warnings that room failures were dropped over the bound.
DROP_LOG_EVERY_S = 10.0

_MODES = {
    NodeRole.PREFILL: RequestMode.PREFILL_ONLY,
    NodeRole.DECODE: RequestMode.REMOTE_DECODE,
}


class Node:
    """The replicas' clients, the node's role, and which replica serves which request."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        info: NodeInfo,
        peer_metrics: Sequence[Sequence[str]] = (),
        bootstrap_allow: BootstrapAllowlist | None = None,
    ) -> None:
        """``peer_metrics``: per replica, each rank's peer metrics address (none: no PD);
        ``bootstrap_allow``: the bootstrap servers a request may name (None: any, for an
        embedder that checks itself; a served node always has one: :mod:`.allow`)."""
        if len(clients) != info.dp:
            raise ValueError(f"{len(clients)} replica clients for dp={info.dp}")
        self.clients = list(clients)
        self.info = info
        self.bootstrap_allow = bootstrap_allow
        self._peer_addresses = [
            ({"replica": str(i), "rank": str(r)}, address)
            for i, ranks in enumerate(peer_metrics)
            for r, address in enumerate(ranks)
        ]
        self._scraper: PeerScraper | None = None
        self._lock = threading.Lock()
        self._worker_problem = ""  # from the last probe (:meth:`probe`)
        self._owner: dict[str, int] = {}  # rid -> replica, while in flight
        self._prefills: set[str] = set()  # the PD prefills among them
        # rid -> replica: PD prefills answered, whose room may still be waiting for D
        self._answered: OrderedDict[str, int] = OrderedDict()
        self._load = [0] * len(clients)
        self._ids = 0
        self._failed_rooms: OrderedDict[int, None] = OrderedDict()  # the last FAILED_ROOMS
        self._room_budget = TokenBucket(ROOM_ABORTS_PER_S)
        self._rooms_dropped = 0
        self._drop_logged = float("-inf")

    def submit(
        self, prompt: list[int], params: SamplingParams, rid: str | None, pd: PdTarget | None
    ) -> RequestStream:
        """Send a request to its replica; :class:`RequestError` for one this node cannot
        serve (a room on a colocated node, an id already in flight), :class:`NodeBusyError`
        when the node holds all it may, :class:`EngineDeadError` when the replica does not
        take the frame."""
        mode = RequestMode.GENERATE
        if pd is not None:
            if self.info.role is NodeRole.COLOCATED:
                raise RequestError("this node serves colocated requests only: it has no PD peer")
            mode = _MODES[self.info.role]
            allow = self.bootstrap_allow
            problem = allow.refusal(pd.bootstrap_host, pd.bootstrap_port) if allow else ""
            if problem:
                raise RequestError(problem)
        with self._lock:
            if rid is None:
                self._ids += 1
                rid = f"node-{self._ids}"
            if rid in self._owner:
                raise RequestError(f"request id {rid!r} is already in use")
            if busy := self._busy():
                raise NodeBusyError(busy)
            if pd is not None and mode == RequestMode.PREFILL_ONLY:
                replica = pd.room % len(self.clients)
            else:
                replica = min(range(len(self.clients)), key=lambda i: (self._load[i], i))
            self._owner[rid] = replica
            self._load[replica] += 1
            self._answered.pop(rid, None)
            if mode == RequestMode.PREFILL_ONLY:
                self._prefills.add(rid)
        try:
            return self.clients[replica].submit(prompt, params, rid, mode, pd)
        except BaseException:
            self.release(rid)
            raise

    def release(self, rid: str) -> None:
        """Forget a finished request (its replica's load drops)."""
        with self._lock:
            replica = self._owner.pop(rid, None)
            if replica is None:
                return
            self._load[replica] -= 1
            if rid in self._prefills:
                self._prefills.discard(rid)
                self._answered[rid] = replica
                if len(self._answered) > ANSWERED_PREFILLS:
                    self._answered.popitem(last=False)

    def abort(self, rid: str) -> bool:
        """Abort a request in flight, or the room of a PD prefill this node answered (it
        prefills before D's pages are ready, so its room, pages and KV write can outlive the
        answer: an abort after it, say because D failed, ends them now rather than at the
        bootstrap timeout); False when this node does not know ``rid``."""
        with self._lock:
            replica = self._owner.get(rid)
            if replica is None:
                replica = self._answered.pop(rid, None)
        if replica is None:
            return False
        self.clients[replica].abort(rid)
        return True

    def refused(self, pd: PdTarget | None, reason: str) -> bool:
        """A request carrying ``pd`` was refused before it reached an engine (busy, a bad
        body, ...): fail its room (:meth:`fail_room`) on a prefill node, where D may have
        pre-allocated it with this node's ranks. Not when ``pd`` names a bootstrap server
        this node may not contact: D then registered the room with another server's ranks.
        Whether the room failure was passed on."""
        allow = self.bootstrap_allow
        if pd is None or (allow and allow.refusal(pd.bootstrap_host, pd.bootstrap_port)):
            return False
        return self.fail_room(pd.room, reason)

    def fail_room(self, room: int, reason: str) -> bool:
        """Fail PD room ``room`` on the ranks of replica ``room % dp`` of a prefill node (see
        the module docstring): the D ranks that pre-allocated it, or do so later, get Failed
        and free their pages. A room a request there holds is left alone by the ranks, an
        unknown one costs a tombstone. Whether it was passed on (or had been already); False
        on any other node, over :data:`ROOM_ABORTS_PER_S`, or when the replica's intake queue
        is full (never waits: the endpoint calls it on its event loop). ``reason`` (1..200
        characters) goes to the workers' log."""
        if self.info.role is not NodeRole.PREFILL:
            return False
        with self._lock:
            if room in self._failed_rooms:
                self._failed_rooms.move_to_end(room)
                return True
            if not self._room_budget.take(time.monotonic()):
                self._dropped_room(f"over {self._room_budget.rate:g} a second")
                return False
            self._failed_rooms[room] = None
            if len(self._failed_rooms) > FAILED_ROOMS:
                self._failed_rooms.popitem(last=False)
        if self.clients[room % len(self.clients)].abort_room(room, reason):
            return True
        with self._lock:  # the replica's intake is full (a long round): not sent after all
            self._failed_rooms.pop(room, None)
            self._dropped_room("its replica's intake queue was full")
        return False

    def _dropped_room(self, why: str) -> None:
        """Count a room failure not passed on; warn at most every DROP_LOG_EVERY_S (the lock
        held)."""
        self._rooms_dropped += 1
        now = time.monotonic()
        if now - self._drop_logged >= DROP_LOG_EVERY_S:
            self._drop_logged = now
            log.warning(
                "a room failure was not passed on, %s (%d so far): the D pages of such rooms "
                "wait for the bootstrap timeout",
                why,
                self._rooms_dropped,
            )

    def in_flight(self) -> int:
        with self._lock:
            return len(self._owner)

    def busy(self) -> str:
        """``""`` while the node may take another request, else why not (at capacity)."""
        with self._lock:
            return self._busy()

    def _busy(self) -> str:
        cap = self.info.max_queued_requests
        if cap and len(self._owner) >= cap:
            return f"node at capacity: {len(self._owner)} requests held of {cap}"
        return ""

    def check_alive(self) -> None:
        """Raise :class:`EngineDeadError` if a rank process of any replica has exited (a
        stopped one is not dead: :meth:`health` reports it)."""
        for i, client in enumerate(self.clients):
            vitals = client.vitals()
            if vitals is not None and vitals.dead:
                raise EngineDeadError(f"replica {i}: the engine's rank processes have exited "
                                      f"({vitals.dead})")  # fmt: skip

    def stats(self, timeout: float = 5.0) -> list[dict[str, float]]:
        """Each replica's rank-0 counters (blocking; EngineDeadError / TimeoutError)."""
        return [client.stats(timeout) for client in self.clients]

    def peer_metrics(self, timeout: float = SCRAPE_TIMEOUT_S) -> str:
        """Every rank's PD peer metrics as one Prometheus exposition (``tspd_pd_*``, labelled
        ``role``, ``replica``, ``rank``) plus ``tspd_node_peer_metrics_up`` per rank (0: the
        rank did not answer in ``timeout``); ``""`` for a node without PD peers."""
        if not self._peer_addresses:
            return ""
        with self._lock:
            if self._scraper is None:
                self._scraper = PeerScraper()
            scraper = self._scraper
        got = scraper.scrape([address for _, address in self._peer_addresses], timeout)
        role = self.info.role.value
        answered = [(at, s) for (at, _), s in zip(self._peer_addresses, got, strict=True) if s]
        up = [
            "# HELP tspd_node_peer_metrics_up whether the rank's PD peer answered the scrape",
            "# TYPE tspd_node_peer_metrics_up gauge",
        ]
        for (at, _), snapshot in zip(self._peer_addresses, got, strict=True):
            labels = f'role="{role}",replica="{at["replica"]}",rank="{at["rank"]}"'
            up.append(f"tspd_node_peer_metrics_up{{{labels}}} {int(snapshot is not None)}")
        return merge(answered).render({"role": role}) + "\n".join(up) + "\n"

    def close(self) -> None:
        """Release the scraper's sockets (the node stops)."""
        with self._lock:
            scraper, self._scraper = self._scraper, None
        if scraper is not None:
            scraper.close()

    def health(self) -> str:
        """``""`` while every replica is alive and progressing and its PD worker works, else
        what is wrong (liveness). Reads each replica's vitals (:mod:`tspd_engine.rank.pulse`)
        and the last probe's worker state; never asks an engine, so it answers at once
        whatever the engines are computing."""
        for i, client in enumerate(self.clients):
            try:
                vitals = client.check_alive()
            except EngineDeadError as exc:
                return f"replica {i}: {exc}"
            problem = vitals.problem() if vitals is not None else ""
            if problem:
                return f"replica {i}: {problem}"
        with self._lock:
            return self._worker_problem

    def probe(self, timeout: float = 5.0) -> None:
        """Ask every replica for its counters once (blocking) and remember whether its PD
        transfer worker works, for :meth:`health`: the endpoint runs this in a loop. An engine
        that does not answer in time (a long round) changes nothing."""
        try:
            replicas = self.stats(timeout)
        except (EngineDeadError, TimeoutError):
            return
        down = [i for i, values in enumerate(replicas) if values.get("pd_peer_ok", 1.0) == 0.0]
        with self._lock:
            self._worker_problem = (
                f"replica {down[0]}: its PD transfer worker is down" if down else ""
            )


class TokenBucket:
    """At most ``rate`` takes a second, in bursts of ``rate`` (starts full). Not thread-safe:
    its owner's lock guards it."""

    __slots__ = ("at", "rate", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()

    def take(self, now: float) -> bool:
        """One token at ``now`` (a monotonic time), if there is one left."""
        self.tokens = min(self.rate, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
