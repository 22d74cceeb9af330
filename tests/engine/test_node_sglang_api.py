"""A node's SGLang-shaped and OpenAI routes over a real aiohttp server and a real (in-process)
engine: SGLang's ``/generate`` (plain and streamed, stop strings, refusals), the OpenAI routes
answered as the router answers them, and what SGLang's model gateway asks a worker
(``/server_info``, ``/model_info``, ``/get_load``, ``/health_generate``, ...). Every answer is
compared token for token with a colocated engine. The PD target rules (top-level
``bootstrap_*``) are tested on their own, without a cluster, at the end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tspd_engine.frames import PdTarget, SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.node.endpoint import make_app
from tspd_engine.node.replicas import NodeInfo, NodeRole
from tspd_engine.node.target import DEFAULT_BOOTSTRAP_PORT, reached_host, top_level_target
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_serving.errors import RequestError
from tspd_serving.openai.chat import render

from .conftest import TOK, small_config
from .test_engine_server import _serving

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineHandle]:
    with launch(small_config(), in_process=True) as handle:
        yield handle


@pytest.fixture(scope="module")
def url(engine: EngineHandle) -> Iterator[str]:
    with _serving(make_app(engine.client, TOK)) as base:
        yield base


def _want(prompt: list[int], max_tokens: int, **kw: Any) -> list[int]:
    (out,) = Engine(small_config()).generate([prompt], SamplingParams(max_tokens, **kw))
    return list(out.tokens)


def _events(resp: requests.Response) -> list[Any]:
    """The SSE events of a stream: each ``data:`` payload parsed, ``[DONE]`` as the string."""
    out: list[Any] = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :]
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


# -- SGLang's /generate -------------------------------------------------------------------


@pytest.mark.multiproc
def test_sglang_generate_answers_in_sglangs_shape(url: str) -> None:
    ids = _want(TOK.encode(PROMPT), 9, ignore_eos=True)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 9, "ignore_eos": True,
            "temperature": 0}, "model": None, "log_metrics": True}  # fmt: skip
    answer = requests.post(f"{url}/generate", json=body, timeout=60).json()
    assert answer["output_ids"] == ids
    assert answer["text"] == TOK.decode(ids)
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(TOK.encode(PROMPT)), 9)
    assert meta["cached_tokens"] >= 0
    assert meta["e2e_latency"] > 0
    assert isinstance(meta["id"], str)
    assert meta["id"]


@pytest.mark.multiproc
def test_sglang_stream_events_carry_the_whole_text_and_the_new_ids(url: str) -> None:
    prompt = TOK.encode("stream me")
    ids = _want(prompt, 7, ignore_eos=True)
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}}  # fmt: skip
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = _events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [t for e in chunks for t in e["output_ids"]] == ids
    assert chunks[-1]["text"] == TOK.decode(ids)
    assert all(e["meta_info"]["finish_reason"] is None for e in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    seen, text = 0, ""
    for event in chunks:  # the text only grows, and completion_tokens counts the ids so far
        assert event["text"].startswith(text)
        text = event["text"]
        seen += len(event["output_ids"])
        assert event["meta_info"]["completion_tokens"] == seen


@pytest.mark.multiproc
def test_sglang_stop_string_cuts_the_text_and_names_the_match(url: str) -> None:
    prompt = TOK.encode(PROMPT)
    full = TOK.decode(_want(prompt, 24, ignore_eos=True))
    stop = full[5:7]
    cut = full[: full.index(stop)]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True,
            "stop": [stop]}}  # fmt: skip
    answer = requests.post(f"{url}/generate", json=body, timeout=60).json()
    assert answer["text"] == cut
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["meta_info"]["completion_tokens"] < 24  # the request was aborted early


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"text": "x", "sampling_params": {"temperature": 0.7}}, 400,
         "this deployment decodes greedily: set 'temperature' to 0 or 'top_k' to 1, or leave "
         "both out (got temperature=0.7, top_k=None)"),
        ({"text": ["a", "b"], "sampling_params": {}}, 400,
         "'text' must be a string or 'input_ids' a list of integers: one prompt per request "
         "(lists of prompts are not served here)"),
        # (a bare client's node does not know its vocabulary: the engine refuses the id)
        ({"input_ids": [5000], "sampling_params": {}}, 400,
         "prompt token ids must lie in 0..258"),
        ({"text": "x", "sampling_params": {"n": 2}}, 400,
         "'n' must be 1: greedy decoding gives n equal answers"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400,
         "'max_new_tokens' must be an integer >= 1"),
        ({"text": "x", "sampling_params": {"regex": "a+"}}, 400,
         "'regex' is not supported by this deployment"),
        ({"text": "x", "bootstrap_room": 7, "bootstrap_host": "127.0.0.1"}, 400,
         "this node serves colocated requests only: it has no PD peer"),
        ({"text": "x", "bootstrap_room": -1}, 400,
         "'bootstrap_room' must be an integer in 0..2**63-1 (one prompt per room), got -1"),
    ],
)  # fmt: skip
def test_sglang_refusals_are_openai_error_bodies(
    url: str, body: dict[str, Any], status: int, message: str
) -> None:
    resp = requests.post(f"{url}/generate", json=body, timeout=60)
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"] == message
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.multiproc
def test_a_body_without_sglang_keys_keeps_the_native_shape(url: str) -> None:
    answer = requests.post(f"{url}/generate", json={"text": "hi", "max_tokens": 3},
                           timeout=60).json()  # fmt: skip
    assert set(answer) >= {"rid", "output_ids", "text", "finish_reason", "prompt_tokens"}
    assert "meta_info" not in answer


# -- the OpenAI routes --------------------------------------------------------------------


@pytest.mark.multiproc
def test_completions_on_the_node_equal_the_engine(url: str) -> None:
    ids = _want(TOK.encode(PROMPT), 10, ignore_eos=True)
    body = {"model": "tspd-tiny", "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
    (choice,) = answer["choices"]
    assert choice["token_ids"] == ids
    assert choice["text"] == TOK.decode(ids)
    assert choice["finish_reason"] == "length"
    n = len(TOK.encode(PROMPT))
    assert answer["usage"] == {"prompt_tokens": n, "completion_tokens": 10, "total_tokens": n + 10}
    assert answer["object"] == "text_completion"
    assert answer["id"].startswith("cmpl-")


@pytest.mark.multiproc
def test_chat_stream_on_the_node_equals_the_engine(url: str) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    ids = _want(TOK.encode(render(messages)), 8, ignore_eos=True)
    body = {"model": "tspd-tiny", "messages": messages, "max_tokens": 8, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        events = _events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert text == TOK.decode(ids)
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 8


@pytest.mark.multiproc
def test_openai_refusals_on_the_node(url: str) -> None:
    wrong = requests.post(f"{url}/v1/completions", json={"model": "gpt-4", "prompt": "a"},
                          timeout=60)  # fmt: skip
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"
    hot = {"model": "tspd-tiny", "prompt": "a", "temperature": 1.0}
    resp = requests.post(f"{url}/v1/completions", json=hot, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "sampling_not_supported"
    pd = {"model": "tspd-tiny", "prompt": ["a", "b"], "bootstrap_room": 3,
          "bootstrap_host": "127.0.0.1"}  # fmt: skip
    resp = requests.post(f"{url}/v1/completions", json=pd, timeout=60)
    assert resp.json()["error"]["message"] == (
        "a PD request (bootstrap_room) carries exactly one prompt"
    )
    models = requests.get(f"{url}/v1/models", timeout=60).json()
    assert [m["id"] for m in models["data"]] == ["tspd-tiny"]


# -- what SGLang's gateway asks a worker ---------------------------------------------------


@pytest.mark.multiproc
def test_server_and_model_info_load_and_health_generate(url: str) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(url + path, timeout=60).json()
        assert info["model_path"] == "tspd-tiny"
        assert (info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (1, 1, "null")
    for path in ("/model_info", "/get_model_info"):
        model = requests.get(url + path, timeout=60).json()
        assert (model["model_path"], model["is_generation"]) == ("tspd-tiny", True)
    (load,) = requests.get(f"{url}/get_load", timeout=60).json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load["dp_rank"] == 0
    assert requests.get(f"{url}/health_generate", timeout=60).json() == {"status": "ok"}
    flush = requests.post(f"{url}/flush_cache", timeout=60)
    assert flush.status_code == 400
    assert flush.json()["success"] is False
    aborted = requests.post(f"{url}/abort_request", json={"rid": "nobody"}, timeout=60)
    assert aborted.json() == {"success": True}


# -- the PD target of top-level bootstrap fields ------------------------------------------

P_INFO = NodeInfo(role=NodeRole.PREFILL, bootstrap="10.0.0.2:9001")
D_INFO = NodeInfo(role=NodeRole.DECODE)


@pytest.mark.parametrize(
    ("body", "info", "reached", "want"),
    [
        ({"bootstrap_room": 5}, P_INFO, None, PdTarget(5, "10.0.0.2", 9001)),
        # The gateway names P by the host of its URL: the name the request reached P by.
        ({"bootstrap_room": 5, "bootstrap_host": "p0.internal", "bootstrap_port": 9001},
         P_INFO, "p0.internal", PdTarget(5, "10.0.0.2", 9001)),
        ({"bootstrap_room": 5, "bootstrap_host": "p0.internal", "bootstrap_port": None},
         P_INFO, "p0.internal", PdTarget(5, "10.0.0.2", 9001)),
        # Another port, or a name the request did not reach P by: left for the allowlist.
        ({"bootstrap_room": 5, "bootstrap_host": "p0.internal", "bootstrap_port": 9002},
         P_INFO, "p0.internal", PdTarget(5, "p0.internal", 9002)),
        ({"bootstrap_room": 5, "bootstrap_host": "elsewhere", "bootstrap_port": 9001},
         P_INFO, "p0.internal", PdTarget(5, "elsewhere", 9001)),
        ({"bootstrap_room": 5, "bootstrap_host": "10.0.0.2", "bootstrap_port": None},
         D_INFO, None, PdTarget(5, "10.0.0.2", DEFAULT_BOOTSTRAP_PORT)),
        ({"bootstrap_host": "10.0.0.2", "bootstrap_port": 1}, D_INFO, None, None),
        ({"bootstrap_room": None}, D_INFO, None, None),
    ],
)  # fmt: skip
def test_top_level_bootstrap_fields_name_the_pd_target(
    body: dict[str, Any], info: NodeInfo, reached: str | None, want: PdTarget | None
) -> None:
    assert top_level_target(body, info, reached) == want


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"bootstrap_room": 5}, "'bootstrap_host' is required with 'bootstrap_room': the "
         "prefill node's host (its bootstrap server's)"),
        ({"bootstrap_room": [5], "bootstrap_host": "h"}, "'bootstrap_room' must be an integer "
         "in 0..2**63-1 (one prompt per room), got [5]"),
        ({"bootstrap_room": True, "bootstrap_host": "h"}, "'bootstrap_room' must be an "
         "integer in 0..2**63-1 (one prompt per room), got True"),
        ({"bootstrap_room": 5, "bootstrap_host": ""}, "'bootstrap_host' must be a host name, "
         "got ''"),
        ({"bootstrap_room": 5, "bootstrap_host": "h", "bootstrap_port": 70000},
         "'bootstrap_port' must be an integer in 1..65535, got 70000"),
    ],
)  # fmt: skip
def test_bad_bootstrap_fields_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as info:
        top_level_target(body, D_INFO, None)
    assert str(info.value) == message


def test_reached_host_reads_the_host_header() -> None:
    assert reached_host("p0.internal:8100") == "p0.internal"
    assert reached_host("[::1]:8100") == "::1"
    assert reached_host("127.0.0.1") == "127.0.0.1"
    assert reached_host(None) is None
    assert reached_host("[bad") is None
