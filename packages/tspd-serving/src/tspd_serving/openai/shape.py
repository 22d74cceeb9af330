"""OpenAI's response bodies and stream chunks of ``/v1/completions`` and
``/v1/chat/completions``, for one parsed request (:class:`~tspd_serving.openai.api.ApiRequest`)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from tspd_serving.errors import RequestError
from tspd_serving.openai.api import ApiRequest
from tspd_serving.openai.errors import BadRequest
from tspd_serving.tokenizer import Tokenizer


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

    @classmethod
    def of(cls, api: ApiRequest, tokenizer: Tokenizer) -> Shape:
        """A fresh id (``cmpl-…`` / ``chatcmpl-…``) and the echoed prompts' text (a 400 when
        ``echo`` names a prompt the tokenizer cannot decode)."""
        prefix = "chatcmpl-" if api.chat else "cmpl-"
        try:
            echoes = tuple(tokenizer.decode(p) if api.echo else "" for p in api.prompts)
        except (RequestError, ValueError) as exc:
            raise BadRequest(
                f"'echo' needs a prompt the tokenizer can decode: {exc}", "echo"
            ) from exc
        return cls(api, prefix + secrets.token_hex(12), int(time.time()), echoes)

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
