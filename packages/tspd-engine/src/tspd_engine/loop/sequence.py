"""The engine's host-side record of one request: its tokens, what the client saw, stop rules.

The scheduler owns pages and slots, and with them a request's progress while it holds a slot
(state, prompt tokens prefilled, prefix hit of this admission: ``RequestScheduler.view``); a
PD request's transfer is its peer's record (docs/pd.md, "One request, its records"). A
:class:`Sequence` owns what the client sees (prompt, generated tokens, what was already
streamed, the first admission's prefix hit) and the rules that end a request, and lives from
submit to the last output, slot or no slot. Deterministic and rank-independent: every rank
holds the same sequences in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tspd_engine.frames import FinishReason, Output, PdTarget, RequestMode, SamplingParams


@dataclass(slots=True)
class Sequence:
    """One request's host state (mutated by the engine thread only)."""

    rid: str
    prompt: npt.NDArray[np.int32]
    params: SamplingParams
    mode: RequestMode = RequestMode.GENERATE
    output: list[int] = field(default_factory=list)
    #: Prompt tokens served by the prefix cache at the first admission: what the client is
    #: told (the scheduler's prefix hit is the current admission's, and goes with the slot).
    cached: int = 0
    #: Output tokens already sent to the client.
    emitted: int = 0
    finish: FinishReason = FinishReason.NONE
    error: str = ""
    #: Times the request was preempted and recomputed (pages reclaimed under pressure).
    preemptions: int = 0
    #: The scheduler's serial of this admission, kept here because the fed decoder asks, per
    #: row of every round, whether a launched row is still this admission's
    #: (``RowViews.live_rows``): a field read instead of a scheduler view per row.
    serial: int = 0
    #: The final output (with the finish reason) has been handed out.
    reported: bool = False
    #: PD halves: the room and P's bootstrap server (None for colocated requests).
    pd: PdTarget | None = None
    #: Not admissible yet: a PD prefill waits for its room to be Bootstrapped (D ready). The
    #: queue's own fact: the scheduler never sees a waiting request.
    blocked: bool = False

    def tokens(self) -> npt.NDArray[np.int32]:
        """What the scheduler prefills: the prompt, plus tokens generated before a preemption."""
        if not self.output or self.preemptions == 0:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output, dtype=np.int32)])

    @property
    def finished(self) -> bool:
        return self.finish != FinishReason.NONE

    def banned(self, index: int, eos: int) -> tuple[int, ...]:
        """Ids the argmax may not pick for output token ``index`` (``min_tokens``)."""
        if index >= self.params.min_tokens:
            return ()
        ids = (eos, *self.params.stop_token_ids)
        return tuple(dict.fromkeys(ids))[:2]

    def stop_reason(self, token: int, eos: int, context_limit: int) -> FinishReason:
        """Why appending ``token`` (already appended) ends the request, or ``NONE``."""
        p = self.params
        stop = (token == eos and not p.ignore_eos) or token in p.stop_token_ids
        if stop and len(self.output) > p.min_tokens:  # output index len-1 >= min_tokens
            return FinishReason.EOS
        if len(self.output) >= p.max_tokens:
            return FinishReason.LENGTH
        if len(self.prompt) + len(self.output) >= context_limit:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def take_output(self) -> Output | None:
        """The tokens not yet streamed (with the finish reason once finished), or None."""
        fresh = tuple(self.output[self.emitted :])
        if self.reported or (not fresh and not self.finished):
            return None
        self.emitted = len(self.output)
        self.reported = self.finished
        return Output(self.rid, fresh, self.finish, self.error, len(self.prompt), self.cached)
