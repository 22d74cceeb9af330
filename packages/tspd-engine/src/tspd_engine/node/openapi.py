"""A node's SGLang-shaped and OpenAI routes as an OpenAPI 3.0 document (``GET /openapi.json``
on a node): SGLang's ``/generate`` body and answer, the OpenAI bodies as the router takes
them (:mod:`tspd_serving.openai.schema`) with the top-level ``bootstrap_*`` fields, and what
SGLang's gateway reads. Written by hand so a fuzzer (schemathesis, tests/hardening) can hold
the node to it: no 5xx of its own, only documented statuses and bodies. (``/generate`` also
takes the node's own shape, whose errors are plain strings: its error body says either.)
"""

from __future__ import annotations

import copy
from typing import Any

from tspd_engine.frames import MAX_RID_CHARS
from tspd_serving.openai import schema as oa

_OBJECT: dict[str, Any] = {"type": "object"}
_BOOTSTRAP: dict[str, Any] = {
    "bootstrap_host": {"type": "string", "minLength": 1, "nullable": True},
    "bootstrap_port": {"type": "integer", "minimum": 1, "maximum": 65535, "nullable": True},
    "bootstrap_room": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1, "nullable": True,
                       "description": "run this node's PD half (a colocated node refuses it)"},
}  # fmt: skip
_SAMPLING: dict[str, Any] = {
    "type": "object",
    "nullable": True,
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 1, "nullable": True, "default": 128},
        "min_new_tokens": {"type": "integer", "minimum": 0, "nullable": True},
        "stop": oa.STOP,
        "stop_token_ids": {"type": "array", "items": oa.ID, "nullable": True},
        "ignore_eos": {"type": "boolean", "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": 0, "nullable": True,
                        "description": "greedy only: > 0 is refused unless top_k is 1"},
        "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
    },
}  # fmt: skip
_GENERATE_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["sampling_params"],
    "properties": {
        "text": {"type": "string"},
        "input_ids": oa.IDS,
        "sampling_params": _SAMPLING,
        "stream": {"type": "boolean", "nullable": True},
        "rid": {"type": "string", "minLength": 1, "maxLength": MAX_RID_CHARS, "nullable": True},
        **_BOOTSTRAP,
    },
}
_META: dict[str, Any] = {
    "type": "object",
    "required": ["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"],
    "properties": {
        "id": {"type": "string"},
        "finish_reason": {"type": "object", "nullable": True},
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "cached_tokens": {"type": "integer", "minimum": 0},
    },
}
_GENERATE: dict[str, Any] = {
    "type": "object",
    "required": ["text", "output_ids", "meta_info"],
    "properties": {"text": {"type": "string"}, "output_ids": {"type": "array", "items": oa.ID},
                   "meta_info": _META},
}  # fmt: skip
#: /generate's errors: OpenAI's body for SGLang's shape, a plain string for the node's own.
_EITHER_ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"oneOf": [{"type": "string"}, oa.ERROR["properties"]["error"]]}},
}
_REFUSALS = {
    "400": "a malformed or unsupported request, or the engine refused it (code says which)",
    "404": "another model than the served one",
    "408": "the body did not arrive in time",
    "413": "the body is larger than the node accepts",
    "503": "busy (Retry-After, busy: true), the PD transfer failed or the engine is gone",
}


def _errors(schema: dict[str, Any], statuses: dict[str, str]) -> dict[str, Any]:
    body = {"application/json": {"schema": schema}}
    return {code: {"description": text, "content": body} for code, text in statuses.items()}


def _post(summary: str, request: dict[str, Any], answer: dict[str, Any],
          error: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": copy.deepcopy(request)}}},
        "responses": {
            "200": {"description": "the answer, or with stream: true SSE events ending with "
                                   "data: [DONE]",
                    "content": {"application/json": {"schema": answer},
                                "text/event-stream": {"schema": oa.EVENT}}},
            **_errors(error, _REFUSALS),
        },
    }}  # fmt: skip


def _get(summary: str, statuses: tuple[str, ...] = ("200",)) -> dict[str, Any]:
    json_object = {"application/json": {"schema": _OBJECT}}
    return {"get": {"summary": summary, "responses": {
        code: {"description": summary, "content": json_object} for code in statuses}}}  # fmt: skip


def openapi_document(model: str) -> dict[str, Any]:
    """The document of a node serving ``model`` (the only value ``model`` takes)."""
    completion = copy.deepcopy(oa.COMPLETION_BODY)
    chat = copy.deepcopy(oa.CHAT_BODY)
    for body in (completion, chat):
        body["properties"] |= _BOOTSTRAP | {"model": oa.COMMON["model"] | {"enum": [model]}}
    paths: dict[str, Any] = {
        "/generate": _post("SGLang's /generate", _GENERATE_BODY, _GENERATE, _EITHER_ERROR),
        "/v1/completions": _post("a text completion", completion, oa.COMPLETION, oa.ERROR),
        "/v1/chat/completions": _post("a chat completion", chat, oa.CHAT, oa.ERROR),
        "/server_info": _get("the node's settings in SGLang's names"),
        "/model_info": _get("the served model"),
        "/get_load": {"get": {"summary": "each replica's load", "responses": {
            "200": {"description": "one entry per replica", "content": {"application/json": {
                "schema": {"type": "array", "items": _OBJECT}}}},
            "503": {"description": "the replicas did not answer",
                    "content": {"application/json": {"schema": _OBJECT}}}}}},
        "/health_generate": _get("one token through a replica", ("200", "503")),
    }  # fmt: skip
    return {
        "openapi": "3.0.3",
        "info": {"title": "tspd node (SGLang's and OpenAI's routes)", "version": "1"},
        "paths": paths,
    }
