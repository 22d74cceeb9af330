"""The router's OpenAI-compatible API as an OpenAPI 3.0 document (``GET /openapi.json``).

Written by hand to say exactly what :mod:`tspd_router.api` accepts (types, ranges, counts)
and what every route answers, so that a client generator reads the real API and a fuzzer
(schemathesis, in the tests) can hold the router to it: valid bodies get a 200 (or a
documented refusal such as a node's), anything else a 4xx in OpenAI's error shape, never a
5xx of the router's own. Fields the router ignores are not listed (extra keys are allowed, as
OpenAI's clients add new ones over time).
"""

from __future__ import annotations

from typing import Any

from tspd_serving.openai.api import COMPLETION_MAX_TOKENS, MAX_PROMPTS, MAX_STOPS

_INT32 = 2**31 - 1
_ID = {"type": "integer", "minimum": 0, "maximum": _INT32}
_IDS = {"type": "array", "items": _ID, "minItems": 1}
_STOP = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS},
    ],
    "nullable": True,
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "the served model (GET /v1/models)"},
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {"include_usage": {"type": "boolean"}},
        "description": "only with stream: true",
    },
    "stop": _STOP,
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
_COMPLETION_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1,
                 "maxItems": MAX_PROMPTS},
                _IDS,
                {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
            ],
        },
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True,
                       "default": COMPLETION_MAX_TOKENS},
        "echo": {"type": "boolean", "nullable": True},
        "best_of": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
    },
}  # fmt: skip
_MESSAGE: dict[str, Any] = {
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
_CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    },
}
_ERROR: dict[str, Any] = {
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
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: {"type": "integer", "minimum": 0}
                   for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}  # fmt: skip
_FINISH = {"type": "string", "enum": ["stop", "length"]}
#: One server-sent event of a stream: ``data:`` holds a chunk (JSON), an error (JSON), or
#: ``[DONE]``.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def _answer(choice: dict[str, Any], obj: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [obj]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


_COMPLETION = _answer(
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                       "finish_reason": _FINISH},
    },
    "text_completion",
)  # fmt: skip
_CHAT = _answer(
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
            "finish_reason": _FINISH,
        },
    },
    "chat.completion",
)  # fmt: skip
#: Every status a generation route may answer besides 200, and when.
_REFUSALS = {
    "400": "malformed or unsupported request, or a node refused it (code says which)",
    "404": "another model than the served one",
    "408": "the body did not arrive within --body-timeout",
    "413": "the body is larger than the router accepts",
    "429": "every node that could take the request is at capacity (code overloaded): retry "
    "after the seconds Retry-After gives",
    "502": "a node or the KV transfer failed",
    "503": "no healthy node of a role",
    "504": "no answer within --request-timeout",
}


#: Headers an error response carries beside its body, by status.
_ERROR_HEADERS = {
    "429": {
        "Retry-After": {
            "description": "seconds to wait before trying again (the longest any node asked)",
            "required": True,
            "schema": {"type": "integer", "minimum": 1},
        }
    }
}


def _errors(statuses: dict[str, str]) -> dict[str, Any]:
    body = {"application/json": {"schema": _ERROR}}
    out: dict[str, Any] = {}
    for code, text in statuses.items():
        out[code] = {"description": text, "content": body}
        if code in _ERROR_HEADERS:
            out[code]["headers"] = _ERROR_HEADERS[code]
    return out


def _generate(summary: str, request: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the answer (JSON), or with stream: true an SSE stream of "
                    "chunks ending with data: [DONE]",
                    "content": {
                        "application/json": {"schema": answer},
                        "text/event-stream": {"schema": _EVENT},
                    },
                },
                **_errors(_REFUSALS),
            },
        }
    }


def openapi_document(model: str | None) -> dict[str, Any]:
    """The document; ``model`` (the served name, None before a node was reached) is the only
    value the ``model`` field takes once known."""
    card = {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["model"]},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"type": "string", "enum": ["list"]},
                       "data": {"type": "array", "items": card}},
    }  # fmt: skip
    plain = {"text/plain": {"schema": {"type": "string"}}}
    health = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {
        "/v1/completions": _generate("a text completion", _COMPLETION_BODY, _COMPLETION),
        "/v1/chat/completions": _generate("a chat completion", _CHAT_BODY, _CHAT),
        "/v1/models": {"get": {
            "summary": "the served model",
            "responses": {"200": {"description": "the list",
                                  "content": {"application/json": {"schema": listing}}}}}},
        "/v1/models/{model}": {"get": {
            "summary": "one model",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": {"description": "the model",
                                  "content": {"application/json": {"schema": card}}},
                          **_errors({"404": "another model than the served one"})}}},
        "/health": {"get": {"summary": "whether every role has a healthy node",
                            "responses": {"200": {"description": "serving", "content": health},
                                          "503": {"description": "a role has no healthy node",
                                                  "content": health}}}},
        "/metrics": {"get": {"summary": "Prometheus text (tspd_router_*)",
                             "responses": {"200": {"description": "metrics", "content": plain}}}},
    }  # fmt: skip
    # Once a node told its model's name, it is the only value served (404 for any other).
    named = {"enum": [model]} if model else {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema["properties"]["model"] = _COMMON["model"] | named
    return {
        "openapi": "3.0.3",
        "info": {"title": "tspd router (OpenAI-compatible)", "version": "1"},
        "paths": paths,
    }
