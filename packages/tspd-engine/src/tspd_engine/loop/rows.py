"""What the decoders ask the engine about the rows of a decode round.

The decoders (:mod:`tspd_engine.loop.decoders`) drive the scheduler's rounds but know nothing of
the requests' host state; three questions need it, and :class:`RowViews` answers them from
the core's running requests:

* ``masks(items)`` — per row, the ids the argmax may not pick (``min_tokens`` keeps EOS and
  stop ids out until enough tokens exist);
* ``more_wanted()`` — whether any decoding request still needs a token once the launched
  steps commit (the fed loop stops launching when none does);
* ``live_rows(slots, serials)`` — per row of a launched step, the request it still belongs
  to, or None when that admission ended (finished or preempted) since the launch.

Pure reads, kept out of the loop's module so the loop reads top to bottom.

Threading: the rank's engine thread only (the same thread that mutates ``running``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from tspd_core.feed import NO_ID, IntArray, row_masks
from tspd_core.ids import RequestId
from tspd_core.sched import RequestScheduler
from tspd_core.sched.request import RequestState
from tspd_core.sched.rounds import DecodeItems
from tspd_engine.loop.sequence import Sequence


class RowViews:
    """Answers the decoders' per-row questions (see the module docstring).

    ``running`` is the core's own table of admitted requests, read live (never copied), so
    the answers follow every admission, finish and preemption.
    """

    def __init__(
        self, sched: RequestScheduler, running: Mapping[str, Sequence], eos: int, limit: int
    ) -> None:
        self.sched = sched
        self.running = running
        self.eos = eos
        self.limit = limit

    def masks(self, items: DecodeItems) -> IntArray:
        n = len(items)
        if not any(s.params.min_tokens for s in self.running.values()):
            return np.full((n, 2), NO_ID, dtype=np.int64)
        banned = []
        for slot, pos in zip(items.slot.tolist(), items.position.tolist(), strict=True):
            seq = self.running[str(self.sched.request_id_at(slot))]
            banned.append(seq.banned(pos + 1 - len(seq.prompt), self.eos))
        return row_masks(banned)

    def more_wanted(self) -> bool:
        """EOS cannot be foreseen; max_tokens and the context limit can."""
        for seq in self.running.values():
            view = self.sched.view(RequestId(seq.rid))
            if view.state != RequestState.DECODE:
                continue
            produced = len(seq.output) + view.pending
            if produced < seq.params.max_tokens and len(seq.prompt) + produced < self.limit:
                return True
        return False

    def live_rows(
        self, slots: npt.NDArray[np.int32], serials: npt.NDArray[np.int64]
    ) -> list[RequestId | None]:
        # The core's admission serials answer without one scheduler view per row.
        out: list[RequestId | None] = []
        for slot, serial in zip(slots.tolist(), serials.tolist(), strict=True):
            rid = self.sched.request_id_at(slot)
            seq = self.running.get(rid) if rid is not None else None
            out.append(rid if seq is not None and seq.serial == serial else None)
        return out
