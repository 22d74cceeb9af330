"""The reference engine's PD on one device: a prefill replica streaming its KV layer by layer
(chunked prefill, ``layerwise_interval`` 1) and a decode replica, one rank each, real bootstrap
server, transfer workers and Mooncake; D's tokens equal a colocated engine's on the same
device, token for token, and both pools come back whole.

On CUDA the two replicas are separate rank processes on the same GPU (each its own CUDA
context, each arena shared with its worker through CUDA IPC). On CPU they run as threads of
this process (``launch(..., in_process=True)``), which keeps the CPU form cheap; the CPU
multi-process path is tests/e2e/test_pd_engine.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tspd_bootstrap.server import BootstrapServer
from tspd_engine.config import EngineConfig
from tspd_engine.frames import FinishReason, PdTarget, RequestMode, SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.config import ModelConfig
from tspd_engine.pdlink import PdConfig, PdRole, canonical_layout
from tspd_engine.pdlink.peer_metrics import PeerScraper
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_serving.tokenizer import ByteTokenizer

from .conftest import DEVICES

pytestmark = pytest.mark.multiproc

TOK = ByteTokenizer()
PARAMS = SamplingParams(max_tokens=10)
CHUNK = 8  #: prompt tokens the prefill replica computes per forward (so prompts stream in chunks)
PROMPTS = [
    TOK.encode("A x"),
    TOK.encode("B hello world"),
    TOK.encode("C paged attention over TCP, layer by layer"),
    TOK.encode("D the quick brown fox jumps over the lazy dog " * 2),
]


def _config(device: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(), num_pages=160, page_size=4, max_running=16,
                        device=device)  # fmt: skip


@dataclass
class Pair:
    server: BootstrapServer
    p: EngineHandle
    d: EngineHandle
    device: str


@pytest.fixture(scope="module", params=DEVICES)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    device = request.param
    in_process = device == "cpu"
    cfg = _config(device)
    server = BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout).start()
    handles: list[EngineHandle] = []
    try:
        p_pd = PdConfig(role=PdRole.PREFILL, bootstrap=f"127.0.0.1:{server.port}",
                        layerwise_interval=1)  # fmt: skip
        p_cfg = cfg.replace(max_prefill_tokens=CHUNK)
        handles.append(launch(p_cfg, in_process=in_process, pd=p_pd, ready_timeout_s=240))
        d_pd = PdConfig(role=PdRole.DECODE)
        handles.append(launch(cfg, in_process=in_process, pd=d_pd, ready_timeout_s=240))
        yield Pair(server, handles[0], handles[1], device)
    finally:
        for handle in handles:
            handle.shutdown()
        server.close()


def _colocated(device: str) -> list[tuple[int, ...]]:
    engine = Engine(_config(device))
    try:
        return [out.tokens for out in engine.generate(PROMPTS, PARAMS)]
    finally:
        engine.close()


def _settled(handle: EngineHandle) -> bool:
    s = handle.client.stats()
    idle = s["waiting"] == s["running"] == s["held"] == s["pd_rooms_tracked"] == 0
    return idle and s["reclaimable_pages"] == s["total_pages"]


def _wait_settled(handles: list[EngineHandle], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(_settled(h) for h in handles):
        assert time.monotonic() < deadline, "pools not back to their initial state"
        time.sleep(0.05)


def _layerwise_counts(handle: EngineHandle) -> tuple[float, float]:
    """P's (chunks, intervals) streamed, from its rank's peer metrics."""
    scraper = PeerScraper()
    try:
        (snap,) = scraper.scrape(list(handle.addrs.metrics), timeout_s=10)
    finally:
        scraper.close()
    assert snap is not None
    return (snap.value("tspd_pd_layerwise_chunks_total"),
            snap.value("tspd_pd_layerwise_intervals_total"))  # fmt: skip


def test_pd_with_layerwise_streaming_equals_colocated_on_the_device(pair: Pair) -> None:
    # One prompt at a time: submitted together, prompts would share forwards (the chunk budget
    # spans requests) in a way that depends on when each arrives, and so would the chunk count.
    outs = []
    for i, prompt in enumerate(PROMPTS):
        target = PdTarget(7_000_000 + i, "127.0.0.1", pair.server.port)
        rid = f"lw-{i}"
        ps = pair.p.client.submit(prompt, PARAMS, rid, RequestMode.PREFILL_ONLY, target)
        ds = pair.d.client.submit(prompt, PARAMS, rid, RequestMode.REMOTE_DECODE, target)
        p_out = ps.result(120)
        assert p_out.finish == FinishReason.LENGTH, p_out.error
        d_out = ds.result(120)
        assert d_out.finish == FinishReason.LENGTH, d_out.error
        assert p_out.tokens == d_out.tokens[:1]  # P's first token seeded D
        outs.append(d_out.tokens)
    assert outs == _colocated(pair.device)
    d_stats, p_stats = pair.d.client.stats(), pair.p.client.stats()
    assert d_stats["pd_transfers_ok"] == len(PROMPTS)
    assert d_stats["pd_kv_pages_in"] == sum(-(-len(p) // 4) for p in PROMPTS)
    assert p_stats["pd_transfers_ok"] == len(PROMPTS)
    for stats in (d_stats, p_stats):
        assert stats["pd_transfers_failed"] == 0
    # Streamed: one chunk per forward of CHUNK tokens, each sent one layer at a time.
    chunks = sum(-(-len(p) // CHUNK) for p in PROMPTS)
    layers = ModelConfig().num_hidden_layers
    assert _layerwise_counts(pair.p) == (chunks, chunks * layers)
    _wait_settled([pair.p, pair.d])
