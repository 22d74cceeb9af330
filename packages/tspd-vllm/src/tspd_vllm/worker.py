"""The connector's worker side: one vLLM worker (TP rank) moving its KV with tspd's peers.

Owned by one vLLM worker and called on its model-runner thread only. It holds the rank's
transfer peer (:class:`~tspd_core.pd.PrefillPeer` or :class:`~tspd_core.pd.DecodePeer`:
Mooncake over TCP, its transfer worker process, the arena shared with it), the rank's arena
over vLLM's own KV allocation, and, on P's rank 0 with ``serve_bootstrap``, the embedded tspd
bootstrap server. Every TP rank of an instance makes the same calls in the same step (vLLM
runs its workers in lockstep), so the peers' poll agrees over the TP group's gloo mesh.

P, per send: ``register`` the room, stage the prompt's block row, hand it over with the first
token; the transfer worker holds it until D's pre-allocation arrives, then writes. The send
is reported finished (vLLM frees the blocks) on Succeeded, or on Failed, which tspd reports
only once no write reads the pages any more. A room the front gives up (``abort_room``) is
failed with ``PrefillPeer.abort_room`` on every rank in the same step: a tracked send fails
(its D ranks that pre-allocated get Failed), an unknown room is remembered as failed.

D, per receive: ``register`` the room; zero the new pages and publish the manifest (at once on
a single rank, on Bootstrapped with several). RemotePrefill finishes the receive; Failed
finishes it as failed (vLLM fails the request or recomputes it, by its
``kv_load_failure_policy``). A request vLLM finishes while its receive is in flight (client
abort) is aborted in tspd and reported only on its final event: until then P may still write
into its blocks, so vLLM keeps them (it frees a finished request's blocks on that report).
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from tspd_bootstrap import BootstrapServer
from tspd_core.ids import RequestId, Room
from tspd_core.layout import build_manifest, encode_contract
from tspd_core.pd import (
    SOLO,
    Bootstrapped,
    DecodeOutbox,
    DecodePeer,
    DecodePeerConfig,
    Failed,
    FirstToken,
    Mesh,
    PdError,
    PrefillPeer,
    PrefillPeerConfig,
    RemoteDecodeRow,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
)
from tspd_vllm.arena import GROUP, KvArena
from tspd_vllm.jobs import JobBatch, RecvJob
from tspd_vllm.layerwise import EarlyRooms
from tspd_vllm.peering import abort, info
from tspd_vllm.settings import Settings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Results:
    """One step's news for vLLM (``KVConnectorTransferResults``' three sets)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Rank:
    """Where this worker sits: its TP rank, and the mesh its replica agrees over."""

    size: int = 1
    rank: int = 0
    mesh: Mesh = SOLO
    barrier: Callable[[], None] = field(default=lambda: None)


@contextmanager
def _may_start_children() -> Iterator[None]:
    """vLLM runs its workers as daemonic processes, which ``multiprocessing`` forbids to
    start children; the transfer worker is one (itself daemonic: it ends with the vLLM
    worker, and it watches its parent). The flag is lifted for the start only."""
    proc = multiprocessing.current_process()
    daemon = proc._config.get("daemon")  # type: ignore[attr-defined]
    proc._config["daemon"] = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        proc._config["daemon"] = daemon  # type: ignore[attr-defined]


class PrefillSide:
    """P's worker side (see the module docstring)."""

    def __init__(self, settings: Settings, arena: KvArena, rank: Rank) -> None:
        self.settings = settings
        self.arena = arena
        self.rank = rank
        self.server: BootstrapServer | None = None
        if rank.rank == 0 and settings.serve_bootstrap:
            self.server = BootstrapServer(settings.bootstrap_host, settings.bootstrap_port)
            self.server.start()
        rank.barrier()  # every rank registers with a server that listens
        try:
            config = PrefillPeerConfig(
                contract=encode_contract(arena.contract).decode(),
                arena=arena.tensor,
                tp_size=rank.size,
                tp_rank=rank.rank,
                host=settings.host,
                bootstrap_url=settings.bootstrap_url,
                layerwise_interval=settings.layerwise_interval,
            )
            with _may_start_children():
                self.peer, self.outbox = PrefillPeer.start(config)
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        #: Layerwise sends (``layerwise_interval`` > 0), else None: today's path only.
        self.early: EarlyRooms | None = None
        if settings.layerwise_interval:
            try:
                self.early = EarlyRooms(self.peer, self.outbox, arena.layers, rank.rank)
            except BaseException:
                self.close()
                raise
        self._done: set[str] = set()  # refused before anything reached the worker

    def take(self, batch: JobBatch) -> None:
        """Hand this step's sends to the transfer worker, then fail the rooms given up (a send
        of this very step included). Layerwise: register the early rooms first and end those
        vLLM ended; arm the forward's rows last (:mod:`tspd_vllm.layerwise`)."""
        if self.early is not None:
            self.early.register(batch.early)
            self.early.end(batch.ends)
        self._send(batch)
        for room in batch.room_aborts:
            try:
                self.peer.abort_room(Room(room), "the PD front gave the room up: no D pulls it")
            except PdError as exc:
                log.warning("room %d: abort not delivered: %s", room, exc)
        if self.early is not None:
            self.early.arm(batch.rows)

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer`` (layerwise only)."""
        if self.early is not None:
            self.early.layer_saved(layer_name)

    def forward_done(self) -> None:
        """``wait_for_save`` (layerwise only)."""
        if self.early is not None:
            self.early.forward_done()

    def _send(self, batch: JobBatch) -> None:
        rows, tokens = [], {}
        for job in batch.sends:
            if self.early is not None and self.early.send(job):
                continue  # an early room's hand-over
            rid = RequestId(job.rid)
            try:
                self.peer.register(rid, info(job.rendezvous))
            except PdError as exc:
                log.error("request %s: KV not sent, the peer refused it: %s", job.rid, exc)
                self._done.add(job.rid)
                continue
            table = np.asarray(job.block_ids, dtype=np.int64)
            rows.append(RemoteDecodeRow(rid, table, 0, job.prompt_len, True))
            tokens[rid] = FirstToken(job.first_token)
        if not rows:
            return
        try:
            self.outbox.stage_remote_decode(rows)
            self.outbox.hand_over_remote_decode(tokens)
        except PdError as exc:  # nothing handed over: the rooms fail, blocks go on Failed
            log.error("KV hand-over refused: %s", exc)
            for row in rows:
                abort(self.peer, row.rid, f"hand-over refused: {exc}")

    def results(self, finished: Iterable[str], idle: bool) -> Results:
        """Poll the peer (collective over the TP group): sends that ended."""
        del finished  # a P request is finished before its send starts
        out = Results(sending=self._done)
        self._done = set()
        events = self.peer.poll(self.rank.mesh)
        for event in events:
            if isinstance(event, Succeeded | Failed):
                if isinstance(event, Failed):
                    log.warning("request %s: KV send failed: %s", event.rid, event.reason)
                failed = isinstance(event, Failed)
                if self.early is None or not self.early.event(str(event.rid), failed):
                    out.sending.add(str(event.rid))
        if self.early is not None:
            out.sending |= self.early.done
            self.early.done = set()
        if idle and not events and not out.sending and self.peer.has_in_flight():
            self.peer.wait(self.settings.idle_wait_ms / 1000)
        return out

    def close(self) -> None:
        self.peer.shutdown()
        if self.server is not None:
            self.server.close()


class DecodeSide:
    """D's worker side (see the module docstring)."""

    def __init__(self, settings: Settings, arena: KvArena, rank: Rank) -> None:
        self.settings = settings
        self.arena = arena
        self.rank = rank
        config = DecodePeerConfig(
            contract=encode_contract(arena.contract).decode(),
            arena=arena.tensor,
            tp_size=rank.size,
            tp_rank=rank.rank,
            host=settings.host,
        )
        self.peer: DecodePeer
        self.outbox: DecodeOutbox
        with _may_start_children():
            self.peer, self.outbox = DecodePeer.start(config)
        self._jobs: dict[str, RecvJob] = {}  # registered, until the final event
        self._aborted: set[str] = set()
        self._refused: set[str] = set()  # refused at register: failed at once

    def take(self, batch: JobBatch) -> None:
        """Register this step's receives (a single rank publishes their manifests too)."""
        for job in batch.recvs:
            try:
                self.peer.register(RequestId(job.rid), info(job.rendezvous))
            except PdError as exc:
                log.error("request %s: KV not received, the peer refused it: %s", job.rid, exc)
                self._refused.add(job.rid)
                continue
            self._jobs[job.rid] = job
            if self.rank.size == 1:
                self._publish(job)
        self._hand_over()

    def _publish(self, job: RecvJob) -> None:
        table = {GROUP: np.asarray(job.block_ids, dtype=np.int64)}
        try:
            manifest = build_manifest(self.arena.contract, table, job.prefix_len, job.prompt_len)
            self.outbox.stage_remote_prefill([RemotePrefillRow(RequestId(job.rid), manifest)])
        except (PdError, ValueError) as exc:
            log.error("request %s: manifest refused: %s", job.rid, exc)
            abort(self.peer, RequestId(job.rid), f"manifest refused: {exc}")

    def _hand_over(self) -> None:
        if self.outbox.remote_prefill_pending():
            self.outbox.hand_over_remote_prefill()

    def results(self, finished: Iterable[str], idle: bool) -> Results:
        """Abort what vLLM finished meanwhile, poll the peer (collective over the TP group)."""
        for rid in finished:
            if rid in self._jobs and rid not in self._aborted:
                self._aborted.add(rid)
                abort(self.peer, RequestId(rid), "the request finished in vLLM (aborted)")
        out = Results(recving=set(self._refused), failed=set(self._refused))
        self._refused.clear()
        events = self.peer.poll(self.rank.mesh)
        for event in events:
            rid = str(event.rid)
            if isinstance(event, Bootstrapped):
                if self.rank.size > 1 and rid in self._jobs and rid not in self._aborted:
                    self._publish(self._jobs[rid])
                continue
            self._jobs.pop(rid, None)
            out.recving.add(rid)
            if isinstance(event, Failed) and rid not in self._aborted:
                log.warning("request %s: KV receive failed: %s", rid, event.reason)
                out.failed.add(rid)
            self._aborted.discard(rid)
            assert isinstance(event, RemotePrefill | Failed)
        self._hand_over()
        if idle and not events and self.peer.has_in_flight():
            self.peer.wait(self.settings.idle_wait_ms / 1000)
        return out

    def close(self) -> None:
        self.peer.shutdown()


Side = PrefillSide | DecodeSide
