"""The fault suite: SIGKILL or SIGSTOP of each role (prefill node, decode node, router) and of
one rank of each node, while 16 streamed completions run through a real cluster
(``launch_pd.py local --restart``).

For every fault: each client gets its exact text (the colocated reference) or an error — an
HTTP error, an SSE error event or a broken connection — with the text before it a prefix of
the exact one; none hangs (every stream ends within :data:`STREAM_BOUND_S`), none gets a 200
with wrong tokens. Then the cluster serves again — a killed role restarted by ``local`` on
its ports, a rank's node having exited with code 3 and been restarted, a stopped process
resumed after :data:`STOP_S` — the time from the fault to the known prompt's exact answer is
measured (and written to ``$TSPD_FAULTS_REPORT`` for ``nox -s faults``), and both pools are
whole again.

The default run takes the representative cases (:data:`DEFAULT`); ``-m faults`` (``nox -s
faults``) runs the whole matrix.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from .cluster import MODEL, Cluster, expected_texts, report, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.faults]

STREAMS = 16
MAX_TOKENS = 400  #: long enough that every fault lands while streams are running
STOP_S = 8.0  #: how long a stopped process stays stopped (past the router's and node's bounds)
STREAM_BOUND_S = 120.0  #: from the fault to the last stream's end: longer is a hang
RECOVERY_BOUND_S = 240.0
TARGETS = ("prefill", "decode", "router", "prefill-rank", "decode-rank")
SIGNALS = (signal.SIGKILL, signal.SIGSTOP)
#: What the default test run covers: one kill of a node (its rank, which makes the node exit
#: and be restarted) and one of the router; the rest needs -m faults.
DEFAULT = {("decode-rank", signal.SIGKILL), ("router", signal.SIGKILL)}


@dataclass
class Stream:
    prompt: str
    text: str = ""
    error: str = ""
    done: bool = False
    first: threading.Event = field(default_factory=threading.Event)

    def run(self, url: str) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True,
                               timeout=(10, STREAM_BOUND_S)) as resp:  # fmt: skip
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return
                self._read(resp)
        except requests.RequestException as exc:
            self.error = self.error or f"connection: {type(exc).__name__}"
        finally:
            self.done = True
            self.first.set()

    def _read(self, resp: requests.Response) -> None:
        for line in resp.iter_lines():
            if not line.startswith(b"data: "):
                continue
            payload = line.removeprefix(b"data: ")
            if payload == b"[DONE]":
                return
            event = json.loads(payload)
            if "error" in event:
                self.error = f"event: {event['error']['code']}"
                return
            self.text += event["choices"][0]["text"]
            self.first.set()
        self.error = "the stream ended without [DONE]"


def _target_pid(cluster: Cluster, target: str) -> int:
    if target.endswith("-rank"):
        return cluster.rank_pids(target.removesuffix("-rank"))[-1]
    return cluster.role_pid(target)


def _taken_out_within(cluster: Cluster, target: str, until: float) -> float | None:
    """Seconds from now until the router reports the stopped node unhealthy (None: not by
    ``until``, or the target is the router itself)."""
    role = target.removesuffix("-rank")
    if role == "router":
        return None
    gauge = f'tspd_router_node_healthy{{node="{cluster.urls[role]}",role="{role}"}}'
    start = time.monotonic()
    while time.monotonic() < until:
        try:
            text = requests.get(cluster.urls["router"] + "/metrics", timeout=5).text
        except requests.RequestException:
            text = ""
        if f"{gauge} 0" in text.splitlines():
            return round(time.monotonic() - start, 2)
        time.sleep(0.1)
    return None


def _restarts_reported(cluster: Cluster) -> bool:
    """Whether local reported every restart it began ("exited on its own; restarting it",
    then "restarted in" once the role is ready again)."""
    began = len(cluster.said("exited on its own .*; restarting it"))
    return len(cluster.said("restarted in")) == began


def _wanted(target: str, sig: signal.Signals, config: pytest.Config) -> bool:
    return (target, sig) in DEFAULT or "faults" in (config.option.markexpr or "")


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
@pytest.mark.parametrize("target", TARGETS)
def test_a_fault_during_16_streams(
    cluster: Cluster, target: str, sig: signal.Signals, request: pytest.FixtureRequest
) -> None:
    if not _wanted(target, sig, request.config):
        pytest.skip("the full fault matrix runs with -m faults (nox -s faults)")
    wait_until(cluster.answers_known, RECOVERY_BOUND_S, "the cluster serving before the fault")
    wait_until(cluster.pools_whole, 60, "both pools whole before the fault")
    prompts = [
        f"fault {target} {sig.name} stream {i}: " + "tspd " * (i % 5) for i in range(STREAMS)
    ]
    want = dict(zip(prompts, expected_texts(prompts, MAX_TOKENS, ignore_eos=True), strict=True))
    streams = [Stream(p) for p in prompts]
    threads = [threading.Thread(target=s.run, args=(cluster.urls["router"],), daemon=True)
               for s in streams]  # fmt: skip
    # Every restart local began (an earlier test's fault) has been reported: the count below
    # is this fault's own.
    wait_until(lambda: _restarts_reported(cluster), 60, "local to report earlier restarts")
    restarts = len(cluster.said("restarted in"))
    for thread in threads:
        thread.start()
    wait_until(lambda: sum(s.first.is_set() for s in streams) >= 4, 120, "four streams going")
    pid = _target_pid(cluster, target)
    fault = time.monotonic()
    os.kill(pid, sig)
    running = sum(not s.done for s in streams)
    assert running, "every stream ended before the fault: nothing was tested"
    taken_out = None
    if sig is signal.SIGSTOP:
        taken_out = _taken_out_within(cluster, target, fault + STOP_S)
        time.sleep(max(0.0, fault + STOP_S - time.monotonic()))
        os.kill(pid, signal.SIGCONT)
    for thread in threads:
        thread.join(max(0.0, STREAM_BOUND_S - (time.monotonic() - fault)))
    assert all(s.done for s in streams), "a stream hung"
    for s in streams:
        if s.error:
            assert want[s.prompt].startswith(s.text), f"wrong tokens before {s.error}"
        else:
            assert s.text == want[s.prompt], "a 200 with wrong tokens"
    wait_until(cluster.answers_known, RECOVERY_BOUND_S, "the cluster serving after the fault")
    recovery = time.monotonic() - fault
    wait_until(cluster.pools_whole, 90, "both pools whole after the fault")
    if sig is signal.SIGKILL:
        role = target.removesuffix("-rank")
        code = 3 if target.endswith("-rank") else -9
        # local says "restarted in" once it read the role's readiness line; the router may
        # have taken the role back (and answered the known prompt) before that.
        reported = lambda: len(cluster.said("restarted in")) > restarts  # noqa: E731
        wait_until(reported, 60, f"local to report {role}'s restart")
        assert cluster.said(f"{role} exited on its own \\(code {code}\\); restarting it")
        assert cluster.said(f"{role} restarted in ")
        assert len(cluster.said("restarted in")) == restarts + 1
    exact = sum(not s.error for s in streams)
    figures = {"recovery_s": round(recovery, 2), "running": running, "exact": exact,
               "errors": STREAMS - exact, "taken_out_s": taken_out}  # fmt: skip
    report(f"{target} {sig.name}", figures)
    print(f"{target} {sig.name}: {figures}")
