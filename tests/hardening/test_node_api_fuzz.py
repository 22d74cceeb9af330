"""A node's SGLang-shaped and OpenAI routes under schemathesis, from the node's own OpenAPI
document (``GET /openapi.json``: tspd_engine/node/openapi.py), as the router's doors are in
test_cluster_doors.py: positive and negative bodies for SGLang's ``/generate``, ``/v1/completions``
and ``/v1/chat/completions``, and the gateway's GETs; checks: no 5xx, documented statuses and
content types, bodies that match the document (and, for the OpenAI routes, invalid bodies
refused). Then the node still answers a known prompt exactly and holds nothing.

The node is a real endpoint over a real in-process engine (colocated: a PD body names a room,
which such a node refuses at its door; the P and D nodes parse with the same code, and their
PD halves are tested through the gateway in tests/e2e/test_sglang_gateway.py).
``/generate`` also takes the node's own shape, which accepts bodies SGLang's schema calls
invalid (``{"text": "x"}``), so its negative run does not hold it to refusing them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import requests
import schemathesis
import torch
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.config import ModelConfig
from tspd_engine.node.endpoint import make_app
from tspd_engine.rank.launch import launch
from tspd_serving.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.multiproc]

TOK = ByteTokenizer()
CFG = EngineConfig(model=ModelConfig(), num_pages=96, page_size=4, max_running=8)
#: Valid bodies may ask for any length; the fuzz caps them so it stays bounded in time.
FUZZ_MAX_TOKENS = 3
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]  # fmt: skip


@pytest.fixture(scope="module")
def node() -> Iterator[str]:
    torch.set_num_threads(1)
    with launch(CFG, in_process=True) as handle:
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(make_app(handle.client, TOK), handler_cancellation=True)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        assert started.wait(30)
        try:
            yield f"http://127.0.0.1:{runner.addresses[0][1]}"
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def _cap(body: object) -> None:
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) is int and body[key] > FUZZ_MAX_TOKENS:
            body[key] = FUZZ_MAX_TOKENS
    sp = body.get("sampling_params")
    if isinstance(sp, dict) and type(sp.get("max_new_tokens")) is int:
        sp["max_new_tokens"] = min(sp["max_new_tokens"], FUZZ_MAX_TOKENS)
    if "max_new_tokens" not in (sp or {}) and isinstance(sp, dict):
        sp["max_new_tokens"] = FUZZ_MAX_TOKENS  # SGLang's default, 128, is a long fuzz


def _fuzz(url: str, path: str, method: str, mode: GenerationMode, examples: int) -> None:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operation = schema[path][method]
    rejects = mode is GenerationMode.NEGATIVE and path != "/generate"
    checks = [*CHECKS, negative_data_rejection] if rejects else CHECKS

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        _cap(case.body)
        response = case.call(base_url=url, timeout=60)
        case.validate_response(response, checks=checks)

    run()


@pytest.fixture(scope="module")
def known() -> list[int]:
    """What a colocated engine of the node's model answers to "known" (6 tokens)."""
    engine = Engine(CFG)
    try:
        (want,) = engine.generate([TOK.encode("known")], SamplingParams(6, ignore_eos=True))
    finally:
        engine.close()
    return list(want.tokens)


@pytest.mark.parametrize(
    ("path", "method", "mode", "examples"),
    [("/generate", "POST", GenerationMode.POSITIVE, 30),
     ("/generate", "POST", GenerationMode.NEGATIVE, 30),
     ("/v1/completions", "POST", GenerationMode.POSITIVE, 20),
     ("/v1/completions", "POST", GenerationMode.NEGATIVE, 20),
     ("/v1/chat/completions", "POST", GenerationMode.POSITIVE, 15),
     ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE, 15),
     ("/server_info", "GET", GenerationMode.POSITIVE, 2),
     ("/get_load", "GET", GenerationMode.POSITIVE, 2),
     ("/health_generate", "GET", GenerationMode.POSITIVE, 2)],
)  # fmt: skip
def test_the_nodes_new_routes_hold_under_schemathesis(
    node: str, known: list[int], path: str, method: str, mode: GenerationMode, examples: int
) -> None:
    _fuzz(node, path, method, mode, examples)
    body = {"text": "known", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    answer = requests.post(node + "/generate", json=body, timeout=60).json()
    assert answer["output_ids"] == known
    stats = requests.get(node + "/stats", timeout=60).json()["replicas"][0]
    assert stats["running"] == stats["waiting"] == 0
    assert stats["reclaimable_pages"] == stats["initial_free_pages"]
