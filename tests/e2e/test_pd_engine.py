"""PD through the reference engine's own front door: a prefill replica and a decode replica,
ranks as processes, KV moved by real transfer peers (Mooncake over TCP), rooms found through
real bootstrap servers. No router here: the test plays it (same room to both halves).

One module-wide cluster serves every (P TP, D TP) pair, with and without layerwise
streaming: P1, P2 and P3 (each with its bootstrap server), D1 and D2; any P serves any D,
re-slicing pages between unequal TP sizes. P1 runs two DP replicas (TP 1 each): every room
goes to replica ``room % 2``, the P DP group D derives from the room. Replica 0 hands the KV
over after the forward, replica 1 streams it layer by layer while the forward runs (so the
room's parity picks the mode) and waits for each room's Bootstrapped before prefilling it
(``prefill_early`` off); P2 (TP 2) hands over, P3 (TP 2) streams, prefilling at once (its
worker holds an armed chunk until D's pre-allocations arrive). The streaming replicas
prefill 8 tokens a round, so most prompts here go out in several chunks.
"""

from __future__ import annotations

import re
import secrets
import socket
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tspd_bootstrap.server import BootstrapServer
from tspd_core.pd import PdTunables
from tspd_core.pd.proc import forkserver
from tspd_engine.frames import FinishReason, Output, PdTarget, RequestMode, SamplingParams
from tspd_engine.node.replicas import Node, NodeInfo, NodeRole
from tspd_engine.pdlink import PdConfig, PdRole, canonical_layout
from tspd_engine.rank.client import EngineClient
from tspd_engine.rank.launch import RANK_PRELOAD, EngineHandle, launch

from .conftest import TOK, colocated, e2e_config, samples, serve_node, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PARAMS = SamplingParams(max_tokens=12)
#: D1 gives up on a room that got no KV after 8 s (the failure tests wait for it).
D1_TUNABLES = PdTunables(waiting_timeout_s=8.0)
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]
LAYERWISE_PAIRS = [(1, 1), (2, 1), (1, 2)]
#: Each prefill instance: its TP, and whether each of its DP replicas streams layerwise.
P_SPECS = {1: (1, (False, True)), 2: (2, (False,)), 3: (2, (True,))}
CHUNK = 8  #: prompt tokens a streaming replica prefills per round
LAYERS = 2  #: the tiny model's layers: one interval each at --layerwise-interval 1


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

    def pick(self, tp: int, layerwise: bool) -> tuple[int, PdTarget]:
        """A prefill instance of TP ``tp`` and a room its layerwise (or not) replica serves."""
        p = next(n for n, (t, modes) in P_SPECS.items() if t == tp and layerwise in modes)
        modes = P_SPECS[p][1]
        room = secrets.randbits(62) * len(modes) + modes.index(layerwise)
        return p, self.target(p, room)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    servers = {
        p: BootstrapServer("127.0.0.1", 0, layout_canonicalizer=canonical_layout).start()
        for p in P_SPECS
    }
    specs = [
        ("p", p, r, tp, PdConfig(role=PdRole.PREFILL, bootstrap=f"127.0.0.1:{servers[p].port}",
                                 dp_size=len(modes), dp_rank=r, layerwise_interval=int(lw),
                                 prefill_early=not (p == 1 and lw)))
        for p, (tp, modes) in P_SPECS.items() for r, lw in enumerate(modes)
    ] + [
        ("d", d, 0, d, PdConfig(role=PdRole.DECODE, tunables=D1_TUNABLES if d == 1 else None))
        for d in (1, 2)
    ]  # fmt: skip
    handles: dict[tuple[str, int, int], EngineHandle] = {}

    def start(spec: tuple[str, int, int, int, PdConfig]) -> None:
        side, n, replica, tp, pd = spec
        chunk = {"max_prefill_tokens": CHUNK} if pd.layerwise_interval else {}
        cfg = e2e_config(tp=tp, **chunk)
        handles[side, n, replica] = launch(cfg, pd=pd, ready_timeout_s=240)

    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            list(pool.map(start, specs))
        p = {n: [handles["p", n, r] for r in range(len(P_SPECS[n][1]))] for n in P_SPECS}
        yield Cluster(servers, p, {1: handles["d", 1, 0], 2: handles["d", 2, 0]})
    finally:
        _shutdown(handles.values())
        for server in servers.values():
            server.close()


def _shutdown(handles: Iterable[EngineHandle]) -> None:
    # Side by side: each replica's stop is mostly waiting for its ranks and workers to exit.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(EngineHandle.shutdown, handles))


def _prompts(p: int, d: int, layerwise: bool = False) -> list[list[int]]:
    # The first page (BOS + 3 bytes) is unique per prompt, so no prompt hits another's
    # cached pages: every transfer moves the whole prompt.
    texts = ["x", "hello world", "paged attention over TCP", "the quick brown fox jumps " * 3]
    mark = "abcd" if layerwise else "ABCD"
    return [TOK.encode(f"{mark[i]}{p}{d} {t}") for i, t in enumerate(texts)]


def _run_pd(
    c: Cluster, p_tp: int, d: int, prompts: Sequence[list[int]], tag: str, layerwise: bool = False
) -> list[Output]:
    """Send each prompt's two halves (same room) and return D's outputs."""
    streams = []
    for i, prompt in enumerate(prompts):
        p, target = c.pick(p_tp, layerwise)
        rid = f"{tag}-{i}"
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


#: A replica's page: 2 layers x (K + V) x 2 KV heads x 4 tokens x 32 dims x 4 bytes.
REPLICA_PAGE = 2 * 2 * 2 * 4 * 32 * 4


@pytest.mark.parametrize(
    ("p", "d", "layerwise"),
    [(p, d, False) for p, d in PAIRS] + [(p, d, True) for p, d in LAYERWISE_PAIRS],
    ids=[f"P{p}D{d}" for p, d in PAIRS] + [f"P{p}D{d}-layerwise" for p, d in LAYERWISE_PAIRS],
)
def test_pd_equals_colocated_token_for_token(
    cluster: Cluster, p: int, d: int, layerwise: bool
) -> None:
    prompts = _prompts(p, d, layerwise)
    want = colocated(prompts, PARAMS)
    before = cluster.d[d].client.stats()
    outs = _run_pd(cluster, p, d, prompts, f"pd{p}{d}{layerwise:d}", layerwise)
    assert [list(o.tokens) for o in outs] == want
    assert all(o.cached_tokens == 0 for o in outs)
    after = cluster.d[d].client.stats()
    moved = after["pd_kv_pages_in"] - before["pd_kv_pages_in"]
    assert moved == sum(_pages(len(x)) for x in prompts)  # every prompt page, nothing else
    assert after["pd_transfers_ok"] - before["pd_transfers_ok"] == len(prompts)
    assert after["pd_kv_bytes_in"] - before["pd_kv_bytes_in"] == moved * REPLICA_PAGE

    # The same prompt again: D's prefix store holds every full page of it but the last
    # token's, so P sends exactly one page (layerwise: its first chunk starts at D's prefix)
    # and the tokens stay the same.
    again = _run_pd(cluster, p, d, prompts[3:], f"again{p}{d}{layerwise:d}", layerwise)
    n = len(prompts[3])
    assert list(again[0].tokens) == want[3]
    assert again[0].cached_tokens == (n - 1) // 4 * 4
    final = cluster.d[d].client.stats()
    assert final["pd_kv_pages_in"] - after["pd_kv_pages_in"] == 1
    for handle in (*cluster.p[cluster.pick(p, layerwise)[0]], cluster.d[d]):
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
    # Nobody listens on the target's port: a socket holds it bound without listening (so
    # connections are refused) until the transfer has failed, so no other process takes it.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        target = PdTarget(secrets.randbits(63), "127.0.0.1", held.getsockname()[1])
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
    # P's engine never hears of this room: D publishes its manifest and waits for KV that
    # never comes (P's worker holds D's pre-allocation, waiting for its engine).
    prompt = TOK.encode("Zd waiting for KV that never comes")
    stream = cluster.d[1].client.submit(
        prompt, PARAMS, "orphan", RequestMode.REMOTE_DECODE, cluster.target(1)
    )
    published = lambda: cluster.d[1].client.stats()["pd_rooms_published"] == 1  # noqa: E731
    wait_until(published, 30, "the manifest published")
    cluster.d[1].client.abort("orphan")
    out = stream.result(10)
    assert (out.finish, out.tokens) == (FinishReason.ABORT, ())
    # Answered at once, but a P rank could still write into the pages: they stay held for as
    # long as the room is tracked, which ends when P answers D's abort (or at D's waiting
    # timeout, 8 s here, if it never does). When the snapshot falls is the race between the
    # two processes; the pairing is not.
    s = cluster.d[1].client.stats()
    assert s["running"] == 0
    assert (s["held"], s["pd_rooms_tracked"]) in {(1, 1), (0, 0)}
    held = s["total_pages"] - _pages(len(prompt)) if s["held"] else s["total_pages"]
    assert s["reclaimable_pages"] == held
    wait_until(lambda: _settled(cluster.d[1]), 30, "the room to end")


@pytest.mark.parametrize("early", [False, True], ids=["held", "prefilled-early"])
def test_abort_on_p_before_bootstrap_fails_d_at_once(cluster: Cluster, early: bool) -> None:
    # P instance 1's layerwise replica holds a request until Bootstrapped (prefill_early
    # off); its other replica prefills at once (PdConfig.prefill_early), answers and holds
    # the pages for the room.
    prompt = TOK.encode("Zp aborted before D arrived")
    _, target = cluster.pick(1, layerwise=not early)
    p_client = cluster.prefill(1, target.room)
    rid = f"gone{early:d}"
    p_stream = p_client.submit(prompt, PARAMS, rid, RequestMode.PREFILL_ONLY, target)
    if early:
        assert p_stream.result(30).finish == FinishReason.LENGTH  # prefilled, D not there
        assert p_client.stats()["held"] == 1  # the pages wait for the room
        p_client.abort(rid)
    else:
        wait_until(lambda: p_client.stats()["blocked"] == 1, 30, "P waiting for D")
        p_client.abort(rid)
        assert p_stream.result(10).finish == FinishReason.ABORT
    for handle in cluster.p[1]:
        wait_until(lambda h=handle: _settled(h), 30, "P's room released")
    # D arrives late: P answers its pre-allocation with an abort, long before D's timeout.
    d_out = (
        cluster.d[2]
        .client.submit(prompt, PARAMS, f"late{early:d}", RequestMode.REMOTE_DECODE, target)
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
    # P answers at the end of its prefill and counts the transfer when its engine polls the
    # Success, which may come after D's last token: wait until P let go of every room.
    for handle in replicas:
        wait_until(lambda h=handle: _settled(h), 30, "P's rooms released")
    after = [s["pd_transfers_ok"] for s in node.stats()]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    view = cluster.servers[1].snapshot()
    assert (view.world_size, view.dp_size, view.complete) == (2, 2, True)


def _p_metrics(c: Cluster, p: int) -> dict[str, float]:
    """Prefill instance ``p``'s node ``/metrics`` (every rank's peer), through the real node
    endpoint over its replicas."""
    handles = c.p[p]
    info = NodeInfo(role=NodeRole.PREFILL, tp=P_SPECS[p][0], dp=len(handles))
    node = Node([h.client for h in handles], info, [h.addrs.metrics for h in handles])
    with serve_node(node) as url:
        return samples(url)


def _per_rank(metrics: dict[str, float], name: str, tp: int) -> list[float]:
    at = 'role="prefill",replica="0",rank='
    return [metrics.get(f'{name}{{{at}"{r}"}}', 0.0) for r in range(tp)]


def test_chunked_layerwise_prefill_streams_layers_x_chunks_and_the_same_bytes(
    cluster: Cluster,
) -> None:
    # 40 prompt tokens (10 pages) at 8 a round: 5 chunks, each sent one layer at a time by
    # both ranks of P3 (TP 2, one KV head each) to D1 (TP 1); P2 sends the same length after
    # the forward. Both move exactly every page once.
    prompts = {lw: TOK.encode(f"{'Ll'[lw]}ong one, chunked into five.. " + "z" * 9)
               for lw in (False, True)}  # fmt: skip
    assert {len(x) for x in prompts.values()} == {40}
    before = {p: _p_metrics(cluster, p) for p in (2, 3)}
    d_before = cluster.d[1].client.stats()["pd_kv_bytes_in"]
    for lw, prompt in prompts.items():
        (out,) = _run_pd(cluster, 2, 1, [prompt], f"chunked{lw:d}", layerwise=lw)
        assert list(out.tokens) == colocated([prompt], PARAMS)[0]
    after = {p: _p_metrics(cluster, p) for p in (2, 3)}

    def delta(p: int, name: str) -> list[float]:
        new, old = _per_rank(after[p], name, 2), _per_rank(before[p], name, 2)
        return [a - b for a, b in zip(new, old, strict=True)]

    chunks = -(-40 // CHUNK)
    assert delta(3, "tspd_pd_layerwise_chunks_total") == [chunks, chunks]
    assert delta(3, "tspd_pd_layerwise_intervals_total") == [LAYERS * chunks] * 2
    assert delta(2, "tspd_pd_layerwise_intervals_total") == [0, 0]  # P2 does not stream
    rank_page = REPLICA_PAGE // 2  # each P rank holds one of the two KV heads
    for p in (2, 3):
        assert delta(p, "tspd_pd_transfer_bytes_total") == [10 * rank_page] * 2
    assert cluster.d[1].client.stats()["pd_kv_bytes_in"] - d_before == 2 * 10 * REPLICA_PAGE
    for handle in (*cluster.p[2], *cluster.p[3], cluster.d[1]):
        wait_until(lambda h=handle: _settled(h), 30, "both pools back to their initial state")


def test_a_streaming_prefill_aborted_between_chunks_keeps_the_counter_aligned(
    cluster: Cluster,
) -> None:
    # 600 tokens at 8 a round: 75 chunks on P3, each armed and streamed before the next.
    prompt = TOK.encode("Abort me halfway. " + "y" * 580)
    p, target = cluster.pick(2, layerwise=True)
    p_client = cluster.prefill(p, target.room)
    ps = p_client.submit(prompt, PARAMS, "halfway", RequestMode.PREFILL_ONLY, target)
    ds = cluster.d[2].client.submit(prompt, PARAMS, "halfway", RequestMode.REMOTE_DECODE, target)
    wait_until(lambda: p_client.stats()["running"] == 1, 60, "P prefilling the prompt")
    p_client.abort("halfway")
    p_out = ps.result(30)
    assert (p_out.finish, p_out.tokens) == (FinishReason.ABORT, ()), "prefill ended first"
    d_out = ds.result(60)
    assert (d_out.finish, d_out.tokens) == (FinishReason.TRANSFER, ())
    for handle in (*cluster.p[p], cluster.d[2]):
        wait_until(lambda h=handle: _settled(h), 30, "the aborted room's pages released")
    # The next streamed prompt lines up with the counter: a misaligned one would send its
    # layers before the forward wrote them, or never (the room would time out).
    outs = _run_pd(cluster, 2, 2, _prompts(2, 2, layerwise=True)[2:], "after-abort", True)
    assert [list(o.tokens) for o in outs] == colocated(_prompts(2, 2, True)[2:], PARAMS)


def _processes() -> dict[int, tuple[int, str]]:
    """Every process of this host: pid -> (parent pid, name)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we read
        # "pid (comm) state ppid ...": the name may hold spaces and parentheses
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        out[int(entry.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), name)
    return out


def test_ranks_start_their_transfer_workers_from_the_launchers_forkserver(
    cluster: Cluster,
) -> None:
    server = forkserver.running(RANK_PRELOAD)
    assert server is not None, "this interpreter's forkserver can be shared"
    procs = _processes()
    handles = [*(h for hs in cluster.p.values() for h in hs), *cluster.d.values()]
    ranks = {pid for h in handles for pid in h.pids}
    assert {pid: procs[pid][0] for pid in ranks} == dict.fromkeys(ranks, server.pid)
    # No rank started a process (no forkserver of its own, no worker); the workers, one per
    # rank, are the launcher's server's children beside the ranks.
    assert [pid for pid, (ppid, _) in procs.items() if ppid in ranks] == []
    workers = sorted(name for ppid, name in procs.values() if ppid == server.pid and "xfer" in name)
    p_ranks = sum(h.cfg.tp for hs in cluster.p.values() for h in hs)
    d_ranks = sum(h.cfg.tp for h in cluster.d.values())
    expect = [f"tspd-d-xfer{r}" for h in cluster.d.values() for r in range(h.cfg.tp)] + [
        f"tspd-p-xfer{r}" for hs in cluster.p.values() for h in hs for r in range(h.cfg.tp)
    ]
    assert len(expect) == p_ranks + d_ranks == 9
    assert workers == sorted(expect)
