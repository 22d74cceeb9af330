"""`PrefillPeer` and `PrefillOutbox`: the P rank's engine-side half.

The scheduler thread owns the peer (``register``, ``poll``); the forward thread owns the outbox.
Per forward batch with requests whose KV goes to D::

    plan ─► outbox.stage_remote_decode(rows)     (before or while the forward runs)
    forward (+ the drafter's pending round) finishes, first tokens sampled
         ─► outbox.hand_over_remote_decode(first_tokens)   (never waits for a transfer)
                     │ SubmitChunk per row, FIFO to the worker
                     ▼
    worker: plan copies, write through Mooncake, Success to D ─► poll() yields Succeeded

``hand_over_remote_decode`` is the signal that the pages are final: the worker reads them only
after it, so the KV sent includes everything the forward and draft round wrote.

With layerwise streaming (``layerwise_interval`` > 0, wire.md §7) the rows are armed *ahead* of
the forward instead, and the forward's step counter says when each interval of layers is
written::

    outbox.arm_layerwise(rows)      (before the forward: one reservation of its producer steps)
    forward: after each producer step's KV writes -> outbox.step_counter.advance()
                     │ worker: wait for the counter, write that interval, next interval ...
    outbox.hand_over_remote_decode(first_tokens)   (only the first tokens of armed final rows)

The outbox moves each request's :class:`HandOver` forward in the peer's table as it hands it
over (``PrefillPeer.handed``: a chunk went out, the final chunk was armed, everything): that
is where an engine learns whether the worker may read the pages and whether a first token is
due, so it keeps no phase of its own.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.layout import CacheContract
from tspd_core.pd.config import PrefillPeerConfig, WorkerRole
from tspd_core.pd.errors import FrameError, UsageError
from tspd_core.pd.layerwise.schedule import LayerwiseSpec, ProducerSchedule
from tspd_core.pd.layerwise.step_counter import StepCounter
from tspd_core.pd.peer.start import parse_config_contract, start_worker
from tspd_core.pd.peer.transfer_peer import TransferPeer
from tspd_core.pd.peer.worker_handle import WorkerHandle
from tspd_core.pd.prefill.worker import main as worker_main
from tspd_core.pd.status import HandOver, TransferPoll
from tspd_core.pd.status import TransferPoll as S
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import StatusMessage, encode_status


@dataclass(frozen=True, slots=True, eq=False)
class RemoteDecodeRow:
    """One request of a forward batch whose KV goes to D.

    ``block_ids`` is P's block-table row per group (``group_specs`` order; a single array is
    accepted for one-group contracts), covering at least the slots up to ``end``.
    ``[start, end)`` are the prompt tokens this forward computes; ``final`` marks the forward
    that completes the prompt (its hand-over must carry the first token).
    """

    rid: RequestId
    block_ids: Sequence[npt.ArrayLike] | npt.NDArray[np.int64]
    start: int
    end: int
    final: bool = True


@dataclass(frozen=True, slots=True)
class FirstToken:
    """What P sends D with Success: the sampled token and its companions."""

    token: int
    spec_ids: tuple[int, ...] = ()
    logprob: float | None = None
    cached_tokens: int = 0  #: P's prefix-cache hit, reported to D (status frame 5)


class PrefillPeer(TransferPeer):
    """A P rank's peer. Start with :meth:`start`; see :class:`TransferPeer` for the API."""

    role = "prefill"

    def __init__(
        self,
        config: PrefillPeerConfig,
        worker: WorkerHandle,
        contract: CacheContract,
        layerwise: tuple[StepCounter, ProducerSchedule] | None = None,
    ) -> None:
        super().__init__(config, worker)
        self.contract = contract
        #: Layerwise streaming: the forward's step counter and producer schedule (else None).
        self.layerwise = layerwise
        self._owns_counter = False

    @classmethod
    def start(cls, config: PrefillPeerConfig) -> tuple[PrefillPeer, PrefillOutbox]:
        """Start the worker (Mooncake, arena registration, PULL socket, bootstrap PUT).

        Raises :class:`ConfigError` for a bad config and :class:`PeerError` when the worker
        cannot start (e.g. the bootstrap server is unreachable or refuses the contract).
        """
        contract = parse_config_contract(config)
        layerwise, spec = None, None
        if config.layerwise_interval > 0:
            schedule = ProducerSchedule.for_contract(contract, config.draft_layers)
            counter = config.step_counter or StepCounter(config.arena.device)
            spec = LayerwiseSpec(config.layerwise_interval, config.draft_layers, counter.host)
            layerwise = (counter, schedule)
        worker = start_worker(
            WorkerRole.PREFILL, worker_main, config, contract, config.bootstrap_url, spec
        )
        peer = cls(config, worker, contract, layerwise)
        peer._owns_counter = config.step_counter is None
        return peer, PrefillOutbox(peer, worker)

    def shutdown(self) -> None:
        super().shutdown()
        if self.layerwise is not None and self._owns_counter:
            self.layerwise[0].close()  # the page lock of a counter this peer made (CUDA)

    def abort_room(self, room: Room, reason: str = "aborted by the engine") -> None:
        """Fail a P→D room whether or not a request of this peer tracks it (the
        :class:`~tspd_core.epd.RoomAborter` contract).

        Tracked: like :meth:`abort` of its request. Not tracked (yet): the worker fails what
        it knows of the room — every D rank that already pre-allocated gets the Failed push at
        once — and remembers it, so a later pre-allocation is answered Failed and a later
        ``register`` of the room fails at the next poll, with ``reason``.
        """
        with self._lock:
            rid = self._rooms.get(room)
        if rid is not None:
            self.abort(rid, reason)
        else:
            # (after any release of the room held before it: same write, in order)
            self._worker.send(ipc.ReleaseRoom(room, reason, failed=True))

    def armable(self, rid: RequestId, early: bool = False) -> bool:
        """Whether ``rid``'s next chunk may be armed (layerwise) or staged: the replica agreed
        its room Bootstrapped — or, ``early``, is still Bootstrapping (its worker then holds
        the armed chunk until D's pre-allocations arrive, and sends the intervals the forward
        passed meanwhile together) — and has not started failing it. A room the replica fails
        stays tracked, without an event yet, until every rank is quiet; a forward leaves such
        a row out (``arm_layerwise`` refuses it). Agreed state: every rank of the replica
        answers the same between the same two polls. Any thread."""
        with self._lock:
            t = self._tracked.get(rid)
            if t is None:
                return False
            return t.local is TransferPoll.BOOTSTRAPPED or (
                early and t.local is TransferPoll.BOOTSTRAPPING
            )

    def record_usage(
        self, rid: RequestId, cached_tokens: int, bootstrap_logprob: float | None = None
    ) -> None:
        """What P reports to D with the Success (status frames 5 and 6): its prefix-cache
        hit and the first token's logprob. Call it before the final hand-over; the
        :class:`FirstToken` values of the hand-over win where they are set.
        """
        _check_usage(rid, cached_tokens, bootstrap_logprob)
        with self._lock:
            t = self._lookup(rid)
            if t.usage_taken:
                raise UsageError(f"request {rid!r}: its final chunk was handed over already")
            t.usage = (int(cached_tokens), bootstrap_logprob)

    def hand_final(self, rid: RequestId) -> tuple[int, float | None] | None:
        """The outbox hands ``rid``'s final chunk (or first token) over: from now on
        :meth:`record_usage` is refused. Returns what it recorded, if anything."""
        with self._lock:
            t = self._tracked.get(rid)
            if t is None:
                return None
            t.usage_taken = True
            return t.usage

    def handed(self, rid: RequestId) -> HandOver:
        """How much of ``rid``'s KV the outbox gave the worker (:class:`HandOver`). From
        ``CHUNK`` on the worker may read the request's pages until its room ends, so an
        engine that gives the request up keeps them until the final event; with layerwise
        streaming, a final hand-over needs ``FINAL_CHUNK`` (its last chunk was armed). The
        outbox moves it: to ``CHUNK``, ``FINAL_CHUNK`` or ``DONE`` once a chunk went out, to
        ``DONE`` as it takes an armed request's first token. :class:`UsageError` for a
        request not registered. Any thread."""
        with self._lock:
            return self._lookup(rid).handed

    def _note_handed(self, handed: Mapping[RequestId, HandOver]) -> None:
        """The outbox's: move each request forward (never back). A request forgotten
        meanwhile (its final event came) is skipped."""
        with self._lock:
            for rid, h in handed.items():
                t = self._tracked.get(rid)
                if t is not None and h > t.handed:
                    t.handed = h

    def _final_armed(self, rids: Iterable[RequestId]) -> dict[RequestId, Room]:
        """The outbox's: the rooms of those of ``rids`` whose final chunk is armed and whose
        first token is still due (layerwise)."""
        with self._lock:
            tracked = ((rid, self._tracked.get(rid)) for rid in rids)
            return {rid: t.room for rid, t in tracked if t and t.handed is HandOver.FINAL_CHUNK}

    def _tokens_due(self) -> bool:
        """The outbox's: whether a tracked request's final chunk is armed, its token due."""
        with self._lock:
            return any(t.handed is HandOver.FINAL_CHUNK for t in self._tracked.values())


class PrefillOutbox:
    """Where the forward thread hands the peer its work. Never waits for a transfer.

    Thread-safe; meant for the one forward thread. Rows are handed over in staging order.
    """

    def __init__(self, peer: PrefillPeer, worker: WorkerHandle) -> None:
        self._peer = peer
        self._worker = worker  #: the command pipe (shared with the peer; sends are locked)
        self._lock = threading.Lock()
        self._staged: list[tuple[RequestId, ipc.SubmitChunk]] = []

    def stage_remote_decode(self, rows: Iterable[RemoteDecodeRow]) -> None:
        """Stage a forward batch's rows; :class:`UsageError` (nothing staged) if one is bad.

        A request need not be Bootstrapped yet (an engine may prefill before D's
        pre-allocations arrive): its worker holds the chunks and writes them the moment the
        room is Bootstrapped. It must be tracked and not failing."""
        chunks = [(row.rid, self._chunk(row)) for row in rows]
        with self._lock:
            self._staged.extend(chunks)

    def remote_decode_pending(self) -> bool:
        """Whether staged rows, or armed final rows (their first token), wait for
        :meth:`hand_over_remote_decode`."""
        with self._lock:
            staged = bool(self._staged)
        return staged or self._peer._tokens_due()

    def hand_over_remote_decode(self, first_tokens: Mapping[RequestId, FirstToken] = {}) -> int:
        """The forward finished: hand every staged row to the worker; returns how many
        messages went out.

        Each staged final row needs its request's :class:`FirstToken` in ``first_tokens``; if
        one is missing nothing is handed over and :class:`UsageError` names it (retry with it).
        An armed final row (layerwise) already streamed: only its first token goes out, when
        ``first_tokens`` has it; the room sends Success once its last interval is written.
        """
        with self._lock:
            staged = self._staged
            missing = sorted(rid for rid, c in staged if c.final and rid not in first_tokens)
            if missing:
                raise UsageError(f"final rows need a first token: none given for {missing}")
            chunks = [self._final(rid, c, first_tokens[rid]) if c.final else c for rid, c in staged]
            streamed = self._peer._final_armed(first_tokens)
            tokens = [self._payload(rid, room, first_tokens[rid]) for rid, room in streamed.items()]
            self._staged = []
            # Claimed here, under the lock, as the staged rows are: no token goes out twice.
            self._peer._note_handed(dict.fromkeys(streamed, HandOver.DONE))
        out: list[ipc.SubmitChunk | ipc.BootstrapToken] = [*chunks, *tokens]
        for msg in out:
            trace.mark_room(msg.room, "p.handover")
            self._worker.send(msg)
        handed: dict[RequestId, HandOver] = {}
        for rid, c in staged:
            h = HandOver.DONE if c.final else HandOver.CHUNK
            handed[rid] = max(h, handed.get(rid, h))
        self._peer._note_handed(handed)  # once they went out: the worker may read the pages
        return len(chunks) + len(tokens)

    # ---- layerwise streaming (wire.md §7) --------------------------------------------------

    def streams_layerwise(self) -> bool:
        """Whether this rank streams layerwise (``layerwise_interval`` > 0): then rows go out
        through :meth:`arm_layerwise` before their forward, which advances
        :attr:`step_counter`."""
        return self._peer.layerwise is not None

    @property
    def step_counter(self) -> StepCounter:
        """The counter the forward advances once per producer step (one per target layer,
        plus one for the draft layers), after that step's KV writes."""
        return self._layerwise()[0]

    @property
    def producer_steps(self) -> int:
        """Producer steps per forward: how often the forward advances :attr:`step_counter`."""
        return self._layerwise()[1].steps

    def arm_layerwise(self, forward: Iterable[RemoteDecodeRow]) -> int:
        """Arm one chunk per row of the next forward, before it runs; returns how many.

        ``forward`` holds the forward's extend rows whose KV goes to D (like
        :meth:`stage_remote_decode`'s rows; a request need not be Bootstrapped yet: its
        worker holds the armed chunk until D's pre-allocations arrive, then sends every
        interval the forward passed meanwhile in one write per destination, and the rest as
        the forward goes on). Call it before **every** forward that advances
        the step counter, even with no such rows: it reserves the forward's producer steps
        once (all rows share that ``begin``). Every row is checked before any is armed: on
        :class:`UsageError` nothing is armed or reserved. A forward that was armed but does
        not run must still advance the counter by :attr:`producer_steps` (after aborting
        its requests), so later forwards' intervals stay aligned.
        """
        counter, schedule = self._layerwise()
        chunks = [(row.rid, self._chunk(row)) for row in forward]
        rids = [rid for rid, _ in chunks]
        if len(set(rids)) != len(rids):
            raise UsageError(f"a forward holds one row per request, got {sorted(map(str, rids))}")
        begin = counter.reserve(schedule.steps)
        for _, c in chunks:
            arm = ipc.ArmChunk(c.room, c.start, c.end, c.final, c.block_ids, begin)
            self._worker.send(arm)
        final, chunk = HandOver.FINAL_CHUNK, HandOver.CHUNK
        self._peer._note_handed({rid: final if c.final else chunk for rid, c in chunks})
        return len(chunks)

    def _layerwise(self) -> tuple[StepCounter, ProducerSchedule]:
        if self._peer.layerwise is None:
            raise UsageError("layerwise streaming is off (PrefillPeerConfig.layerwise_interval)")
        return self._peer.layerwise

    def release_registration(self, timeout_s: float = 10.0) -> None:
        """Sleep: deregister the KV cache from the transfer engine (e.g. before its memory is
        released). :class:`UsageError` while a tracked request's KV may still go out; a room
        no request claimed (only D's pre-allocations arrived) does not hold it. Until
        :meth:`restore_registration`, ``register`` is refused."""
        self._peer.release_registration(timeout_s)

    def restore_registration(self, timeout_s: float = 10.0) -> None:
        """Wake: register the KV cache again, on the same Mooncake session (D ranks keep
        their view of this rank)."""
        self._peer.restore_registration(timeout_s)

    def _final(self, rid: RequestId, chunk: ipc.SubmitChunk, t: FirstToken) -> ipc.SubmitChunk:
        """The final chunk with what D gets along with Success (checked like the wire)."""
        p, c = self._payload(rid, chunk.room, t), chunk
        return ipc.SubmitChunk(
            c.room,
            c.start,
            c.end,
            c.final,
            c.block_ids,
            p.token,
            p.spec_ids,
            p.cached_tokens,
            p.logprob,
        )

    def _payload(self, rid: RequestId, room: Room, t: FirstToken) -> ipc.BootstrapToken:
        """What D gets along with Success (checked like the wire)."""
        usage = self._peer.hand_final(rid)
        cached, logprob = t.cached_tokens, t.logprob
        if usage is not None:
            cached = cached or usage[0]
            logprob = usage[1] if logprob is None else logprob
        spec = tuple(int(i) for i in t.spec_ids)
        try:
            encode_status(StatusMessage(room, S.SUCCESS, 0, int(t.token), spec, cached, logprob))
        except (FrameError, struct.error) as exc:
            raise UsageError(f"request {rid!r}: its first token cannot be sent: {exc}") from exc
        return ipc.BootstrapToken(room, int(t.token), spec, int(cached), logprob)

    def _chunk(self, row: RemoteDecodeRow) -> ipc.SubmitChunk:
        # Bootstrapping or Bootstrapped: the worker holds a chunk (plain or armed) until D's
        # pre-allocations arrived.
        room = self._peer.live_room(row.rid)
        if not 0 <= row.start < row.end:
            raise UsageError(f"request {row.rid!r}: chunk [{row.start}, {row.end}) is empty")
        return ipc.SubmitChunk(room, row.start, row.end, row.final, self._tables(row))

    def _tables(self, row: RemoteDecodeRow) -> tuple[npt.NDArray[np.int64], ...]:
        groups = self._peer.contract.group_ids()
        ids = row.block_ids
        arrays = (
            [np.asarray(ids, dtype=np.int64)]
            if isinstance(ids, np.ndarray) and ids.ndim == 1
            else [np.asarray(a, dtype=np.int64) for a in ids]
        )
        if len(arrays) != len(groups) or any(a.ndim != 1 for a in arrays):
            raise UsageError(
                f"request {row.rid!r}: give one 1-D block-table row per group {list(groups)}"
            )
        return tuple(arrays)


def _check_usage(rid: RequestId, cached_tokens: int, logprob: float | None) -> None:
    if int(cached_tokens) < 0:
        raise UsageError(f"request {rid!r}: cached_tokens must be >= 0, got {cached_tokens}")
    if logprob is not None and (math.isnan(logprob) or logprob > 0.0):
        raise UsageError(f"request {rid!r}: bootstrap_logprob must be <= 0, got {logprob}")
