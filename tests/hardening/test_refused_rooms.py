"""A room the prefill node will never serve fails at once on its ranks, on a real cluster.

The router sends a PD request to P and D at the same time, and D registers the room with P's
transfer workers (its pre-allocation) while P may still refuse the request at its door. D then
kept those pages and its running slot until P's workers gave the room up at the bootstrap
timeout (120 s): with ``--max-running 2 --max-queued-requests 2`` and 16 locust users the
decode node still showed held 2, waiting 2 more than 2 minutes after the run. Now a
prefill node fails such a room on its ranks (a ``RoomAbort`` through rank 0's intake), so P's
workers push Failed to D, which frees its pages within a round or so:

* P busy (at capacity: requests held blocked with ``--prefill-after-bootstrap``, no compute)
  refuses a request whose D half has pre-allocated: D's half ends ``transfer`` at once;
* the router's abort to P names the room, which P never saw: D's half ends likewise;
* a room a request of P holds is left alone by an ``/abort`` that names it with another rid:
  that request still completes, with exactly the colocated engine's tokens;
* requests through the router while P is busy: 429, and D's held/waiting/running back to 0
  within seconds.

Every wait is bounded far below the bootstrap timeout the cluster runs with (120 s). The
cluster then answers the known prompt exactly and both pools are whole.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import requests

from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine

from .cluster import CFG, MODEL, TOK, Cluster, report, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CAPACITY = 2
#: How long D may take to free a refused room's pages: a few of its rounds and P's pushes on a
#: loaded machine; the bootstrap timeout (the old bound) is 120 s.
FREED_WITHIN_S = 10.0
PROMPT = "a room nobody serves"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A PD cluster whose nodes hold at most CAPACITY requests; P holds each request until
    D's pages are ready, so a request without a D half waits at P without computing."""
    started = Cluster.start("--max-running", str(CAPACITY), "--max-queued-requests",
                            str(CAPACITY), "--prefill-after-bootstrap")  # fmt: skip
    try:
        yield started
    finally:
        started.stop()


def _bootstrap(cluster: Cluster) -> dict[str, object]:
    host, port = (
        requests.get(cluster.urls["prefill"] + "/info", timeout=10)
        .json()["bootstrap"]
        .rsplit(":", 1)
    )
    return {"bootstrap_host": host, "bootstrap_port": int(port)}


def _pd_body(cluster: Cluster, rid: str, room: int) -> dict[str, object]:
    return {"input_ids": TOK.encode(PROMPT), "max_tokens": MAX_TOKENS, "rid": rid,
            "pd": {"room": room} | _bootstrap(cluster)}  # fmt: skip


def _post(url: str, body: dict[str, object]) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=120)


def _stats(cluster: Cluster, role: str) -> dict[str, float]:
    (replica,) = requests.get(cluster.urls[role] + "/stats", timeout=10).json()["replicas"]
    return replica  # type: ignore[no-any-return]


def _preallocated(cluster: Cluster) -> list[float]:
    """Per P rank, the rooms its worker knows that are still Bootstrapping (P's held requests'
    rooms, and D's pre-allocations of rooms P has not matched): one more on every rank when a
    D half's pre-allocation arrived."""
    text = requests.get(cluster.urls["prefill"] + "/metrics", timeout=10).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tspd_pd_rooms{") and 'state="bootstrapping"' in line]  # fmt: skip


def _decode_idle(cluster: Cluster) -> bool:
    stats = _stats(cluster, "decode")
    return stats["held"] + stats["waiting"] + stats["running"] + stats["pd_rooms_tracked"] == 0


def _decode_half(
    cluster: Cluster, pool: ThreadPoolExecutor, rid: str, room: int
) -> Future[requests.Response]:
    """D's half of room ``room``, sent straight to the decode node; returns once every P rank
    holds D's pre-allocation of it (one more room Bootstrapping on each)."""
    before = _preallocated(cluster)
    half = pool.submit(_post, cluster.urls["decode"], _pd_body(cluster, rid, room))

    def arrived() -> bool:
        now = _preallocated(cluster)
        return len(now) == len(before) and all(n >= b + 1 for n, b in zip(now, before, strict=True))

    wait_until(arrived, 30, f"D's pre-allocation of room {room} on every P rank")
    return half


def _failed_transfer(answer: requests.Response, rid: str) -> None:
    """``answer`` is D's: its KV transfer failed because a P rank aborted the room."""
    body = answer.json()
    assert (answer.status_code, body["rid"], body["finish_reason"], body["output_ids"]) == (
        503, rid, "transfer", [])  # fmt: skip
    assert re.fullmatch(r"KV transfer failed: P rank [01] aborted the transfer", body["error"])


def test_a_room_p_will_not_serve_frees_ds_pages_at_once(cluster: Cluster) -> None:
    prefill, decode = cluster.urls["prefill"], cluster.urls["decode"]
    pool = ThreadPoolExecutor(8)
    try:
        # P at capacity: two requests held blocked (no D half: their rooms never bootstrap).
        hogs = [pool.submit(_post, prefill, _pd_body(cluster, f"hog-{i}", 1000 + i))
                for i in range(CAPACITY)]  # fmt: skip
        wait_until(lambda: requests.get(prefill + "/ready", timeout=10).status_code == 503, 30,
                   "the prefill node at capacity")  # fmt: skip

        # 1. P refuses a request as busy after its D half pre-allocated: D's half fails now.
        half = _decode_half(cluster, pool, "busy-d", 2001)
        refused = _post(prefill, _pd_body(cluster, "busy-p", 2001))
        assert (refused.status_code, refused.json()["busy"]) == (503, True)
        started = time.monotonic()
        answer = half.result(timeout=FREED_WITHIN_S)
        took_busy = time.monotonic() - started
        _failed_transfer(answer, "busy-d")
        wait_until(lambda: _decode_idle(cluster), FREED_WITHIN_S, "D idle again")

        # 2. The router's abort names the room P never saw: D's half fails now.
        half = _decode_half(cluster, pool, "gone-d", 2002)
        started = time.monotonic()
        aborted = requests.post(prefill + "/abort", json={"rid": "gone-p", "room": 2002},
                                timeout=10)  # fmt: skip
        assert (aborted.status_code, aborted.json()) == (
            200, {"aborted": False, "room_aborted": True})  # fmt: skip
        answer = half.result(timeout=FREED_WITHIN_S)
        took_abort = time.monotonic() - started
        _failed_transfer(answer, "gone-d")
        wait_until(lambda: _decode_idle(cluster), FREED_WITHIN_S, "D idle again")

        # 3. Through the router while P is busy: every request a 429; D is freed at once.
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
        completions = cluster.urls["router"] + "/v1/completions"
        routed = list(pool.map(lambda _: requests.post(completions, json=body, timeout=60),
                               range(6)))  # fmt: skip
        assert [(r.status_code, r.json()["error"]["code"]) for r in routed] == [
            (429, "overloaded")] * 6  # fmt: skip
        took_router = wait_until(lambda: _decode_idle(cluster), FREED_WITHIN_S, "D idle")

        # Free P: its held requests are aborted by rid.
        for i in range(CAPACITY):
            answer = requests.post(prefill + "/abort", json={"rid": f"hog-{i}"}, timeout=10)
            assert answer.json() == {"aborted": True}
        assert [h.result(timeout=30).json()["finish_reason"] for h in hogs] == ["abort"] * 2
        wait_until(lambda: _stats(cluster, "prefill")["pd_rooms_tracked"] == 0, 30,
                   "P's held rooms gone")  # fmt: skip

        # 4. A room a request of P holds is not failed by an abort that names it with another
        # rid: the request, once its D half comes, gets exactly the colocated engine's tokens.
        owner = pool.submit(_post, prefill, _pd_body(cluster, "owner-p", 2003))
        wait_until(lambda: _stats(cluster, "prefill")["pd_rooms_tracked"] == 1, 30,
                   "P holding room 2003")  # fmt: skip
        other = requests.post(prefill + "/abort", json={"rid": "outsider", "room": 2003},
                              timeout=10)  # fmt: skip
        assert other.json() == {"aborted": False, "room_aborted": True}  # passed on, ignored
        half = pool.submit(_post, decode, _pd_body(cluster, "owner-d", 2003))
        want = _reference()
        p_answer, d_answer = owner.result(timeout=60), half.result(timeout=60)
        assert (p_answer.status_code, p_answer.json()["output_ids"]) == (200, want[:1])
        assert (d_answer.status_code, d_answer.json()["output_ids"]) == (200, want)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a failed check waits for nothing

    assert cluster.answers_known()
    wait_until(cluster.pools_whole, 30, "both pools whole")
    report("refused_rooms", {"d_freed_after_busy_s": round(took_busy, 3),
                             "d_freed_after_room_abort_s": round(took_abort, 3),
                             "d_idle_after_429s_s": round(took_router, 3)})  # fmt: skip


def _reference() -> list[int]:
    """The prompt's greedy tokens on a colocated TP-1 engine."""
    engine = Engine(CFG.replace(tp=1))
    try:
        (out,) = engine.generate([TOK.encode(PROMPT)], SamplingParams(MAX_TOKENS))
    finally:
        engine.close()
    return list(out.tokens)
