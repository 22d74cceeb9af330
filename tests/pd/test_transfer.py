"""Identity-tagged arenas moved P -> D byte-exact through real peers.

Real bootstrap server, real transfer worker processes sharing the arenas, real ZMQ, real
Mooncake over TCP. Dozens of concurrent rooms of mixed lengths, some with a prefix hit on D;
every destination byte is checked against its global identity and every other byte of every
D arena must be unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, AttentionKind, PageLayout
from tspd_core.pd import Bootstrapped, PdTunables, RemotePrefill, Succeeded
from tspd_testing.loopback import LoopbackCluster, RoomPlan, plan_rooms

ROOMS = 36
MAX_PROMPT = 58  # tokens; 4-token pages -> up to 15 pages per room


def _spec(attention: AttentionKind, tp: int, rank: int, layout: PageLayout) -> ArenaSpec:
    return ArenaSpec(
        layers=2,
        attention=attention,
        kv_heads=12,
        head_dim=16,
        latent_dim=64,
        rope_dim=16,
        page_size=4,
        tp_size=tp,
        tp_rank=rank,
        page_layout=layout,
        num_pages=ROOMS * 16,
    )


STAGED = PdTunables(stage_min_runs=1)  # small pages: every job goes through D staging slots
DIRECT = PdTunables(stage_below_bytes=0, max_run_bytes=1024)  # direct writes, runs cut to 1 KiB

SCENARIOS = [
    pytest.param(AttentionKind.GQA, 1, 1, PageLayout.HND, STAGED, id="1P1D-staged"),
    pytest.param(AttentionKind.GQA, 1, 1, PageLayout.HND, DIRECT, id="1P1D-direct"),
    pytest.param(AttentionKind.GQA, 2, 1, PageLayout.NHD, STAGED, id="P2-D1-nhd-staged"),
    pytest.param(AttentionKind.GQA, 2, 1, PageLayout.NHD, DIRECT, id="P2-D1-nhd-direct"),
    pytest.param(AttentionKind.GQA, 1, 2, PageLayout.HND, STAGED, id="P1-D2-staged"),
    pytest.param(AttentionKind.GQA, 4, 2, PageLayout.HND, STAGED, id="P4-D2-staged"),
    pytest.param(AttentionKind.GQA, 4, 2, PageLayout.HND, DIRECT, id="P4-D2-direct"),
    pytest.param(AttentionKind.GQA, 2, 3, PageLayout.NHD, STAGED, id="P2-D3-nhd-staged"),
    pytest.param(AttentionKind.MLA, 2, 1, PageLayout.HND, STAGED, id="MLA-P2-D1-staged"),
    pytest.param(AttentionKind.MLA, 2, 1, PageLayout.HND, DIRECT, id="MLA-P2-D1-direct"),
]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(("attention", "p_tp", "d_tp", "layout", "tunables"), SCENARIOS)
def test_identity_arenas_move_byte_exact(
    attention: AttentionKind, p_tp: int, d_tp: int, layout: PageLayout, tunables: PdTunables
) -> None:
    p_specs = [_spec(attention, p_tp, r, layout) for r in range(p_tp)]
    d_specs = [_spec(attention, d_tp, r, layout) for r in range(d_tp)]
    with LoopbackCluster(p_specs, d_specs, tunables=tunables) as cluster:
        rooms = plan_rooms(
            cluster.p[0].view.contract, cluster.d[0].view.contract, ROOMS, MAX_PROMPT, seed=p_tp
        )
        assert any(r.prefix_len for r in rooms)
        snapshots = cluster.tag(rooms, seed=d_tp)
        outcome = cluster.drive(rooms, timeout_s=180)
        for i in range(d_tp):
            events = outcome.events[("d", i)]
            booted = [e.rid for e in events if isinstance(e, Bootstrapped)]
            assert sorted(booted) == sorted(r.rid for r in rooms)
            assert outcome.final("d", i) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        for i in range(p_tp):
            assert outcome.final("p", i) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        assert not any(rank.peer.has_in_flight() for rank in [*cluster.p, *cluster.d])
        p_counters = [rank.peer.counters() for rank in cluster.p]
        d_counters = [rank.peer.counters() for rank in cluster.d]
        staged = sum(c["staged_jobs"] for c in p_counters)
        scattered = sum(c["scattered_bytes"] for c in d_counters)
        assert sum(c["failed_jobs"] for c in p_counters) == 0
        if tunables.stage_below_bytes:
            assert staged == sum(c["jobs"] for c in p_counters) > 0
            assert scattered == sum(c["bytes"] for c in p_counters)
        else:
            assert staged == scattered == 0
        assert all(c["rooms"] == 0 for c in [*p_counters, *d_counters])


@pytest.mark.multiproc
@pytest.mark.slow
def test_staged_pieces_send_contiguous_sources_from_the_arena_and_gather_the_rest() -> None:
    """P TP 2 -> D TP 1 with head-major 16 KiB half-pages and 1 MiB staging slots: rooms whose
    P pages are consecutive stage long source runs straight from P's arena (several pieces in
    flight per job), the others are gathered; every byte lands where it should."""

    def spec(tp: int, rank: int) -> ArenaSpec:
        return ArenaSpec(
            layers=2,
            kv_heads=8,
            head_dim=128,
            page_size=16,
            tp_size=tp,
            tp_rank=rank,
            page_layout=PageLayout.HND,
            num_pages=200,
        )

    # One transfer thread per queue (the default's thread count grows with the CPUs): the
    # grant's warm-up then runs on the thread that takes the rooms' jobs. Every room stages,
    # room 1's twelve 16 KiB runs too (few enough to go direct by default).
    tunables = PdTunables(stage_min_runs=1, staging_bytes=8 << 20, staging_slots=8,
                          queue_size=4, thread_pool_size=4,
                          stage_few_below_bytes=256 << 10)  # fmt: skip
    rng = np.random.default_rng(5)
    # (P pages, D pages, prefix pages on D); pages are disjoint across rooms on each side.
    tables = [
        (np.arange(1, 65), np.arange(101, 165), 0),  # 1 MiB runs per field: direct, 4 pieces
        (np.arange(70, 73), np.array([3, 9, 4]), 0),  # 48 KiB runs: gathered
        (rng.permutation(np.arange(120, 199))[:20], rng.permutation(np.arange(10, 60))[:20], 0),
        (np.arange(75, 115), np.concatenate([np.arange(165, 199), np.arange(60, 66)]), 8),
    ]
    rooms = [
        RoomPlan(
            RequestId(f"room-{i}"),
            Room(9_000 + i),
            p.size * 16,
            prefix * 16,
            {"full_attention": p.astype(np.int64)},
            {"full_attention": d.astype(np.int64)},
            40 + i,
        )
        for i, (p, d, prefix) in enumerate(tables)
    ]
    with LoopbackCluster([spec(2, 0), spec(2, 1)], [spec(1, 0)], tunables=tunables) as cluster:
        snapshots = cluster.tag(rooms, seed=9)
        outcome = cluster.drive(rooms, timeout_s=180)
        assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        counters = [rank.peer.counters() for rank in cluster.p]
        for c in counters:
            assert c["staged_jobs"] == c["jobs"] == len(rooms)
            assert c["staged_direct_bytes"] + c["gathered_bytes"] == c["bytes"]
            # Room 0's four 1 MiB runs and room 3's four 512 KiB runs went direct.
            assert c["staged_direct_bytes"] == 4 * (64 + 32) * (16 << 10)
        # D registered with the first room and granted each P rank 2 slots; the grant warmed
        # the rank's one transfer thread of that queue up before the room's job (same FIFO
        # queue): its 2 gather buffers made, a few bytes written into a free slot (Mooncake's
        # first connection); the control thread made its buffer for inline staged jobs. The
        # rooms' jobs made no buffer of their own.
        keys = ("warm_ups", "gather_buffers", "gather_buffers_by_jobs")
        warmth = [tuple(c[k] for k in keys) for c in counters]
        assert warmth == [(1, 3, 0), (1, 3, 0)]
        # Each rank timed each room's hand-over (final chunk in -> Success sent).
        for rank in cluster.p:
            text = rank.peer.metrics().render({"rank": "r"})
            assert f'tspd_pd_handover_seconds_count{{rank="r"}} {len(rooms)}' in text.splitlines()
        scattered = cluster.d[0].peer.counters()["scattered_bytes"]
        assert scattered == sum(c["bytes"] for c in counters)


@pytest.mark.multiproc
def test_a_short_prompts_staged_job_starts_on_ps_control_thread() -> None:
    """P TP 2 -> D TP 1 in NHD, rooms one at a time: a staged job within
    ``inline_staged_bytes`` is gathered and written by P's control thread (no hand-off to a
    transfer thread); a larger one goes through the transfer threads. Bytes exact both ways."""
    # 1.5 KiB per page per P rank: 2 pages (3 KiB) start inline, 12 pages (18 KiB) do not.
    tunables = PdTunables(stage_min_runs=1, inline_staged_bytes=8 << 10)
    p_specs = [_spec(AttentionKind.GQA, 2, r, PageLayout.NHD) for r in range(2)]
    with LoopbackCluster(p_specs, [_spec(AttentionKind.GQA, 1, 0, PageLayout.NHD)],
                         tunables=tunables) as cluster:  # fmt: skip
        for i, (p_pages, d_pages, inline) in enumerate(
            [([7, 3], [40, 12], 1), (list(range(60, 72)), list(range(100, 112)), 1)]
        ):
            room = RoomPlan(
                RequestId(f"short-{i}"),
                Room(5_000 + i),
                len(p_pages) * 4,
                0,
                {"full_attention": np.array(p_pages, dtype=np.int64)},
                {"full_attention": np.array(d_pages, dtype=np.int64)},
                11 + i,
            )
            snapshots = cluster.tag([room], seed=3 + i)
            outcome = cluster.drive([room], timeout_s=120)
            assert outcome.final("d", 0) == {room.rid: RemotePrefill(room.rid, room.token)}
            assert cluster.verify([room], snapshots) == []
            counters = [rank.peer.counters() for rank in cluster.p]
            assert [(c["staged_jobs"], c["inline_jobs"]) for c in counters] == [(i + 1, inline)] * 2


@pytest.mark.multiproc
@pytest.mark.parametrize(("latent", "rope", "staged"), [(512, 64, False), (112, 16, True)])
def test_a_one_page_rooms_long_runs_go_direct_inline_and_short_ones_stage(
    latent: int, rope: int, staged: bool
) -> None:
    """MLA P TP 1 -> D TP 1, one page of 16 layers: 16 runs, enough to stage by the run count.
    With a DeepSeek-sized latent the runs are 18 KiB (288 KiB in all): few runs, of at least
    ``stage_few_below_bytes`` on average, so the job goes direct, as its 16 descriptors from
    P's control thread. With 4 KiB runs it stages: P gathers it on its control thread and D
    scatters it on its own control thread (the room alone on D, the scatter thread idle).
    Bytes exact both ways."""
    spec = ArenaSpec(layers=16, attention=AttentionKind.MLA, latent_dim=latent, rope_dim=rope,
                     page_size=16, num_pages=8)  # fmt: skip
    room = RoomPlan(
        RequestId("one-page"),
        Room(6_100),
        16,
        0,
        {"full_attention": np.array([5], dtype=np.int64)},
        {"full_attention": np.array([2], dtype=np.int64)},
        17,
    )
    with LoopbackCluster([spec], [spec], tunables=PdTunables()) as cluster:
        snapshots = cluster.tag([room], seed=4)
        outcome = cluster.drive([room], timeout_s=120)
        assert outcome.final("d", 0) == {room.rid: RemotePrefill(room.rid, room.token)}
        assert cluster.verify([room], snapshots) == []
        p, d = cluster.p[0].peer.counters(), cluster.d[0].peer.counters()
    run = 16 * (latent + rope) * 2
    assert p["bytes"] == 16 * run
    # The first job on an idle queue, the first scatter on an idle thread: both inline.
    assert (p["jobs"], p["staged_jobs"], p["inline_jobs"]) == (1, int(staged), 1)
    assert (d["scatters"], d["inline_scatters"]) == (int(staged), int(staged))
    assert d["scattered_bytes"] == (16 * run if staged else 0)


@pytest.mark.multiproc
def test_d_scatters_inline_only_for_a_room_alone_on_its_rank() -> None:
    """Three staged one-page rooms at once (4 KiB runs, as above): when the first piece
    arrives the other two rooms are live on D, so that scatter goes to the scatter thread,
    not D's control thread (which serves the other rooms' frames). Bytes exact."""
    spec = ArenaSpec(layers=16, attention=AttentionKind.MLA, latent_dim=112, rope_dim=16,
                     page_size=16, num_pages=8)  # fmt: skip
    rooms = [
        RoomPlan(
            RequestId(f"page-{k}"),
            Room(6_200 + k),
            16,
            0,
            {"full_attention": np.array([1 + k], dtype=np.int64)},
            {"full_attention": np.array([5 + k % 3], dtype=np.int64)},
            17 + k,
        )
        for k in range(3)
    ]
    with LoopbackCluster([spec], [spec], tunables=PdTunables()) as cluster:
        snapshots = cluster.tag(rooms, seed=5)
        outcome = cluster.drive(rooms, timeout_s=120)
        assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        d = cluster.d[0].peer.counters()
    assert d["scatters"] == 3
    assert d["inline_scatters"] < 3  # at least the first: two other rooms were live
