"""The served model's limits, and what a front door checks against them before any engine
sees a prompt.

One token stands for at most ``max_token_bytes`` bytes of text (the tokenizer's longest piece;
:meth:`~tspd_serving.tokenizer.Tokenizer.least_tokens`), so text of more bytes than the
context's tokens can stand for cannot fit, and :func:`check_text` refuses it without the
tokenizer's work (four 15 MB prompts took SmolLM2's tokenizer 48 s on the router's event loop
and 2.3 GB). Text under that bound is tokenized and its ids checked exactly
(:func:`check_prompts`): an id past the vocabulary, or past int32 (``[2147483648]``), is
refused with a 400 rather than travelling to every rank; a prompt that alone fills the context
is refused here, sparing the engines a body of megabytes. The router takes the limits from
the nodes' ``/info`` (the smallest any node reported, so a prompt that passes fits every
node; before any node was reached only the int32 bound applies); a node knows its own. Pure
functions, safe on any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tspd_serving.openai.errors import BadRequest
from tspd_serving.tokenizer import MAX_TOKEN_ID


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The served model's limits (0: not known yet)."""

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


#: Before any node told its limits.
UNKNOWN = ModelLimits()


def check_text(
    nbytes: int,
    least: int,
    max_token_bytes: int | None,
    limits: ModelLimits,
    which: str,
    param: str,
) -> None:
    """:class:`BadRequest` if text of ``nbytes`` bytes, which takes at least ``least`` tokens
    (:meth:`~tspd_serving.tokenizer.Tokenizer.least_tokens`, plus a BOS the tokenizer
    adds), cannot fit the context (no known limit or bound: nothing to check yet)."""
    limit = limits.max_model_len
    if not limit or max_token_bytes is None:
        return
    if least >= limit:
        per = f"{max_token_bytes} bytes" if max_token_bytes > 1 else "1 byte"
        raise BadRequest(
            f"{which} has {nbytes} bytes of text, so at least {least} tokens (one token "
            f"stands for at most {per}), which leaves no room below the context limit {limit}",
            param,
            "context_length_exceeded",
        )  # fmt: skip


def check_prompts(prompts: Sequence[Sequence[int]], limits: ModelLimits, param: str) -> None:
    """:class:`BadRequest` naming the first prompt that cannot be served: empty, filling the
    context alone, or holding an id outside the vocabulary (``param``: the body field the
    prompts came from, ``prompt`` or ``messages``)."""
    for i, prompt in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
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
