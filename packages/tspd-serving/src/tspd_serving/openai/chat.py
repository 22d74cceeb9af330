"""OpenAI ``messages`` to a prompt through the served model's chat template.

:func:`messages` checks and normalizes a request's messages into what templates expect:
``{"role", "content"}`` with text content. Roles: ``system`` (``developer`` is read as
system, as OpenAI's newer clients send it), ``user``, ``assistant``. Content is a string or a
list of ``{"type": "text", "text": ...}`` parts (joined); other parts (images, audio) and tool
messages are refused with a clear error.

:func:`chat_prompt` renders them with the tokenizer's template (the model's own, from its
``tokenizer_config.json``, ``chat_template.jinja`` or GGUF metadata; the byte model's is
tspd's plain format below) and tokenizes the result; a template that refuses the conversation
or cannot render it is a 400 naming why.

The byte model's plain format (docs/router.md): BOS, then one line per message
``<|role|>content`` followed by a newline, then ``<|assistant|>`` to prompt the answer::

    <BOS><|system|>You are terse.\\n<|user|>Hi!\\n<|assistant|>
"""

from __future__ import annotations

from typing import Any

from tspd_serving.errors import TemplateError
from tspd_serving.openai.errors import BadRequest
from tspd_serving.openai.limits import UNKNOWN, ModelLimits, check_text
from tspd_serving.tokenizer import ByteTokenizer, ChatText, ContentSpecials, Tokenizer

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_MESSAGES = 1024


def messages(raw: Any) -> list[dict[str, str]]:
    """The request's ``messages`` as ``{"role", "content"}`` text messages (400 if malformed)."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise BadRequest(f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", "messages")
        given = msg.get("role")
        role = ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise BadRequest(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {_shown(given)}",
                "messages",
            )
        out.append({"role": role, "content": _content(msg.get("content"), i)})
    return out


def chat_prompt(
    raw: Any,
    tokenizer: Tokenizer,
    limits: ModelLimits = UNKNOWN,
    content: ContentSpecials = ContentSpecials.PARSE,
) -> tuple[int, ...]:
    """The prompt ids of the request's messages through the model's chat template; the
    rendered text is refused before tokenizing when it cannot fit the context."""
    try:
        chat = tokenizer.chat_text(messages(raw), content)
        least = len(tokenizer.chat_ids(ChatText(("",))))  # a BOS the template leaves out
        least += sum(map(tokenizer.least_tokens, chat.parts))
        check_text(chat.utf8_bytes(), least, tokenizer.max_token_bytes, limits,
                   "the conversation", "messages")  # fmt: skip
        return tuple(tokenizer.chat_ids(chat))
    except TemplateError as exc:
        raise BadRequest(str(exc), "messages", "chat_template_error") from exc


def render(raw: Any) -> str:
    """The byte model's prompt text of a ``messages`` list (BOS is added by the tokenizer)."""
    return ByteTokenizer.render_chat(messages(raw))


def _shown(value: Any) -> str:
    """A client's value in an error message, cut short (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
