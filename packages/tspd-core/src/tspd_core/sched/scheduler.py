"""The fixed-capacity request scheduler: admission, lifecycle, page tables, decode rounds.

Its state and every rule that changes it are native (``_slots.pyx``: the slot table and
inspection; ``_lifecycle.pyx``: admission, prompt completion, copy-on-write, fork, finish;
``_rounds.pyx``: decode rounds); this class adds what only orchestrates them (a synchronous
round around a backend call, round scratch).
"""

from __future__ import annotations

import numpy as np

from tspd_core.sched._rounds import RoundsCore
from tspd_core.sched.errors import BackendMismatch, InvalidInput, WrongState
from tspd_core.sched.pool import PAGE_DTYPE, PageArray
from tspd_core.sched.rounds import DecodeBackend, DecodeItems, DecodeOutputs, RoundCommit


class RequestScheduler(RoundsCore):
    """A hard bound of ``capacity`` concurrent requests, each in a stable slot with a logical
    page table of ``logical_pages`` entries (max context ``logical_pages * page_size`` tokens).

    ``RequestScheduler(capacity, logical_pages, *, page_size, pool, prefixes=None)``.

    The scheduler owns one reference on every page in its requests' tables, taken from
    ``pool`` (and, for prefix hits, shared with ``prefixes``, a store built on that pool).
    Every method is atomic: it either completes or raises leaving all state (tables,
    reference counts, store) as it was.

    Prefix hits count whole pages and never cover the prompt's last token: a prompt that is
    all prefix recomputes its last page (``prefix_tokens <= (prompt_len-1) // page_size *
    page_size``), so prefill never writes into a shared page and a decode peer's prefix
    length is page aligned and below the prompt length (wire.md §5).

    Threading: not thread-safe. One engine loop (or one simulated instance) drives it; the
    page-table views it returns are valid until the next call that changes that request.
    """

    __slots__ = ()

    def new_round_scratch(self) -> tuple[DecodeItems, PageArray, DecodeOutputs]:
        """Worst-case scratch for one round: items, block table, outputs."""
        table = np.zeros(self.capacity * self.logical_pages, dtype=PAGE_DTYPE)
        return DecodeItems.empty(self.capacity), table, DecodeOutputs.empty(self.capacity)

    def execute_decode_round(
        self,
        backend: DecodeBackend,
        item_scratch: DecodeItems,
        block_table_scratch: PageArray,
        output_scratch: DecodeOutputs,
    ) -> RoundCommit:
        """One synchronous ragged decode round: prepare, exactly one backend call, commit.

        The backend's outputs are checked as a complete batch before any state changes; on
        a mismatch (BackendMismatch) or a backend exception the round is aborted, so the
        scheduler is as before the call. With no DECODE request the backend is not called.
        """
        if self.rounds_in_flight():
            raise WrongState(
                "pipelined rounds are in flight; commit them before a synchronous round"
            )
        decoding = self._decoding_count()
        if len(output_scratch) < decoding:
            raise InvalidInput(f"output scratch holds {len(output_scratch)} rows, need {decoding}")
        batch = self.prepare_decode_round(item_scratch, block_table_scratch)
        if batch.size == 0:
            self.abort_decode_round(batch.round_id)
            return RoundCommit(batch.round_id, 0, 0)
        try:
            written = backend.execute_ragged(batch, output_scratch)
            if written != batch.size:
                raise BackendMismatch(
                    f"round {batch.round_id}: backend wrote {written!r} outputs for "
                    f"{batch.size} items"
                )
            return self.commit_decode_round(batch.round_id, output_scratch.head(batch.size))
        except BaseException:
            self.abort_decode_round(batch.round_id)
            raise
