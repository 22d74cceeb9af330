"""What the router checks itself before a prompt reaches any node.

A parsed request (:mod:`tspd_router.api`) holds prompts as token ids, but nothing yet says
they fit the model: an id past the vocabulary, or past int32 (``[2147483648]``), must be
refused here with a 400 rather than travel to every rank; a prompt that alone fills the
context would be refused by the nodes anyway, and refusing it here spares them a body of
megabytes. The limits come from the nodes' ``/info`` (``vocab_size``, ``max_model_len``):
the smallest any node reported, so a prompt that passes fits every node. Before any node was
reached only the int32 bound applies (the request then fails on the missing node, 503).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tspd_engine.frames import MAX_TOKEN_ID
from tspd_router.api import ApiRequest
from tspd_router.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The served model's limits as the nodes report them (0: not known yet)."""

    vocab_size: int = 0
    max_model_len: int = 0

    @classmethod
    def of(cls, infos: Iterable[Mapping[str, Any]]) -> ModelLimits:
        """The tightest limits any node reported (a node's ``/info``)."""
        vocab: list[int] = []
        context: list[int] = []
        for info in infos:
            for key, into in (("vocab_size", vocab), ("max_model_len", context)):
                value = info.get(key)
                if type(value) is int and value > 0:
                    into.append(value)
        return cls(min(vocab, default=0), min(context, default=0))

    @property
    def top_id(self) -> int:
        return self.vocab_size - 1 if self.vocab_size else MAX_TOKEN_ID


def check_prompts(api: ApiRequest, limits: ModelLimits) -> None:
    """:class:`BadRequest` naming the first prompt that cannot be served (see the module)."""
    param = "messages" if api.chat else "prompt"
    for i, prompt in enumerate(api.prompts):
        which = f"prompt {i}" if len(api.prompts) > 1 else "the prompt"
        if not prompt:
            raise BadRequest(f"{which} is empty", param)
        if limits.max_model_len and len(prompt) >= limits.max_model_len:
            raise BadRequest(
                f"{which} has {len(prompt)} tokens, which leaves no room below the context "
                f"limit {limits.max_model_len}",
                param,
                "context_length_exceeded",
            )
        top = limits.top_id
        bad = next((t for t in prompt if not 0 <= t <= top), None)
        if bad is not None:
            raise BadRequest(
                f"token id {bad} in {which} is outside the model's vocabulary 0..{top}", param
            )
