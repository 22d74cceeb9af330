"""Decode drivers: the synchronous round and the device-fed pipeline, on the real scheduler.

Both run the scheduler's ragged decode rounds (every DECODE request, slot order) and return
the tokens that were committed, as ``(request id, token)`` pairs in row order. The engine
then applies its stop rules; a request that stops while a later step is already launched is
finished, and that step's output is dropped at commit (the scheduler checks serials).

Fed pipeline timeline (one stream; the host never waits for the step it just launched)::

    host    prep+launch N │ prep+launch N+1 │ read N, commit N │ prep+launch N+2 │ read N+1 ...
    device  [fwd N · argmax N → cells · D2H → slot N · event N]
                            [fwd N+1 reads cells of N · argmax · D2H · event N+1] ...

Threading: the engine thread of one rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.feed import HostRing, HostSlot, IntArray, encode_source_columns
from tspd_core.ids import RequestId
from tspd_core.sched import RequestScheduler
from tspd_core.sched.rounds import DecodeItems, DecodeOutputs, DecodeRound
from tspd_engine.loop.runner import ModelRunner

#: ``masks(items)`` → the ``[rows, 2]`` argmax masks of a round's rows (see tspd_core.feed).
MaskFn = Callable[[DecodeItems], IntArray]
Committed = list[tuple[RequestId, int]]


#: ``live(slots, serials)`` → per row, the request it still belongs to, or None if that
#: request finished (or was preempted) since the row was launched.
LiveFn = Callable[[npt.NDArray[np.int32], npt.NDArray[np.int64]], list[RequestId | None]]


def scheduler_live_rows(sched: RequestScheduler) -> LiveFn:
    """A :data:`LiveFn` asking the scheduler itself (one view per row; engines that track
    admission serials answer faster)."""

    def live(
        slots: npt.NDArray[np.int32], serials: npt.NDArray[np.int64]
    ) -> list[RequestId | None]:
        out: list[RequestId | None] = []
        for slot, serial in zip(slots.tolist(), serials.tolist(), strict=True):
            rid = sched.request_id_at(slot)
            out.append(rid if rid is not None and sched.view(rid).serial == serial else None)
        return out

    return live


class SyncDecoder:
    """One decode round per call: launch, wait for the tokens, commit."""

    def __init__(self, sched: RequestScheduler, runner: ModelRunner, masks: MaskFn) -> None:
        self.sched = sched
        self.runner = runner
        self.masks = masks
        self._items, self._table, self._out = sched.new_round_scratch()
        self._committed: Committed = []

    @property
    def in_flight(self) -> int:
        return 0

    def execute_ragged(self, batch: DecodeRound, out: DecodeOutputs) -> int:
        """The scheduler's DecodeBackend: forward, argmax on the host, fill ``out``."""
        items = batch.items
        logits = self.runner.decode_batch(batch)
        tokens = self.runner.argmax_host(logits, self.masks(items))
        n = batch.size
        out.slot[:n], out.serial[:n], out.token[:n] = items.slot, items.serial, tokens
        # Prepared and committed in this one call: every row is live.
        rids = [self.sched.request_id_at(s) for s in items.slot.tolist()]
        self._committed = [
            (rid, int(t)) for rid, t in zip(rids, tokens.tolist(), strict=True) if rid is not None
        ]
        return n

    def step(self) -> Committed:
        self._committed = []
        self.sched.execute_decode_round(self, self._items, self._table, self._out)
        return self._committed

    def drain(self) -> Committed:
        return []

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class _Launched:
    round_id: int
    slots: npt.NDArray[np.int32]
    serials: npt.NDArray[np.int64]
    ring_slot: HostSlot


class FedDecoder:
    """Keeps one fed step in flight: each call launches round N+1, then commits round N.

    ``wanted()`` says whether any decoding request still needs a token once the steps in
    flight commit; when none does (all stop on length), no step is launched past the end.
    Scratch is double-buffered (round N's items stay valid while N+1 is prepared); the host
    ring has two slots for the same reason.
    """

    def __init__(
        self,
        sched: RequestScheduler,
        runner: ModelRunner,
        masks: MaskFn,
        wanted: Callable[[], bool] = lambda: True,
        live: LiveFn | None = None,
    ) -> None:
        if not runner.supports_device_token_feed():
            raise ValueError("FedDecoder needs a runner with a device token feed")
        self.sched = sched
        self.runner = runner
        self.masks = masks
        self.wanted = wanted
        self.live = live or scheduler_live_rows(sched)
        self._scratch = [sched.new_round_scratch()[:2] for _ in range(2)]
        self._turn = 0
        self._ring = HostRing(runner.feed_device, depth=2)
        self._inflight: deque[_Launched] = deque()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def step(self) -> Committed:
        """Launch the next round (if any request decodes), then commit the oldest but the one
        just launched; with nothing left to launch, commit everything."""
        launched = self._launch()
        committed: Committed = []
        while len(self._inflight) > (1 if launched else 0):
            committed += self._settle()
        return committed

    def drain(self) -> Committed:
        """Commit every round in flight (before a prefill, a preemption or shutdown)."""
        committed: Committed = []
        while self._inflight:
            committed += self._settle()
        return committed

    def _launch(self) -> bool:
        if self._inflight and not self.wanted():
            return False  # every decoding request ends with the steps in flight: settle them
        items, table = self._scratch[self._turn]
        batch = self.sched.prepare_decode_round(items, table)
        if batch.size == 0:
            self.sched.abort_decode_round(batch.round_id)
            return False
        self._turn ^= 1
        it = batch.items
        words = encode_source_columns(
            it.token_on_host, it.token, it.feed_row, self.runner.feed_device.max_rows
        )
        try:
            slot = self._ring.acquire(batch.size)
        except BaseException:
            self.sched.abort_decode_round(batch.round_id)
            raise
        try:
            logits = self.runner.decode_batch_fed(words, batch)
            self.runner.argmax_batch_to_feed(logits, self.masks(it), slot.cells, slot.event)
        except BaseException:
            self._ring.discard(slot)
            self.sched.abort_decode_round(batch.round_id)
            raise
        self._inflight.append(_Launched(batch.round_id, it.slot.copy(), it.serial.copy(), slot))
        return True

    def _settle(self) -> Committed:
        step = self._inflight.popleft()
        tokens = self._ring.read(step.ring_slot)  # waits on this step's event only
        self.runner.fed_step_settled()
        rows = self.live(step.slots, step.serials)
        outputs = DecodeOutputs(step.slots, step.serials, tokens.astype(np.int32))
        done = self.sched.commit_decode_round(step.round_id, outputs)
        assert done.committed == sum(r is not None for r in rows), (
            f"round {step.round_id}: the scheduler kept {done.committed} rows, the engine "
            f"{sum(r is not None for r in rows)}; a request's serial changed behind its back"
        )
        return [(rid, int(t)) for rid, t in zip(rows, tokens, strict=True) if rid is not None]

    def close(self) -> None:
        self.drain()
        self._ring.close()


Decoder = SyncDecoder | FedDecoder
