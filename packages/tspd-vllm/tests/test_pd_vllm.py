"""Real vLLM (CPU build) prefill and decode processes with TspdConnector, SmolLM2-135M, behind
the PD front, against a colocated vLLM: greedy outputs token for token (completions and
chat, streamed and not; the concurrent flow), D's KV usage back to zero, and a forged
rendezvous refused without harm. (A P killed holding KV: test_pd_kill.py.)"""

from __future__ import annotations

import json
import time
import urllib.request
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
    start_front,
    start_vllm,
    tspd_kv_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(900)]

MAX_TOKENS = 24
LONG = " ".join(
    f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} coins." for i in range(40)
)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "The quick brown fox",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village,",
    LONG + "\nHow many coins are in the box of item 13?",  # several blocks
]
CHATS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Say hello in Spanish.",
    LONG + "\nWhich colour is the box of item 5?",
]
USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class Cluster:
    reference: VllmNode
    prefill: VllmNode
    decode: VllmNode
    fronts: dict[str, VllmNode]
    bootstrap_port: int


def _stop_all(nodes: list[VllmNode]) -> None:
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def cluster(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    boot = free_port()
    nodes = [
        start_vllm("reference", vllm_model_dir, logs),
        start_vllm("prefill", vllm_model_dir, logs, kv_config=tspd_kv_config("kv_producer", boot)),
        start_vllm(
            "decode",
            vllm_model_dir,
            logs,
            kv_config=tspd_kv_config("kv_consumer") | {"kv_load_failure_policy": "fail"},
        ),
    ]
    try:
        for node in nodes:
            node.wait_ready()
        ref, p, d = nodes
        fronts = {
            "sequential": start_front(logs, [p.url], [d.url], "sequential"),
            "concurrent": start_front(logs, [f"{p.url}@127.0.0.1:{boot}"], [d.url], "concurrent"),
        }
        nodes += fronts.values()
        for front in fronts.values():
            front.wait_ready(60)
        yield Cluster(ref, p, d, fronts, boot)
    finally:
        _stop_all(nodes)


def _completion(url: str, prompt: str, **extra: Any) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}  # fmt: skip
    status, answer = post_json(f"{url}/v1/completions", body)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def _chat_body(question: str, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
    }


def _chat(url: str, question: str) -> list[int]:
    status, answer = post_json(f"{url}/v1/chat/completions", _chat_body(question, False))
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def _chat_stream(url: str, question: str) -> tuple[list[int], int]:
    """The streamed token ids and the number of content chunks that carried them."""
    data = json.dumps(_chat_body(question, True)).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data, {"Content-Type": "application/json"}
    )
    ids: list[int] = []
    chunks = 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                ids += got
                chunks += bool(got)
    return ids, chunks


def test_completions_equal_colocated_token_for_token(cluster: Cluster) -> None:
    want = [_completion(cluster.reference.url, p) for p in PROMPTS]
    got = [_completion(cluster.fronts["sequential"].url, p) for p in PROMPTS]
    assert got == want
    assert all(len(ids) == MAX_TOKENS or ids[-1] == 2 for ids in want)  # EOS is id 2


def test_concurrent_flow_moves_the_kv_and_answers(cluster: Cluster) -> None:
    """The concurrent flow: D recomputes the last prompt token itself (vLLM's own PD does
    too), so only its first token is held to the colocated one here; every answer is whole."""
    for prompt in PROMPTS:
        want = _completion(cluster.reference.url, prompt)
        got = _completion(cluster.fronts["concurrent"].url, prompt)
        assert got[0] == want[0]
        assert len(got) == MAX_TOKENS or got[-1] == 2


def test_chat_streamed_and_not_equal_colocated(cluster: Cluster) -> None:
    front = cluster.fronts["sequential"].url
    for question in CHATS:
        want = _chat(cluster.reference.url, question)
        assert _chat(front, question) == want
        streamed, chunks = _chat_stream(front, question)
        assert streamed == want
        assert chunks > 1  # streamed, not one answer in a chunk


def test_decode_kv_usage_returns_to_zero(cluster: Cluster) -> None:
    _completion(cluster.fronts["concurrent"].url, LONG)
    _wait_usage_zero(cluster.decode)


def _wait_usage_zero(node: VllmNode, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (usage := metric(node.url, USAGE)) != 0.0:
        assert time.monotonic() < deadline, f"{node.name}: {USAGE} stays {usage}"
        time.sleep(0.2)  # polling the node's own metric


def test_forged_rendezvous_fails_the_request_not_the_node(cluster: Cluster) -> None:
    """D asked to load from a bootstrap server nobody serves: the request fails (policy
    ``fail``) with an error answer, D's blocks go back, and D serves the next request."""
    params = {"do_remote_prefill": True, "bootstrap_host": "127.0.0.1",
              "bootstrap_port": free_port(), "bootstrap_room": 5}  # fmt: skip
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": params}  # fmt: skip
    status, answer = post_json(f"{cluster.decode.url}/v1/completions", body, timeout_s=120)
    assert status >= 400 or answer["choices"][0]["finish_reason"] == "error", answer
    _wait_usage_zero(cluster.decode)
    bad = dict(body, kv_transfer_params={"do_remote_prefill": "yes"})  # malformed: computed here
    status, answer = post_json(f"{cluster.decode.url}/v1/completions", bad)
    assert status == 200, answer
    assert _completion(cluster.decode.url, PROMPTS[0]) == _completion(
        cluster.reference.url, PROMPTS[0]
    )
