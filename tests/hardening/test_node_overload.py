"""Issue 35's node attacks, performed on real processes (``launch_pd.py``): a node flooded with
request ids its engine would drop, a cluster sent far more streams than its nodes hold, and a
SmolLM2 cluster sent a prompt near the model's 8,192-token context.

* 550 ``/generate`` requests with a 257-character ``rid`` used to wedge a node for good (each
  waited on a thread for an answer its engine never sent: 521 threads, ``/health`` 503,
  SIGKILL to stop it). Each is now a 400 with the reason; the node answers a known prompt
  exactly, its threads are back to where they were, and SIGTERM stops it cleanly.
* 500 concurrent streams were all accepted and the decode node, taken for dead, failed every
  one. A node now holds at most ``--max-queued-requests`` (running and queued) and refuses
  more as busy: the router answers those 429 with ``Retry-After``, never a node-down error,
  every accepted stream gets its exact text, and both nodes stay in.
* A 2,048-token SmolLM2 prefill round kept the engine silent past the node's 5 s health bound,
  so fresh prompts of 1,500 tokens and more failed on an idle machine. ``/health`` now reads
  the ranks' pulses: an ~8,000-token prompt goes through the whole PD cluster with exactly
  the colocated engine's tokens while the prefill node stays healthy, and a SIGSTOPped rank
  is still found (``/health`` 503 naming it, taken out by the router, back once resumed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.models import SMOLLM2, resolve

from .cluster import LAUNCHER, MODEL, TOK, Cluster, expected_texts, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ATTACKS = 550
LONG_RID = "r" * 257
KNOWN = "the node still answers"


def _ready_line(proc: subprocess.Popen[str], role: str) -> str:
    """The URL of ``role`` once its process prints its readiness line."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"{role} ready on "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep it drained
            return line.split()[3]
    raise AssertionError(f"{role} exited before it was ready (code {proc.wait()})")


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its ranks, their workers, the forkserver)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out.update(children)
        todo += children
    return out


@pytest.fixture
def node() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A colocated node process (tiny model, one replica)."""
    argv = [sys.executable, str(LAUNCHER), "colocated", "--log-level", "warning", "--port", "0",
            "--num-pages", "256", "--max-running", "8"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        yield proc, _ready_line(proc, "colocated")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_hundreds_of_ids_the_engine_would_drop_cost_a_node_nothing(
    node: tuple[subprocess.Popen[str], str],
) -> None:
    proc, url = node
    engine = Engine(EngineConfig(num_pages=256, max_running=8))
    try:
        (want,) = engine.generate([TOK.encode(KNOWN)], SamplingParams(8))
    finally:
        engine.close()
    known = {"text": KNOWN, "max_tokens": 8}
    with requests.Session() as warm:  # the node's lazily made threads exist before the count
        assert warm.post(f"{url}/generate", json=known, timeout=60).status_code == 200
        assert warm.get(f"{url}/stats", timeout=10).status_code == 200
    baseline = _threads(proc.pid)

    def attack(i: int) -> tuple[int, str]:
        body = {"text": f"attack {i}", "max_tokens": 2000, "rid": LONG_RID}
        resp = requests.post(f"{url}/generate", json=body, timeout=60)
        return resp.status_code, resp.json()["error"]

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(attack, range(ATTACKS)))
    assert answers == [(400, "'rid' must be a string of 1..256 characters")] * ATTACKS
    answer = requests.post(f"{url}/generate", json=known, timeout=60).json()
    assert (answer["output_ids"], answer["finish_reason"]) == (list(want.tokens), "length")
    health = requests.get(f"{url}/health", timeout=10)
    assert (health.status_code, health.json()) == (
        200, {"status": "ok", "in_flight": 0, "capacity": 16})  # fmt: skip
    wait_until(lambda: _threads(proc.pid) <= baseline, 30, "the node's threads back to baseline")
    ranks = _descendants(proc.pid)  # the rank, its forkserver, the resource tracker
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    # Its ranks at once; the forkserver and resource tracker once they see the node gone.
    gone = lambda: all(_state(pid) in ("gone", "Z") for pid in ranks)  # noqa: E731
    wait_until(gone, 30, "every process of the node gone")


# -- admission control through a PD cluster ----------------------------------------------

STREAMS = 40
CAPACITY = 6
MAX_TOKENS = 48


@dataclass
class Outcome:
    status: int = 0
    text: str = ""
    error: str = ""
    retry_after: str = ""


def _stream(url: str, prompt: str) -> Outcome:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True}  # fmt: skip
    out = Outcome()
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.error = resp.json()["error"]["code"]
            out.retry_after = resp.headers.get("Retry-After", "")
            return out
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line.removeprefix(b"data: "))
            if "error" in event:
                out.error = event["error"]["code"]
                return out
            out.text += event["choices"][0]["text"]
    return out


@pytest.fixture(scope="module")
def small() -> Iterator[Cluster]:
    """A PD cluster whose nodes each hold at most CAPACITY requests (4 running)."""
    started = Cluster.start("--max-running", "4", "--max-queued-requests", str(CAPACITY))
    try:
        yield started
    finally:
        started.stop()


def test_far_more_streams_than_a_node_holds_are_refused_as_busy_never_failed(
    small: Cluster,
) -> None:
    for role in ("prefill", "decode"):
        info = requests.get(small.urls[role] + "/info", timeout=10).json()
        assert info["max_queued_requests"] == CAPACITY
    prompts = [f"overload stream {i}: " + "tspd " * (i % 4) for i in range(STREAMS)]
    want = dict(zip(prompts, expected_texts(prompts, MAX_TOKENS, ignore_eos=True), strict=True))
    with ThreadPoolExecutor(STREAMS) as pool:
        outcomes = list(pool.map(lambda p: _stream(small.urls["router"], p), prompts))
    served = [p for p, o in zip(prompts, outcomes, strict=True) if o.status == 200]
    refused = [o for o in outcomes if o.status != 200]
    assert [(o.status, o.error, o.text) for o in refused] == [(429, "overloaded", "")] * len(
        refused
    )
    assert all(int(o.retry_after) >= 1 for o in refused)
    assert refused, "no stream was refused: the nodes took more than they hold"
    assert served, "no stream was served"
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        if outcome.status == 200:
            assert (outcome.error, outcome.text) == ("", want[prompt])
    # (What a full node answers on /ready is checked exactly where its fullness is held, not
    # sampled: tests/engine/test_engine_server.py. Polling D here for its moments at capacity
    # missed them on a loaded machine.)
    assert small.said("taken out") == []  # busy is not dead: neither node left the pool
    assert small.answers_known()
    wait_until(small.pools_whole, 60, "both pools whole")
    ready = requests.get(small.urls["decode"] + "/ready", timeout=10)
    assert (ready.status_code, ready.json()) == (
        200, {"status": "ready", "in_flight": 0, "capacity": CAPACITY})  # fmt: skip


# -- a prompt near SmolLM2's context through a PD cluster ---------------------------------

LONG_TOKENS = 8000
LONG_MAX_TOKENS = 4
SMOL_KNOWN = "The capital of France is"


def _smollm2_cluster() -> Cluster:
    argv = [sys.executable, str(LAUNCHER), "local", "--log-level", "warning", "--model", SMOLLM2,
            "--router-port", "0", "--prefill-port", "0", "--decode-port", "0",
            "--bootstrap-port", "0", "--num-pages", "1024"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    cluster = Cluster(proc)
    threading.Thread(target=cluster._read, daemon=True).start()
    if not cluster.ready.wait(300):
        cluster.stop()
        raise AssertionError("\n".join(["local never got ready:", *cluster.lines]))
    return cluster


def _token_ids(cluster: Cluster, prompt: list[int]) -> list[int] | str:
    """The ids the cluster generates for ``prompt`` (EOS ignored, as in the reference), or
    what went wrong."""
    body = {"model": SMOLLM2, "prompt": prompt, "max_tokens": LONG_MAX_TOKENS,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    resp = requests.post(cluster.urls["router"] + "/v1/completions", json=body, timeout=600)
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    choice = resp.json()["choices"][0]
    assert resp.json()["usage"]["prompt_tokens"] == len(prompt)
    return list(choice["token_ids"])


def _healthy_gauge(cluster: Cluster, role: str) -> str:
    return f'tspd_router_node_healthy{{node="{cluster.urls[role]}",role="{role}"}}'


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_a_prompt_near_smollm2s_context_is_served_and_a_stopped_rank_still_found() -> None:
    path = resolve(SMOLLM2)
    tok = load_tokenizer(path)
    # A fresh prompt: nothing of it is in any prefix cache (the cluster is new as well).
    ids = tok.encode(" ".join(f"w{i}" for i in range(LONG_TOKENS)))[:LONG_TOKENS]
    known_ids = tok.encode(SMOL_KNOWN)
    engine = Engine(EngineConfig(checkpoint=path, num_pages=1024))
    try:
        params = SamplingParams(LONG_MAX_TOKENS, ignore_eos=True)
        long_want, known_want = engine.generate([ids, known_ids], params)
    finally:
        engine.close()
    cluster = _smollm2_cluster()
    try:
        unhealthy: list[str] = []
        done = threading.Event()

        def watch_prefill() -> None:  # every answer of P's /health while the prompt runs
            while not done.wait(0.25):
                resp = requests.get(cluster.urls["prefill"] + "/health", timeout=10)
                if resp.status_code != 200:
                    unhealthy.append(resp.text)

        watcher = threading.Thread(target=watch_prefill, daemon=True)
        watcher.start()
        got = _token_ids(cluster, ids)
        done.set()
        watcher.join(30)
        assert (len(ids), got) == (LONG_TOKENS, list(long_want.tokens))
        assert unhealthy == []
        assert cluster.said("taken out") == []
        # A stopped rank is still found: P's /health names it, the router takes P out.
        pid = cluster.rank_pids("prefill")[-1]
        rank = int(Path(f"/proc/{pid}/comm").read_text().strip().removeprefix("tspd-p-rank"))
        os.kill(pid, signal.SIGSTOP)
        try:
            gauge = _healthy_gauge(cluster, "prefill")
            wait_until(lambda: f"{gauge} 0" in requests.get(
                cluster.urls["router"] + "/metrics", timeout=10).text.splitlines(),
                30, "the router taking the stopped prefill node out")  # fmt: skip
            health = requests.get(cluster.urls["prefill"] + "/health", timeout=10)
            assert health.status_code == 503
            assert re.fullmatch(rf"replica 0: rank {rank} has not run for [\d.]+ s \(stopped\?\)",
                                health.json()["error"])  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)

        wait_until(lambda: _token_ids(cluster, known_ids) == list(known_want.tokens), 120,
                   "the resumed cluster answering the known prompt exactly")  # fmt: skip
    finally:
        cluster.stop()
