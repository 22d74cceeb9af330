"""The README's cluster, for real: ``launch_pd.py local`` (prefill node at TP 2 hosting its
bootstrap server and streaming its KV layerwise, decode node at TP 1, router, all as
processes) driven by the ``openai`` client.

Every answer is checked token for token (as text: one byte per token) against a colocated
TP-1 engine; a stop string cuts the text and aborts the request on the real decode node;
SIGINT must stop every process the launcher started, exit code 0.

One cluster serves the module; a test that stops it (SIGINT) leaves the next test a fresh one
(:class:`Clusters`), so every test runs alone or in any order. Counters are compared before and
after each test's own requests, never against what other tests sent.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import openai
import pytest
import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.model.config import ModelConfig
from tspd_serving.openai.chat import render
from tspd_serving.openai.text import Detokenizer

from .conftest import (
    LAUNCHER,
    TOK,
    alive,
    child_env,
    colocated,
    descendants,
    samples,
    wait_until,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CFG = EngineConfig(num_pages=256, max_running=16)  # what the launcher's flags below set
MODEL = "tspd-tiny"


@dataclass
class Local:
    proc: subprocess.Popen[str]
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  #: its output was all read

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
        self.ended.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_local(extra: Sequence[str] = ()) -> Local:
    """``launch_pd.py local`` on free ports with this module's flags (and ``extra``), once
    ready."""
    argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning",
            "--router-port", "0", "--prefill-port", "0", "--decode-port", "0",
            "--bootstrap-port", "0", "--num-pages", "256", "--max-running", "16",
            "--layerwise-interval", "1", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env())
    cluster = Local(proc)
    threading.Thread(target=cluster.read, daemon=True).start()
    if not cluster.ready.wait(300):
        cluster.stop()
        raise AssertionError("\n".join(["local never got ready:", *cluster.lines]))
    return cluster


class Clusters:
    """The module's cluster: started for the first test that needs one, and again for a test
    that comes after one that stopped it."""

    def __init__(self) -> None:
        self.current: Local | None = None

    def live(self) -> Local:
        if self.current is None or self.current.proc.poll() is not None:
            self.current = start_local()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()


@pytest.fixture(scope="module")
def clusters() -> Iterator[Clusters]:
    held = Clusters()
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def local(clusters: Clusters) -> Local:
    return clusters.live()


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
    # The router checks the prompt against the nodes' vocabulary and context before either
    # node sees it (the nodes check again; tests/hardening).
    why = re.escape("token id 99999 in the prompt is outside the model's vocabulary 0..258")
    with pytest.raises(openai.BadRequestError, match=why):
        local.client.completions.create(model=MODEL, prompt=[1, 99999], max_tokens=2)
    negative = re.escape("'max_tokens' must be an integer >= 1")
    with pytest.raises(openai.BadRequestError, match=negative) as bad:
        local.client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    assert bad.value.body == {"message": "'max_tokens' must be an integer >= 1",
                              "type": "invalid_request_error", "param": "max_tokens",
                              "code": "bad_request"}  # fmt: skip
    long = ("the prompt has 5000 bytes of text, so at least 5001 tokens (one token stands for "
            "at most 1 byte), which leaves no room below the context limit 4096")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=re.escape(long)) as too_long:
        local.client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=2)
    assert isinstance(too_long.value.body, dict)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError, match="no route POST /v1/embeddings here") as missing:
        local.client.embeddings.create(model=MODEL, input="a")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "not_found"


def _delta(after: dict[str, float], before: dict[str, float], prefix: str) -> dict[str, float]:
    """The samples starting with ``prefix`` that changed, by how much (absent = 0)."""
    keys = [k for k in after.keys() | before.keys() if k.startswith(prefix)]
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)
            if after.get(k, 0) != before.get(k, 0)}  # fmt: skip


def test_models_health_metrics_and_transfer_counters(local: Local) -> None:
    models = local.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = requests.get(local.urls["router"] + "/health", timeout=10).json()
    assert health == {"status": "ok", "prefill": {"healthy": 1, "total": 1},
                      "decode": {"healthy": 1, "total": 1}}  # fmt: skip
    router = local.urls["router"]
    before, d_before = samples(router), _decode_stats(local)
    # This test's own traffic: a batch of 2 and a chat (3 choices, each a PD transfer), one
    # refusal, one unknown model, and an unknown route (not an endpoint: not counted).
    local.client.completions.create(model=MODEL, prompt=["count me", "and me"], max_tokens=3)
    chat = [{"role": "user", "content": "count me too"}]
    local.client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="decodes greedily"):
        local.client.completions.create(model=MODEL, prompt="a", temperature=0.7)
    with pytest.raises(openai.NotFoundError, match="does not exist here"):
        local.client.completions.create(model="gpt-4", prompt="a")
    assert requests.get(router + "/v1/nothing", timeout=10).status_code == 404
    after = samples(router)
    assert _delta(after, before, "tspd_router_requests_total") == {
        'tspd_router_requests_total{endpoint="chat/completions",status="200"}': 1,
        'tspd_router_requests_total{endpoint="completions",status="200"}': 1,
        'tspd_router_requests_total{endpoint="completions",status="400"}': 1,
        'tspd_router_requests_total{endpoint="completions",status="404"}': 1,
    }
    assert _delta(after, before, "tspd_router_errors_total") == {
        'tspd_router_errors_total{cause="model_not_found"}': 1,
        'tspd_router_errors_total{cause="sampling_not_supported"}': 1,
    }
    assert _delta(after, before, "tspd_router_ttft_seconds_count") == {
        "tspd_router_ttft_seconds_count": 3
    }
    stats = _decode_stats(local)
    assert stats["pd_transfers_ok"] - d_before["pd_transfers_ok"] == 3  # every KV from P
    assert stats["pd_transfers_failed"] == d_before["pd_transfers_failed"]
    assert stats["running"] == stats["held"] == stats["pd_rooms_tracked"] == 0


def _decode_stats(local: Local) -> dict[str, float]:
    (stats,) = requests.get(local.urls["decode"] + "/stats", timeout=10).json()["replicas"]
    return dict(stats)


def test_node_metrics_carry_every_ranks_transfer_peer(local: Local) -> None:
    p_before, d_before = samples(local.urls["prefill"]), samples(local.urls["decode"])
    # First pages (BOS + 3 bytes) no other test sends: D has none of their pages cached, so
    # every page of both prompts crosses from P.
    prompts = [TOK.encode("Peer metrics, one"), TOK.encode("Pfennig: the second prompt")]
    local.client.completions.create(model=MODEL, prompt=prompts, max_tokens=2)
    p, d = samples(local.urls["prefill"]), samples(local.urls["decode"])

    def grew(now: dict[str, float], then: dict[str, float], sample: str) -> float:
        return now.get(sample, 0) - then.get(sample, 0)

    ranks = [f'role="prefill",replica="0",rank="{r}"' for r in (0, 1)]
    for at in ranks:  # P TP 2: both ranks hold half the KV heads, both sent every room
        assert p[f"tspd_node_peer_metrics_up{{{at}}}"] == 1
        assert grew(p, p_before, f"tspd_pd_rooms_succeeded_total{{{at}}}") == 2
        # --layerwise-interval 1: each prompt is one chunk (below the prefill budget) of 2
        # layers, one interval each; intervals the counter had already passed when the
        # previous write ended go out as one write (so 2 to 4 writes). A write is one job
        # to D's pages, or, staged (P's half of the heads is strided in D's pages), one job
        # per interval: staged jobs are not merged.
        assert grew(p, p_before, f"tspd_pd_layerwise_chunks_total{{{at}}}") == 2
        assert grew(p, p_before, f"tspd_pd_layerwise_intervals_total{{{at}}}") == 4
        writes = grew(p, p_before, f"tspd_pd_layerwise_writes_total{{{at}}}")
        assert 2 <= writes <= 4
        jobs = grew(p, p_before, f'tspd_pd_transfer_jobs_total{{{at},result="ok"}}')
        staged = grew(p, p_before, f"tspd_pd_transfer_staged_jobs_total{{{at}}}")
        assert (jobs, staged) in ((writes, 0), (4, 4))
        assert grew(p, p_before, f'tspd_pd_transfer_jobs_total{{{at},result="failed"}}') == 0
        assert grew(p, p_before, f"tspd_pd_transfer_seconds_count{{{at}}}") == jobs
    info = requests.get(local.urls["prefill"] + "/info", timeout=10).json()
    pages = sum(-(-len(x) // info["page_size"]) for x in prompts)
    model = ModelConfig()  # float32: 4 bytes a value; K and V of every layer and KV head
    page_bytes = model.num_hidden_layers * 2 * model.num_key_value_heads * model.head_dim * 4
    sent = sum(grew(p, p_before, f"tspd_pd_transfer_bytes_total{{{at}}}") for at in ranks)
    d_at = 'role="decode",replica="0"'
    kv_in = grew(d, d_before, f"tspd_node_pd_kv_bytes_in_total{{{d_at}}}")
    assert sent == kv_in == pages * info["page_size"] * page_bytes  # every byte, counted in
    assert grew(d, d_before, f"tspd_node_pd_transfers_ok_total{{{d_at}}}") == 2
    assert d[f'tspd_node_peer_metrics_up{{{d_at},rank="0"}}'] == 1
    assert grew(d, d_before, f'tspd_pd_rooms_succeeded_total{{{d_at},rank="0"}}') == 2
    failed = {**_delta(p, p_before, "tspd_pd_room_failures_total"),
              **_delta(d, d_before, "tspd_pd_room_failures_total")}  # fmt: skip
    assert failed == {}


def _stop_string(text: str) -> str:
    """Two printable ASCII characters of ``text``, past its start, found there first."""
    for i in range(3, len(text) - 1):
        stop = text[i : i + 2]
        if all(" " <= c <= "~" for c in stop) and text.index(stop) == i:
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


def test_a_stop_string_cuts_the_text_and_aborts_the_request_on_the_decode_node(
    local: Local,
) -> None:
    prompt = TOK.encode("Stop strings cut here")
    max_tokens = 2000  # a whole run: 1999 decode forwards on D (P computes the first token)
    (tokens,) = colocated([prompt], SamplingParams(max_tokens=40, ignore_eos=True), CFG)
    text = Detokenizer().feed(tokens)
    stop = _stop_string(text)
    cut = text[: text.index(stop)]
    # The router reads D's stream one token a line: it has read exactly the tokens up to the
    # one that completes the stop string when it stops.
    read = next(k for k in range(1, len(tokens) + 1) if stop in Detokenizer().feed(tokens[:k]))
    before = _decode_stats(local)
    got = local.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          stop=[stop], extra_body={"ignore_eos": True})  # fmt: skip
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(prompt), read)

    def settled() -> bool:
        s = _decode_stats(local)
        idle = s["waiting"] == s["running"] == s["held"] == s["pd_rooms_tracked"] == 0
        return idle and s["reclaimable_pages"] == s["initial_free_pages"] == s["total_pages"]

    wait_until(settled, 30, "D's request gone and its pages back in the pool")
    after = _decode_stats(local)
    # D computed the tokens the router read (all but P's first) and whatever it decoded
    # before the abort landed: far fewer than the 1999 of a run to max_tokens, which only an
    # abort explains (ignore_eos: nothing else ends the request early).
    forwarded = after["forward_tokens"] - before["forward_tokens"]
    assert read - 1 <= forwarded < max_tokens - 1
    assert after["pd_transfers_ok"] - before["pd_transfers_ok"] == 1


def test_sigint_stops_every_process_cleanly(local: Local) -> None:
    tree = descendants(local.proc.pid)
    assert len(tree) >= 3 + 3 + 3  # roles, rank processes, transfer workers (and helpers)
    local.proc.send_signal(signal.SIGINT)
    assert local.proc.wait(90) == 0
    wait_until(lambda: not alive(tree), 30, "every process of the cluster to exit")
    assert local.ended.wait(30)  # the reader has its last lines (it may lag behind the exit)
    tail = local.lines[-5:]
    assert tail[0] == "SIGINT received: stopping the cluster"
    # The router first; then the two nodes, started side by side, stop side by side.
    assert tail[1].split()[1] == "router"
    assert sorted(line.split()[1] for line in tail[2:4]) == ["decode", "prefill"]
    assert tail[4] == "cluster stopped"
