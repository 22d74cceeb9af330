"""A mixed cluster end to end: SGLang's model gateway (``sglang-router`` 0.3.2 from PyPI, its
Rust binary, in PD mode) in front of tspd's nodes, prefill at TP 2 hosting its bootstrap
server and decode at TP 1 (tiny model), every role a process; and tspd's router in SGLang mode
(``--node-api sglang``) in front of the same nodes.

* the gateway's worker discovery (``/health``, ``/server_info``, ``/model_info``) and health
  checks take both nodes in, with their roles, TP sizes and P's bootstrap port;
* completions, chat, their streams and ``/generate`` (plain and streamed) through the gateway
  are a colocated engine's tokens exactly (``return_token_ids``, ``output_ids``), as are
  tspd's router's in SGLang mode; both nodes' pools are whole afterwards;
* the prefill node SIGKILLed while requests are in flight: each client of the gateway gets its
  exact text or an error within a bounded time, never a hang (the gateway retries a request
  whose P connection broke, then answers 503 ``server_selection_failed`` once its circuit
  breaker took P out: within 2 s here); the decode node's pool is whole within its heartbeat
  bound, and nothing of the dead node survives it.

A killed prefill node is replaced, with the gateway and router that named it, for the next
test (:meth:`Stack.whole`), so every test runs alone or in any order.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import requests

from tspd_core.pd.decode.heartbeat import bound_for
from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_serving.openai.chat import render

from .conftest import TOK, alive, colocated, descendants, wait_until
from .gateway import Proc, bootstrap_port, gateway, pool_whole, role

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = "tspd-tiny"
NODE = ("--num-pages", "512", "--max-running", "16")
CFG = EngineConfig(num_pages=512, max_running=16)  # what NODE sets, for the reference
#: P prefills 128 tokens a round, so long prompts keep requests on P when it dies.
PREFILL = ("--tp", "2", "--bootstrap-port", "0", "--max-prefill-tokens", "128", *NODE)
HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES = 2, 1
DECODE = ("--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
          "--heartbeat-failures", str(HEARTBEAT_FAILURES), *NODE)  # fmt: skip
#: From P's death to the last client's answer (the gateway's own request timeout is far
#: longer: whatever ends a request here is the nodes' doing).
ERROR_BOUND_S = 60.0
SETTLE_BOUND_S = bound_for(HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES) + 22


@dataclass
class Stack:
    started: list[Proc]
    prefill: Proc
    decode: Proc
    gateway: Proc
    router: Proc  #: tspd's router in SGLang mode

    def whole(self) -> None:
        """Replace a prefill node an earlier test killed, and the gateway and router."""
        if self.prefill.proc.poll() is None:
            return
        self.gateway.stop()
        self.router.stop()
        self.prefill = self.start("prefill", *PREFILL)
        self.prefill.wait_ready()
        self.gateway = gateway(self.prefill.url, self.decode.url)
        self.started.append(self.gateway)
        self.router = self.start_router()

    def start(self, name: str, *args: str) -> Proc:
        self.started.append(role(name, *args))
        return self.started[-1]

    def start_router(self) -> Proc:
        router = self.start("router", "--node-api", "sglang", "--prefill", self.prefill.url,
                            "--decode", self.decode.url)  # fmt: skip
        router.wait_ready()
        return router

    def settle(self) -> None:
        for node in (self.prefill, self.decode):
            wait_until(lambda n=node: pool_whole(n.url), 60, f"{node.name}'s pool whole")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started = [role("prefill", *PREFILL), role("decode", *DECODE)]
    try:
        for child in started:
            child.wait_ready()
        p, d = started
        gw = gateway(p.url, d.url)
        started.append(gw)
        held = Stack(started, p, d, gw, gw)
        held.router = held.start_router()
        yield held
    finally:
        fronts = [c for c in started if c.name in ("gateway", "router")]
        for child in fronts:
            child.stop()
        nodes = [c for c in started if c not in fronts]
        with ThreadPoolExecutor(max(1, len(nodes))) as pool:
            list(pool.map(Proc.stop, nodes))


def _want(prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return colocated([prompt], params, CFG)[0]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = requests.post(url, json=body, timeout=120)
    assert resp.status_code == 200, resp.text[:500]
    return dict(resp.json())


def _events(url: str, body: dict[str, Any]) -> list[Any]:
    """A stream's SSE payloads (``[DONE]`` as the string)."""
    out: list[Any] = []
    with requests.post(url, json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200, resp.text[:500]
        for line in resp.iter_lines():
            if line.startswith(b"data:"):
                data = line[len(b"data:") :].strip()
                out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


def test_the_gateway_discovers_the_nodes_and_finds_them_healthy(stack: Stack) -> None:
    stack.whole()
    listing = requests.get(stack.gateway.url + "/workers", timeout=30).json()
    assert listing["total"] == 2
    assert listing["stats"] == {"prefill_count": 1, "decode_count": 1, "regular_count": 0}
    workers = {w["worker_type"]: w for w in listing["workers"]}
    p, d = workers["prefill"], workers["decode"]
    assert (p["url"], d["url"]) == (stack.prefill.url, stack.decode.url)
    assert p["bootstrap_port"] == bootstrap_port(stack.prefill.url)
    assert p["is_healthy"] is d["is_healthy"] is True
    assert (p["model_id"], d["model_id"]) == (MODEL, MODEL)
    # What the gateway kept of the nodes' /server_info and /model_info:
    read = {"model_path": MODEL, "served_model_name": MODEL, "dp_size": "1",
            "load_balance_method": "follow_bootstrap_room", "model_type": "llama",
            "architectures": '["LlamaForCausalLM"]'}  # fmt: skip
    assert p["metadata"] == read | {"disaggregation_mode": "prefill", "tp_size": "2"}
    assert d["metadata"] == read | {"disaggregation_mode": "decode", "tp_size": "1"}
    readiness = requests.get(stack.gateway.url + "/readiness", timeout=30).json()
    assert readiness == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    models = requests.get(stack.gateway.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("front", ["gateway", "router"])
def test_completions_chat_streams_and_generate_equal_a_colocated_engine(
    stack: Stack, front: str
) -> None:
    stack.whole()
    url = stack.gateway.url if front == "gateway" else stack.router.url
    prompt = f"{front}: the gateway passes D's answer on"
    want = _want(TOK.encode(prompt), 12)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    (choice,) = _post(url + "/v1/completions", body)["choices"]
    assert choice["token_ids"] == want
    assert choice["text"] == TOK.decode(want)
    assert choice["finish_reason"] == "length"

    events = _events(url + "/v1/completions", body | {"stream": True})
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["choices"][0]["token_ids"]] == want
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TOK.decode(want)

    messages = [{"role": "user", "content": f"{front}, say something"}]
    chat_want = _want(TOK.encode(render(messages)), 9)
    chat = {"model": MODEL, "messages": messages, "max_tokens": 9, "ignore_eos": True}
    answer = _post(url + "/v1/chat/completions", chat)
    assert answer["choices"][0]["message"]["content"] == TOK.decode(chat_want)
    assert answer["usage"]["completion_tokens"] == 9
    events = _events(url + "/v1/chat/completions", chat | {"stream": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == TOK.decode(chat_want)
    stack.settle()


def test_generate_through_the_gateway_equals_a_colocated_engine(stack: Stack) -> None:
    stack.whole()
    prompt = TOK.encode("SGLang's /generate, through the gateway")
    want = _want(prompt, 10)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "ignore_eos": True}}
    answer = _post(stack.gateway.url + "/generate", body)
    assert answer["output_ids"] == want
    assert answer["text"] == TOK.decode(want)
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    events = _events(stack.gateway.url + "/generate", body | {"stream": True})
    assert events[-1] == "[DONE]"
    assert [t for e in events[:-1] for t in e["output_ids"]] == want
    assert events[-2]["text"] == TOK.decode(want)
    stack.settle()


def test_a_prefill_node_killed_mid_request_is_an_error_not_a_hang(stack: Stack) -> None:
    stack.whole()
    prompts = [f"{i:03d} " + "a long prompt keeps the prefill node busy. " * 30 for i in range(16)]
    want = [TOK.decode(_want(TOK.encode(p), 16)) for p in prompts]
    p_tree = {stack.prefill.proc.pid} | descendants(stack.prefill.proc.pid)
    outcomes, killed_at = asyncio.run(_storm(stack, prompts))

    assert all(at - killed_at < ERROR_BOUND_S for _, _, at in outcomes)  # nobody hung
    failed = [out for out, ok, _ in outcomes if not ok]
    assert failed, "the kill came after every transfer: no request saw the failure"
    for i, (out, ok, _) in enumerate(outcomes):
        if ok:
            assert out == want[i]  # a request that succeeded has exactly the right text
    for out in failed:
        assert isinstance(out, str)
        assert out.startswith(("HTTP 5", "error event", "stream cut")), out
    wait_until(lambda: pool_whole(stack.decode.url), SETTLE_BOUND_S, "D's pool whole")
    wait_until(lambda: not alive(p_tree), 30, "every process of the killed prefill node gone")


async def _storm(stack: Stack, prompts: list[str]) -> tuple[list[tuple[str, bool, float]], float]:
    """Stream every prompt through the gateway; SIGKILL P once a first token arrived. Per
    request: (its text, or how it failed; whether it succeeded; when it ended)."""
    first = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=ERROR_BOUND_S + 60)

    async def one(session: aiohttp.ClientSession, prompt: str) -> tuple[str, bool, float]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                "stream": True}  # fmt: skip
        try:
            async with session.post(stack.gateway.url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}: {(await resp.text())[:200]}", False, _now()
                parts, done = [], False
                async for raw in resp.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data:"):
                        event = json.loads(line[len(b"data:") :])
                        if "error" in event:
                            return f"error event: {event['error']}", False, _now()
                        parts.append(event["choices"][0]["text"])
                        first.set()
                if not done:
                    return f"stream cut after {len(parts)} events", False, _now()
                return "".join(parts), True, _now()
        except aiohttp.ClientError as exc:
            return f"stream cut: {exc!r}", False, _now()

    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(one(session, p)) for p in prompts]
        await asyncio.wait_for(first.wait(), 120)
        stack.prefill.kill()
        killed_at = _now()
        done = await asyncio.wait_for(asyncio.gather(*tasks), ERROR_BOUND_S + 30)
    return list(done), killed_at


def _now() -> float:
    return time.monotonic()
