"""MLA through TspdConnector, end to end: a tiny DeepSeek-V2-style model (random weights made
here by ``export_tiny_mla``, SmolLM2's tokenizer; nothing downloaded) served by vLLM's CPU
build with its CPU_MLA backend — one 576-wide latent per token and layer, the same on every
TP rank — as P and D behind the front, against D's own colocated answers (a request without
``kv_transfer_params`` D computes itself; one vLLM process fewer): greedy completions token for
token at P TP 1 → D TP 1, every prompt token's latent loaded from P (D's external
prefix-cache hits); and P TP 2 (the latent replicated on both P ranks) → D TP 1."""

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
    start_front,
    start_vllm,
    tspd_kv_config,
)
from tspd_vllm.model import export_tiny_mla

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc, pytest.mark.timeout(900)]

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    "The quick brown fox",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a small village,",
    " ".join(f"Item {i}: a box of {i * 7} coins." for i in range(30)),  # several blocks
]
MAX_TOKENS = 12
#: float32 everywhere: random weights leave near-ties (an output that drifts from one repeated
#: token to another crosses one), and P at TP 2 sums its attention output in another order
#: than a TP 1 vLLM; in bf16 that flipped a token at such a crossing (the KV moved exactly:
#: TP 1 → 1 matched in bf16 too). On vLLM's reference MLA backend: on a CPU with AMX tiles
#: vLLM would pick its AMX MLA backend, which takes only 16-bit (or narrower) weights.
FP32 = ("--dtype", "float32", "--attention-backend", "CPU_MLA")
HITS = "vllm:external_prefix_cache_hits_total"
USAGE = "vllm:kv_cache_usage_perc"


@dataclass
class MlaCluster:
    decode: VllmNode  #: also the colocated reference (requests without kv_transfer_params)
    #: The front of each P (by its TP size), all feeding the one D.
    fronts: dict[int, VllmNode]


@pytest.fixture(scope="module")
def mla(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlaCluster]:
    model = export_tiny_mla(vllm_model_dir.parent / "tiny-mla", vllm_model_dir)
    logs = tmp_path_factory.mktemp("vllm-mla-logs")
    boots = {1: free_port(), 2: free_port()}
    nodes = [
        start_vllm("mla-decode", model, logs, extra_args=FP32,
                   kv_config=tspd_kv_config("kv_consumer") | {"kv_load_failure_policy": "fail"}),
        *(start_vllm(f"mla-prefill-tp{tp}", model, logs, tp=tp, extra_args=FP32,
                     kv_config=tspd_kv_config("kv_producer", boot))
          for tp, boot in boots.items()),
    ]  # fmt: skip
    try:
        for node in nodes:
            node.wait_ready()
        d, *prefills = nodes
        fronts = {
            tp: start_front(logs, [p.url], [d.url], name=f"front-mla-tp{tp}")
            for tp, p in zip(boots, prefills, strict=True)
        }
        nodes += fronts.values()
        for front in fronts.values():
            front.wait_ready(60)
        yield MlaCluster(d, fronts)
    finally:
        for node in nodes:
            node.stop()


def _complete(url: str, prompt: str) -> tuple[list[int], int]:
    """Greedy token ids and the prompt's length in tokens."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "return_token_ids": True}  # fmt: skip
    status, answer = post_json(f"{url}/v1/completions", body)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"]), int(answer["usage"]["prompt_tokens"])


def _loaded_all(mla: MlaCluster, before: float, prompt_tokens: int) -> None:
    """D loaded every prompt token's latent from P (it computed only P's first token), and
    its blocks went back."""
    assert _settled(mla.decode, HITS, before + prompt_tokens) == before + prompt_tokens
    assert _settled(mla.decode, USAGE, 0.0) == 0.0


def test_mla_pd_equals_colocated_token_for_token(mla: MlaCluster) -> None:
    """P TP 1 → D TP 1: the same computations as a colocated vLLM (D's own), the latent moved
    exactly."""
    want = [_complete(mla.decode.url, p) for p in PROMPTS]
    before = metric(mla.decode.url, HITS) or 0.0
    got = [_complete(mla.fronts[1].url, p) for p in PROMPTS]
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert all(len(ids) == MAX_TOKENS or ids[-1] == 2 for ids, _ in want)  # whole answers
    _loaded_all(mla, before, sum(n for _, n in want))


def test_mla_unequal_pair_moves_the_replicated_latent(mla: MlaCluster) -> None:
    """P TP 2 → D TP 1: D's one rank gets the whole latent of every layer from P's two
    (it is replicated: no rank splits it). P's prefill at TP 2 sums its heads' outputs in
    another order than a TP 1 vLLM, so with random weights the later tokens may leave the
    colocated ones at a near-tie (one prompt of eight did, at its 6th token); the latent's
    bytes are checked exactly at this pair in test_transfer.py. Here: P's first token equals
    the colocated one, every answer is whole, every prompt token's latent was loaded."""
    want = [_complete(mla.decode.url, p) for p in PROMPTS]
    before = metric(mla.decode.url, HITS) or 0.0
    got = [_complete(mla.fronts[2].url, p) for p in PROMPTS]
    assert [ids[0] for ids, _ in got] == [ids[0] for ids, _ in want]
    assert [n for _, n in got] == [n for _, n in want]
    assert all(len(ids) == MAX_TOKENS or ids[-1] == 2 for ids, _ in got)
    _loaded_all(mla, before, sum(n for _, n in want))


def _settled(node: VllmNode, name: str, want: float, timeout_s: float = 30.0) -> float:
    """``name``'s value once it reads ``want`` (metrics follow the answers by a step), or
    its last value at the bound."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(node.url, name) or 0.0) != want and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the node's own metric
    return value
