"""P's layerwise sends through vLLM's per-layer hooks (``layerwise_interval`` > 0).

Owned by P's worker side (:class:`~tspd_vllm.worker.PrefillSide`), called on vLLM's
model-runner thread only. Without it, a P request's KV goes out after its prefill, the whole
prompt at once (``request_finished`` → a send). With it, a request asked to
``do_remote_decode`` registers its room as vLLM first schedules it (an *early room*), so D
can bootstrap the room while P still prefills; every later prefill chunk of the prompt is
armed before its forward and written while the forward runs, an interval of layers at a time
(tspd's layerwise streams, docs/layerwise.md)::

    step's metadata: EarlyRoom (first scheduled) · ForwardRow per early room in the forward
    first wait_for_layer_load ─ register the new rooms; arm the rows whose room the replica
                                agreed Bootstrapped (PrefillPeer.armable) — one chunk
                                [sent, end): the earlier chunks' pages ride along
    save_kv_layer(layer i)    ─ step counter + 1 (the worker writes an interval once passed)
    wait_for_save             ─ the counter catches up with what the forward reserved
    request_finished ─ send   ─ final chunk armed: only the first token goes; else the rest
                                of the prompt [sent, prompt) goes as a plain final chunk
                                (nothing armed: today's whole-prompt hand-over, byte for byte)

vLLM's CPU runner calls ``start_load_kv`` after the forward when the step's loads are
asynchronous (a P's always are), so arming happens in the step's first
``wait_for_layer_load``. A room registered in a step cannot be armed in that step's forward
(D's Bootstrapped comes with a poll after it): a prompt of one forward always goes whole,
and so does one whose room D bootstrapped only after its last forward (the sequential flow,
where D learns of P from P's answer).

Ends: a request vLLM finishes before its prompt was handed over (aborted mid-prefill) fails
its room and keeps its blocks until the room's final event (a write may read them); one vLLM
preempts mid-prefill fails its room too, and — its blocks already freed by vLLM, which will
recompute it — reports nothing (its ``kv_transfer_params`` answer nothing to D).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tspd_core.ids import RequestId, Room
from tspd_core.pd import (
    FirstToken,
    HandOver,
    PdError,
    PeerError,
    PrefillOutbox,
    PrefillPeer,
    RemoteDecodeRow,
)
from tspd_core.pd.layerwise.step_counter import behind
from tspd_vllm.errors import SettingsError
from tspd_vllm.jobs import EarlyRoom, EndJob, ForwardRow, SendJob
from tspd_vllm.peering import abort, info

log = logging.getLogger(__name__)

#: One line per early room as its final event is reported, with this rank's transfer
#: counters: a child of vLLM's own logger, so it prints where vLLM's lines go (vLLM sets up
#: no handler for other loggers). The tests read it (docs/vllm.md).
stats_log = logging.getLogger("vllm.tspd_vllm.layerwise")


@dataclass(slots=True)
class Early:
    """One early room, from registration to the report of its final event."""

    room: Room
    sent: int = 0  #: prompt tokens the armed chunks carry (``[0, sent)``)
    chunks: int = 0  #: chunks armed
    finished: bool = False  #: vLLM finished the request: report the final event
    preempted: bool = False  #: vLLM preempted it: forget it on the final event
    ended: bool = False  #: its final event came (or the peer refused it)
    failed: bool = False


class EarlyRooms:
    """One P rank's early rooms (see the module docstring)."""

    def __init__(
        self, peer: PrefillPeer, outbox: PrefillOutbox, layers: tuple[str, ...], rank: int
    ) -> None:
        if outbox.producer_steps != len(layers):
            raise SettingsError(
                f"layerwise: {outbox.producer_steps} producer steps for {len(layers)} KV layers"
            )
        self.peer = peer
        self.outbox = outbox
        self.rank = rank
        self._index = {name: i for i, name in enumerate(layers)}
        self.rooms: dict[str, Early] = {}
        #: Requests whose final event is to be reported (``finished_sending``).
        self.done: set[str] = set()
        self._armed = False  #: this step's forward reserved counter steps
        self._saved = 0  #: layers of this forward saved in order (counter steps issued)

    # -- the step's jobs (before its forward) ------------------------------------------------

    def register(self, jobs: Iterable[EarlyRoom]) -> None:
        for job in jobs:
            early = Early(Room(job.rendezvous.room))
            try:
                self.peer.register(RequestId(job.rid), info(job.rendezvous))
            except PdError as exc:
                log.error("request %s: KV not sent, the peer refused it: %s", job.rid, exc)
                early.ended = early.failed = True
            self.rooms[job.rid] = early

    def end(self, jobs: Iterable[EndJob]) -> None:
        """Requests vLLM ended mid-prefill: their rooms fail."""
        for job in jobs:
            early = self.rooms.get(job.rid)
            if early is None:
                continue
            if not early.ended:
                why = "aborted" if job.held else "preempted"
                abort(self.peer, RequestId(job.rid), f"{why} in vLLM before its prefill ended")
            if job.held:
                early.finished = True
            else:
                early.preempted = True
            if early.ended:
                self._final(job.rid)

    def send(self, job: SendJob) -> bool:
        """A finished prefill's hand-over; False if ``job`` is not an early room's."""
        early = self.rooms.get(job.rid)
        if early is None:
            return False
        early.finished = True
        if early.ended:
            self._final(job.rid)
            return True
        rid = RequestId(job.rid)
        try:
            if self.peer.handed(rid) < HandOver.FINAL_CHUNK:  # the rest goes as today's
                table = np.asarray(job.block_ids, dtype=np.int64)
                row = RemoteDecodeRow(rid, table, early.sent, job.prompt_len, True)
                self.outbox.stage_remote_decode([row])
            self.outbox.hand_over_remote_decode({rid: FirstToken(job.first_token)})
        except PdError as exc:  # nothing handed over: the room fails, blocks go on Failed
            log.error("request %s: KV hand-over refused: %s", job.rid, exc)
            abort(self.peer, rid, f"hand-over refused: {exc}")
        return True

    def arm(self, rows: Iterable[ForwardRow]) -> None:
        """Arm the forward's rows whose room the replica agreed Bootstrapped (every rank
        decides the same between the same two polls)."""
        ready = [r for r in rows if self._armable(r.rid)]
        if not ready:
            return
        chunks = [
            RemoteDecodeRow(
                RequestId(r.rid),
                np.asarray(r.block_ids, dtype=np.int64),
                self.rooms[r.rid].sent,
                r.end,
                r.final,
            )
            for r in ready
        ]
        try:
            self.outbox.arm_layerwise(chunks)
        except PeerError as exc:  # the steps were reserved; every room fails at the next poll
            log.error("layerwise arming lost the transfer worker: %s", exc)
        except PdError as exc:  # refused before anything was armed or reserved
            log.error("cannot arm a prefill forward's KV: %s", exc)
            for r in ready:
                abort(self.peer, RequestId(r.rid), f"layerwise arming refused: {exc}")
            return
        self._armed, self._saved = True, 0
        for r in ready:
            early = self.rooms[r.rid]
            early.sent, early.chunks = r.end, early.chunks + 1

    def _armable(self, rid: str) -> bool:
        early = self.rooms.get(rid)
        if early is None or early.ended or early.finished or early.preempted:
            return False
        return self.peer.armable(RequestId(rid)) and not self.peer.aborted(RequestId(rid))

    # -- the forward ---------------------------------------------------------------------------

    def layer_saved(self, layer_name: str) -> None:
        """``save_kv_layer``: the layer's KV of this forward is written. Steps are issued in
        layer order only; a layer out of order leaves the rest to :meth:`forward_done`."""
        if self._armed and self._index.get(layer_name) == self._saved:
            self.outbox.step_counter.advance()
            self._saved += 1

    def forward_done(self) -> None:
        """``wait_for_save``: the forward is over; issue every step it reserved and did not
        issue (a layer that never called ``save_kv_layer``), so the next forward lines up."""
        if not self._armed:
            return
        self._armed = False
        counter = self.outbox.step_counter
        missing = behind(counter.issued, counter.reserved)
        if missing > 0:
            counter.advance(missing)

    # -- events --------------------------------------------------------------------------------

    def event(self, rid: str, failed: bool) -> bool:
        """A Succeeded or Failed event; False if ``rid`` is not an early room's."""
        early = self.rooms.get(rid)
        if early is None:
            return False
        early.ended, early.failed = True, failed
        if early.finished or early.preempted:
            self._final(rid)
        return True

    def _final(self, rid: str) -> None:
        early = self.rooms.pop(rid)
        if early.finished:
            self.done.add(rid)
        try:
            totals = self.peer.counters()
        except PdError as exc:
            log.warning("rank %d: no transfer counters: %s", self.rank, exc)
            totals = {}
        stats_log.info(
            "TspdConnector P rank %d: room %d %s, %d chunk(s) armed; rank totals: jobs=%d bytes=%d",
            self.rank,
            early.room,
            "failed" if early.failed else "sent",
            early.chunks,
            int(totals.get("jobs", -1)),
            int(totals.get("bytes", -1)),
        )
