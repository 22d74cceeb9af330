"""The README's cluster, for real: ``launch_pd.py local`` (prefill node at TP 2 hosting its
bootstrap server and streaming its KV layerwise, decode node at TP 1, router, all as
processes) driven by the ``openai`` client.

Every answer is checked token for token (as text: one byte per token) against a colocated
TP-1 engine; at the end SIGINT must stop every process the launcher started, exit code 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest
import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_router.chat import render
from tspd_router.text import Detokenizer

from .conftest import LAUNCHER, TOK, alive, child_env, colocated, descendants, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CFG = EngineConfig(num_pages=256, max_running=16)  # what the launcher's flags below set
MODEL = "tspd-tiny"


@dataclass
class Local:
    proc: subprocess.Popen[str]
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.urls["router"] + "/v1", api_key="-", max_retries=0)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            words = line.split()
            if len(words) == 2 and words[0] in ("bootstrap", "prefill", "decode", "router"):
                self.urls[words[0]] = words[1]  # the summary: "  <role>  <url>"
            if line.startswith("local ready on "):
                self.ready.set()


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning",
            "--router-port", "0", "--prefill-port", "0", "--decode-port", "0",
            "--bootstrap-port", "0", "--num-pages", "256", "--max-running", "16",
            "--layerwise-interval", "1"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env())
    cluster = Local(proc)
    threading.Thread(target=cluster.read, daemon=True).start()
    try:
        assert cluster.ready.wait(300), "\n".join(["local never got ready:", *cluster.lines])
        yield cluster
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _expected(prompts: list[list[int]], max_tokens: int) -> list[tuple[str, str, int]]:
    """(text, finish reason, tokens) of each prompt on a colocated TP-1 engine."""
    out = []
    for tokens in colocated(prompts, SamplingParams(max_tokens=max_tokens), CFG):
        d = Detokenizer()
        text = d.feed(tokens) + d.flush()
        out.append((text, "stop" if tokens[-1] == TOK.EOS else "length", len(tokens)))
    return out


def test_every_role_reported_ready(local: Local) -> None:
    starts = [line for line in local.lines if " ready on " in line]
    roles = [line.split()[0] for line in starts[:3]]
    # The two nodes side by side (either may be first), then the router.
    assert (sorted(roles[:2]), roles[2]) == (["[decode]", "[prefill]"], "[router]")
    by_role = dict(zip(roles, starts[:3], strict=True))
    prefill = by_role["[prefill]"]
    assert "(tp=2, dp=1, bootstrap 127.0.0.1:" in prefill
    assert prefill.endswith(" served here)")  # the node hosts its bootstrap server
    assert "(tp=1, dp=1)" in by_role["[decode]"]
    assert starts[3].startswith(f"local ready on {local.urls['router']}")
    boot = prefill.split("bootstrap ")[1].split()[0]
    assert f"  bootstrap http://{boot} (served by the prefill node)" in local.lines
    info = requests.get(local.urls["prefill"] + "/info", timeout=10).json()
    assert (info["bootstrap"], info["bootstrap_hosted"]) == (boot, True)
    ranks = requests.get(f"http://{boot}/ranks", timeout=10).json()
    assert [(r["engine_rank"], r["tp_rank"]) for r in ranks["ranks"]] == [(0, 0), (1, 1)]
    assert ranks["complete"] is True


def test_completions_equal_colocated_token_for_token(local: Local) -> None:
    texts = ["Hello", "paged attention over TCP", "x" * 40]
    want = _expected([TOK.encode(t) for t in texts], 12)
    got = local.client.completions.create(model=MODEL, prompt=texts, max_tokens=12)
    assert [(c.text, c.finish_reason) for c in got.choices] == [(t, f) for t, f, _ in want]
    assert got.usage is not None
    assert got.usage.completion_tokens == sum(n for _, _, n in want)
    assert got.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in texts)
    assert got.model == MODEL
    assert got.id.startswith("cmpl-")
    ids = local.client.completions.create(model=MODEL, prompt=TOK.encode("Hello"), max_tokens=12)
    assert ids.choices[0].text == want[0][0]


def test_streamed_completion_equals_the_plain_one(local: Local) -> None:
    (want,) = _expected([TOK.encode("stream me please")], 16)
    stream = local.client.completions.create(
        model=MODEL, prompt="stream me please", max_tokens=16, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want[0]
    assert len(texts) > 1  # it really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want[2]


def test_chat_completion_plain_and_streamed(local: Local) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    (want,) = _expected([TOK.encode(render(messages))], 10)
    got = local.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)  # type: ignore[arg-type]
    assert got.choices[0].message.role == "assistant"
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == want[:2]
    assert got.object == "chat.completion"
    stream = local.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        stream=True,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want[0]
    assert chunks[-1].choices[0].finish_reason == want[1]


def test_refusals_are_openai_errors(local: Local) -> None:
    with pytest.raises(openai.BadRequestError, match="decodes greedily"):
        local.client.completions.create(model=MODEL, prompt="a", temperature=0.7)
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        local.client.completions.create(model="gpt-4", prompt="a")
    # Both halves check the prompt; whichever answers first names itself.
    why = r"the (prefill|decode) node refused the request: prompt token ids must lie in 0\.\.258"
    with pytest.raises(openai.BadRequestError, match=why):
        local.client.completions.create(model=MODEL, prompt=[1, 99999], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        local.client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    assert bad.value.body == {"message": "'max_tokens' must be an integer >= 1",
                              "type": "invalid_request_error", "param": "max_tokens",
                              "code": "bad_request"}  # fmt: skip
    long = r"the (prefill|decode) node refused the request: prompt of 5001 tokens leaves no "
    with pytest.raises(openai.BadRequestError, match=long + "room below the context limit 4096"):
        local.client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as missing:
        local.client.embeddings.create(model=MODEL, input="a")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "not_found"


def test_models_health_metrics_and_transfer_counters(local: Local) -> None:
    models = local.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = requests.get(local.urls["router"] + "/health", timeout=10).json()
    assert health == {"status": "ok", "prefill": {"healthy": 1, "total": 1},
                      "decode": {"healthy": 1, "total": 1}}  # fmt: skip
    metrics = requests.get(local.urls["router"] + "/metrics", timeout=10).text.splitlines()
    # Answered before this test: a batch of 3, 1 by token ids, 1 stream (3 completions
    # requests), 2 chats: 7 choices, each a PD transfer; and the refusals: 4 bad requests,
    # 1 unknown model (an unknown route is not an endpoint: not counted).
    assert 'tspd_router_requests_total{endpoint="completions",status="200"} 3' in metrics
    assert 'tspd_router_requests_total{endpoint="completions",status="400"} 4' in metrics
    assert 'tspd_router_requests_total{endpoint="completions",status="404"} 1' in metrics
    assert 'tspd_router_requests_total{endpoint="chat/completions",status="200"} 2' in metrics
    assert "tspd_router_ttft_seconds_count 7" in metrics
    stats = requests.get(local.urls["decode"] + "/stats", timeout=10).json()["replicas"][0]
    assert stats["pd_transfers_ok"] == 7  # every answer's KV came from P (TP 2 -> TP 1)
    assert stats["pd_transfers_failed"] == 0
    assert stats["running"] == stats["held"] == stats["pd_rooms_tracked"] == 0


def _samples(url: str) -> dict[str, float]:
    """A node's /metrics as {sample with labels: value}; each family declared once."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    types = [line.split()[2] for line in lines if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one family per name across every rank
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}  # fmt: skip


def test_node_metrics_carry_every_ranks_transfer_peer(local: Local) -> None:
    p = _samples(local.urls["prefill"])
    d = _samples(local.urls["decode"])
    ranks = [f'role="prefill",replica="0",rank="{r}"' for r in (0, 1)]
    for at in ranks:  # P TP 2: both ranks hold half the KV heads, both sent every room
        assert p[f"tspd_node_peer_metrics_up{{{at}}}"] == 1
        assert p[f"tspd_pd_rooms_succeeded_total{{{at}}}"] == 7
        # --layerwise-interval 1: each prompt is one chunk (below the prefill budget) of 2
        # layers, one interval each; intervals the counter had already passed when the
        # previous write ended go out as one write (so 7 to 14 writes, one job each).
        assert p[f"tspd_pd_layerwise_chunks_total{{{at}}}"] == 7
        assert p[f"tspd_pd_layerwise_intervals_total{{{at}}}"] == 14
        writes = p[f"tspd_pd_layerwise_writes_total{{{at}}}"]
        assert 7 <= writes <= 14
        assert p[f'tspd_pd_transfer_jobs_total{{{at},result="ok"}}'] == writes
        assert p.get(f'tspd_pd_transfer_jobs_total{{{at},result="failed"}}', 0) == 0
        assert p[f"tspd_pd_transfer_seconds_count{{{at}}}"] == writes
    sent = sum(p[f"tspd_pd_transfer_bytes_total{{{at}}}"] for at in ranks)
    d_at = 'role="decode",replica="0"'
    assert sent == d[f"tspd_node_pd_kv_bytes_in_total{{{d_at}}}"] > 0  # every byte D counted in
    assert d[f"tspd_node_pd_transfers_ok_total{{{d_at}}}"] == 7
    assert d[f'tspd_node_peer_metrics_up{{{d_at},rank="0"}}'] == 1
    assert d[f'tspd_pd_rooms_succeeded_total{{{d_at},rank="0"}}'] == 7
    failed = [k for k, v in {**p, **d}.items() if "room_failures_total" in k and v]
    assert failed == []


def test_sigint_stops_every_process_cleanly(local: Local) -> None:
    tree = descendants(local.proc.pid)
    assert len(tree) >= 3 + 3 + 3  # roles, rank processes, transfer workers (and helpers)
    local.proc.send_signal(signal.SIGINT)
    assert local.proc.wait(90) == 0
    wait_until(lambda: not alive(tree), 30, "every process of the cluster to exit")
    tail = local.lines[-5:]
    assert tail[0] == "SIGINT received: stopping the cluster"
    # The router first; then the two nodes, started side by side, stop side by side.
    assert tail[1].split()[1] == "router"
    assert sorted(line.split()[1] for line in tail[2:4]) == ["decode", "prefill"]
    assert tail[4] == "cluster stopped"
