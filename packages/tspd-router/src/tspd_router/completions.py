"""From a dispatcher's token pieces to OpenAI text: one choice's text deltas, and the
response bodies and stream chunks of ``/v1/completions`` and ``/v1/chat/completions``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tspd_router.api import ApiRequest, GenParams
from tspd_router.dispatch import Dispatcher
from tspd_router.metrics import RouterMetrics
from tspd_router.text import Detokenizer, StopMatcher
from tspd_serving.tokenizer import Tokenizer

#: The node's finish reasons in OpenAI's words (a matched stop string is "stop" too).
FINISH = {"eos": "stop", "length": "length"}


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
    detok, stopper = Detokenizer(choice.tokenizer, prompt), StopMatcher(params.stop)
    count, first, last = 0, 0.0, 0.0
    async with aclosing(dispatcher.generate(rid, prompt, params)) as pieces:
        async for piece in pieces:
            if piece.tokens:
                last = time.monotonic()
                first = first or last
            count += len(piece.tokens)
            text = stopper.feed(detok.feed(piece.tokens))
            finish = "stop" if stopper.stopped else None
            if finish is None and piece.finish is not None:
                text += stopper.feed(detok.flush())
                text += stopper.flush()
                finish = "stop" if stopper.stopped else FINISH[piece.finish]
            if finish is not None:
                times = (received, first, last) if count else ()
                metrics.completed(len(prompt), count, times)
                yield Delta(text, finish, count, piece.tokens)
                return
            if text or (params.return_token_ids and piece.tokens):
                yield Delta(text, None, count, piece.tokens)


@dataclass(frozen=True, slots=True)
class Answer:
    """One choice's whole answer (non-streamed)."""

    text: str
    finish: str
    tokens: int
    ids: tuple[int, ...] = ()


@dataclass(slots=True)
class Shape:
    """Builds one request's OpenAI bodies (its id, creation time, model and kind)."""

    api: ApiRequest
    rid: str
    created: int
    echoes: tuple[str, ...]  # completions with echo: each prompt's text, else ""

    @property
    def object(self) -> str:
        return "chat.completion" if self.api.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.api.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = sum(len(p) for p in self.api.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def response(self, choices: list[Answer]) -> dict[str, Any]:
        """The whole (non-streamed) body, one :class:`Answer` per prompt."""
        items = []
        for i, answer in enumerate(choices):
            item: dict[str, Any] = {"index": i, "logprobs": None, "finish_reason": answer.finish}
            if self.api.chat:
                item["message"] = {"role": "assistant", "content": answer.text}
            else:
                item["text"] = self.echoes[i] + answer.text
            if self.api.params.return_token_ids:
                item["token_ids"] = list(answer.ids)
            items.append(item)
        usage = self.usage(sum(c.tokens for c in choices))
        return self._head(self.object) | {"choices": items, "usage": usage}

    def chunk(
        self, index: int, text: str | None, finish: str | None, ids: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        """One stream event; chat's first event of a choice (``text=None``) names the role."""
        choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if self.api.params.return_token_ids and text is not None:
            choice["token_ids"] = list(ids)
        if self.api.chat:
            choice["delta"] = (
                {"role": "assistant", "content": ""} if text is None else {"content": text}
            )
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice["text"] = text or ""
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.api.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": self.usage(completion_tokens)}
