"""`DecodePeer` and `DecodeOutbox`: the D rank's engine-side half.

Once the scheduler has allocated a request's pages (after D's own prefix hit) the engine
stages its destination manifest — a D replica of one rank right after ``register``, so the
worker sends the pre-allocations the moment its look-up finishes, with no engine round in
between; a replica of several ranks after ``poll`` yields ``Bootstrapped`` (every rank's
look-up succeeded, so no rank's manifest goes out for a room another rank fails)::

    outbox.stage_remote_prefill(rows)   zero every new page (all fields) on the arena's device;
                                        on CUDA, record an event after the zeroing kernels
    outbox.hand_over_remote_prefill()   hand over each row whose zeroing finished (event done);
                                        the worker publishes its manifest to the P ranks
    poll()                              RemotePrefill(first token, ...) once every P rank
                                        reported Success

So a manifest is never published before its pages are clean: P's writes cannot race with the
zeroing, and a page P does not write (it is outside every fragment) reads as zeros, not as a
previous request's KV.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tspd_core import trace
from tspd_core.ids import RequestId, Room
from tspd_core.layout import BlockManifest, CacheContract, encode_manifest, validate_manifest
from tspd_core.pd.config import DecodePeerConfig, WorkerRole
from tspd_core.pd.decode.worker import main as worker_main
from tspd_core.pd.errors import UsageError
from tspd_core.pd.events import PdEvent, RemotePrefill
from tspd_core.pd.peer.start import parse_config_contract, start_worker
from tspd_core.pd.peer.tracked import Tracked
from tspd_core.pd.peer.transfer_peer import TransferPeer
from tspd_core.pd.peer.worker_handle import WorkerHandle
from tspd_core.pd.transfer.byterows import zero_ranges
from tspd_core.pd.wire import ipc


@dataclass(frozen=True, slots=True, eq=False)
class RemotePrefillRow:
    """One request whose prompt KV D receives: its destination manifest (D's own page ids,
    D's prefix hit as ``prefix_len``, the full prompt as ``prompt_len``)."""

    rid: RequestId
    manifest: BlockManifest


class DecodePeer(TransferPeer):
    """A D rank's peer. Start with :meth:`start`; see :class:`TransferPeer` for the API."""

    role = "decode"

    def __init__(
        self, config: DecodePeerConfig, worker: WorkerHandle, contract: CacheContract
    ) -> None:
        super().__init__(config, worker)
        self.contract = contract

    @classmethod
    def start(cls, config: DecodePeerConfig) -> tuple[DecodePeer, DecodeOutbox]:
        """Start the worker (Mooncake, arena registration, PULL socket).

        Raises :class:`ConfigError` for a bad config and :class:`PeerError` when the worker
        cannot start.
        """
        contract = parse_config_contract(config)
        worker = start_worker(WorkerRole.DECODE, worker_main, config, contract)
        peer = cls(config, worker, contract)
        return peer, DecodeOutbox(peer, worker)

    def _success_event(self, t: Tracked) -> PdEvent:
        """D's final event, carrying what the P ranks sent with their Success."""
        s = t.success
        if s is None:
            return RemotePrefill(t.rid, -1)
        return RemotePrefill(t.rid, s.token, s.spec_ids, s.cached_tokens, s.logprob)


@dataclass(slots=True)
class _Staged:
    rid: RequestId
    room: Room
    manifest: str
    zeroed: Any  # a torch.cuda.Event, or None when the zeroing already completed


class DecodeOutbox:
    """Where the engine hands the peer its destination manifests. Never waits for a transfer.

    Thread-safe; meant for the thread that launches work on the arena's device (the zeroing
    runs on its current stream).
    """

    def __init__(self, peer: DecodePeer, worker: WorkerHandle) -> None:
        self._peer = peer
        self._worker = worker  #: the command pipe (shared with the peer; sends are locked)
        self._lock = threading.Lock()
        self._staged: list[_Staged] = []
        self._views = _FieldPages(peer.contract, peer.config.arena)

    def stage_remote_prefill(self, rows: Iterable[RemotePrefillRow]) -> None:
        """Validate each manifest, launch the zeroing of its pages and stage it.

        Right after ``register`` (a D replica of one rank: the worker holds the manifest
        until its look-up finished, and no engine round sits between the look-up and the
        pre-allocations) or after the Bootstrapped event (a replica of several ranks, which
        must agree on Bootstrapped first). :class:`UsageError` (nothing staged or zeroed) for
        an unknown or failing request or a manifest invalid against this rank's contract.
        """
        checked = [self._check(row) for row in rows]
        for _, room, _ in checked:
            trace.mark_room(room, "d.stage")
        self._views.zero(m for _, _, m in checked)
        event = None
        if self._peer.config.arena.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        with self._lock:
            self._staged.extend(
                _Staged(rid, room, encode_manifest(m).decode(), event) for rid, room, m in checked
            )

    def remote_prefill_pending(self) -> bool:
        """Whether staged manifests wait for their zeroing or their hand-over."""
        with self._lock:
            return bool(self._staged)

    def hand_over_remote_prefill(self) -> int:
        """Publish every staged manifest whose pages are zeroed; returns how many went."""
        with self._lock:
            ready = [s for s in self._staged if s.zeroed is None or s.zeroed.query()]
            self._staged = [s for s in self._staged if s not in ready]
        for s in ready:
            trace.mark_room(s.room, "d.handover")
            self._worker.send(ipc.PublishManifest(s.room, s.manifest))
        return len(ready)

    def release_registration(self, timeout_s: float = 10.0) -> None:
        """Sleep: deregister the KV cache from the transfer engine. :class:`UsageError` while
        any request is tracked (P may still write into its pages); ``register`` is refused
        until :meth:`restore_registration`."""
        self._peer.release_registration(timeout_s)

    def restore_registration(self, timeout_s: float = 10.0) -> None:
        """Wake: register the KV cache under a fresh Mooncake session (``peer.session_id()``
        changes). Every registration with P ranks is forgotten, so the next request's P ranks
        get a new one and retire the old session."""
        self._peer.restore_registration(timeout_s)

    def _check(self, row: RemotePrefillRow) -> tuple[RequestId, Room, BlockManifest]:
        room = self._peer.live_room(row.rid)
        try:
            validate_manifest(row.manifest, self._peer.contract)
        except ValueError as exc:
            raise UsageError(f"request {row.rid!r}: invalid manifest: {exc}") from exc
        return row.rid, room, row.manifest


class _FieldPages:
    """Where each group's fields sit, to zero a manifest's pages in one call: per group, the
    fields' first-page offsets, page strides and payloads as vectors, so a manifest's ranges
    are one broadcast (field x page), not a numpy call per field (an MLA page of 32 layers:
    ~120 -> ~45 µs here, on D's path to publishing the manifest)."""

    def __init__(self, contract: CacheContract, arena: torch.Tensor) -> None:
        self._arena = arena
        self._fields: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for gid in contract.group_ids():
            fields = contract.fields_for_group(gid)
            self._fields[gid] = (
                np.array([contract.page0_offset(f.field_id) for f in fields], dtype=np.int64),
                np.array([f.page_stride_bytes for f in fields], dtype=np.int64),
                np.array([f.payload_bytes for f in fields], dtype=np.int64),
            )

    def zero(self, manifests: Iterable[BlockManifest]) -> None:
        starts, lengths = [], []
        for manifest in manifests:
            for group in manifest.groups:
                ids = np.asarray(group.block_ids, dtype=np.int64)
                page0, stride, payload = self._fields[group.group_id]
                starts.append((page0[:, None] + stride[:, None] * ids[None, :]).reshape(-1))
                lengths.append(np.repeat(payload, ids.size))
        if starts:
            zero_ranges(self._arena, np.concatenate(starts), np.concatenate(lengths))
