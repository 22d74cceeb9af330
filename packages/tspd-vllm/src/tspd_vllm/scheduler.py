"""The connector's scheduler side: which requests move KV, in vLLM's scheduler process.

Owned by vLLM's scheduler and called on its thread only (no locks). It holds no KV and no
peer: it turns vLLM's hooks into :class:`~tspd_vllm.jobs.JobBatch` es for the workers and
tracks what keeps blocks held. vLLM types stay in :mod:`tspd_vllm.connector`; here a request
is its id, its ``kv_transfer_params`` and a few numbers, so every rule is testable alone.

P: a request asked to ``do_remote_decode`` that finished its prefill (length-capped or
stopped) keeps its blocks (``request_finished`` → True) and becomes a send; its answer names
P's bootstrap server and the room, which D gets. The blocks go back when a worker reports
the send finished (Succeeded, or Failed once no write reads them). A request that names an
``abort_room`` (the front's, for a room no D will pull) makes the workers fail that room in the
step that schedules it, so its send ends (Failed) and its blocks go back at once.

P, layerwise (``layerwise_interval`` > 0, :mod:`tspd_vllm.layerwise`): such a request's room
is registered in the step vLLM first schedules it (an early room), and each step's forward
rows of it (prompt tokens ``[computed, computed + scheduled)``, from the ``SchedulerOutput``)
go to the workers, which arm those D bootstrapped. Its send at ``request_finished`` hands
over what the armed chunks did not carry. A request vLLM preempts before its prefill ended
fails its room (vLLM freed its blocks; it is recomputed and hands nothing over); one vLLM
aborts then fails its room and holds its blocks until the room's final event.

D: a request with ``do_remote_prefill`` loads the prompt tokens P holds (``kv_tokens``, else
the whole prompt) past D's own prefix hit asynchronously; once vLLM allocated its blocks it
becomes a receive. D computes what follows: P's first token when the front appended it to
D's prompt (:mod:`tspd_vllm.relay`), else vLLM recomputes the last prompt token to sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tspd_vllm.errors import TransferParamsError
from tspd_vllm.jobs import EarlyRoom, EndJob, ForwardRow, JobBatch, RecvJob, SendJob
from tspd_vllm.params import (
    Rendezvous,
    remote_prefill,
    room_for,
    room_to_abort,
    wants_remote_decode,
)
from tspd_vllm.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A request in a step's forward: ``tokens`` of it from token ``computed`` on."""

    rid: str
    computed: int
    tokens: int


class PrefillScheduler:
    """P's scheduler side (see the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._sends: list[SendJob] = []
        self._room_aborts: list[int] = []
        #: Requests whose ``abort_room`` was taken (vLLM may ask about a request again).
        self._aborters: set[str] = set()
        #: Requests whose blocks a send holds, until a worker reports it finished.
        self.holding: set[str] = set()
        # Layerwise only: requests that will have an early room once vLLM schedules them;
        # those that have one (until request_finished or a preemption); those preempted.
        self._candidates: dict[str, Rendezvous] = {}
        self.early: dict[str, Rendezvous] = {}
        self.preempted: set[str] = set()
        self._early: list[EarlyRoom] = []
        self._ends: list[EndJob] = []

    def scheduling(self, rid: str, params: object, prompt_len: int = 0) -> None:
        """``get_num_new_matched_tokens`` (P loads nothing): a request naming ``abort_room``
        fails that room in this step's batch, once per request. Layerwise: a request asked
        to ``do_remote_decode`` with a room will get an early room if vLLM schedules it."""
        if self.settings.layerwise_interval:
            self._candidate(rid, params, prompt_len)
        try:
            room = room_to_abort(params)
        except TransferParamsError as exc:
            log.warning("request %s: no room aborted: %s", rid, exc)
            return
        if room is None or rid in self._aborters:
            return
        self._aborters.add(rid)
        self._room_aborts.append(room)

    def _candidate(self, rid: str, params: object, prompt_len: int) -> None:
        if rid in self.early or rid in self.preempted or prompt_len < 1:
            return
        try:
            if not wants_remote_decode(params):
                return
            room = room_for(params)
        except TransferParamsError:
            return  # refused by name at request_finished
        s = self.settings
        self._candidates[rid] = Rendezvous(s.bootstrap_host, s.bootstrap_port, room, prompt_len)

    def finished(
        self,
        rid: str,
        params: object,
        *,
        prefilled: bool,
        block_ids: Iterable[int],
        prompt_len: int,
        first_token: int | None,
    ) -> tuple[bool, dict[str, object] | None]:
        """``request_finished``: (hold the blocks?, the answer's ``kv_transfer_params``).
        ``prefilled``: the request ended normally (not aborted) with its prompt computed."""
        self._aborters.discard(rid)
        self._candidates.pop(rid, None)
        if rid in self.preempted:  # its room failed when vLLM preempted it
            self.preempted.discard(rid)
            return False, None
        early = self.early.pop(rid, None)
        if early is not None:
            return self._finished_early(rid, early, prefilled, tuple(block_ids), first_token)
        try:
            if not wants_remote_decode(params):
                return False, None
            room = room_for(params)
        except TransferParamsError as exc:
            log.warning("request %s: no KV hand-over: %s", rid, exc)
            return False, None
        blocks = tuple(block_ids)
        if not prefilled or first_token is None or not blocks or prompt_len < 1:
            return False, None
        s = self.settings
        meet = Rendezvous(s.bootstrap_host, s.bootstrap_port, room, prompt_len)
        self._sends.append(SendJob(rid, meet, blocks, prompt_len, first_token))
        self.holding.add(rid)
        return True, meet.as_params()

    def _finished_early(
        self,
        rid: str,
        meet: Rendezvous,
        prefilled: bool,
        blocks: tuple[int, ...],
        first_token: int | None,
    ) -> tuple[bool, dict[str, object] | None]:
        """An early room's request finished: a send, or (aborted before its prefill ended)
        its room fails. Either way its blocks stay until the room's final event (a write
        may read them)."""
        self.holding.add(rid)
        prompt_len = meet.tokens or 0
        if prefilled and first_token is not None and blocks:
            self._sends.append(SendJob(rid, meet, blocks, prompt_len, first_token))
            return True, meet.as_params()
        self._ends.append(EndJob(rid, held=True))
        return True, None

    def take(
        self,
        scheduled: Iterable[Scheduled] = (),
        preempted: Iterable[str] = (),
        blocks: Callable[[str], Iterable[int]] | None = None,
    ) -> JobBatch:
        """``build_connector_meta``: this step's new sends and room aborts; layerwise, the
        early rooms (``scheduled``: the step's forward; ``preempted``: requests vLLM
        preempted in this step; ``blocks``: a request's block row)."""
        rows: list[ForwardRow] = []
        if self.settings.layerwise_interval:
            rows = self._layerwise(scheduled, preempted, blocks)
        sends, self._sends = self._sends, []
        aborts, self._room_aborts = self._room_aborts, []
        early, self._early = self._early, []
        ends, self._ends = self._ends, []
        return JobBatch(
            sends=tuple(sends),
            room_aborts=tuple(aborts),
            early=tuple(early),
            rows=tuple(rows),
            ends=tuple(ends),
        )

    def _layerwise(
        self,
        scheduled: Iterable[Scheduled],
        preempted: Iterable[str],
        blocks: Callable[[str], Iterable[int]] | None,
    ) -> list[ForwardRow]:
        for rid in preempted:
            self._candidates.pop(rid, None)
            if self.early.pop(rid, None) is not None:
                self.preempted.add(rid)
                self._ends.append(EndJob(rid, held=False))
        rows = []
        for s in scheduled:
            meet = self._candidates.pop(s.rid, None)
            if meet is not None and s.rid not in self.early and s.rid not in self.preempted:
                self.early[s.rid] = meet
                self._early.append(EarlyRoom(s.rid, meet))
            early = self.early.get(s.rid)
            prompt_len = 0 if early is None else early.tokens or 0
            if s.computed >= prompt_len or s.tokens < 1:
                continue  # not an early room, or past its prefill
            assert blocks is not None, "layerwise rows need the requests' block rows"
            end = min(s.computed + s.tokens, prompt_len)
            rows.append(ForwardRow(s.rid, tuple(blocks(s.rid)), s.computed, end, end == prompt_len))
        return rows

    def reported(self, finished_sending: Iterable[str]) -> None:
        """``update_connector_output``: these sends are over (their blocks go back)."""
        self.holding.difference_update(finished_sending)

    def pending(self) -> bool:
        """``has_pending_push_work``: vLLM must keep stepping (sends' results to collect)."""
        return bool(self.holding)


class DecodeScheduler:
    """D's scheduler side (see the module docstring)."""

    def __init__(self) -> None:
        self._recvs: list[RecvJob] = []
        #: Requests that were given a receive (one per request, even if vLLM recomputes it
        #: after a failed load) -> their rendezvous.
        self.started: dict[str, Rendezvous] = {}

    def matched(self, rid: str, params: object, prompt_len: int, computed: int) -> tuple[int, bool]:
        """``get_num_new_matched_tokens`` (side-effect free): the prompt tokens past D's own
        hit, loaded asynchronously; (0, False) for a local request, one whose receive was
        given already, or one whose parameters are malformed (computed here instead)."""
        if rid in self.started:
            return 0, False
        try:
            meet = remote_prefill(params)
        except TransferParamsError as exc:
            log.warning("request %s: computed locally: %s", rid, exc)
            return 0, False
        if meet is None or _loaded(meet, prompt_len) - computed <= 0:
            return 0, False
        return _loaded(meet, prompt_len) - computed, True

    def allocated(
        self,
        rid: str,
        params: object,
        block_ids: Iterable[int],
        external: int,
        prompt_len: int,
    ) -> None:
        """``update_state_after_alloc``: the blocks for ``external`` loaded tokens exist."""
        if external <= 0 or rid in self.started:
            return
        meet = remote_prefill(params)  # parsed fine in matched() (same params)
        assert meet is not None, f"request {rid}: allocated for a load it never asked"
        self.started[rid] = meet
        end = _loaded(meet, prompt_len)
        self._recvs.append(RecvJob(rid, meet, tuple(block_ids), end - external, end))
        if isinstance(params, dict):
            params["do_remote_prefill"] = False  # as vLLM's own connectors: asked once

    def take(self) -> JobBatch:
        """``build_connector_meta``: this step's new receives."""
        recvs, self._recvs = self._recvs, []
        return JobBatch(recvs=tuple(recvs))

    def finished(self, rid: str) -> None:
        """``request_finished``: forget the request (its worker side ends its room)."""
        self.started.pop(rid, None)


def _loaded(meet: Rendezvous, prompt_len: int) -> int:
    """How many of D's prompt tokens come from P: P's prompt (``kv_tokens``), at most D's."""
    return prompt_len if meet.tokens is None else min(meet.tokens, prompt_len)
