"""Every body tspd's router sends in SGLang mode (``--node-api sglang``) is one TokenSpeed's
own request class takes: each is given to TokenSpeed's ``GenerateReqInput`` as its HTTP layer
would (``GenerateReqInput(**body)``, ``normalize_batch_and_arguments()``) and its
``sampling_params`` to TokenSpeed's ``SamplingParams`` (``verify`` against the vocabulary).

The bodies are the ones the router really sent, recorded by SGLang-speaking node doubles
(tests/e2e/sglang_doubles.py) for completions, chat and streams, with ``min_tokens``,
``ignore_eos`` and extra stop ids; the same room and prefill bootstrap address reach both
halves, and TokenSpeed reads them back as one request with greedy sampling (``top_k`` 1).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)
tokenspeed_env.load()

from tokenspeed.runtime.engine.io_struct import GenerateReqInput  # noqa: E402
from tokenspeed.runtime.sampling.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from sglang_doubles import BOOTSTRAP_PORT, SglangNode, sglang_cluster  # noqa: E402

from tspd_router.sglang import generate_body  # noqa: E402

VOCAB = 259  # the byte model's
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 5}),
    ("/v1/completions", {"model": "tiny", "prompt": [65, 66], "max_tokens": 3, "stream": True,
                         "min_tokens": 2, "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 2, "stream": True}),
]  # fmt: skip


def _accepted(body: dict[str, Any]) -> tuple[GenerateReqInput, Any]:
    """TokenSpeed's request and sampling parameters of ``body``, as its server builds them."""
    request = GenerateReqInput(**body)
    request.normalize_batch_and_arguments()
    params = SamplingParams(**request.sampling_params)
    params.verify(VOCAB)
    return request, params


def test_every_body_the_router_sends_is_a_generate_req_input() -> None:
    p, d = SglangNode("prefill"), SglangNode("decode")

    async def run() -> None:
        async with sglang_cluster(p, d) as url, aiohttp.ClientSession() as session:
            for _ in range(200):
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            for path, body in REQUESTS:
                async with session.post(url + path, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()

    asyncio.run(run())
    assert len(p.bodies) == len(d.bodies) == len(REQUESTS)
    for (_, sent), pb, db in zip(REQUESTS, p.bodies, d.bodies, strict=True):
        for half, body in (("prefill", pb), ("decode", db)):
            request, params = _accepted(body)
            assert request.is_single, half
            assert (request.bootstrap_host, request.bootstrap_port) == ("127.0.0.1", BOOTSTRAP_PORT)
            assert request.bootstrap_room == pb["bootstrap_room"]
            assert request.stream is (half == "decode")  # D streams, P answers once
            assert params.top_k == 1  # temperature 0: greedy in TokenSpeed's terms
            want = sent.get("max_tokens") or sent.get("max_completion_tokens")
            assert params.max_new_tokens == want
            assert params.min_new_tokens == sent.get("min_tokens", 0)
            assert params.ignore_eos is sent.get("ignore_eos", False)
        assert pb["input_ids"] == db["input_ids"]


def test_stop_ids_and_a_colocated_body_are_generate_req_inputs_too() -> None:
    body = {"input_ids": [1, 2], "max_tokens": 7, "min_tokens": 2, "ignore_eos": False,
            "stop_token_ids": [9, 10], "rid": "r-1", "pd": None}  # fmt: skip
    request, params = _accepted(generate_body(body, False))
    assert request.bootstrap_room is None
    assert params.stop_token_ids == {9, 10}
    assert request.rid != "r-1"  # TokenSpeed assigns its own: the router sends none
