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
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tspd_core.ids import RequestId, Room
from tspd_core.layout import CacheContract
from tspd_core.pd import ipc
from tspd_core.pd.common import parse_config_contract, start_worker
from tspd_core.pd.config import PrefillPeerConfig
from tspd_core.pd.errors import FrameError, UsageError
from tspd_core.pd.peer import TransferPeer
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.status import TransferPoll as S
from tspd_core.pd.wire import StatusMessage, encode_status
from tspd_core.pd.worker import WorkerHandle

if TYPE_CHECKING:
    from tspd_core.epd import EmbeddingReceiver, EmbeddingReceiverConfig


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
        self, config: PrefillPeerConfig, worker: WorkerHandle, contract: CacheContract
    ) -> None:
        super().__init__(config, worker)
        self.contract = contract

    @classmethod
    def start(cls, config: PrefillPeerConfig) -> tuple[PrefillPeer, PrefillOutbox]:
        """Start the worker (Mooncake, arena registration, PULL socket, bootstrap PUT).

        Raises :class:`ConfigError` for a bad config and :class:`PeerError` when the worker
        cannot start (e.g. the bootstrap server is unreachable or refuses the contract).
        """
        contract = parse_config_contract(config)
        worker = start_worker("prefill", config, contract, config.bootstrap_url)
        peer = cls(config, worker, contract)
        return peer, PrefillOutbox(peer)

    def embedding_receiver(self, config: EmbeddingReceiverConfig) -> EmbeddingReceiver:
        """This rank's EPD receiver, placed like this peer (see docs/epd.md); a request whose
        embeddings fail has its P→D room aborted through :meth:`abort_room`."""
        from tspd_core.epd import receiver_for_peer  # late: epd builds on pd

        return receiver_for_peer(self.config, config, aborter=self)

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
            self._worker.send(ipc.ReleaseRoom(room, reason, failed=True))

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
            if t.final_handed:
                raise UsageError(f"request {rid!r}: its final chunk was handed over already")
            t.usage = (int(cached_tokens), bootstrap_logprob)


class PrefillOutbox:
    """Where the forward thread hands the peer its work. Never waits for a transfer.

    Thread-safe; meant for the one forward thread. Rows are handed over in staging order.
    """

    def __init__(self, peer: PrefillPeer) -> None:
        self._peer = peer
        self._lock = threading.Lock()
        self._staged: list[tuple[RequestId, ipc.SubmitChunk]] = []

    def stage_remote_decode(self, rows: Iterable[RemoteDecodeRow]) -> None:
        """Stage a forward batch's rows; :class:`UsageError` (nothing staged) if one is bad."""
        chunks = [(row.rid, self._chunk(row)) for row in rows]
        with self._lock:
            self._staged.extend(chunks)

    def remote_decode_pending(self) -> bool:
        """Whether staged rows wait for :meth:`hand_over_remote_decode`."""
        with self._lock:
            return bool(self._staged)

    def hand_over_remote_decode(self, first_tokens: Mapping[RequestId, FirstToken] = {}) -> int:
        """The forward finished: hand every staged row to the worker; returns how many.

        Each final row needs its request's :class:`FirstToken` in ``first_tokens``; if one is
        missing nothing is handed over and :class:`UsageError` names it (retry with it).
        """
        with self._lock:
            staged = self._staged
            missing = sorted(rid for rid, c in staged if c.final and rid not in first_tokens)
            if missing:
                raise UsageError(f"final rows need a first token: none given for {missing}")
            chunks = [self._final(rid, c, first_tokens[rid]) if c.final else c for rid, c in staged]
            self._staged = []
        for chunk in chunks:
            self._peer._worker.send(chunk)
        return len(chunks)

    def release_registration(self, timeout_s: float = 10.0) -> None:
        """Sleep: deregister the KV cache from the transfer engine (e.g. before its memory is
        released). :class:`UsageError` while a tracked request's KV may still go out; a room
        no request claimed (only D's pre-allocations arrived) does not hold it. Until
        :meth:`restore_registration`, ``register`` is refused."""
        self._peer._release_registration(timeout_s)

    def restore_registration(self, timeout_s: float = 10.0) -> None:
        """Wake: register the KV cache again, on the same Mooncake session (D ranks keep
        their view of this rank)."""
        self._peer._restore_registration(timeout_s)

    def _final(self, rid: RequestId, chunk: ipc.SubmitChunk, t: FirstToken) -> ipc.SubmitChunk:
        """The final chunk with what D gets along with Success (checked like the wire)."""
        with self._peer._lock:
            tracked = self._peer._tracked.get(rid)
            usage = tracked.usage if tracked is not None else None
            if tracked is not None:
                tracked.final_handed = True
        cached, logprob = t.cached_tokens, t.logprob
        if usage is not None:
            cached = cached or usage[0]
            logprob = usage[1] if logprob is None else logprob
        spec = tuple(int(i) for i in t.spec_ids)
        try:
            encode_status(
                StatusMessage(chunk.room, S.SUCCESS, 0, int(t.token), spec, cached, logprob)
            )
        except (FrameError, struct.error) as exc:
            raise UsageError(f"request {rid!r}: its first token cannot be sent: {exc}") from exc
        c = chunk
        return ipc.SubmitChunk(
            c.room, c.start, c.end, c.final, c.block_ids, int(t.token), spec, int(cached), logprob
        )

    def _chunk(self, row: RemoteDecodeRow) -> ipc.SubmitChunk:
        peer = self._peer
        with peer._lock:
            t = peer._lookup(row.rid)
            if t.local is not TransferPoll.BOOTSTRAPPED:
                raise UsageError(f"request {row.rid!r} is not bootstrapped yet; wait for its event")
            room = t.room
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
