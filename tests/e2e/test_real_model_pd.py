"""PD on a real model: SmolLM2-135M-Instruct (3 KV heads) prefilled on P, decoded on D, token
for token what a colocated engine generates, at (P TP, D TP) = (1, 1), (3, 1) and (1, 3), with
the KV handed over after the forward and streamed layer by layer; and the same model behind
the router, answering a chat through the ``openai`` client.

One module-wide cluster (as in test_pd_engine.py): prefill instances P1 (TP 1) and P3 (TP 3),
each with two DP replicas behind its bootstrap server (replica ``room % 2``: 0 hands the KV
over after the forward, 1 streams it, prefilling 16 tokens a round so prompts go in chunks),
and decode instances D1 and D3. Every rank is a process with its transfer worker, the KV moves
through Mooncake over TCP. Answers are short (10 tokens): the point is equality, not length.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tspd_bootstrap.server import BootstrapServer
from tspd_engine.config import EngineConfig
from tspd_engine.frames import FinishReason, PdTarget, RequestMode, SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.node.replicas import Node, NodeInfo, NodeRole
from tspd_engine.pdlink import PdConfig, PdRole, canonical_layout
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_router.config import RouterConfig
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.models import SMOLLM2, packaged
from tspd_serving.tokenizer import Tokenizer

from .conftest import serve_node, serve_router

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PARAMS = SamplingParams(max_tokens=10)
P_TP = (1, 3)
D_TP = (1, 3)
CHUNK = 16  #: prompt tokens a streaming replica prefills per round
PAIRS = [(1, 1), (3, 1), (1, 3)]
TEXTS = {
    (1, 1): "The capital of France is",
    (3, 1): "In the beginning, there was",
    (1, 3): "def fibonacci(n):",
}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Cluster:
    path: Path
    tokenizer: Tokenizer
    servers: dict[int, BootstrapServer]
    p: dict[int, list[EngineHandle]]  #: each prefill instance's replicas: [handover, layerwise]
    d: dict[int, EngineHandle]
    reference: Engine  #: colocated, TP 1, in this process

    def target(self, p: int, layerwise: bool) -> PdTarget:
        room = secrets.randbits(62) * 2 + int(layerwise)  # replica room % 2
        return PdTarget(room, "127.0.0.1", self.servers[p].port)

    def colocated(self, prompts: Sequence[list[int]]) -> list[list[int]]:
        return [list(o.tokens) for o in self.reference.generate(prompts, PARAMS)]


def _config(path: Path, tp: int, **changes: object) -> EngineConfig:
    # All seven engines load SmolLM2 at once: on a loaded 2-core machine the slowest rank of a
    # TP 3 group reached the start-up barrier more than the default 60 s after the first
    # (gloo timed out), so the group gets as long as the launch itself (300 s).
    cfg = EngineConfig(checkpoint=path, tp=tp, num_pages=48, max_running=8, group_timeout_s=300)
    return cfg.replace(**changes)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    path = packaged(SMOLLM2)
    servers = {
        p: BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout).start()
        for p in P_TP
    }
    specs = [
        ("p", p, lw, _config(path, p, **({"max_prefill_tokens": CHUNK} if lw else {})),
         PdConfig(role=PdRole.PREFILL, bootstrap=f"127.0.0.1:{servers[p].port}", dp_size=2,
                  dp_rank=lw, layerwise_interval=lw))
        for p in P_TP for lw in (0, 1)
    ] + [("d", d, 0, _config(path, d), PdConfig(role=PdRole.DECODE)) for d in D_TP]  # fmt: skip
    handles: dict[tuple[str, int, int], EngineHandle] = {}

    def start(spec: tuple[str, int, int, EngineConfig, PdConfig]) -> None:
        side, n, replica, cfg, pd = spec
        handles[side, n, replica] = launch(cfg, pd=pd, ready_timeout_s=300)

    reference = None
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            list(pool.map(start, specs))
        reference = Engine(_config(path, 1))
        yield Cluster(
            path,
            load_tokenizer(path),
            servers,
            {p: [handles["p", p, 0], handles["p", p, 1]] for p in P_TP},
            {d: handles["d", d, 0] for d in D_TP},
            reference,
        )
    finally:
        if reference is not None:
            reference.close()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(EngineHandle.shutdown, handles.values()))
        for server in servers.values():
            server.close()


def _run_pd(c: Cluster, p: int, d: int, prompts: Sequence[list[int]], layerwise: bool) -> list:
    """Each prompt's two halves (same room) to P's replica and D; D's outputs."""
    streams = []
    for i, prompt in enumerate(prompts):
        target = c.target(p, layerwise)
        rid = f"real-{p}{d}{int(layerwise)}-{i}-{target.room}"
        replica = c.p[p][target.room % 2].client
        ps = replica.submit(prompt, PARAMS, rid, RequestMode.PREFILL_ONLY, target)
        ds = c.d[d].client.submit(prompt, PARAMS, rid, RequestMode.REMOTE_DECODE, target)
        streams.append((ps, ds))
    outs = []
    for ps, ds in streams:
        p_out = ps.result(120)
        assert p_out.finish == FinishReason.LENGTH, p_out.error
        outs.append(ds.result(120))
        assert p_out.tokens == outs[-1].tokens[:1]  # P's first token seeded D
    return outs


@pytest.mark.parametrize("layerwise", [False, True], ids=["handover", "layerwise"])
@pytest.mark.parametrize(("p", "d"), PAIRS, ids=[f"P{p}D{d}" for p, d in PAIRS])
def test_pd_equals_colocated_on_smollm2(cluster: Cluster, p: int, d: int, layerwise: bool) -> None:
    tok = cluster.tokenizer
    prompts = [tok.encode(TEXTS[p, d]), tok.chat_prompt(CHAT)]
    want = cluster.colocated(prompts)
    before = cluster.d[d].client.stats()
    outs = _run_pd(cluster, p, d, prompts, layerwise)
    assert [list(o.tokens) for o in outs] == want
    after = cluster.d[d].client.stats()
    assert after["pd_transfers_ok"] - before["pd_transfers_ok"] == len(prompts)
    # Real text, not noise: the chat's answer names the city.
    assert tok.decode(outs[-1].tokens) == "The capital of France is Paris."
    assert outs[-1].finish == FinishReason.EOS


def test_openai_chat_and_stream_through_the_router(cluster: Cluster) -> None:
    """P3 (both replicas: either mode, by the router's random room) and D1 behind their real
    node endpoints and the router, which tokenizes, applies SmolLM2's chat template and
    detokenizes."""
    tok = cluster.tokenizer
    p_info = NodeInfo(role=NodeRole.PREFILL, model=SMOLLM2, tp=3, dp=2,
                      bootstrap=f"127.0.0.1:{cluster.servers[3].port}")  # fmt: skip
    d_info = NodeInfo(role=NodeRole.DECODE, model=SMOLLM2, tp=1, dp=1)
    with ExitStack() as stack:
        p_url = stack.enter_context(serve_node(Node([h.client for h in cluster.p[3]], p_info), tok))
        d_url = stack.enter_context(serve_node(Node([cluster.d[1].client], d_info), tok))
        cfg = RouterConfig(prefill=(p_url,), decode=(d_url,))
        url = stack.enter_context(serve_router(cfg, tok))
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)

        chat = client.chat.completions.create(
            model=SMOLLM2, messages=CHAT, max_tokens=10, extra_body={"return_token_ids": True}
        )
        (want,) = cluster.colocated([tok.chat_prompt(CHAT)])
        choice = chat.choices[0]
        assert choice.token_ids == want  # type: ignore[attr-defined]
        assert choice.message.content == "The capital of France is Paris."
        assert choice.finish_reason == "stop"
        assert chat.usage is not None
        assert chat.usage.completion_tokens == len(want) == 8  # 7 words and <|im_end|>

        prompt = "Once upon a time, in a small village by the sea,"
        (story,) = cluster.colocated([tok.encode(prompt)])
        stream = client.completions.create(
            model=SMOLLM2, prompt=prompt, max_tokens=10, stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        pieces, ids, finish = [], [], None
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
            ids += chunk.choices[0].token_ids  # type: ignore[attr-defined]
            finish = chunk.choices[0].finish_reason or finish
        assert ids == story
        assert "".join(pieces) == tok.decode(story)
        assert all("\ufffd" not in p for p in pieces)
        assert finish == "length"

        cut = client.completions.create(
            model=SMOLLM2, prompt=prompt, max_tokens=10, stop=[" wizard", " old"]
        )
        text = tok.decode(story)
        first = min(i for i in (text.find(" wizard"), text.find(" old")) if i >= 0)
        assert cut.choices[0].text == text[:first]
        assert cut.choices[0].finish_reason == "stop"
