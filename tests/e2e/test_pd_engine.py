"""PD through the reference engine's own front door: a prefill replica and a decode replica,
ranks as processes, KV moved by real transfer peers (Mooncake over TCP), rooms found through
real bootstrap servers. No router here: the test plays it (same room to both halves).

One module-wide cluster serves every (P TP, D TP) pair: P1 and P2 (each with its bootstrap
server), D1 and D2; any P serves any D, re-slicing pages between unequal TP sizes. P1 runs two
DP replicas (TP 1 each): every room goes to replica ``room % 2``, the P DP group D derives
from the room, and one test checks exactly which replica served which room.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tspd_bootstrap.server import BootstrapServer
from tspd_core.pd import PdTunables
from tspd_engine.client import EngineClient
from tspd_engine.frames import FinishReason, Output, PdTarget, RequestMode, SamplingParams
from tspd_engine.launch import EngineHandle, free_port, launch
from tspd_engine.node import Node, NodeInfo, NodeRole
from tspd_engine.pdlink import PdConfig, PdRole, canonical_layout

from .conftest import TOK, colocated, e2e_config, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PARAMS = SamplingParams(max_tokens=12)
#: D1 gives up on a room that got no KV after 8 s (the failure tests wait for it).
D1_TUNABLES = PdTunables(waiting_timeout_s=8.0)
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]


#: DP replicas of each prefill instance (P1's two replicas are the DP test's node).
P_DP = {1: 2, 2: 1}


@dataclass
class Cluster:
    servers: dict[int, BootstrapServer]
    p: dict[int, list[EngineHandle]]  #: each prefill instance's DP replicas
    d: dict[int, EngineHandle]

    def target(self, p: int, room: int | None = None) -> PdTarget:
        room = secrets.randbits(63) if room is None else room
        return PdTarget(room, "127.0.0.1", self.servers[p].port)

    def prefill(self, p: int, room: int) -> EngineClient:
        """The replica of prefill instance ``p`` that serves ``room`` (as a node routes)."""
        return self.p[p][room % len(self.p[p])].client


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    servers = {
        p: BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout).start()
        for p in (1, 2)
    }
    specs = [
        ("p", p, r, PdConfig(role=PdRole.PREFILL, bootstrap=f"127.0.0.1:{servers[p].port}",
                             dp_size=P_DP[p], dp_rank=r))
        for p in (1, 2) for r in range(P_DP[p])
    ] + [
        ("d", d, 0, PdConfig(role=PdRole.DECODE, tunables=D1_TUNABLES if d == 1 else None))
        for d in (1, 2)
    ]  # fmt: skip
    handles: dict[tuple[str, int, int], EngineHandle] = {}

    def start(spec: tuple[str, int, int, PdConfig]) -> None:
        side, tp, replica, pd = spec
        handles[side, tp, replica] = launch(e2e_config(tp=tp), pd=pd, ready_timeout_s=240)

    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            list(pool.map(start, specs))
        p = {n: [handles["p", n, r] for r in range(P_DP[n])] for n in (1, 2)}
        yield Cluster(servers, p, {1: handles["d", 1, 0], 2: handles["d", 2, 0]})
    finally:
        _shutdown(handles.values())
        for server in servers.values():
            server.close()


def _shutdown(handles: Iterable[EngineHandle]) -> None:
    # Side by side: each replica's stop is mostly waiting for its ranks and workers to exit.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(EngineHandle.shutdown, handles))


def _prompts(p: int, d: int) -> list[list[int]]:
    # The first page (BOS + 3 bytes) is unique per prompt, so no prompt hits another's
    # cached pages: every transfer moves the whole prompt.
    texts = ["x", "hello world", "paged attention over TCP", "the quick brown fox jumps " * 3]
    return [TOK.encode(f"{chr(65 + i)}{p}{d} {t}") for i, t in enumerate(texts)]


def _run_pd(c: Cluster, p: int, d: int, prompts: Sequence[list[int]], tag: str) -> list[Output]:
    """Send each prompt's two halves (same room) and return (P output, D output) pairs."""
    streams = []
    for i, prompt in enumerate(prompts):
        target, rid = c.target(p), f"{tag}-{i}"
        ps = c.prefill(p, target.room).submit(prompt, PARAMS, rid, RequestMode.PREFILL_ONLY, target)
        ds = c.d[d].client.submit(prompt, PARAMS, rid, RequestMode.REMOTE_DECODE, target)
        streams.append((ps, ds))
    outs = []
    for ps, ds in streams:
        p_out = ps.result(120)
        assert p_out.finish == FinishReason.LENGTH, p_out.error
        outs.append(ds.result(120))
        assert p_out.tokens == outs[-1].tokens[:1]  # P's first token seeded D
    return outs


def _settled(handle: EngineHandle) -> bool:
    s = handle.client.stats()
    idle = s["waiting"] == s["running"] == s["held"] == s["pd_rooms_tracked"] == 0
    return idle and s["reclaimable_pages"] == s["total_pages"]


def _pages(n: int) -> int:
    return -(-n // 4)


@pytest.mark.parametrize(("p", "d"), PAIRS)
def test_pd_equals_colocated_token_for_token(cluster: Cluster, p: int, d: int) -> None:
    prompts = _prompts(p, d)
    want = colocated(prompts, PARAMS)
    before = cluster.d[d].client.stats()
    outs = _run_pd(cluster, p, d, prompts, f"pd{p}{d}")
    assert [list(o.tokens) for o in outs] == want
    assert all(o.cached_tokens == 0 for o in outs)
    after = cluster.d[d].client.stats()
    moved = after["pd_kv_pages_in"] - before["pd_kv_pages_in"]
    assert moved == sum(_pages(len(x)) for x in prompts)  # every prompt page, nothing else
    assert after["pd_transfers_ok"] - before["pd_transfers_ok"] == len(prompts)
    # A replica's page: 2 layers x (K + V) x 2 KV heads x 4 tokens x 32 dims x 4 bytes.
    page = 2 * 2 * 2 * 4 * 32 * 4
    assert after["pd_kv_bytes_in"] - before["pd_kv_bytes_in"] == moved * page

    # The same prompt again: D's prefix store holds every full page of it but the last
    # token's, so P sends exactly one page and the tokens stay the same.
    again = _run_pd(cluster, p, d, prompts[3:], f"again{p}{d}")
    n = len(prompts[3])
    assert list(again[0].tokens) == want[3]
    assert again[0].cached_tokens == (n - 1) // 4 * 4
    final = cluster.d[d].client.stats()
    assert final["pd_kv_pages_in"] - after["pd_kv_pages_in"] == 1
    for handle in (*cluster.p[p], cluster.d[d]):
        wait_until(lambda h=handle: _settled(h), 30, "both pools back to their initial state")


def test_wrong_halves_are_refused_with_the_reason(cluster: Cluster) -> None:
    prompt = TOK.encode("Zr wrong half")
    target = cluster.target(1)
    p_client, d_client = cluster.prefill(1, target.room), cluster.d[1].client
    out = p_client.submit(prompt, PARAMS, "w1", RequestMode.REMOTE_DECODE, target).result(30)
    assert (out.finish, out.error) == (
        FinishReason.ERROR, "this is a prefill node: it does not take REMOTE_DECODE requests"
    )  # fmt: skip
    out = d_client.submit(prompt, PARAMS, "w2", RequestMode.REMOTE_DECODE).result(30)
    assert "needs its room and bootstrap address" in out.error
    held = d_client.submit(prompt, PARAMS, "w3", RequestMode.REMOTE_DECODE, target)
    out = d_client.submit(prompt, PARAMS, "w4", RequestMode.REMOTE_DECODE, target).result(30)
    assert out.error == f"room {target.room} is already in use on this node"
    # The room's P half arrives: the refusal cost the room nothing, it completes as usual
    # (rather than an abort, whose pages D holds until its waiting timeout: tested below).
    p_client.submit(prompt, PARAMS, "w3", RequestMode.PREFILL_ONLY, target)
    assert list(held.result(60).tokens) == colocated([prompt], PARAMS)[0]
    wait_until(lambda: _settled(cluster.d[1]), 30, "D1 idle again")


def test_unreachable_bootstrap_server_fails_the_transfer(cluster: Cluster) -> None:
    target = PdTarget(secrets.randbits(63), "127.0.0.1", free_port())  # nobody listens
    stream = cluster.d[1].client.submit(
        TOK.encode("Zu nobody home"), PARAMS, "lost", RequestMode.REMOTE_DECODE, target
    )
    out = stream.result(60)
    assert out.finish == FinishReason.TRANSFER
    assert out.error.startswith("KV transfer failed: ")
    assert "bootstrap" in out.error
    assert out.tokens == ()
    wait_until(lambda: _settled(cluster.d[1]), 30, "D1's pages released")


def test_abort_on_d_keeps_the_pages_until_the_room_ends(cluster: Cluster) -> None:
    # P never hears of this room: D publishes its manifest and waits for KV that never comes.
    prompt = TOK.encode("Zd waiting for KV that never comes")
    stream = cluster.d[1].client.submit(
        prompt, PARAMS, "orphan", RequestMode.REMOTE_DECODE, cluster.target(1)
    )
    published = lambda: cluster.d[1].client.stats()["pd_rooms_published"] == 1  # noqa: E731
    wait_until(published, 30, "the manifest published")
    cluster.d[1].client.abort("orphan")
    out = stream.result(10)
    assert (out.finish, out.tokens) == (FinishReason.ABORT, ())
    s = cluster.d[1].client.stats()
    # Answered at once, but a P rank could still write into the pages: they stay held.
    assert (s["held"], s["running"]) == (1, 0)
    assert s["reclaimable_pages"] == s["total_pages"] - _pages(len(prompt))
    # D's waiting timeout (8 s here) ends the room; only then are the pages released.
    wait_until(lambda: _settled(cluster.d[1]), 30, "the room to time out")


def test_abort_on_p_before_bootstrap_fails_d_at_once(cluster: Cluster) -> None:
    prompt = TOK.encode("Zp aborted before D arrived")
    target = cluster.target(1)
    p_client = cluster.prefill(1, target.room)
    p_stream = p_client.submit(prompt, PARAMS, "gone", RequestMode.PREFILL_ONLY, target)
    wait_until(lambda: p_client.stats()["blocked"] == 1, 30, "P waiting for D")
    p_client.abort("gone")
    assert p_stream.result(10).finish == FinishReason.ABORT
    for handle in cluster.p[1]:
        wait_until(lambda h=handle: _settled(h), 30, "P's room released")
    # D arrives late: P answers its pre-allocation with an abort, long before D's timeout.
    d_out = (
        cluster.d[2]
        .client.submit(prompt, PARAMS, "late", RequestMode.REMOTE_DECODE, target)
        .result(6)
    )
    assert d_out.finish == FinishReason.TRANSFER
    # D2's two ranks each get P's abort; rank 0 may act on rank 1's verdict first (the MIN
    # agreement), then it reports the generic reason.
    assert re.fullmatch(
        r"KV transfer failed: (P rank 0 aborted the transfer|failed on another rank of the "
        r"replica)",
        d_out.error,
    )
    wait_until(lambda: _settled(cluster.d[2]), 30, "D2's pages released")


def test_dp_prefill_replica_is_chosen_by_room(cluster: Cluster) -> None:
    replicas = cluster.p[1]  # P1: two DP replicas behind one bootstrap server
    node = Node([h.client for h in replicas], NodeInfo(role=NodeRole.PREFILL, dp=2))
    prompts = [TOK.encode(f"{chr(75 + i)}dp data parallel prefill {i}") for i in range(4)]
    want = colocated(prompts, PARAMS)
    before = [s["pd_transfers_ok"] for s in node.stats()]
    rooms = [10, 13, 22, 7]  # replicas 0, 1, 0, 1 (room % dp, as D picks the P DP group)
    streams = []
    for i, (prompt, room) in enumerate(zip(prompts, rooms, strict=True)):
        target = cluster.target(1, room)
        ps = node.submit(prompt, PARAMS, f"dp-{i}", target)
        ds = cluster.d[1].client.submit(
            prompt, PARAMS, f"dp-{i}", RequestMode.REMOTE_DECODE, target
        )
        streams.append((ps, ds))
    assert [list(ds.result(120).tokens) for _, ds in streams] == want
    assert all(ps.result(60).finish == FinishReason.LENGTH for ps, _ in streams)
    after = [s["pd_transfers_ok"] for s in node.stats()]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    view = cluster.servers[1].snapshot()
    assert (view.world_size, view.dp_size, view.complete) == (2, 2, True)
