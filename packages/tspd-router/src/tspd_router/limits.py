"""The served model's limits as the nodes report them, and the check of prompt text against
the context before it is tokenized.

One token stands for at most ``max_token_bytes`` bytes of text (the tokenizer's longest piece;
:meth:`~tspd_serving.tokenizer.Tokenizer.least_tokens`), so text of more bytes than the
context's tokens can stand for cannot fit, and :func:`check_text` refuses it without the
tokenizer's work (four 15 MB prompts took SmolLM2's tokenizer 48 s on the router's event loop
and 2.3 GB). Text under that bound is tokenized and its ids checked exactly
(:mod:`tspd_router.validate`). Pure functions, safe on any thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tspd_router.errors import BadRequest
from tspd_serving.tokenizer import MAX_TOKEN_ID


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
