"""Load and failure through the whole stack, every role a ``launch_pd.py`` process.

32 concurrent requests complete with the colocated tokens, through the PD router and through a
router in colocated mode (a colocated node) alike. Then the prefill node is
SIGKILLed while 24 streams are in flight: each client gets either its exact tokens (its KV
had arrived) or an error from the router within a bounded time — never a hang, never wrong
tokens — and nothing the dead node started survives it.

The prefill node hosts its bootstrap server (WIRE §3), so the kill takes the server down too:
the decode node's heartbeat (every 2 s, one failure declares P dead) fails every room that
waited for the dead node's KV, and D's pool returns to its initial free count within the
heartbeat bound — long before D's waiting timeout (the default 300 s here), which is what
used to free those pages when the server outlived the node.
"""

from __future__ import annotations

import asyncio
import os
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

from tspd_core.pd.heartbeat import bound_for
from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_router.text import Detokenizer

from .conftest import LAUNCHER, TOK, alive, child_env, colocated, descendants, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MODEL = "tspd-tiny"
#: Every error a client may see when P dies: its request was on P, P was found dead while
#: the KV was awaited, or D gave up on the transfer.
DEATH_CAUSES = {"prefill_failed", "prefill_node_down", "transfer_failed"}
ERROR_BOUND_S = 45.0  # from the kill to the last client's answer
HEARTBEAT_INTERVAL_S, HEARTBEAT_FAILURES = 2, 1  # D's flags below
#: The heartbeat's bound, tspd_core.pd.heartbeat: failures x (interval + 2 s connect + 3 s
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


@dataclass
class Stack:
    prefill: Role
    decode: Role
    colocated: Role
    router: Role
    colocated_router: Role


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    roles: list[Role] = []
    try:
        # A slow prefill (long prompts, 128 tokens a round) keeps requests on P when it dies;
        # it hosts its bootstrap server (the default) on a free port.
        roles.append(_start("prefill", "--bootstrap-port", "0", "--num-pages", "1024",
                            "--max-prefill-tokens", "128"))  # fmt: skip
        roles.append(_start("decode", "--num-pages", "4096",
                            "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
                            "--heartbeat-failures", str(HEARTBEAT_FAILURES)))  # fmt: skip
        roles.append(_start("colocated", "--num-pages", "1024"))
        _wait(*roles)
        roles.append(_start("router", "--prefill", roles[0].url, "--decode", roles[1].url,
                            "--health-interval", "0.5", "--health-failures", "2"))  # fmt: skip
        roles.append(_start("router", "--colocated", roles[2].url))
        _wait(*roles[3:])
        yield Stack(*roles)
    finally:
        # The routers first (no new requests reach the nodes), then the nodes side by side.
        for role in roles[3:]:
            role.stop()
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(Role.stop, roles[:3]))


def _texts(prompts: list[list[int]], max_tokens: int) -> list[str]:
    cfg = EngineConfig(num_pages=4096, max_running=64)
    out = []
    for tokens in colocated(prompts, SamplingParams(max_tokens=max_tokens), cfg):
        d = Detokenizer()
        out.append(d.feed(tokens) + d.flush())
    return out


def _client(stack: Stack, router: Role | None = None) -> openai.AsyncOpenAI:
    url = (router or stack.router).url
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_32_concurrent_requests_complete_with_the_colocated_tokens(stack: Stack) -> None:
    prompts = [f"request {i}: {'tspd ' * (i % 7)}end" for i in range(32)]
    want = _texts([TOK.encode(p) for p in prompts], 16)

    async def run(router: Role) -> list[str]:
        client = _client(stack, router)
        calls = [client.completions.create(model=MODEL, prompt=p, max_tokens=16) for p in prompts]
        answers = await asyncio.gather(*calls)
        return [a.choices[0].text for a in answers]

    assert asyncio.run(run(stack.router)) == want
    stats = requests.get(stack.decode.url + "/stats", timeout=10).json()["replicas"][0]
    assert stats["pd_transfers_ok"] == 32
    assert asyncio.run(run(stack.colocated_router)) == want  # the colocated mode agrees
    node = requests.get(stack.colocated.url + "/stats", timeout=10).json()["replicas"][0]
    assert "pd_transfers_ok" not in node  # it served them itself, no PD peer


def test_killing_the_prefill_node_fails_its_requests_in_bounded_time(stack: Stack) -> None:
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
    outcomes, killed_at = asyncio.run(_storm(stack, prompts))

    assert all(at - killed_at < ERROR_BOUND_S for _, _, at in outcomes)  # nobody hung
    errors = [(i, out) for i, (out, ok, _) in enumerate(outcomes) if not ok]
    assert errors, "the kill came after every transfer: no request saw the failure"
    for i, (out, ok, _) in enumerate(outcomes):
        if ok:
            assert out == want[i]  # a request that succeeded has exactly the right tokens
    for _, err in errors:
        assert isinstance(err, openai.APIStatusError)
        assert err.status_code == 502
        assert isinstance(err.body, dict)
        assert err.body["code"] in DEATH_CAUSES, err.body
    assert stack.prefill.proc.wait(10) == -signal.SIGKILL
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{boot}/health", timeout=10)  # what D's heartbeat meets
    remaining = killed_at + SETTLE_BOUND_S - time.monotonic()
    wait_until(lambda: _decode_settled(stack), remaining, "D's pool whole (heartbeat bound)")
    d = _peer_samples(stack.decode.url)
    # D's worker declared exactly one P instance dead: the heartbeat, not a timeout, freed it.
    at = 'role="decode",replica="0",rank="0"'
    assert d[f"tspd_pd_heartbeat_node_failures_total{{{at}}}"] == 1
    assert d.get(f'tspd_pd_room_failures_total{{{at},cause="timeout"}}', 0) == 0
    wait_until(lambda: not alive(p_tree), 30, "every process of the dead prefill node to exit")
    metrics = requests.get(stack.router.url + "/metrics", timeout=10).text.splitlines()
    counted = sum(
        int(line.split()[-1])
        for line in metrics
        if line.startswith("tspd_router_errors_total") and line.split('"')[1] in DEATH_CAUSES
    )
    assert counted == len(errors)
    health = requests.get(stack.router.url + "/health", timeout=10)
    assert (health.status_code, health.json()["prefill"]) == (503, {"healthy": 0, "total": 1})


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
