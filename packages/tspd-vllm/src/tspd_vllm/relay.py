"""The sequential flow's bodies: P's first token goes to the client at once and into D's
prompt, and D's completion is relayed in the client's own shape (completion or chat).

Why D gets P's first token: D then computes that token's forward as a colocated vLLM
computes its second one (one query token over the prompt's KV, which P's prefill wrote
exactly as a colocated prefill does), so greedy outputs equal a colocated vLLM's token for
token. Without it (vLLM's own proxy flow, and the concurrent flow) D recomputes the last
prompt token on its own, a forward a colocated prefill never runs: its K/V differ in the last
bits and a near-tie can turn later (here: 1 prompt of 8, at its 17th token).

Pure functions of JSON values; any thread.
"""

from __future__ import annotations

import time
from typing import Any

#: What D takes over from the client's request (sampling, stopping, what to return).
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "return_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream",
    "stream_options",
    "min_tokens",
)


def max_new(body: dict[str, Any]) -> int | None:
    """The client's token budget (chat's ``max_completion_tokens`` wins over ``max_tokens``)."""
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_ids(p_answer: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids P answered (a completion's choice or a chat's top level)."""
    ids = p_answer.get("prompt_token_ids")
    if ids is None:
        choices = p_answer.get("choices") or [{}]
        ids = choices[0].get("prompt_token_ids")
    return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def first_token(p_answer: dict[str, Any], chat: bool) -> tuple[int, str, str | None] | None:
    """P's first token, its text and P's finish reason (None: P answered no token)."""
    choices = p_answer.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or len(ids) != 1 or not isinstance(ids[0], int):
        return None
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    return ids[0], text or "", choice.get("finish_reason")


def decode_body(
    client: dict[str, Any], model: Any, prompt: list[int], budget: int | None, params: Any
) -> dict[str, Any]:
    """D's completion request: the prompt with P's first token, the rest of the budget."""
    body = {k: client[k] for k in SAMPLING if k in client}
    body.update(model=model, prompt=prompt, kv_transfer_params=params)
    if budget is not None:
        body["max_tokens"] = budget - 1
    return body


def _usage(usage: Any, prompt_len: int) -> Any:
    if not isinstance(usage, dict):
        return usage
    completion = int(usage.get("completion_tokens") or 0) + 1
    return {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion}  # fmt: skip


def merged_answer(
    chat: bool, d_answer: dict[str, Any], first: tuple[int, str], prompt_len: int, ids: bool
) -> dict[str, Any]:
    """The client's non-streamed answer: P's first token, then D's completion."""
    token, text = first
    choice = (d_answer.get("choices") or [{}])[0]
    out_ids = [token, *(choice.get("token_ids") or [])] if ids else None
    full = text + (choice.get("text") or "")
    usage = _usage(d_answer.get("usage"), prompt_len)
    base = {"id": d_answer.get("id"), "created": d_answer.get("created", int(time.time())),
            "model": d_answer.get("model"), "usage": usage}  # fmt: skip
    if not chat:
        merged = dict(choice, text=full, token_ids=out_ids)
        return base | {"object": "text_completion", "choices": [merged]}
    message = {"role": "assistant", "content": full}
    merged = {"index": 0, "message": message, "finish_reason": choice.get("finish_reason"),
              "token_ids": out_ids}  # fmt: skip
    return base | {"object": "chat.completion", "choices": [merged]}


def p_only_answer(chat: bool, p_answer: dict[str, Any]) -> dict[str, Any]:
    """P's answer as the client's (P's first token ended the request): no transfer params."""
    return {k: v for k, v in p_answer.items() if k != "kv_transfer_params"}


def first_chunk(
    chat: bool, first: tuple[int, str], model: Any, rid: str, ids: bool, finish: str | None
) -> dict[str, Any]:
    """The stream's first event: P's first token, sent the moment P answered."""
    token, text = first
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if ids:
        choice["token_ids"] = [token]
    if chat:
        choice["delta"] = {"role": "assistant", "content": text}
        kind = "chat.completion.chunk"
    else:
        choice["text"] = text
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [choice]}  # fmt: skip


def relay_chunk(chat: bool, chunk: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """One of D's completion stream events in the client's shape (usage counts P's token)."""
    out = dict(chunk)
    if "usage" in out and out["usage"] is not None:
        out["usage"] = _usage(out["usage"], prompt_len)
    if not chat:
        return out
    choices = []
    for choice in chunk.get("choices") or []:
        converted = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")},
                     "finish_reason": choice.get("finish_reason")}  # fmt: skip
        if "token_ids" in choice:
            converted["token_ids"] = choice["token_ids"]
        choices.append(converted)
    out.update(object="chat.completion.chunk", choices=choices)
    return out
