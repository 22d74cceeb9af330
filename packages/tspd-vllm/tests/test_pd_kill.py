"""A vLLM P with TspdConnector SIGKILLed while it holds prefilled requests' KV for D: the D
whose ``kv_load_failure_policy`` is ``fail`` answers an error, the D with ``recompute``
computes the prompt itself and answers a colocated vLLM's tokens; both Ds' KV usage goes
back to zero, nothing hangs, and both serve on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tspd_testing.vllm_nodes import (
    MODEL_NAME,
    VllmNode,
    free_port,
    metric,
    post_json,
    start_vllm,
    tspd_kv_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(900)]

PROMPTS = [
    "Write a haiku about the sea:",
    " ".join(f"Line {i}: the lamp in room {i} is {['on', 'off'][i % 2]}." for i in range(60))
    + "\nIs the lamp in room 7 on?",
]
USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class Nodes:
    prefill: VllmNode
    fail: VllmNode
    recompute: VllmNode


@pytest.fixture(scope="module")
def nodes(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    logs = tmp_path_factory.mktemp("vllm-kill-logs")
    boot = free_port()

    def decode(name: str, policy: str) -> VllmNode:
        config = tspd_kv_config("kv_consumer") | {"kv_load_failure_policy": policy}
        return start_vllm(name, vllm_model_dir, logs, kv_config=config)

    started = [
        start_vllm("prefill", vllm_model_dir, logs, kv_config=tspd_kv_config("kv_producer", boot)),
        decode("decode-fail", "fail"),
        decode("decode-recompute", "recompute"),
    ]
    try:
        for node in started:
            node.wait_ready()
        yield Nodes(*started)
    finally:
        for node in started:
            node.stop()


def _body(prompt: str, max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "return_token_ids": True}  # fmt: skip
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _tokens(url: str, prompt: str, params: dict[str, Any] | None = None) -> list[int]:
    status, answer = post_json(f"{url}/v1/completions", _body(prompt, 24, params), timeout_s=120)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def _wait_usage_zero(node: VllmNode, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (usage := metric(node.url, USAGE)) != 0.0:
        assert time.monotonic() < deadline, f"{node.name}: {USAGE} stays {usage}"
        time.sleep(0.2)  # polling the node's own metric


def test_prefill_killed_holding_the_kv(nodes: Nodes) -> None:
    colocated = _tokens(nodes.recompute.url, PROMPTS[1])  # D computing alone: colocated vLLM
    answers = []
    for prompt in PROMPTS:
        status, answer = post_json(
            f"{nodes.prefill.url}/v1/completions", _body(prompt, 1, {"do_remote_decode": True})
        )
        assert status == 200, answer
        answers.append(answer["kv_transfer_params"])
    nodes.prefill.kill()
    started = time.monotonic()
    status, answer = post_json(
        f"{nodes.fail.url}/v1/completions", _body(PROMPTS[0], 24, answers[0]), timeout_s=120
    )
    assert status >= 400 or answer["choices"][0]["finish_reason"] == "error", answer
    assert _tokens(nodes.recompute.url, PROMPTS[1], answers[1]) == colocated
    assert time.monotonic() - started < 60  # P's death is noticed, not waited out
    for node in (nodes.fail, nodes.recompute):
        _wait_usage_zero(node)
    assert _tokens(nodes.fail.url, PROMPTS[0]) == _tokens(nodes.recompute.url, PROMPTS[0])
