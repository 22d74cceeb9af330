"""What a request must satisfy on its own before it is queued (the engine's refusals).

The checks that need the loop's state — a duplicate id, the hooks' verdicts — stay with the
core; these need only the model's vocabulary and the replica's context and page limits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_engine.loop.sequence import Sequence


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """One replica's limits on a request (identical on every rank)."""

    vocab_size: int
    #: Longest prompt + output, in tokens.
    context_limit: int
    page_size: int
    num_pages: int

    def id_refusal(self, prompt: npt.NDArray[np.int64]) -> str:
        """Why the prompt's ids are not this model's (checked before any narrowing), or ``""``."""
        if prompt.size and (int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size):
            return f"prompt token ids must lie in 0..{self.vocab_size - 1}"
        return ""

    def refusal(self, seq: Sequence) -> str:
        """Why ``seq`` cannot be served here, or ``""``."""
        n, vocab, limit = len(seq.prompt), self.vocab_size, self.context_limit
        if n == 0:
            return "prompt is empty"
        if int(seq.prompt.min()) < 0 or int(seq.prompt.max()) >= vocab:
            return f"prompt token ids must lie in 0..{vocab - 1}"
        if n >= limit:
            return f"prompt of {n} tokens leaves no room below the context limit {limit}"
        if -(-n // self.page_size) > self.num_pages:
            return f"prompt of {n} tokens needs more KV pages than the cache has"
        return ""
