"""What the router checks itself before a prompt reaches any node.

A parsed request (:mod:`tspd_router.api`) holds prompts as token ids, but nothing yet says
they fit the model: an id past the vocabulary, or past int32 (``[2147483648]``), must be
refused here with a 400 rather than travel to every rank; a prompt that alone fills the
context would be refused by the nodes anyway, and refusing it here spares them a body of
megabytes. The limits come from the nodes' ``/info`` (``vocab_size``, ``max_model_len``):
the smallest any node reported, so a prompt that passes fits every node. Before any node was
reached only the int32 bound applies (the request then fails on the missing node, 503).

Prompt *text* was checked before it was tokenized (:func:`tspd_router.limits.check_text`).
"""

from __future__ import annotations

from tspd_router.api import ApiRequest
from tspd_router.errors import BadRequest
from tspd_router.limits import UNKNOWN, ModelLimits, check_text

__all__ = ["UNKNOWN", "ModelLimits", "check_prompts", "check_text"]


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
