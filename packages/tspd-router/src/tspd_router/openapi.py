"""The router's OpenAI-compatible API as an OpenAPI 3.0 document (``GET /openapi.json``).

Written by hand to say exactly what :mod:`tspd_serving.openai.api` accepts (types, ranges, counts;
the bodies' schemas are :mod:`tspd_serving.openai.schema`, shared with the nodes' document)
and what every route answers, so that a client generator reads the real API and a fuzzer
(schemathesis, in the tests) can hold the router to it: valid bodies get a 200 (or a
documented refusal such as a node's), anything else a 4xx in OpenAI's error shape, never a
5xx of the router's own. Fields the router ignores are not listed (extra keys are allowed, as
OpenAI's clients add new ones over time).
"""

from __future__ import annotations

import copy
from typing import Any

from tspd_serving.openai import schema as oa

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
    body = {"application/json": {"schema": oa.ERROR}}
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
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": copy.deepcopy(request)}},
            },
            "responses": {
                "200": {
                    "description": "the answer (JSON), or with stream: true an SSE stream of "
                    "chunks ending with data: [DONE]",
                    "content": {
                        "application/json": {"schema": answer},
                        "text/event-stream": {"schema": oa.EVENT},
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
        "/v1/completions": _generate("a text completion", oa.COMPLETION_BODY,
                                     oa.COMPLETION),
        "/v1/chat/completions": _generate("a chat completion", oa.CHAT_BODY, oa.CHAT),
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
        schema["properties"]["model"] = oa.COMMON["model"] | named
    return {
        "openapi": "3.0.3",
        "info": {"title": "tspd router (OpenAI-compatible)", "version": "1"},
        "paths": paths,
    }
