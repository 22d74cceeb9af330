"""One prefill round: chunks of PREFILL requests, admission order, within a token budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tspd_core.feed import row_masks
from tspd_core.ids import RequestId
from tspd_core.sched.request import RequestState
from tspd_engine.runner import PrefillChunk
from tspd_engine.sequence import Sequence

if TYPE_CHECKING:
    from tspd_engine.core import EngineCore


def run_prefill(core: EngineCore, budget: int) -> list[tuple[Sequence, int]]:
    """Prefill up to ``budget`` prompt tokens (long prompts are chunked across rounds).

    Returns the requests whose prompt KV is now complete, each with its first token (the
    masked argmax of its last prompt position); partial chunks only advance the scheduler.
    """
    chunks: list[PrefillChunk] = []
    seqs: list[Sequence] = []
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
    logits = core.runner.prefill(chunks)
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
