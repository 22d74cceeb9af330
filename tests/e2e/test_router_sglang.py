"""The router's SGLang mode against SGLang-speaking node doubles (tests/e2e/sglang_doubles.py):
the exact bodies it sends P and D (TokenSpeed's ``GenerateReqInput`` fields only, the same
room on both, P's bootstrap address from its ``/server_info`` and URL), the exact tokens it
reads from SSE streams whether their ids are new or cumulative, and SGLang's errors and
aborts as the router's. TokenSpeed's own ``GenerateReqInput`` takes these bodies in
tests/interop/test_sglang_bodies.py; real tspd nodes in SGLang mode in
tests/e2e/test_sglang_gateway.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tspd_router.sglang import generate_body, native_error, node_info, read_event

from .sglang_doubles import BOOTSTRAP_PORT, FIRST, REST, SglangNode, sglang_cluster

COMPLETION = {"model": "tiny", "prompt": "abc", "max_tokens": 5, "return_token_ids": True}


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        return resp.status, await resp.json()


async def _ready(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError("the router never saw both doubles healthy")


@pytest.mark.parametrize("cumulative", [False, True])
@pytest.mark.parametrize("legacy", [False, True])
def test_sglang_mode_sends_generate_req_input_bodies_and_reads_either_stream(
    cumulative: bool, legacy: bool
) -> None:
    p, d = SglangNode("prefill", legacy=legacy), SglangNode("decode", cumulative, legacy)

    async def run() -> tuple[int, Any]:
        async with sglang_cluster(p, d) as url:
            await _ready(url)
            return await _post(url, COMPLETION)

    status, answer = asyncio.run(run())
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == [FIRST, *REST]
    assert answer["usage"]["completion_tokens"] == 5
    ((pb,), (db,)) = (p.bodies, d.bodies)
    room = pb["bootstrap_room"]
    assert type(room) is int
    assert 0 <= room < 2**63
    want = {"input_ids": [256, 97, 98, 99],  # BOS + "abc"
            "sampling_params": {"max_new_tokens": 5, "min_new_tokens": 0, "ignore_eos": False,
                                "temperature": 0.0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOTSTRAP_PORT,
            "bootstrap_room": room}  # fmt: skip
    assert pb == want | {"stream": False}
    assert db == want | {"stream": True}


def test_sglang_errors_become_the_routers() -> None:
    refused = {"error": {"message": "prompt too long", "code": "bad_request"}}
    busy = {"error": {"message": "node at capacity", "code": "busy"}, "busy": True}
    transfer = [{"error": {"message": "P went away", "code": "transfer_failed"}}]
    aborted = [
        {
            "text": "",
            "output_ids": [FIRST],
            "meta_info": {
                "completion_tokens": 1,
                "finish_reason": {"type": "abort", "message": "aborted by the operator"},
            },
        }
    ]

    async def run(p: SglangNode, d: SglangNode) -> tuple[int, Any]:
        async with sglang_cluster(p, d) as url:
            await _ready(url)
            return await _post(url, COMPLETION)

    status, body = asyncio.run(run(SglangNode("prefill", status=400, error=refused),
                                   SglangNode("decode")))  # fmt: skip
    assert (status, body["error"]["code"]) == (400, "refused")
    assert body["error"]["message"] == "the prefill node refused the request: prompt too long"
    status, body = asyncio.run(run(SglangNode("prefill"), SglangNode("decode", events=transfer)))
    assert (status, body["error"]) == (502, {"message": "P went away", "type": "server_error",
                                             "param": None, "code": "transfer_failed"})  # fmt: skip
    status, body = asyncio.run(run(SglangNode("prefill"), SglangNode("decode", events=aborted)))
    assert (status, body["error"]["code"]) == (502, "aborted")
    status, body = asyncio.run(run(SglangNode("prefill", status=503, error=busy),
                                   SglangNode("decode")))  # fmt: skip
    assert (status, body["error"]["code"]) == (429, "overloaded")


def test_generate_body_carries_only_generate_req_input_fields() -> None:
    body = {"input_ids": [1, 2], "max_tokens": 7, "min_tokens": 2, "ignore_eos": True,
            "stop_token_ids": [9, 10], "rid": "r-1",
            "pd": {"room": 5, "bootstrap_host": "10.0.0.2", "bootstrap_port": 8998}}  # fmt: skip
    assert generate_body(body, True) == {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 2, "ignore_eos": True,
                            "temperature": 0.0, "stop_token_ids": [9, 10]},
        "stream": True, "bootstrap_host": "10.0.0.2", "bootstrap_port": 8998,
        "bootstrap_room": 5,
    }  # fmt: skip
    colocated = body | {"pd": None, "stop_token_ids": []}
    assert "bootstrap_room" not in generate_body(colocated, False)


@pytest.mark.parametrize(
    ("event", "seen", "want"),
    [
        ({"output_ids": [7, 8], "meta_info": {"completion_tokens": 2}}, 0, ((7, 8), None, 0)),
        # cumulative: the ids so far, two of them new
        ({"output_ids": [7, 8, 9, 10], "meta_info": {"completion_tokens": 4}}, 2,
         ((9, 10), None, 0)),
        # incremental: only the new ones
        ({"output_ids": [9, 10], "meta_info": {"completion_tokens": 4}}, 2, ((9, 10), None, 0)),
        ({"output_ids": [2], "meta_info": {"completion_tokens": 3, "cached_tokens": 4,
          "finish_reason": {"type": "stop", "matched": 2}}}, 2, ((2,), "eos", 4)),
        ({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length", "length": 9}}},
         8, ((5,), "length", 0)),
    ],
)  # fmt: skip
def test_stream_events_give_exactly_the_new_ids(
    event: dict[str, Any], seen: int, want: tuple[Any, ...]
) -> None:
    assert read_event(event, seen) == want


def test_server_info_becomes_the_routers_node_info() -> None:
    info = {"served_model_name": "m", "model_path": "/models/m", "disaggregation_mode":
            "prefill", "context_length": 8192}  # fmt: skip
    assert node_info(info, "http://p0.internal:30000") == {
        "role": "prefill",
        "model": "m",
        "max_model_len": 8192,
        "bootstrap": "p0.internal:8998",
    }
    assert node_info({"model_path": "m"}, "http://c:1")["role"] == "colocated"
    with pytest.raises(RuntimeError, match="disaggregation_mode 'encode'"):
        node_info({"disaggregation_mode": "encode"}, "http://e:1")
    assert native_error({"error": "plain"}) == {"error": "plain"}
