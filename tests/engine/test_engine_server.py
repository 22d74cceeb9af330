"""The node HTTP endpoint over a real aiohttp server and a real (in-process) engine."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
import zmq
from aiohttp import web

from tspd_bootstrap import BootstrapServer
from tspd_core.pd.proc.control import route_source_ip
from tspd_engine.frames import (
    Abort,
    FinishReason,
    Frame,
    Output,
    PdTarget,
    Query,
    RoomAbort,
    SamplingParams,
    Stats,
    Submit,
    decode,
    encode,
)
from tspd_engine.loop.engine import Engine
from tspd_engine.node import replicas as replicas_module
from tspd_engine.node.allow import OWN_ONLY, BootstrapAllowlist
from tspd_engine.node.endpoint import make_app
from tspd_engine.node.replicas import Node, NodeInfo, NodeRole, TokenBucket
from tspd_engine.node.run import NodeSpec, host_bootstrap
from tspd_engine.rank import client as client_module
from tspd_engine.rank.client import EngineClient
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_serving import process_metrics
from tspd_serving.errors import ConfigError

from .conftest import TOK, small_config


@contextmanager
def _serving(app: web.Application) -> Iterator[str]:
    """Serve ``app`` on a port the OS picks, from a thread of its own; its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        # Port 0: the OS picks a free port as the site binds; read it back from the runner.
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineHandle]:
    with launch(small_config(), in_process=True) as handle:
        yield handle


@pytest.fixture(scope="module")
def base_url(engine: EngineHandle) -> Iterator[str]:
    with _serving(make_app(engine.client, TOK)) as url:
        yield url


def _want(text: str, max_tokens: int) -> list[int]:
    (out,) = Engine(small_config()).generate([TOK.encode(text)], SamplingParams(max_tokens))
    return list(out.tokens)


@pytest.mark.multiproc
def test_health_and_generate(base_url: str) -> None:
    ok = {"status": "ok", "in_flight": 0, "capacity": 0}  # a bare client's node: no bound
    assert requests.get(f"{base_url}/health", timeout=10).json() == ok
    r = requests.post(
        f"{base_url}/generate", json={"text": "hi there", "max_tokens": 7}, timeout=60
    )
    assert r.status_code == 200
    body = r.json()
    assert body["output_ids"] == _want("hi there", 7)
    assert body["text"] == TOK.decode(body["output_ids"])
    assert (body["finish_reason"], body["prompt_tokens"]) == ("length", 9)


@pytest.mark.multiproc
def test_stream_is_ndjson_chunks_of_the_same_tokens(base_url: str) -> None:
    payload = {"input_ids": TOK.encode("stream me"), "max_tokens": 9, "stream": True}
    with requests.post(f"{base_url}/generate", json=payload, stream=True, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [t for line in lines for t in line["output_ids"]] == _want("stream me", 9)
    assert all("finish_reason" not in line for line in lines[:-1])
    assert lines[-1]["finish_reason"] == "length"


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{", "body is not valid JSON"),
        (b'{"text": "a", "input_ids": [1]}', "exactly one of 'text' and 'input_ids'"),
        (b'{"input_ids": [1, "x"]}', "'input_ids' must be a list of integers"),
        (b'{"text": "a", "max_tokens": "9"}', "'max_tokens' must be an integer"),
        (b'{"text": "a", "max_tokens": 0}', "max_tokens must be >= 1"),
        (b'{"input_ids": []}', "prompt must hold at least one token id"),
        (b'{"input_ids": [256, 7000]}', "prompt token ids must lie in 0..258"),
        # Issue 35.3: rank 0's intake drops a frame with an id past 256 characters unread, so
        # the node refuses it at its door (the request used to wait for an answer for ever).
        (b'{"text": "a", "rid": "' + b"r" * 257 + b'"}', "'rid' must be a string of 1..256 "),
        (b'{"text": "a", "rid": ""}', "'rid' must be a string of 1..256 characters"),
    ],
)
def test_bad_bodies_get_400_with_the_reason(base_url: str, body: bytes, why: str) -> None:
    r = requests.post(f"{base_url}/generate", data=body, timeout=60)
    assert r.status_code == 400
    assert why in r.json()["error"]
    ok = requests.post(f"{base_url}/generate", json={"text": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the bad body lost nothing


@pytest.mark.multiproc
def test_a_stream_closed_by_its_client_is_aborted_quietly(
    base_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A router closes D's stream as soon as it has its answer (or its client left): the node
    # must abort the request and free its pages, and log it as the ordinary event it is.
    caplog.set_level(logging.INFO, logger="tspd_engine.node.endpoint")
    payload = {"text": "go on", "max_tokens": 300, "ignore_eos": True, "stream": True,
               "rid": "closed-early"}  # fmt: skip
    with requests.post(f"{base_url}/generate", json=payload, stream=True, timeout=60) as r:
        first = json.loads(next(r.iter_lines()))
        assert first["rid"] == "closed-early"
    deadline = time.monotonic() + 30
    while requests.get(f"{base_url}/info", timeout=10).json()["in_flight"]:
        assert time.monotonic() < deadline, "the closed stream's request never ended"
        time.sleep(0.05)
    (stats,) = requests.get(f"{base_url}/stats", timeout=10).json()["replicas"]
    assert (stats["running"], stats["waiting"]) == (0, 0)
    assert stats["reclaimable_pages"] == stats["initial_free_pages"] == 96
    quiet = [
        (r.name, r.getMessage()) for r in caplog.records if r.name == "tspd_engine.node.endpoint"
    ]
    assert quiet == [("tspd_engine.node.endpoint", "closed-early: the client closed the stream; "
                      "request aborted")]  # fmt: skip
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


class ScriptedRank0:
    """Rank 0's side of the intake protocol, scripted by the test over real ZMQ sockets: it
    receives exactly what a node sends its engine (token checked) and answers only what the
    test tells it to."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind("tcp://127.0.0.1:0")
        self.address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies: dict[str, zmq.Socket[bytes]] = {}

    def take(self, timeout: float = 30.0) -> Frame | None:
        """The next frame a client sent other than a query (each answered with no counters:
        the node's background probe asks every second); None: none within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            token, raw = self._pull.recv_multipart()
            assert token == self.token
            frame = decode(raw)
            if not isinstance(frame, Query):
                return frame
            self._send(frame.reply, Stats(frame.qid, {}))
        return None

    def answer(self, submit: Submit, out: Output) -> None:
        self._send(submit.reply, out)

    def _send(self, address: str, frame: Frame) -> None:
        sock = self._replies.get(address)
        if sock is None:
            sock = self._replies[address] = self._ctx.socket(zmq.PUSH)
            sock.connect(address)
        sock.send(encode(frame))

    def close(self) -> None:
        for sock in [self._pull, *self._replies.values()]:
            sock.close(linger=1000)
        self._ctx.term()


@contextmanager
def _scripted_node(
    capacity: int,
    role: NodeRole = NodeRole.COLOCATED,
    allow: BootstrapAllowlist | None = None,
) -> Iterator[tuple[ScriptedRank0, str]]:
    """A node endpoint of ``capacity`` (and ``role``, ``allow``) whose one replica is a
    :class:`ScriptedRank0`."""
    rank0 = ScriptedRank0("secret")
    client = EngineClient(rank0.address, "secret")
    try:
        node = Node([client], NodeInfo(role=role, max_queued_requests=capacity), (), allow)
        with _serving(make_app(node, TOK)) as url:
            yield rank0, url
    finally:
        client.close()
        rank0.close()


def _submit(frame: Frame | None) -> Submit:
    assert isinstance(frame, Submit), frame
    return frame


BUSY = {"error": "node at capacity: 2 requests held of 2", "busy": True}


def test_a_node_at_capacity_refuses_one_more_before_it_reaches_the_engine() -> None:
    # Issue 35.6: a node took every request it was sent (500 streams) and stopped answering
    # its health checks. Now it holds at most its capacity, running and queued, and refuses
    # one more with 503 + Retry-After + busy (the router tries another node or answers 429);
    # busy is not dead: /health stays 200, /ready says busy until a request ends.
    with _scripted_node(capacity=2) as (rank0, url), ThreadPoolExecutor(3) as pool:
        held = [pool.submit(requests.post, f"{url}/generate", json={"text": "x", "rid": rid},
                            timeout=60) for rid in ("held-0", "held-1")]  # fmt: skip
        subs = sorted((_submit(rank0.take()) for _ in held), key=lambda sub: sub.rid)
        for sub in subs:
            rank0.answer(sub, Output(sub.rid, ()))  # taken (the intake's acknowledgement)
        refused = requests.post(f"{url}/generate", json={"text": "one more"}, timeout=60)
        assert (refused.status_code, refused.headers["Retry-After"], refused.json()) == (
            503, "1", BUSY)  # fmt: skip
        assert rank0.take(timeout=0.5) is None  # refused before anything reached the engine
        ready = requests.get(f"{url}/ready", timeout=10)
        assert (ready.status_code, ready.headers["Retry-After"], ready.json()) == (503, "1", BUSY)
        health = requests.get(f"{url}/health", timeout=10)
        assert (health.status_code, health.json()) == (
            200, {"status": "ok", "in_flight": 2, "capacity": 2})  # fmt: skip
        rank0.answer(subs[0], Output("held-0", (104, 105), FinishReason.LENGTH, "", 2, 0))
        answer = held[0].result()
        assert (answer.status_code, answer.json()) == (200, {
            "rid": "held-0", "output_ids": [104, 105], "text": "hi", "finish_reason": "length",
            "prompt_tokens": 2, "cached_tokens": 0})  # fmt: skip
        ready = requests.get(f"{url}/ready", timeout=10)  # the slot was freed before the answer
        assert (ready.status_code, ready.json()) == (
            200, {"status": "ready", "in_flight": 1, "capacity": 2})  # fmt: skip
        again = pool.submit(requests.post, f"{url}/generate", json={"text": "y"}, timeout=60)
        third = _submit(rank0.take())
        assert third.prompt == tuple(TOK.encode("y"))
        for sub in (subs[1], third):
            rank0.answer(sub, Output(sub.rid, (), FinishReason.ABORT))
        assert [f.result().json()["finish_reason"] for f in (held[1], again)] == ["abort"] * 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_submit_the_engine_never_takes_fails_and_frees_its_slot(
    stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 35.3: a submit rank 0 dropped unread held its request (a thread, a slot) for ever.
    # Rank 0 acknowledges each submit it takes; one never acknowledged fails within the bound
    # (here without vitals: ACK_TIMEOUT_S, shortened) and frees its slot.
    monkeypatch.setattr(client_module, "ACK_TIMEOUT_S", 1.0)
    why = "request lost: the engine never took it: no acknowledgement in 1 s (its frame was lost)"
    with _scripted_node(capacity=1) as (rank0, url), ThreadPoolExecutor(1) as pool:
        body = {"text": "x", "rid": "lost", "stream": stream}
        lost = pool.submit(requests.post, f"{url}/generate", json=body, timeout=60)
        assert _submit(rank0.take()).rid == "lost"  # it reached rank 0, which says nothing
        answer = lost.result()
        assert rank0.take() == Abort("lost")  # should the engine hold it after all, it ends
        ready = requests.get(f"{url}/ready", timeout=10)
    if stream:
        line = {"rid": "lost", "output_ids": [], "finish_reason": "failed", "error": why}
        assert (answer.status_code, answer.text) == (200, json.dumps(line) + "\n")
    else:
        assert (answer.status_code, answer.json()) == (503, {"error": why})
    assert (ready.status_code, ready.json()) == (
        200, {"status": "ready", "in_flight": 0, "capacity": 1})  # fmt: skip


def test_a_node_spec_without_replicas_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^a node runs at least one replica, got dp=0$"):
        NodeSpec(role=NodeRole.DECODE, engine=small_config(), dp=0)


@pytest.mark.multiproc
def test_metrics_render_the_stats_with_counter_and_gauge_types(base_url: str) -> None:
    (before,) = requests.get(f"{base_url}/stats", timeout=10).json()["replicas"]
    # A prompt whose first page (BOS + 3 bytes) no other request of this module shares: no
    # prefix hit, so the engine forwards the 25 prompt tokens (BOS + 24 bytes), then one token
    # per decode step: 7 (ignore_eos; the prefill gives the first of the 8 tokens, and no
    # step is launched past max_tokens).
    prompt = TOK.encode("Forward tokens, counted.")
    assert len(prompt) == 25
    body = {"input_ids": prompt, "max_tokens": 8, "ignore_eos": True}
    r = requests.post(f"{base_url}/generate", json=body, timeout=60)
    assert (r.status_code, len(r.json()["output_ids"])) == (200, 8)
    (stats,) = requests.get(f"{base_url}/stats", timeout=10).json()["replicas"]
    assert stats["forward_tokens"] - before["forward_tokens"] == 25 + 7
    # Rounds that ran a forward: the prefill with the first decode step (colocated), then 6
    # decode steps; the round that only settles the last fed step is not one of them.
    grew = {k: stats[k] - before[k] for k in ("prefill_rounds", "mixed_rounds", "decode_rounds")}
    assert grew == {"prefill_rounds": 0, "mixed_rounds": 1, "decode_rounds": 6}
    lines = requests.get(f"{base_url}/metrics", timeout=10).text.splitlines()
    types = dict(line.split()[2:4] for line in lines if line.startswith("# TYPE "))
    assert types == {
        "process_start_time_seconds": "gauge",
        "tspd_node_blocked": "gauge",
        "tspd_node_discarded_steps_total": "counter",
        "tspd_node_forward_tokens_total": "counter",
        "tspd_node_free_pages": "gauge",
        "tspd_node_held": "gauge",
        "tspd_node_initial_free_pages": "gauge",
        "tspd_node_preemptions_total": "counter",
        "tspd_node_reclaimable_pages": "gauge",
        "tspd_node_running": "gauge",
        "tspd_node_total_pages": "gauge",
        "tspd_node_waiting": "gauge",
    } | {
        f"tspd_node_{kind}_{what}_total": "counter"
        for kind in ("prefill", "decode", "mixed")
        for what in ("rounds", "round_seconds")
    }
    samples = {line.split("{")[0].split()[0]: float(line.rsplit(" ", 1)[1])
               for line in lines if not line.startswith("#")}  # fmt: skip
    # This process serves the node: its start time, as the module read it from the kernel.
    assert samples.pop("process_start_time_seconds") == process_metrics.STARTED
    renamed = {"preemptions", "discarded_steps", "forward_tokens"} | {
        k for k in stats if k.endswith(("_rounds", "_round_seconds"))
    }
    assert samples == {
        f"tspd_node_{k}_total" if k in renamed else f"tspd_node_{k}": v for k, v in stats.items()
    }


def _hosted(admin: bool) -> BootstrapServer:
    spec = NodeSpec(role=NodeRole.PREFILL, engine=small_config(), bootstrap_port=0,
                    bootstrap_admin=admin)  # fmt: skip
    started, server = host_bootstrap(spec)
    assert server is not None
    assert started.bootstrap == server.url.removeprefix("http://")
    return server


def test_a_prefill_nodes_own_bootstrap_server_refuses_admin_by_default() -> None:
    with _hosted(admin=False) as server:
        assert requests.get(f"{server.url}/ranks", timeout=10).status_code == 200
        for path in ("/ranks", "/ranks/0"):
            r = requests.delete(f"{server.url}{path}", timeout=10)
            assert (r.status_code, r.json()["error"]) == (403, "admin_disabled")


def test_bootstrap_admin_turns_the_operator_endpoints_on() -> None:
    with _hosted(admin=True) as server:
        r = requests.delete(f"{server.url}/ranks", timeout=10)
        assert (r.status_code, r.json()) == (200, {"removed": 0})
        r = requests.delete(f"{server.url}/ranks/0", timeout=10)
        assert (r.status_code, r.json()["error"]) == (404, "not_registered")


@pytest.mark.parametrize("changes", [{"role": NodeRole.DECODE}, {"bootstrap": "127.0.0.1:8998"}])
def test_bootstrap_admin_is_refused_where_the_node_hosts_no_server(
    changes: dict[str, object],
) -> None:
    spec: dict[str, object] = {"role": NodeRole.PREFILL, "engine": small_config()}
    with pytest.raises(ConfigError, match=r"^bootstrap_admin applies to the bootstrap server a "):
        NodeSpec(**(spec | changes), bootstrap_admin=True)  # type: ignore[arg-type]


#: (--host, --advertise-host, $TSPD_HOST) -> where the ranks bind and are reached (issue 18.7:
#: a node told one address puts nothing of its own elsewhere).
RANK_HOSTS = [
    (("10.0.0.2", None, None), "10.0.0.2"),  # --host alone: the ranks follow it
    (("10.0.0.2", "10.1.0.2", None), "10.1.0.2"),  # a separate network for the KV
    (("10.0.0.2", None, "10.1.0.3"), "10.1.0.3"),  # $TSPD_HOST names the ranks' address
    (("10.0.0.2", "10.1.0.2", "10.1.0.3"), "10.1.0.2"),  # the flag beats the environment
    (("0.0.0.0", None, "10.1.0.3"), "10.1.0.3"),
    (("127.0.0.1", None, None), "127.0.0.1"),  # the default: this host only
]


@pytest.mark.parametrize(("given", "want"), RANK_HOSTS)
def test_the_ranks_bind_where_the_operator_said(
    given: tuple[str, str | None, str | None], want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    host, advertise, env = given
    if env is None:
        monkeypatch.delenv("TSPD_HOST", raising=False)
    else:
        monkeypatch.setenv("TSPD_HOST", env)
    spec = NodeSpec(role=NodeRole.DECODE, engine=small_config(), host=host, advertise=advertise)
    assert spec.ranks_host() == want
    pd = spec.pd(0)
    assert pd is not None
    assert pd.host == want


def test_a_wildcard_host_gives_the_ranks_the_default_routes_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TSPD_HOST", raising=False)
    spec = NodeSpec(role=NodeRole.DECODE, engine=small_config(), host="0.0.0.0")
    assert spec.ranks_host() == route_source_ip("127.0.0.1")


def test_decode_nodes_are_told_the_address_the_bootstrap_server_listens_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two loopback addresses stand in for a multi-homed host: HTTP and the bootstrap server
    # on one, the ranks (--advertise-host) on the other. D must be told the first.
    monkeypatch.delenv("TSPD_HOST", raising=False)
    spec = NodeSpec(role=NodeRole.PREFILL, engine=small_config(), host="127.0.0.2",
                    advertise="127.0.0.3", bootstrap_port=0)  # fmt: skip
    started, server = host_bootstrap(spec)
    assert server is not None
    with server:
        assert started.bootstrap_advertised == f"127.0.0.2:{server.port}"
        assert started.info().bootstrap == f"127.0.0.2:{server.port}"
        assert started.ranks_host() == "127.0.0.3"
        assert requests.get(f"http://127.0.0.2:{server.port}/health", timeout=10).text == "OK"


def test_a_prefill_node_may_contact_only_its_own_bootstrap_server() -> None:
    spec = NodeSpec(role=NodeRole.PREFILL, engine=small_config(), bootstrap_port=0)
    started, server = host_bootstrap(spec)
    assert server is not None
    own = f"127.0.0.1:{server.port}"
    with server:
        allow = started.allowlist()
        assert allow is not None
        assert allow.refusal("127.0.0.1", server.port) == ""
        # It has no --allow-bootstrap (a decode node's flag): the refusal does not send the
        # operator looking for one.
        assert allow.refusal("127.0.0.1", server.port + 1) == (
            f"bootstrap server 127.0.0.1:{server.port + 1} is not one this node may contact "
            f"(allowed: {own}; a prefill node contacts only its own bootstrap server)"
        )


@pytest.mark.parametrize(
    ("flags", "host", "port", "allowed"),
    [
        ((), "127.0.0.1", 8998, True),  # one machine: any port of its own hosts
        ((), "localhost", 1, True),
        ((), "10.1.2.3", 80, False),
        (("10.0.0.2:8998",), "10.0.0.2", 8998, True),
        (("10.0.0.2:8998",), "10.0.0.2", 8999, False),
        (("10.0.0.2:8998",), "127.0.0.1", 8998, False),  # the flag replaces the default
        (("10.0.0.2:*",), "10.0.0.2", 1, True),
        (("*",), "192.0.2.7", 8998, True),
    ],
)
def test_a_decode_nodes_allowlist(
    flags: tuple[str, ...], host: str, port: int, allowed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TSPD_HOST", raising=False)
    spec = NodeSpec(role=NodeRole.DECODE, engine=small_config(), allow_bootstrap=flags)
    allow = spec.allowlist()
    assert allow is not None
    why = allow.refusal(host, port)
    if allowed:
        assert why == ""
    else:
        # By default: loopback, and the address the ranks pick without --advertise-host.
        own = {"127.0.0.1", "::1", "localhost", route_source_ip("127.0.0.1")}
        names = ", ".join(sorted(flags) or sorted(f"{h}:*" for h in own))
        assert why == (
            f"bootstrap server {host}:{port} is not one this node may contact "
            f"(allowed: {names}; see --allow-bootstrap)"
        )


class _Replica:
    """Stands in for a replica's client: records what the node sends it."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def submit(self, *args: object) -> object:
        return args

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def test_an_abort_reaches_a_pd_prefill_the_node_already_answered() -> None:
    # P prefills before D's pages are ready (PdConfig.prefill_early) and answers: its room
    # and pages outlive the answer, so the router's abort (D failed) must still reach them.
    replicas = [_Replica(), _Replica()]
    info = NodeInfo(role=NodeRole.PREFILL, dp=2)
    node = Node(replicas, info)  # type: ignore[arg-type]
    room = PdTarget(3, "127.0.0.1", 8998)
    node.submit([1, 2], SamplingParams(), "pd", room)
    node.release("pd")  # answered
    node.submit([1, 2], SamplingParams(), "plain", None)
    node.release("plain")
    assert node.in_flight() == 0
    assert (node.abort("pd"), node.abort("plain"), node.abort("never")) == (True, False, False)
    assert (replicas[0].aborted, replicas[1].aborted) == ([], ["pd"])  # room 3 % 2
    assert not node.abort("pd")  # once


# -- rooms a prefill node will not serve (issue 35, item 6's follow-up) --------------------

BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
OWN = BootstrapAllowlist.of(["127.0.0.1:8998"], OWN_ONLY)
ABORTED_AHEAD = "aborted before the prefill node took its request"


def _abort(url: str, body: object) -> tuple[int, object]:
    resp = requests.post(f"{url}/abort", json=body, timeout=30)
    return resp.status_code, resp.json()


def test_a_prefill_node_fails_the_room_of_a_request_it_refuses_at_its_door() -> None:
    # D takes its half at the same time as P and pre-allocates the room with P's ranks: a
    # room P refuses at its door (busy, or a bad body that named a valid room) must fail on
    # P's ranks, or D keeps its pages and slot until P's bootstrap timeout.
    with _scripted_node(1, NodeRole.PREFILL, OWN) as (rank0, url), ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            requests.post,
            f"{url}/generate",
            timeout=60,
            json={"text": "x", "rid": "held", "pd": {"room": 1} | BOOTSTRAP},
        )
        sub = _submit(rank0.take())
        rank0.answer(sub, Output("held", ()))  # taken: the node holds all it may
        busy = {"text": "y", "pd": {"room": 42} | BOOTSTRAP}
        refused = requests.post(f"{url}/generate", json=busy, timeout=60)
        assert (refused.status_code, refused.json()) == (503, {
            "error": "node at capacity: 1 requests held of 1", "busy": True})  # fmt: skip
        assert rank0.take() == RoomAbort(42, "the prefill node was at capacity")
        rank0.answer(sub, Output("held", (104,), FinishReason.LENGTH, "", 1, 0))
        assert held.result().status_code == 200
        bad = {"input_ids": "not ids", "pd": {"room": 43} | BOOTSTRAP}
        answer = requests.post(f"{url}/generate", json=bad, timeout=60)
        assert (answer.status_code, answer.json()) == (
            400, {"error": "'input_ids' must be a list of integers"})  # fmt: skip
        assert rank0.take() == RoomAbort(43, "the prefill node refused the request")
        # Nothing to fail: an invalid room, or another bootstrap server's (D pre-allocated
        # the room with that server's ranks, not this node's).
        for pd in ({"room": -1} | BOOTSTRAP, {"room": 44, "bootstrap_host": "10.9.9.9",
                                              "bootstrap_port": 8998}):  # fmt: skip
            answer = requests.post(f"{url}/generate", json={"text": "z", "pd": pd}, timeout=60)
            assert answer.status_code == 400
        assert rank0.take(timeout=0.5) is None
        # The router's abort of the refused request names the room: sent once only.
        assert _abort(url, {"rid": "gone", "room": 42}) == (
            200, {"aborted": False, "room_aborted": True})  # fmt: skip
        assert rank0.take(timeout=0.5) is None


def test_a_prefill_nodes_abort_with_a_room_fails_it_only_for_a_request_it_does_not_know() -> None:
    with _scripted_node(4, NodeRole.PREFILL) as (rank0, url), ThreadPoolExecutor(1) as pool:
        # A room the node never saw (the router gave the request up before P read it).
        assert _abort(url, {"rid": "never-seen", "room": 7}) == (
            200, {"aborted": False, "room_aborted": True})  # fmt: skip
        assert rank0.take() == RoomAbort(7, ABORTED_AHEAD)
        assert _abort(url, {"rid": "never-seen", "room": 7}) == (
            200, {"aborted": False, "room_aborted": True})  # fmt: skip
        assert rank0.take(timeout=0.5) is None  # remembered: not sent twice
        # A known request is aborted by its rid alone (its own room ends with it).
        known = pool.submit(
            requests.post,
            f"{url}/generate",
            timeout=60,
            json={"text": "x", "rid": "known", "pd": {"room": 8} | BOOTSTRAP},
        )
        sub = _submit(rank0.take())
        rank0.answer(sub, Output("known", ()))
        assert _abort(url, {"rid": "known", "room": 8}) == (
            200, {"aborted": True, "room_aborted": False})  # fmt: skip
        assert rank0.take() == Abort("known")
        rank0.answer(sub, Output("known", (), FinishReason.ABORT))
        assert known.result().json()["finish_reason"] == "abort"
        # The rid form stands as it was.
        assert _abort(url, {"rid": "other"}) == (200, {"aborted": False})
        for room in (-1, 2**63, 1.5, True, "7", None, [7]):
            body = {"rid": "x", "room": room}
            want = (200, {"aborted": False}) if room is None else (
                400, {"error": "'room' must be an integer in 0..2**63-1"})  # fmt: skip
            assert _abort(url, body) == want
        assert _abort(url, {"room": 9}) == (400, {"error": "'rid' must be a non-empty string"})
        assert rank0.take(timeout=0.5) is None


@pytest.mark.parametrize("role", [NodeRole.DECODE, NodeRole.COLOCATED])
def test_only_a_prefill_node_fails_rooms(role: NodeRole) -> None:
    with _scripted_node(4, role) as (rank0, url):
        assert _abort(url, {"rid": "r", "room": 7}) == (
            200, {"aborted": False, "room_aborted": False})  # fmt: skip
        body = {"input_ids": "bad", "pd": {"room": 8} | BOOTSTRAP}
        assert requests.post(f"{url}/generate", json=body, timeout=60).status_code == 400
        assert rank0.take(timeout=0.5) is None


def test_room_failures_over_the_rate_bound_are_not_passed_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each room failure leaves a tombstone in P's workers until the bootstrap timeout: a flood
    # of /abort calls with made-up rooms must not grow them without bound.
    monkeypatch.setattr(replicas_module, "ROOM_ABORTS_PER_S", 2)
    with _scripted_node(4, NodeRole.PREFILL) as (rank0, url):
        answers = [_abort(url, {"rid": "r", "room": room})[1] for room in (1, 2, 3)]
        assert [a["room_aborted"] for a in answers] == [True, True, False]  # type: ignore[index]
        assert [rank0.take(), rank0.take()] == [RoomAbort(1, ABORTED_AHEAD),
                                                RoomAbort(2, ABORTED_AHEAD)]  # fmt: skip
        assert rank0.take(timeout=0.5) is None


def test_a_token_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket(4)
    now = bucket.at
    assert [bucket.take(now) for _ in range(5)] == [True] * 4 + [False]
    assert [bucket.take(now + 0.25), bucket.take(now + 0.25)] == [True, False]
    assert sum(bucket.take(now + 100) for _ in range(10)) == 4  # never more than a burst


def test_a_room_failure_never_waits_for_an_intake_that_takes_nothing() -> None:
    # The endpoint fails rooms on its event loop, also while a long round keeps rank 0 from
    # reading: a full queue must cost the room (its D pages wait for the bootstrap timeout, as
    # before), never the loop's time. Here rank 0's port is bound but never listens, so the
    # frames queue up to ZMQ's high-water mark.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        client = EngineClient(f"tcp://127.0.0.1:{held.getsockname()[1]}", "secret")
        try:
            node = Node([client], NodeInfo(role=NodeRole.PREFILL))
            started = time.monotonic()
            sent = 0
            while sent < 10_000 and client.abort_room(sent, "x"):
                sent += 1
            assert sent == client._push.getsockopt(zmq.SNDHWM) == 1000  # then full, at once
            assert (node.fail_room(20_000, "x"), node.fail_room(20_000, "x")) == (False, False)
            assert time.monotonic() - started < client_module.SEND_TIMEOUT_MS / 1000
        finally:
            client.close()
