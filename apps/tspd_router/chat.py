"""The chat template for the byte-level reference model.

The seeded reference model was never trained on a chat format, so tspd defines a plain one
(documented in docs/router.md): BOS, then one line per message ``<|role|>content`` followed by
a newline, then ``<|assistant|>`` to prompt the answer::

    <BOS><|system|>You are terse.\\n<|user|>Hi!\\n<|assistant|>

Roles: ``system`` (``developer`` is read as system), ``user``, ``assistant``. Content is a
string or a list of ``{"type": "text", "text": ...}`` parts; other parts (images, audio) and
tool messages are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

from tspd_router.errors import BadRequest

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
GENERATION_PROMPT = "<|assistant|>"


def render(messages: Any) -> str:
    """The prompt text of an OpenAI ``messages`` list (BOS is added by the tokenizer)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    lines = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        role = ROLES.get(msg.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise BadRequest(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {msg.get('role')!r}",
                "messages",
            )
        lines.append(f"<|{role}|>{_content(msg.get('content'), i)}\n")
    return "".join(lines) + GENERATION_PROMPT


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(
                    f"messages[{i}].content: only text parts are supported by this model",
                    "messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"messages[{i}].content: a text part needs 'text'", "messages")
            parts.append(text)
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
