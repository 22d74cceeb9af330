"""From a dispatcher's token pieces to one choice's OpenAI text deltas (the response bodies
themselves: :mod:`tspd_serving.openai.shape`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from tspd_router.dispatch import Dispatcher
from tspd_router.metrics import RouterMetrics
from tspd_serving.openai.api import GenParams
from tspd_serving.openai.text import TextStream
from tspd_serving.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of one choice; ``finish`` and the token count on the last one. ``ids``: the
    tokens that arrived with it (their text may come in a later delta, while a character is
    incomplete or a stop string may be starting)."""

    text: str
    finish: str | None = None
    tokens: int = 0
    ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """One prompt to generate, and how its tokens become text."""

    rid: str
    prompt: tuple[int, ...]
    params: GenParams
    tokenizer: Tokenizer


async def run_choice(
    dispatcher: Dispatcher, metrics: RouterMetrics, choice: Choice, received: float
) -> AsyncIterator[Delta]:
    """Generate one prompt; stop strings are cut (the request is aborted on the nodes)."""
    rid, prompt, params = choice.rid, choice.prompt, choice.params
    text = TextStream(choice.tokenizer, prompt, params.stop)
    count, first, last = 0, 0.0, 0.0
    async with aclosing(dispatcher.generate(rid, prompt, params)) as pieces:
        async for piece in pieces:
            if piece.tokens:
                last = time.monotonic()
                first = first or last
            count += len(piece.tokens)
            step = text.feed(piece.tokens, piece.finish)
            if step.finish is not None:
                times = (received, first, last) if count else ()
                metrics.completed(len(prompt), count, times)
                yield Delta(step.text, step.finish, count, piece.tokens)
                return
            if step.text or (params.return_token_ids and piece.tokens):
                yield Delta(step.text, None, count, piece.tokens)
