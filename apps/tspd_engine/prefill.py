"""One prefill round: chunks of PREFILL requests, admission order, within a token budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tspd_core.feed import row_masks
from tspd_core.ids import RequestId
from tspd_core.sched.request import RequestState
from tspd_engine.hooks import AfterLayer, LayerStream, PrefillRow
from tspd_engine.runner import PrefillChunk
from tspd_engine.sequence import Sequence as Seq

if TYPE_CHECKING:
    from tspd_engine.core import EngineCore


def run_prefill(core: EngineCore, budget: int) -> list[tuple[Seq, int]]:
    """Prefill up to ``budget`` prompt tokens (long prompts are chunked across rounds).

    Returns the requests whose prompt KV is now complete, each with its first token (the
    masked argmax of its last prompt position); partial chunks only advance the scheduler.
    """
    chunks: list[PrefillChunk] = []
    seqs: list[Seq] = []
    for seq in core.running.values():
        if budget <= 0:
            break
        if core.sched.state(RequestId(seq.rid)) != RequestState.PREFILL:
            continue
        tokens = seq.tokens()
        n = min(len(tokens) - seq.prefilled, budget)
        table = core.sched.page_table(RequestId(seq.rid))
        chunks.append(PrefillChunk(seq.prefilled, tokens[seq.prefilled : seq.prefilled + n], table))
        seqs.append(seq)
        budget -= n
    if not chunks:
        return []
    logits = _forward(core, seqs, chunks)
    done: list[int] = []
    for i, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
        seq.prefilled += len(chunk.tokens)
        if seq.prefilled < len(seq.tokens()):
            core.sched.advance_prefill(RequestId(seq.rid), len(chunk.tokens))
        else:
            done.append(i)
    if not done:
        return []
    masks = row_masks([seqs[i].banned(len(seqs[i].output), core.eos) for i in done])
    first = core.runner.argmax_host(logits[done], masks)
    return [(seqs[i], int(t)) for i, t in zip(done, first.tolist(), strict=True)]


def _forward(core: EngineCore, seqs: Sequence[Seq], chunks: Sequence[PrefillChunk]) -> torch.Tensor:
    """The prefill forward, with the hooks' layer streams (layerwise PD) around it.

    Every stream is closed whether the forward completes or raises, so a stream that counts
    layers (a P rank's step counter) stays aligned with the forwards that follow.
    """
    rows = [_row(seq, chunk) for seq, chunk in zip(seqs, chunks, strict=True)]
    streams = [st for hooks in core.hooks if (st := hooks.before_prefill(rows)) is not None]
    try:
        return core.runner.prefill(list(chunks), _after_layer(streams))
    finally:
        for stream in streams:
            stream.close()


def _row(seq: Seq, chunk: PrefillChunk) -> PrefillRow:
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
