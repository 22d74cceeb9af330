"""An unequal pair end to end: a vLLM P at TP 3 (SmolLM2's 3 KV heads, one per rank: three
arenas, three PrefillPeers, one bootstrap server) and a vLLM D at TP 1 behind the front.
D's one rank receives each prompt's KV from all three P ranks (the planner's route: every
rank's head into its place in D's pages); greedy outputs equal D's own colocated ones, and
D's KV usage goes back to zero."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

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

FP32 = ("--dtype", "float32")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    " ".join(f"Item {i} costs {i * 3} coins." for i in range(50)) + " Which item costs 27 coins?",
]


@pytest.fixture(scope="module")
def nodes(
    vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmNode, VllmNode]]:
    logs = tmp_path_factory.mktemp("vllm-tp-logs")
    boot = free_port()
    # float32: P's forward is split three ways and D's is not, so in bfloat16 their sums
    # differ enough to flip a greedy token (seen on a CPU with AMX tiles, whose bfloat16
    # matmuls accumulate differently; float32 keeps them within a rounding of each other).
    p = start_vllm("prefill-tp3", vllm_model_dir, logs, tp=3, extra_args=FP32,
                   kv_config=tspd_kv_config("kv_producer", boot))  # fmt: skip
    d = start_vllm("decode-tp1", vllm_model_dir, logs, extra_args=FP32,
                   kv_config=tspd_kv_config("kv_consumer"))  # fmt: skip
    started = [p, d]
    try:
        p.wait_ready(600)
        d.wait_ready()
        front = start_front(logs, [p.url], [d.url])
        started.append(front)
        front.wait_ready(60)
        yield front, d
    finally:
        for node in started:
            node.stop()


def _tokens(url: str, prompt: str) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    status, answer = post_json(f"{url}/v1/completions", body)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def test_p_tp3_to_d_tp1_equals_colocated(nodes: tuple[VllmNode, VllmNode]) -> None:
    front, d = nodes
    for prompt in PROMPTS:
        assert _tokens(front.url, prompt) == _tokens(d.url, prompt)
    deadline = time.monotonic() + 60
    while (usage := metric(d.url, "vllm:kv_cache_usage_perc")) != 0.0:
        assert time.monotonic() < deadline, f"D's KV usage stays {usage}"
        time.sleep(0.2)  # polling D's own metric
