"""OpenAI's request and response bodies as OpenAPI 3.0 schemas: what
:mod:`tspd_serving.openai.api` accepts (types, ranges, counts) and what
:mod:`tspd_serving.openai.shape` answers, for the documents the router (``GET /openapi.json``)
and the nodes serve. Fields the parser ignores are not listed (extra keys are allowed)."""

from __future__ import annotations

from typing import Any

from tspd_serving.openai.api import COMPLETION_MAX_TOKENS, MAX_PROMPTS, MAX_STOPS

INT32 = 2**31 - 1
ID = {"type": "integer", "minimum": 0, "maximum": INT32}
IDS = {"type": "array", "items": ID, "minItems": 1}
STOP = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
    ],
    "nullable": True,
}
COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "the served model (GET /v1/models)"},
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {"include_usage": {"type": "boolean"}},
        "description": "only with stream: true",
    },
    "stop": STOP,
    "min_tokens": {"type": "integer", "minimum": 0, "nullable": True},
    "ignore_eos": {"type": "boolean", "nullable": True},
    "seed": {"type": "integer", "nullable": True, "description": "ignored: decoding is greedy"},
    "temperature": {
        "type": "number",
        "minimum": 0,
        "maximum": 2,
        "nullable": True,
        "description": "greedy only: > 0 is refused (sampling_not_supported) unless the "
        "router runs with --accept-sampling",
    },
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
}
COMPLETION_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **COMMON,
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1,
                 "maxItems": MAX_PROMPTS},
                IDS,
                {"type": "array", "items": IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
            ],
        },
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True,
                       "default": COMPLETION_MAX_TOKENS},
        "echo": {"type": "boolean", "nullable": True},
        "best_of": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
    },
}  # fmt: skip
MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
    },
}
CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **COMMON,
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    },
}
ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string"},
            },
        }
    },
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: {"type": "integer", "minimum": 0}
                   for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}  # fmt: skip
FINISH = {"type": "string", "enum": ["stop", "length"]}
#: One server-sent event of a stream: ``data:`` holds a chunk (JSON), an error (JSON), or
#: ``[DONE]``.
EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def answer(choice: dict[str, Any], obj: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [obj]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": USAGE,
        },
    }


COMPLETION = answer(
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                       "finish_reason": FINISH},
    },
    "text_completion",
)  # fmt: skip
CHAT = answer(
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string", "enum": ["assistant"]},
                               "content": {"type": "string"}},
            },
            "finish_reason": FINISH,
        },
    },
    "chat.completion",
)  # fmt: skip
