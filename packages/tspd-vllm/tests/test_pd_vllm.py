"""Real vLLM (CPU build) prefill and decode processes with TspdConnector, SmolLM2-135M, behind
the PD front, against a colocated vLLM: greedy outputs token for token (completions and
chat, streamed and not; the concurrent flow), D's KV usage back to zero, and a forged
rendezvous refused without harm, and a room no D pulls given up on P at once (P's KV usage
back to zero in seconds, not at its 120 s bootstrap timeout). A second P streams layerwise
(``layerwise_interval`` 1, chunked prefill of 128 tokens): with D bootstrapped while it
prefills, a multi-chunk prompt leaves in several write jobs, one-forward prompts and a room D
bootstraps after P's last forward in one, and D's tokens equal P's colocated ones. (A P
killed holding KV: test_pd_kill.py.)"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
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
#: The layerwise P's prefill: chunks of 128 tokens (one CPU block), so the long prompts take
#: four forwards; no prefix cache, so its colocated answers are prefilled like its PD ones.
LAYERWISE_ARGS = ("--max-num-batched-tokens", "128", "--max-num-seqs", "8",
                  "--no-enable-prefix-caching")  # fmt: skip


@dataclass
class Cluster:
    reference: VllmNode
    prefill: VllmNode
    decode: VllmNode
    fronts: dict[str, VllmNode]
    bootstrap_port: int
    #: Fronts whose D accepts connections and never answers (``hole`` listens, accepts nothing).
    nowhere: dict[str, VllmNode]
    #: P streaming layerwise (chunked prefill, no prefix cache: its own colocated reference)
    #: and its bootstrap port.
    layerwise: VllmNode
    layerwise_port: int


def _stop_all(nodes: list[VllmNode]) -> None:
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def cluster(vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    boot = free_port()
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    nowhere = f"http://127.0.0.1:{hole.getsockname()[1]}"
    lw_boot = free_port()
    nodes = [
        start_vllm("reference", vllm_model_dir, logs),
        start_vllm("prefill", vllm_model_dir, logs, kv_config=tspd_kv_config("kv_producer", boot)),
        start_vllm(
            "decode",
            vllm_model_dir,
            logs,
            kv_config=tspd_kv_config("kv_consumer") | {"kv_load_failure_policy": "fail"},
        ),
        start_vllm(
            "prefill-layerwise",
            vllm_model_dir,
            logs,
            kv_config=tspd_kv_config("kv_producer", lw_boot, layerwise_interval=1),
            extra_args=LAYERWISE_ARGS,
        ),
    ]
    try:
        for node in nodes:
            node.wait_ready()
        ref, p, d, lw = nodes
        fronts = {
            "sequential": start_front(logs, [p.url], [d.url], "sequential"),
            "concurrent": start_front(logs, [f"{p.url}@127.0.0.1:{boot}"], [d.url], "concurrent"),
        }
        holes = {
            flow: start_front(
                logs, [f"{p.url}@127.0.0.1:{boot}"], [nowhere], flow, name=f"front-{flow}-nowhere"
            )
            for flow in ("sequential", "concurrent")
        }
        nodes += [*fronts.values(), *holes.values()]
        for front in [*fronts.values(), *holes.values()]:
            front.wait_ready(60)
        yield Cluster(ref, p, d, fronts, boot, holes, lw, lw_boot)
    finally:
        _stop_all(nodes)
        hole.close()


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


def _wait_usage(node: VllmNode, held: bool, timeout_s: float) -> float:
    """Until ``node``'s KV usage is above zero (``held``) or zero; the seconds it took."""
    start = time.monotonic()
    while ((metric(node.url, USAGE) or 0.0) > 0.0) != held:
        waited = time.monotonic() - start
        assert waited < timeout_s, f"{node.name}: {USAGE} not {'> 0' if held else '0'}"
        time.sleep(0.1)  # polling the node's own metric
    return time.monotonic() - start


#: How soon P must free a room no D pulls: far below its bootstrap timeout (120 s).
GIVE_UP_S = 15.0


def test_a_first_token_that_ends_the_request_frees_p_at_once(cluster: Cluster) -> None:
    """``max_tokens`` 1: P's answer is the client's, D is never asked; P, which held the
    room's KV for a D, frees it at once (the front gives the room up)."""
    _wait_usage(cluster.prefill, held=False, timeout_s=60)
    want = _completion(cluster.reference.url, PROMPTS[1], max_tokens=1)
    assert _completion(cluster.fronts["sequential"].url, PROMPTS[1], max_tokens=1) == want
    _wait_usage(cluster.prefill, held=False, timeout_s=GIVE_UP_S)


def test_a_client_gone_before_d_asked_frees_p_at_once_sequential(cluster: Cluster) -> None:
    """Sequential flow, streamed: the client reads P's first token and goes away while the
    front waits on a D that never answers (so D never asked for the KV). P held the room's
    KV; it is back to zero usage within seconds."""
    _wait_usage(cluster.prefill, held=False, timeout_s=60)
    conn = _open(cluster.nowhere["sequential"], dict(_chat_body(CHATS[0], True)))
    resp = conn.getresponse()
    assert resp.status == 200
    first = json.loads(resp.readline().decode().removeprefix("data: "))
    assert first["choices"][0]["token_ids"] == _chat(cluster.reference.url, CHATS[0])[:1]
    _wait_usage(cluster.prefill, held=True, timeout_s=30)  # P holds it for a D
    conn.close()  # the client goes away
    _wait_usage(cluster.prefill, held=False, timeout_s=GIVE_UP_S)


def test_a_client_gone_before_d_asked_frees_p_at_once_concurrent(cluster: Cluster) -> None:
    """Concurrent flow: P prefills and holds the room while D (never answering) never asks;
    the client goes away; P is back to zero usage within seconds."""
    _wait_usage(cluster.prefill, held=False, timeout_s=60)
    body = {"model": MODEL_NAME, "prompt": LONG, "max_tokens": 4, "temperature": 0}
    conn = _open(cluster.nowhere["concurrent"], body)
    _wait_usage(cluster.prefill, held=True, timeout_s=60)  # prefilled, held for a D
    conn.close()
    _wait_usage(cluster.prefill, held=False, timeout_s=GIVE_UP_S)


def _open(front: VllmNode, body: dict[str, Any]) -> http.client.HTTPConnection:
    """A request sent to ``front`` on a connection of its own (the caller reads or closes)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


# -- layerwise (a P with layerwise_interval 1) ------------------------------------------------

#: P's line per early room (tspd_vllm.layerwise): room, outcome, chunks armed, rank totals.
STATS = re.compile(
    r"TspdConnector P rank 0: room (\d+) (sent|failed), (\d+) chunk\(s\) armed; "
    r"rank totals: jobs=(\d+) "
)


def _room_stats(node: VllmNode, room: int, timeout_s: float = 30.0) -> tuple[int, int]:
    """(chunks armed, write jobs) of ``room``'s send, from P's log line for it: the jobs are
    its rank total less the total of the line before (requests here run one at a time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = STATS.findall(node.log_path.read_text(errors="replace"))
        for i, (r, outcome, chunks, jobs) in enumerate(found):
            if int(r) == room:
                assert outcome == "sent", found[i]
                before = int(found[i - 1][3]) if i else 0
                return int(chunks), int(jobs) - before
        assert time.monotonic() < deadline, f"no stats line for room {room}"
        time.sleep(0.1)  # polling P's own log


def _colocated(node: VllmNode, prompt: str) -> tuple[list[int], list[int]]:
    """(prompt token ids, greedy tokens) of ``node`` serving ``prompt`` itself; past an EOS
    too (``ignore_eos``: the long prompt's first token is EOS with 128-token chunks), so
    every answer has ``MAX_TOKENS`` tokens to compare."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    status, answer = post_json(f"{node.url}/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    return list(choice["prompt_token_ids"]), list(choice["token_ids"])


def _prefill(cluster: Cluster, prompt: str, room: int) -> int:
    """P's half: one token, its KV to go to a D through ``room``."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True,
            "kv_transfer_params": {"do_remote_decode": True, "bootstrap_room": room}}  # fmt: skip
    status, answer = post_json(f"{cluster.layerwise.url}/v1/completions", body)
    assert status == 200, answer
    (token,) = answer["choices"][0]["token_ids"]
    return int(token)


def _decode(cluster: Cluster, ids: list[int], first: int, room: int, out: list[Any]) -> None:
    """D's half (the front's sequential body): P's prompt and first token, P's KV loaded
    through ``room``; a cache salt of its own, so no prefix D cached earlier is reused."""
    params = {"do_remote_prefill": True, "bootstrap_host": "127.0.0.1",
              "bootstrap_port": cluster.layerwise_port, "bootstrap_room": room,
              "kv_tokens": len(ids)}  # fmt: skip
    body = {"model": MODEL_NAME, "prompt": [*ids, first], "max_tokens": MAX_TOKENS - 1,
            "temperature": 0, "return_token_ids": True, "kv_transfer_params": params,
            "cache_salt": f"layerwise-{room}", "ignore_eos": True}  # fmt: skip
    out.append(post_json(f"{cluster.decode.url}/v1/completions", body))


def _d_tokens(answer: tuple[int, Any]) -> list[int]:
    status, body = answer
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


ONE_FORWARD = 128  #: prompts of at most this many tokens are prefilled in one forward


def test_layerwise_streams_while_p_prefills_token_for_token(cluster: Cluster) -> None:
    """D first (as in the concurrent flow: it bootstraps the room while P prefills), then P:
    every prompt of ``PROMPTS`` — D's tokens after P's first token equal P's colocated ones;
    a prompt of several forwards went out layerwise (chunks armed, several write jobs); a
    prompt of one forward cannot (its room is registered in that forward's step) and goes in
    one write job."""
    _wait_usage(cluster.decode, held=False, timeout_s=60)
    for n, prompt in enumerate(PROMPTS):
        ids, want = _colocated(cluster.layerwise, prompt)
        room = 7100 + n
        answer: list[Any] = []
        d = threading.Thread(target=_decode, args=(cluster, ids, want[0], room, answer))
        d.start()
        try:
            _wait_usage(cluster.decode, held=True, timeout_s=60)  # D pre-allocated the room
            assert _prefill(cluster, prompt, room) == want[0]
        finally:
            d.join(timeout=300)
        assert _d_tokens(answer[0]) == want[1:], prompt
        chunks, jobs = _room_stats(cluster.layerwise, room)
        if len(ids) > 2 * ONE_FORWARD:  # D had a forward's time at least: streamed
            assert chunks >= 1, (prompt, chunks)
            assert jobs > 1, (prompt, jobs)
        elif len(ids) <= ONE_FORWARD:
            assert (chunks, jobs) == (0, 1), prompt
        _wait_usage(cluster.decode, held=False, timeout_s=60)
    assert max(len(_colocated(cluster.layerwise, p)[0]) for p in PROMPTS) > 2 * ONE_FORWARD


def test_layerwise_room_d_bootstraps_after_p_s_last_forward_goes_whole(cluster: Cluster) -> None:
    """P first, to the end (the sequential flow: D learns of P from its answer), then D: the
    long prompt's four forwards armed nothing, so its KV went whole, in one write job, and
    D's tokens equal P's colocated ones."""
    prompt = PROMPTS[-1]
    ids, want = _colocated(cluster.layerwise, prompt)
    assert len(ids) > 3 * ONE_FORWARD
    room = 7200
    assert _prefill(cluster, prompt, room) == want[0]
    answer: list[Any] = []
    _decode(cluster, ids, want[0], room, answer)
    assert _d_tokens(answer[0]) == want[1:]
    assert _room_stats(cluster.layerwise, room) == (0, 1)
