"""SGLang's model gateway in front of a SmolLM2-135M-Instruct cluster (tspd prefill and decode
nodes, TP 1 each, every role a process): a chat, a streamed completion and SGLang's
``/generate`` through the gateway are what a colocated engine generates, token for token, and
real text ("The capital of France is Paris."); tspd's router in SGLang mode answers the same
chat with the same tokens. The tiny-model cluster and the failure paths:
tests/e2e/test_sglang_gateway.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.models import SMOLLM2, packaged
from tspd_serving.tokenizer import Tokenizer

from .conftest import wait_until
from .gateway import Proc, gateway, pool_whole, role

# Heavy: SmolLM2 on two nodes and in this process (~30 s); the tiny model's gateway tests
# (test_sglang_gateway.py) run by default, this one in `nox -s faults` (CI runs it).
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.heavy]

NODE = ("--model", SMOLLM2, "--num-pages", "64", "--max-running", "4")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    gateway: Proc
    router: Proc
    tokenizer: Tokenizer
    reference: Engine

    def want(self, prompt: list[int], max_tokens: int) -> list[int]:
        (out,) = self.reference.generate([prompt], SamplingParams(max_tokens=max_tokens))
        return list(out.tokens)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = [role("prefill", "--bootstrap-port", "0", *NODE), role("decode", *NODE)]
    reference = Engine(EngineConfig(checkpoint=packaged(SMOLLM2), num_pages=64, max_running=4))
    try:
        for child in started:
            child.wait_ready()
        p, d = started
        started.append(gateway(p.url, d.url))
        started.append(role("router", "--node-api", "sglang", "--tokenizer", SMOLLM2,
                            "--prefill", p.url, "--decode", d.url))  # fmt: skip
        started[-1].wait_ready()
        tok = load_tokenizer(packaged(SMOLLM2))
        yield Cluster(p, d, started[2], started[3], tok, reference)
    finally:
        reference.close()
        for child in reversed(started):
            child.stop()


def test_smollm2_through_the_gateway_equals_a_colocated_engine(cluster: Cluster) -> None:
    tok, url = cluster.tokenizer, cluster.gateway.url
    want = cluster.want(tok.chat_prompt(CHAT), 10)
    # The gateway re-encodes chat bodies with the fields it knows (return_token_ids is not
    # one): the ids are checked through the text and their count.
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 10}
    resp = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    answer = resp.json()
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == tok.decode(want) == "The capital of France is Paris."
    assert answer["usage"]["completion_tokens"] == len(want) == 8  # 7 words and <|im_end|>
    assert choice["finish_reason"] == "stop"

    story = cluster.want(tok.encode(STORY), 10)
    stream = {"model": SMOLLM2, "prompt": STORY, "max_tokens": 10, "stream": True,
              "return_token_ids": True}  # fmt: skip
    ids, pieces = [], []
    with requests.post(url + "/v1/completions", json=stream, stream=True, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[len(b"data: ") :])["choices"][0]
                ids += choice["token_ids"]
                pieces.append(choice["text"])
    assert ids == story
    assert "".join(pieces) == tok.decode(story)

    generate = {"text": STORY, "sampling_params": {"max_new_tokens": 10}}
    answer = requests.post(url + "/generate", json=generate, timeout=300).json()
    assert answer["output_ids"] == story
    assert answer["text"] == tok.decode(story)
    for node in (cluster.prefill, cluster.decode):
        wait_until(lambda n=node: pool_whole(n.url), 60, f"{node.name}'s pool whole")


def test_smollm2_through_tspds_router_in_sglang_mode(cluster: Cluster) -> None:
    want = cluster.want(cluster.tokenizer.chat_prompt(CHAT), 10)
    body = {"model": SMOLLM2, "messages": CHAT, "max_tokens": 10, "return_token_ids": True}
    resp = requests.post(cluster.router.url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    (choice,) = resp.json()["choices"]
    assert choice["token_ids"] == want
    assert choice["message"]["content"] == "The capital of France is Paris."
