"""Load and failure through the whole stack, every role a ``launch_pd.py`` process.

32 concurrent requests complete with the colocated tokens, through the PD router and through a
router in colocated mode (a colocated node) alike. A decode node SIGKILLed after a stream's
first token ends that stream with an OpenAI error event (the tokens before it exact, no
``[DONE]``), and its router goes on serving through the other decode node. Then the prefill
node is SIGKILLed while 24 streams are in flight: each client gets either its exact tokens
(its KV had arrived) or an error from the router within a bounded time — never a hang, never
wrong tokens — and nothing the dead node started survives it.

A killed node is replaced (with the routers that named it) for the next test that needs it
(:meth:`Stack.whole`), so each test runs alone or in any order; counters are compared before
and after a test's own requests.

The prefill node hosts its bootstrap server (wire.md §3), so the kill takes the server down too:
the decode node's heartbeat (every 2 s, one failure declares P dead) fails every room that
waited for the dead node's KV, and D's pool returns to its initial free count within the
heartbeat bound — long before D's waiting timeout (the default 300 s here), which is what
used to free those pages when the server outlived the node.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai
import pytest
import requests

from tspd_core.pd.decode.heartbeat import bound_for
from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_serving.openai.text import Detokenizer

from .conftest import LAUNCHER, TOK, alive, child_env, colocated, descendants, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = "tspd-tiny"
#: Every error a client may see when P dies: its request was on P, P was found dead while
#: the KV was awaited, or D gave up on the transfer.
DEATH_CAUSES = {"prefill_failed", "prefill_node_down", "transfer_failed"}
ERROR_BOUND_S = 45.0  # from the kill to the last client's answer
HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES = 2, 1  # D's flags below
#: The heartbeat's bound, tspd_core.pd.decode.heartbeat: failures x (interval + 2 s connect + 3 s
#: read) = 7 s.
HEARTBEAT_BOUND_S = bound_for(HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES)
#: Kill to D's pool whole: the bound, plus rounds and scrapes on a loaded 2-core machine; far
#: below the 300 s waiting timeout, the only other way D gives up on a room whose manifest
#: is out (a client abort keeps the pages until P answers: docs/engine.md).
SETTLE_BOUND_S = HEARTBEAT_BOUND_S + 22


@dataclass
class Role:
    name: str
    proc: subprocess.Popen[str]
    url: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(f"{self.name} ready on "):
                self.url = line.split()[3]
                self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _start(name: str, *args: str) -> Role:
    argv = [sys.executable, str(LAUNCHER), name, "--log-level", "warning", "--port", "0", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)  # fmt: skip
    role = Role(name, proc)
    threading.Thread(target=role.read, daemon=True).start()
    return role


def _wait(*roles: Role) -> None:
    for role in roles:
        assert role.ready.wait(300), f"{role.name} never got ready: {role.lines}"


#: The prefill node: a slow prefill (long prompts, 128 tokens a round) keeps requests on P
#: when it dies; it hosts its bootstrap server (the default) on a free port.
PREFILL = ("--bootstrap-port", "0", "--num-pages", "1024", "--max-prefill-tokens", "128")
HEALTH = ("--health-interval", "0.5", "--health-failures", "2")


@dataclass
class Stack:
    started: list[Role]  #: every role started for the module (replaced ones too), to stop
    prefill: Role
    decode: Role
    colocated: Role
    decode2: Role  #: the decode node router2 picks first (killed by one test)
    router: Role = field(init=False)  #: PD: prefill -> decode
    router2: Role = field(init=False)  #: PD: prefill -> decode2 first, then decode
    colocated_router: Role = field(init=False)

    def start(self, name: str, *args: str) -> Role:
        self.started.append(_start(name, *args))
        return self.started[-1]

    def start_pd_routers(self) -> None:
        self.router = self.start("router", "--prefill", self.prefill.url, "--decode",
                                 self.decode.url, *HEALTH)  # fmt: skip
        decodes = ("--decode", self.decode2.url, "--decode", self.decode.url)
        self.router2 = self.start("router", "--prefill", self.prefill.url, *decodes, *HEALTH)
        _wait(self.router, self.router2)

    def whole(self) -> None:
        """Replace a prefill node an earlier test killed, and the PD routers that named it."""
        if self.prefill.proc.poll() is None:
            return
        self.router.stop()
        self.router2.stop()
        self.prefill = self.start("prefill", *PREFILL)
        _wait(self.prefill)
        self.start_pd_routers()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    started: list[Role] = []
    try:
        started.append(_start("prefill", *PREFILL))
        started.append(_start("decode", "--num-pages", "4096",
                              "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
                              "--heartbeat-failures", str(HEARTBEAT_FAILURES)))  # fmt: skip
        started.append(_start("colocated", "--num-pages", "1024"))
        started.append(_start("decode", "--num-pages", "256"))
        _wait(*started)
        stack = Stack(started, *started)
        stack.colocated_router = stack.start("router", "--colocated", stack.colocated.url)
        stack.start_pd_routers()
        _wait(stack.colocated_router)
        yield stack
    finally:
        # The routers first (no new requests reach the nodes), then the nodes side by side.
        for role in started:
            if role.name == "router":
                role.stop()
        nodes = [role for role in started if role.name != "router"]
        with ThreadPoolExecutor(max(1, len(nodes))) as pool:
            list(pool.map(Role.stop, nodes))


def _texts(prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> list[str]:
    cfg = EngineConfig(num_pages=4096, max_running=64)
    out = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    for tokens in colocated(prompts, params, cfg):
        d = Detokenizer()
        out.append(d.feed(tokens) + d.flush())
    return out


def _client(stack: Stack, router: Role | None = None) -> openai.AsyncOpenAI:
    url = (router or stack.router).url
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


def _decode_stats(role: Role) -> dict[str, float]:
    (stats,) = requests.get(role.url + "/stats", timeout=10).json()["replicas"]
    return dict(stats)


def test_32_concurrent_requests_complete_with_the_colocated_tokens(stack: Stack) -> None:
    stack.whole()
    prompts = [f"request {i}: {'tspd ' * (i % 7)}end" for i in range(32)]
    want = _texts([TOK.encode(p) for p in prompts], 16)
    before = _decode_stats(stack.decode)

    async def run(router: Role) -> list[str]:
        async with _client(stack, router) as client:  # closed on this loop, not at GC
            calls = [
                client.completions.create(model=MODEL, prompt=p, max_tokens=16) for p in prompts
            ]
            answers = await asyncio.gather(*calls)
        return [a.choices[0].text for a in answers]

    assert asyncio.run(run(stack.router)) == want
    after = _decode_stats(stack.decode)
    assert after["pd_transfers_ok"] - before["pd_transfers_ok"] == 32
    assert asyncio.run(run(stack.colocated_router)) == want  # the colocated mode agrees
    node = requests.get(stack.colocated.url + "/stats", timeout=10).json()["replicas"][0]
    assert "pd_transfers_ok" not in node  # it served them itself, no PD peer


def _health(router: Role) -> dict[str, object]:
    return dict(requests.get(router.url + "/health", timeout=10).json())


def _router_samples(router: Role) -> dict[str, float]:
    lines = requests.get(router.url + "/metrics", timeout=10).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}  # fmt: skip


def test_a_decode_node_killed_mid_stream_ends_the_stream_with_an_error_event(
    stack: Stack,
) -> None:
    stack.whole()
    two = {"healthy": 2, "total": 2}
    wait_until(lambda: _health(stack.router2)["decode"] == two, 30, "router2's decode nodes up")
    prompt = "a stream its decode node breaks"
    # 600 tokens (ignore_eos): D is far from done when the kill lands, right after the first
    # token reached this client; every text before the error is the colocated text's.
    (full,) = _texts([TOK.encode(prompt)], 600, ignore_eos=True)
    d2_tree = {stack.decode2.proc.pid} | descendants(stack.decode2.proc.pid)
    before = _router_samples(stack.router2)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 600, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with requests.post(stack.router2.url + "/v1/completions", json=body, stream=True,
                       timeout=60) as resp:  # fmt: skip
        events = resp.iter_lines()
        first = json.loads(next(e for e in events if e)[len(b"data: ") :])
        stack.decode2.proc.send_signal(signal.SIGKILL)  # round robin: decode2 took it
        rest = [e for e in events if e]
    assert resp.status_code == 200  # the stream had started: its error comes as an event
    assert rest[-1].startswith(b"data: {")
    error = json.loads(rest[-1][len(b"data: ") :])
    *middle, last = [first, *(json.loads(e[len(b"data: ") :]) for e in rest[:-1]), error]
    text = "".join(e["choices"][0]["text"] for e in middle)
    assert [e["choices"][0]["finish_reason"] for e in middle] == [None] * len(middle)
    assert text  # at least the first token
    assert full.startswith(text)  # exact so far
    assert len(text) < len(full)  # and cut short
    assert b"data: [DONE]" not in rest
    url = re.escape(stack.decode2.url)
    why = rf"decode node {url} (closed the stream early|failed: .+)"
    assert re.fullmatch(why, last["error"]["message"]), last
    assert last == {"error": {"message": last["error"]["message"], "type": "server_error",
                              "param": None, "code": "decode_failed"}}  # fmt: skip
    assert stack.decode2.proc.wait(10) == -signal.SIGKILL
    wait_until(lambda: not alive(d2_tree), 30, "every process of the dead decode node to exit")
    after = _router_samples(stack.router2)
    assert after.get('tspd_router_errors_total{cause="decode_failed"}', 0) - before.get(
        'tspd_router_errors_total{cause="decode_failed"}', 0) == 1  # fmt: skip
    # The router survives: once its health checks took decode2 out, it serves through decode.
    one = {"healthy": 1, "total": 2}
    wait_until(lambda: _health(stack.router2)["decode"] == one, 30, "decode2 taken out")
    again = requests.post(stack.router2.url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 12})  # fmt: skip
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == _texts([TOK.encode(prompt)], 12)[0]


def test_killing_the_prefill_node_fails_its_requests_in_bounded_time(stack: Stack) -> None:
    stack.whole()
    prompts = [f"{i:03d} " + "a long prompt keeps the prefill node busy. " * 34 for i in range(24)]
    want = _texts([TOK.encode(p) for p in prompts], 24)
    info = requests.get(stack.prefill.url + "/info", timeout=10).json()
    assert info["bootstrap_hosted"] is True  # the server dies with the node
    boot = info["bootstrap"]
    assert requests.get(f"http://{boot}/health", timeout=10).status_code == 200
    # The node's own server listens on its --host: its operator endpoints stay off unless
    # --bootstrap-admin asks for them, so a stray DELETE cannot cut D off this node.
    refused = requests.delete(f"http://{boot}/ranks", timeout=10)
    assert (refused.status_code, refused.json()["error"]) == (403, "admin_disabled")
    assert len(requests.get(f"http://{boot}/ranks", timeout=10).json()["ranks"]) == 1
    p_tree = {stack.prefill.proc.pid} | descendants(stack.prefill.proc.pid)
    d_before, r_before = _peer_samples(stack.decode.url), _router_samples(stack.router)
    outcomes, killed_at = asyncio.run(_storm(stack, prompts))

    assert all(at - killed_at < ERROR_BOUND_S for _, _, at in outcomes)  # nobody hung
    errors = [(i, out) for i, (out, ok, _) in enumerate(outcomes) if not ok]
    assert errors, "the kill came after every transfer: no request saw the failure"
    for i, (out, ok, _) in enumerate(outcomes):
        if ok:
            assert out == want[i]  # a request that succeeded has exactly the right tokens
    for _, err in errors:
        # Before its first token a stream fails with a status; after P's first token (which
        # the router passes on at once) with the stream's last event: the same cause.
        assert isinstance(err, openai.APIError)
        if isinstance(err, openai.APIStatusError):
            assert err.status_code == 502
        assert isinstance(err.body, dict)
        assert err.body["code"] in DEATH_CAUSES, err.body
    assert stack.prefill.proc.wait(10) == -signal.SIGKILL
    with pytest.raises(requests.ConnectionError, match="Connection refused"):
        requests.get(f"http://{boot}/health", timeout=10)  # what D's heartbeat meets
    remaining = killed_at + SETTLE_BOUND_S - time.monotonic()
    wait_until(lambda: _decode_settled(stack), remaining, "D's pool whole (heartbeat bound)")
    d = _peer_samples(stack.decode.url)

    def grew(now: dict[str, float], then: dict[str, float], sample: str) -> float:
        return now.get(sample, 0) - then.get(sample, 0)

    # D's worker declared exactly one P instance dead: the heartbeat, not a timeout, freed it.
    at = 'role="decode",replica="0",rank="0"'
    assert grew(d, d_before, f"tspd_pd_heartbeat_node_failures_total{{{at}}}") == 1
    assert grew(d, d_before, f'tspd_pd_room_failures_total{{{at},cause="timeout"}}') == 0
    wait_until(lambda: not alive(p_tree), 30, "every process of the dead prefill node to exit")
    r_after = _router_samples(stack.router)
    causes = [f'tspd_router_errors_total{{cause="{c}"}}' for c in sorted(DEATH_CAUSES)]
    assert sum(grew(r_after, r_before, c) for c in causes) == len(errors)
    # A request can fail on the broken connection before a health check takes P out.
    out = {"healthy": 0, "total": 1}
    wait_until(lambda: _health(stack.router)["prefill"] == out, 30, "the router to take P out")
    health = requests.get(stack.router.url + "/health", timeout=10)
    assert (health.status_code, health.json()["prefill"]) == (503, out)


async def _storm(
    stack: Stack, prompts: list[str]
) -> tuple[list[tuple[object, bool, float]], float]:
    """Stream every prompt; SIGKILL P once the first token arrives. Per request: (text or
    the exception, succeeded, when it ended)."""
    client = _client(stack)
    first_token = asyncio.Event()

    async def one(prompt: str) -> tuple[object, bool, float]:
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, stream=True
            )
            parts = []
            async for chunk in stream:
                parts.append(chunk.choices[0].text)
                first_token.set()
            return "".join(parts), True, time.monotonic()
        except openai.APIError as exc:
            return exc, False, time.monotonic()

    async with client:  # closed on this loop: a client left to GC closes on a dead loop
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.wait_for(first_token.wait(), 120)
        stack.prefill.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        done = await asyncio.wait_for(asyncio.gather(*tasks), ERROR_BOUND_S + 30)
    return list(done), killed_at


def _peer_samples(url: str) -> dict[str, float]:
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line and not line.startswith("#")}  # fmt: skip


def _decode_settled(stack: Stack) -> bool:
    s = requests.get(stack.decode.url + "/stats", timeout=10).json()["replicas"][0]
    idle = s["waiting"] == s["running"] == s["held"] == s["pd_rooms_tracked"] == 0
    return idle and s["reclaimable_pages"] == s["initial_free_pages"] == s["total_pages"]
