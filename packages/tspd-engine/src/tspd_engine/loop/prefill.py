"""One prefill round: chunks of PREFILL requests, admission order, within a token budget.

:class:`PrefillRound` holds what a round needs — the scheduler, the runner, the hooks (read
live: hooks added later take part) and the EOS id — and is handed the running requests each
round, so it never reaches into the core.
"""

from __future__ import annotations

import collections.abc
from collections.abc import Iterable

import torch

from tspd_core.feed import row_masks
from tspd_core.ids import RequestId
from tspd_core.sched import RequestScheduler
from tspd_core.sched.request import RequestState
from tspd_engine.loop.hooks import LayerStream, PdHooks, PrefillRow
from tspd_engine.loop.runner import ModelRunner, PrefillChunk
from tspd_engine.loop.sequence import Sequence
from tspd_engine.model.llama import AfterLayer


class PrefillRound:
    """Runs prefill rounds over one rank's scheduler and runner (engine thread only)."""

    def __init__(
        self,
        sched: RequestScheduler,
        runner: ModelRunner,
        hooks: collections.abc.Sequence[PdHooks],
        eos: int,
    ) -> None:
        self.sched = sched
        self.runner = runner
        self.hooks = hooks
        self.eos = eos

    def run(self, running: Iterable[Sequence], budget: int) -> list[tuple[Sequence, int]]:
        """Prefill up to ``budget`` prompt tokens of the PREFILL requests among ``running``
        (in its order; long prompts are chunked across rounds).

        Returns the requests whose prompt KV is now complete, each with its first token (the
        masked argmax of its last prompt position); partial chunks only advance the scheduler.
        """
        chunks: list[PrefillChunk] = []
        seqs: list[Sequence] = []
        for seq in running:
            if budget <= 0:
                break
            rid = RequestId(seq.rid)
            if self.sched.state(rid) != RequestState.PREFILL:
                continue
            tokens = seq.tokens()
            start = self.sched.view(rid).num_tokens  # KV written so far, the prefix hit's too
            n = min(len(tokens) - start, budget)
            table = self.sched.page_table(rid)
            chunks.append(PrefillChunk(start, tokens[start : start + n], table))
            seqs.append(seq)
            budget -= n
        if not chunks:
            return []
        logits = self._forward(seqs, chunks)
        done: list[int] = []
        for i, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            if chunk.start + len(chunk.tokens) < len(seq.tokens()):
                self.sched.advance_prefill(RequestId(seq.rid), len(chunk.tokens))
            else:
                done.append(i)  # the core marks the prompt complete
        if not done:
            return []
        masks = row_masks([seqs[i].banned(len(seqs[i].output), self.eos) for i in done])
        first = self.runner.argmax_host(logits[done], masks)
        return [(seqs[i], int(t)) for i, t in zip(done, first.tolist(), strict=True)]

    def _forward(
        self,
        seqs: collections.abc.Sequence[Sequence],
        chunks: collections.abc.Sequence[PrefillChunk],
    ) -> torch.Tensor:
        """The prefill forward, with the hooks' layer streams (layerwise PD) around it.

        Every stream is closed whether the forward completes or raises, so a stream that counts
        layers (a P rank's step counter) stays aligned with the forwards that follow.
        """
        rows = [_row(seq, chunk) for seq, chunk in zip(seqs, chunks, strict=True)]
        streams = [st for hooks in self.hooks if (st := hooks.before_prefill(rows)) is not None]
        try:
            return self.runner.prefill(list(chunks), _after_layer(streams))
        finally:
            for stream in streams:
                stream.close()


def _row(seq: Sequence, chunk: PrefillChunk) -> PrefillRow:
    end = chunk.start + len(chunk.tokens)
    return PrefillRow(seq.rid, chunk.start, end, end == len(seq.tokens()), chunk.table)


def _after_layer(streams: list[LayerStream]) -> AfterLayer | None:
    if not streams:
        return None  # the model's layer loop then does nothing extra
    if len(streams) == 1:
        return streams[0].after_layer

    def each(layer: int) -> None:
        for stream in streams:
            stream.after_layer(layer)

    return each
