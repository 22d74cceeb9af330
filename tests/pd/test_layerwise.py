"""Layerwise streaming through real peers (bootstrap server, worker processes, ZMQ, Mooncake).

The P "forward" (:class:`SimulatedForward`) writes each producer step's layers into P's arena
only as it reaches them and then advances the step counter, so a send that came before its
counter passed would carry stale bytes. Checked: identity-tagged arenas byte-exact for equal
and unequal TP, several intervals, draft layers, chunked prefill from P's own cache hit; and,
driving the forward one step at a time, exactly which layers have landed on D after each
step (the rest of D still holds its old bytes), across the counter's wrap; an abort stopping
the later intervals; and the misuse the outbox refuses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, AttentionKind, PageLayout, slot_range
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    Failed,
    FailureCause,
    FirstToken,
    HandOver,
    PdEvent,
    PdTunables,
    RemoteDecodeRow,
    RemotePrefill,
    Succeeded,
    UsageError,
)
from tspd_core.pd.layerwise.step_counter import M
from tspd_core.pd.prefill.peer import PrefillOutbox
from tspd_testing.identity import check_identity, page_mask
from tspd_testing.layerwise_loopback import (
    PrefillJob,
    SimulatedForward,
    chunked_jobs,
    drive_layerwise,
)
from tspd_testing.loopback import LoopbackCluster, Outcome, Rank, RoomPlan, plan_rooms

PAGE = 4


def _spec(
    tp: int, rank: int, layers: int, draft: int = 0, attn: AttentionKind = AttentionKind.GQA
) -> ArenaSpec:
    return ArenaSpec(
        layers=layers,
        attention=attn,
        kv_heads=4,
        head_dim=8,
        latent_dim=32,
        rope_dim=8,
        page_size=PAGE,
        tp_size=tp,
        tp_rank=rank,
        page_layout=PageLayout.HND,
        draft_layers=draft,
        num_pages=240,
    )


def _cluster(
    p_tp: int,
    d_tp: int,
    interval: int,
    layers: int,
    draft: int = 0,
    attn: AttentionKind = AttentionKind.GQA,
    tunables: PdTunables | None = None,
    counter_start: int = 0,
) -> LoopbackCluster:
    return LoopbackCluster(
        [_spec(p_tp, r, layers, draft, attn) for r in range(p_tp)],
        [_spec(d_tp, r, layers, draft, attn) for r in range(d_tp)],
        tunables=tunables,
        layerwise_interval=interval,
        draft_layers=draft,
        counter_start=counter_start,
    )


SCENARIOS = [
    pytest.param(1, 1, 1, 4, 0, PdTunables(), AttentionKind.GQA, id="1P1D-every-layer"),
    pytest.param(
        2, 1, 2, 3, 2, PdTunables(stage_min_runs=1), AttentionKind.GQA, id="P2-D1-i2-draft-staged"
    ),
    pytest.param(1, 2, 3, 4, 1, PdTunables(), AttentionKind.GQA, id="P1-D2-i3-draft"),
    pytest.param(2, 1, 1, 2, 0, PdTunables(), AttentionKind.MLA, id="MLA-P2-D1"),
]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "interval", "layers", "draft", "tunables", "attn"), SCENARIOS
)
def test_chunked_rooms_stream_byte_exact(
    p_tp: int,
    d_tp: int,
    interval: int,
    layers: int,
    draft: int,
    tunables: PdTunables,
    attn: AttentionKind,
) -> None:
    with _cluster(p_tp, d_tp, interval, layers, draft, tunables=tunables, attn=attn) as cluster:
        rooms = plan_rooms(
            cluster.p[0].view.contract, cluster.d[0].view.contract, 12, 38, seed=p_tp + d_tp
        )
        snapshots = cluster.tag(rooms, seed=interval)
        # Each step "computes" 5 ms before its KV lands: a send ahead of the counter would
        # find P's pages still zero.
        forward = SimulatedForward(cluster, compute_s=0.005)
        jobs = chunked_jobs(rooms, PAGE, chunk=8, seed=layers)
        assert any(j.p_start > j.plan.prefix_len for j in jobs)  # P's own hit beyond D's
        assert any(len(j.chunks()) > 2 for j in jobs)
        forward.prefill_cached(jobs)
        outcome = drive_layerwise(forward, jobs, timeout_s=120)
        for i in range(d_tp):
            assert outcome.final("d", i) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        for i in range(p_tp):
            assert outcome.final("p", i) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        steps = layers + (draft > 0)
        per_forward = -(-steps // interval)  # intervals of one chunk (none empty here)
        sent = [r.peer.metrics() for r in cluster.p]
        armed = [m.value("tspd_pd_layerwise_chunks_total") for m in sent]
        intervals = [m.value("tspd_pd_layerwise_intervals_total") for m in sent]
        dummies = [m.value("tspd_pd_transfer_bytes_total") == 0 for m in sent]
        # A data rank arms every chunk that selects pages (at least the final one) and sends
        # each interval once; a dummy rank (MLA P2 -> D1: P1) arms only the final chunks,
        # which wait for nothing but the first token.
        for a, n, dummy in zip(armed, intervals, dummies, strict=True):
            assert (
                (a, n) == (len(rooms), 0) if dummy else (n == a * per_forward and a >= len(rooms))
            )
        assert dummies == [attn is AttentionKind.MLA and i > 0 for i in range(p_tp)]
        assert sum(m.value("tspd_pd_transfer_jobs_total", result="failed") for m in sent) == 0


# ---- one step at a time ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stepped() -> Iterator[LoopbackCluster]:
    """P TP 2 -> D TP 1, 4 layers, one interval per layer, counters 3 steps before the wrap."""
    with _cluster(2, 1, 1, 4, counter_start=M - 3) as cluster:
        yield cluster


def _room(n: int, prompt: int, prefix: int = 0) -> RoomPlan:
    pages = -(-prompt // PAGE)
    p = np.arange(1 + 20 * n, 1 + 20 * n + pages, dtype=np.int64)
    d = np.arange(200 - 20 * n - pages, 200 - 20 * n, dtype=np.int64)[::-1].copy()
    gid = "full_attention"
    return RoomPlan(
        RequestId(f"step-{n}"), Room(1000 + n), prompt, prefix, {gid: p}, {gid: d}, 50 + n
    )


def _register(ranks: list[Rank], rooms: list[RoomPlan], bootstrap: tuple[str, int]) -> None:
    host, port = bootstrap
    for r in rooms:
        for rank in ranks:
            rank.peer.register(r.rid, BootstrapInfo(host, port, r.room))


def _bootstrap(
    cluster: LoopbackCluster, rooms: list[RoomPlan], p_registered: bool = False
) -> dict[str, list[PdEvent]]:
    """Register the rooms on every rank (on D only: ``p_registered``) and wait until every
    rank is past Bootstrapping (D's manifests published as the rooms boot); the later events
    polled meanwhile, by side (a chunk held for the room may finish it at once)."""
    ranks = [*cluster.p, *cluster.d]
    _register(cluster.d if p_registered else ranks, rooms, cluster.bootstrap)
    waiting = {(id(rank), r.rid) for rank in ranks for r in rooms}
    later: dict[str, list[PdEvent]] = {"p": [], "d": []}
    deadline = time.monotonic() + 30
    while waiting:
        assert time.monotonic() < deadline, f"not bootstrapped: {waiting}"
        for side, group in (("d", cluster.d), ("p", cluster.p)):
            for rank in group:
                events = rank.peer.poll()
                booted = [e.rid for e in events if isinstance(e, Bootstrapped)]
                plans = [r for r in rooms if r.rid in booted]
                if plans and side == "d":
                    cluster._react(
                        "d",
                        rank,
                        [Bootstrapped(r.rid) for r in plans],
                        {r.rid: r for r in rooms},
                        Outcome(),
                    )
                waiting -= {(id(rank), e.rid) for e in events}
                later[side] += [e for e in events if not isinstance(e, Bootstrapped)]
        time.sleep(0.005)
    return later


def _sent(cluster: LoopbackCluster) -> int:
    return int(sum(r.peer.counters()["bytes"] for r in cluster.p))


def _paced(cluster: LoopbackCluster) -> list[tuple[int, int]]:
    """Per P rank: (intervals whose writes started, interval writes) so far."""
    got = [r.peer.metrics() for r in cluster.p]
    return [
        (
            int(m.total("tspd_pd_layerwise_intervals_total")),
            int(m.total("tspd_pd_layerwise_writes_total")),
        )
        for m in got
    ]


def _layer_bytes(cluster: LoopbackCluster, plan: RoomPlan, hi: int) -> int:
    """Bytes D must hold for layers [0, hi) of the room: each D byte is written once."""
    total = 0
    for rank in cluster.d:
        contract = rank.view.contract
        for spec in contract.group_specs:
            n = len(slot_range(spec, plan.prefix_len, plan.prompt_len))
            total += n * sum(
                f.payload_bytes for f in contract.fields_for_group(spec.group_id) if f.layer < hi
            )
    return total


def _await_bytes(cluster: LoopbackCluster, want: int) -> None:
    deadline = time.monotonic() + 15
    while (got := _sent(cluster)) != want:
        assert got < want, f"P sent {got} bytes, more than the {want} the counter allows"
        assert time.monotonic() < deadline, f"P sent {got} of {want} bytes"
        time.sleep(0.005)


def _d_state(
    cluster: LoopbackCluster, plan: RoomPlan, landed: int, layers: int, snapshot: list[np.ndarray]
) -> list[str]:
    """Layers [0, landed) hold the room's identity on every D rank; layers [landed, layers)
    still hold their old bytes."""
    problems = []
    for i, rank in enumerate(cluster.d):
        for spec in rank.view.contract.group_specs:
            slots = np.arange(plan.prefix_len // PAGE, -(-plan.prompt_len // PAGE))
            pages = plan.d_table[spec.group_id][slots]
            if landed:
                problems += check_identity(
                    rank.view, spec.group_id, slots, pages, plan.room, (0, landed)
                )
            mask = page_mask(rank.view.contract, {spec.group_id: pages}, (landed, layers))
            if (rank.view.arena[mask] != snapshot[i][mask]).any():
                problems.append(f"D{i}: layers >= {landed} changed before their step")
    return problems


@pytest.mark.multiproc
def test_no_interval_goes_before_its_counter_passes(stepped: LoopbackCluster) -> None:
    cluster = stepped
    plan = _room(0, prompt=10, prefix=4)  # D holds page 0; pages 1, 2 (partial) go
    _bootstrap(cluster, [plan])
    forward = SimulatedForward(cluster)
    job = PrefillJob(plan)
    forward.prefill_cached([job])
    rng = np.random.default_rng(0)
    for rank in cluster.d:
        rank.view.arena[:] = rng.integers(0, 256, rank.view.arena.size, dtype=np.uint8)
    snapshot = [rank.view.arena.copy() for rank in cluster.d]
    base = _sent(cluster)
    seen: list[tuple[int, int]] = []

    def after(step: int) -> None:
        _await_bytes(cluster, base + _layer_bytes(cluster, plan, step + 1))
        time.sleep(0.05)  # an early send of the next layer would show up now
        assert _sent(cluster) == base + _layer_bytes(cluster, plan, step + 1)
        assert _d_state(cluster, plan, step + 1, 4, snapshot) == []
        seen.append((step, _sent(cluster) - base))

    assert _d_state(cluster, plan, 0, 4, snapshot) == []
    before = [_outbox(r).step_counter.value() for r in cluster.p]
    paced = _paced(cluster)
    forward.run({0: [(job, 0)], 1: [(job, 0)]}, on_step=after)
    assert [_outbox(r).step_counter.value() for r in cluster.p] == [(v + 4) % M for v in before]
    # One step at a time: every interval is a write of its own on each P rank.
    assert _paced(cluster) == [(i + 4, w + 4) for i, w in paced]
    per_layer = _layer_bytes(cluster, plan, 1)
    assert seen == [(s, per_layer * (s + 1)) for s in range(4)]
    # The last byte is out, the token went with the hand-over: now both sides finish.
    _finish(cluster, plan)


def _outbox(rank: object) -> PrefillOutbox:
    box = rank.outbox  # type: ignore[attr-defined]
    assert isinstance(box, PrefillOutbox)
    return box


def _finish(
    cluster: LoopbackCluster, plan: RoomPlan, got: dict[str, list[PdEvent]] | None = None
) -> None:
    """Both sides end the room as they should (``got``: events polled already)."""
    want_d, want_p = RemotePrefill(plan.rid, plan.token), Succeeded(plan.rid)
    got = got or {"p": [], "d": []}
    deadline = time.monotonic() + 15
    while len(got["d"]) < len(cluster.d) or len(got["p"]) < len(cluster.p):
        assert time.monotonic() < deadline, f"unfinished: {got}"
        for side, ranks in (("p", cluster.p), ("d", cluster.d)):
            for rank in ranks:
                got[side] += rank.peer.poll()
        time.sleep(0.005)
    assert got == {"p": [want_p] * len(cluster.p), "d": [want_d] * len(cluster.d)}


@pytest.mark.multiproc
def test_success_waits_for_the_first_token(stepped: LoopbackCluster) -> None:
    cluster = stepped
    plan = _room(1, prompt=7)
    _bootstrap(cluster, [plan])
    base = _sent(cluster)
    paced = _paced(cluster)
    rows = {i: RemoteDecodeRow(plan.rid, [plan.p_table["full_attention"]], 0, 7) for i in range(2)}
    for i, rank in enumerate(cluster.p):
        assert _outbox(rank).streams_layerwise()
        assert _outbox(rank).producer_steps == 4
        assert _outbox(rank).arm_layerwise([rows[i]]) == 1
        assert _outbox(rank).remote_decode_pending()  # the token is still due
        _outbox(rank).step_counter.advance(4)
    _await_bytes(cluster, base + _layer_bytes(cluster, plan, 4))
    # The counter passed all four intervals at once: each P rank wrote them in one go.
    assert _paced(cluster) == [(i + 4, w + 1) for i, w in paced]
    time.sleep(0.1)
    assert [r.peer.poll() for r in [*cluster.p, *cluster.d]] == [[], [], []]  # no Success yet
    for rank in cluster.p:
        assert _outbox(rank).hand_over_remote_decode({plan.rid: FirstToken(plan.token)}) == 1
        assert not _outbox(rank).remote_decode_pending()
    _finish(cluster, plan)


def _quiet(cluster: LoopbackCluster) -> None:
    """Every P worker has handled what its engine sent so far (one pipe, answered in order)."""
    for rank in cluster.p:
        rank.peer.counters()


@pytest.mark.multiproc
def test_a_chunk_armed_before_d_came_sends_what_the_forward_passed_at_once(
    stepped: LoopbackCluster,
) -> None:
    """Armed while the room is Bootstrapping (``armable(early=True)``): the worker holds the
    chunk; when D's pre-allocation arrives after two of four steps, those two intervals go
    out as one write per P rank, and each later step as its own."""
    cluster = stepped
    plan = _room(5, prompt=10, prefix=4)
    _register(cluster.p, [plan], cluster.bootstrap)
    assert all(r.peer.armable(plan.rid, early=True) for r in cluster.p)
    assert not any(r.peer.armable(plan.rid) for r in cluster.p)  # not Bootstrapped
    forward = SimulatedForward(cluster)
    job = PrefillJob(plan)
    forward.prefill_cached([job])
    snapshot: list[np.ndarray] = []
    later: dict[str, list[PdEvent]] = {}
    base, paced = _sent(cluster), _paced(cluster)
    per_layer = _layer_bytes(cluster, plan, 1)
    seen: list[tuple[int, int, list[tuple[int, int]]]] = []

    def after(step: int) -> None:
        if step == 1:
            _quiet(cluster)
            assert _sent(cluster) == base  # held: D has not come
            assert _paced(cluster) == paced
            later.update(_bootstrap(cluster, [plan], p_registered=True))
            # D zeroed the room's pages as it published them; layers 2 and 3 stay so until
            # their steps (P may be writing layers 0 and 1 already).
            snapshot[:] = [rank.view.arena.copy() for rank in cluster.d]
        if step >= 1:
            _await_bytes(cluster, base + _layer_bytes(cluster, plan, step + 1))
            assert _d_state(cluster, plan, step + 1, 4, snapshot) == []
            seen.append((step, _sent(cluster) - base, _paced(cluster)))

    forward.run({0: [(job, 0)], 1: [(job, 0)]}, on_step=after)
    assert seen == [
        (s, per_layer * (s + 1), [(i + s + 1, w + s) for i, w in paced]) for s in (1, 2, 3)
    ]
    _finish(cluster, plan, later)


@pytest.mark.multiproc
def test_a_final_chunk_armed_before_d_came_goes_with_its_token(stepped: LoopbackCluster) -> None:
    """The whole forward ran and its first token was handed over before D came: the worker
    holds both; D's pre-allocation sends all four intervals in one write per P rank, then
    Success with the token."""
    cluster = stepped
    plan = _room(6, prompt=9)
    _register(cluster.p, [plan], cluster.bootstrap)
    forward = SimulatedForward(cluster)
    job = PrefillJob(plan)
    forward.prefill_cached([job])
    snapshot = [rank.view.arena.copy() for rank in cluster.d]
    base, paced, ok = _sent(cluster), _paced(cluster), _jobs_ok(cluster)
    forward.run({0: [(job, 0)], 1: [(job, 0)]})  # armed, four steps, the token handed over
    assert [r.peer.handed(plan.rid) for r in cluster.p] == [HandOver.DONE] * 2
    _quiet(cluster)
    assert _sent(cluster) == base
    _finish(cluster, plan, _bootstrap(cluster, [plan], p_registered=True))
    assert _sent(cluster) == base + _layer_bytes(cluster, plan, 4)
    assert _d_state(cluster, plan, 4, 4, snapshot) == []
    assert _paced(cluster) == [(i + 4, w + 1) for i, w in paced]
    assert _jobs_ok(cluster) == [n + 1 for n in ok]


def _jobs_ok(cluster: LoopbackCluster) -> list[int]:
    got = [r.peer.metrics() for r in cluster.p]
    return [int(m.value("tspd_pd_transfer_jobs_total", result="ok")) for m in got]


@pytest.mark.multiproc
def test_an_abort_before_d_came_drops_the_held_armed_chunk(stepped: LoopbackCluster) -> None:
    cluster = stepped
    plan = _room(7, prompt=6)
    _register(cluster.p, [plan], cluster.bootstrap)
    base = _sent(cluster)
    row = RemoteDecodeRow(plan.rid, [plan.p_table["full_attention"]], 0, 6)
    for rank in cluster.p:
        assert _outbox(rank).arm_layerwise([row]) == 1
        rank.peer.abort(plan.rid, "client went away")
        _outbox(rank).step_counter.advance(4)  # the armed forward still runs its steps
    events: list[object] = []
    deadline = time.monotonic() + 15
    while len(events) < len(cluster.p):
        assert time.monotonic() < deadline, events
        events += [e for r in cluster.p for e in r.peer.poll()]
        time.sleep(0.005)
    assert [(type(e), e.cause) for e in events] == [(Failed, FailureCause.ABORT)] * 2  # type: ignore[attr-defined]
    assert not any(r.peer.armable(plan.rid, early=True) for r in cluster.p)
    assert not any(r.peer.has_in_flight() for r in cluster.p)
    assert _sent(cluster) == base


@pytest.mark.multiproc
def test_the_peer_records_what_was_armed_and_handed(stepped: LoopbackCluster) -> None:
    """What an engine asks instead of keeping a phase of its own (``PrefillPeer.handed``), on
    each P rank: nothing, a chunk armed, the final chunk armed (its token due), all handed."""
    cluster = stepped
    plan = _room(4, prompt=7)
    _bootstrap(cluster, [plan])
    table = [plan.p_table["full_attention"]]
    chunks = [RemoteDecodeRow(plan.rid, table, 0, 4, False), RemoteDecodeRow(plan.rid, table, 4, 7)]
    seen = [[r.peer.handed(plan.rid) for r in cluster.p]]
    for chunk in chunks:
        for rank in cluster.p:
            assert _outbox(rank).arm_layerwise([chunk]) == 1
            _outbox(rank).step_counter.advance(4)
        seen.append([r.peer.handed(plan.rid) for r in cluster.p])
    assert all(_outbox(r).remote_decode_pending() for r in cluster.p)  # the token is due
    for rank in cluster.p:
        assert _outbox(rank).hand_over_remote_decode({plan.rid: FirstToken(plan.token)}) == 1
    seen.append([r.peer.handed(plan.rid) for r in cluster.p])
    assert seen == [[h, h] for h in HandOver]
    assert not any(_outbox(r).remote_decode_pending() for r in cluster.p)
    _finish(cluster, plan)


@pytest.mark.multiproc
def test_an_abort_stops_the_later_intervals(stepped: LoopbackCluster) -> None:
    cluster = stepped
    plan = _room(2, prompt=12)
    assert not any(r.peer.armable(plan.rid) for r in cluster.p)  # not registered yet
    _bootstrap(cluster, [plan])
    assert all(r.peer.armable(plan.rid) for r in cluster.p)  # agreed Bootstrapped
    forward = SimulatedForward(cluster)
    job = PrefillJob(plan)
    forward.prefill_cached([job])
    snapshot = [rank.view.arena.copy() for rank in cluster.d]
    base = _sent(cluster)
    one = _layer_bytes(cluster, plan, 1)

    def after(step: int) -> None:
        if step == 0:
            _await_bytes(cluster, base + one)
            # Each P rank here is a replica of its own: abort on both, as the agreement of
            # one replica would (its other ranks fail the room in the same round).
            for rank in cluster.p:
                rank.peer.abort(plan.rid, "client went away")
                # Answered after the abort (one pipe, read in order): the worker failed the
                # room before the next step's counter moves, so no later interval starts.
                rank.peer.counters()

    forward.run({0: [(job, 0)], 1: [(job, 0)]}, on_step=after)
    events: dict[int, list[object]] = {i: [] for i in range(3)}
    deadline = time.monotonic() + 15
    ranks = [*cluster.p, *cluster.d]
    while not all(events.values()):
        assert time.monotonic() < deadline, events
        for i, rank in enumerate(ranks):
            events[i] += rank.peer.poll()
        time.sleep(0.005)
    assert all(len(v) == 1 and isinstance(v[0], Failed) for v in events.values()), events
    causes = [e.cause for v in events.values() for e in v]  # type: ignore[attr-defined]
    assert causes == [FailureCause.ABORT, FailureCause.ABORT, FailureCause.REMOTE]
    assert not any(r.peer.armable(plan.rid) for r in cluster.p)  # failed: never armed again
    assert _sent(cluster) == base + one  # layers 1..3 never went out
    assert _d_state(cluster, plan, 1, 4, snapshot) == []
    assert not any(r.peer.has_in_flight() for r in ranks)


@pytest.mark.multiproc
def test_the_outbox_refuses_misuse(stepped: LoopbackCluster) -> None:
    cluster = stepped
    plan = _room(3, prompt=8)
    box = _outbox(cluster.p[0])
    counter = box.step_counter
    reserved = counter.reserved
    row = RemoteDecodeRow(plan.rid, [plan.p_table["full_attention"]], 0, 8)
    with pytest.raises(UsageError, match="not registered"):
        box.arm_layerwise([row])
    _bootstrap(cluster, [plan])
    with pytest.raises(UsageError, match="one row per request"):
        box.arm_layerwise([row, row])
    assert counter.reserved == reserved  # nothing reserved, nothing armed
    counter.advance(2)  # a forward that was never armed
    with pytest.raises(UsageError, match="call arm_layerwise before every forward"):
        box.arm_layerwise([row])
    assert box.arm_layerwise([]) == 0  # resynced: an empty forward still reserves its steps
    counter.advance(4)
    for rank in cluster.p:
        rank.peer.abort(plan.rid, "test over")
    deadline = time.monotonic() + 15
    while any(r.peer.has_in_flight() for r in [*cluster.p, *cluster.d]):
        assert time.monotonic() < deadline
        for r in [*cluster.p, *cluster.d]:
            r.peer.poll()
        time.sleep(0.005)
