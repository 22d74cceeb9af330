"""Routes: wire.md §4.1 and §6.4 examples, replica groups, parts, fan-outs and rejections."""

from __future__ import annotations

import dataclasses

import pytest
from layout_testkit import WIRE_EXAMPLE, wire_spec

from tspd_core.layout.codec import parse_contract
from tspd_core.layout.contract import CacheContract
from tspd_core.layout.copies import plan_copies
from tspd_core.layout.errors import ContractMismatch, RouteError
from tspd_core.layout.manifest import BlockManifest, GroupBlocks
from tspd_core.layout.recipe import ArenaSpec, AttentionKind, PageLayout, StateSpec, build_contract
from tspd_core.layout.routes import Fragment, RoutePlan, plan_routes, prefill_dp_group


def gqa(heads: int, tp: int, layout: PageLayout = PageLayout.NHD, **kw: object) -> CacheContract:
    spec = ArenaSpec(
        layers=1,
        kv_heads=heads,
        head_dim=8,
        page_size=4,
        tp_size=tp,
        page_layout=layout,
        num_pages=4,
    )
    return build_contract(dataclasses.replace(spec, **kw))


def route(heads: int, p: int, d: int, layout: PageLayout = PageLayout.NHD) -> RoutePlan:
    return plan_routes(gqa(heads, p, layout), p, gqa(heads, d, layout), d)


def frags(plan: RoutePlan, p: int, d: int, field: str = "layer.0.k") -> tuple[Fragment, ...]:
    link = plan.link(p, d)
    assert link is not None
    return next(f.fragments for f in link.fields if f.field_id == field)


def test_wire_p4_to_d1_with_two_kv_heads() -> None:
    plan = route(2, 4, 1)
    assert plan.targets(0) == (0, 2)
    assert plan.dummies == (1, 3)
    assert plan.contacts(0) == (0, 1, 2, 3)
    assert [plan.destinations(p) for p in range(4)] == [(0,), (), (0,), ()]
    assert [plan.is_dummy(p) for p in range(4)] == [False, True, False, True]
    assert [plan.preallocation_fanout(p) for p in range(4)] == [1, 1, 1, 1]
    assert plan.success_fanout(0) == 2
    # Head h of P rank 2h (local extent 1) lands at head h of D's page: 4 rows of 16 bytes.
    assert frags(plan, 2, 0) == (Fragment(4, 16, 0, 16, 16, 32),)
    assert plan.link(1, 0) is None


def test_wire_p2_to_d3_with_six_heads() -> None:
    plan = route(6, 2, 3)
    assert [plan.targets(d) for d in range(3)] == [(0,), (0, 1), (1,)]
    assert [plan.destinations(p) for p in range(2)] == [(0, 1), (1, 2)]
    assert plan.dummies == ()
    assert plan.contacts(0) == (0,)
    assert plan.contacts(1) == (0, 1)
    assert [plan.preallocation_fanout(p) for p in range(2)] == [2, 2]
    # P0 holds heads 0-2, P1 heads 3-5; D1 holds heads 2-3. inner = 8 · 2 = 16 bytes.
    assert frags(plan, 0, 1) == (Fragment(4, 16, 32, 0, 48, 32),)
    assert frags(plan, 1, 1) == (Fragment(4, 16, 0, 16, 48, 32),)
    assert frags(plan, 0, 0) == (Fragment(4, 32, 0, 0, 48, 32),)


def test_wire_p2_to_d3_replicated_latent() -> None:
    spec = ArenaSpec(
        layers=1, attention=AttentionKind.MLA, latent_dim=4, rope_dim=0, page_size=4, num_pages=4
    )
    plan = plan_routes(build_contract(spec), 2, build_contract(spec), 3)
    assert [plan.targets(d) for d in range(3)] == [(0,), (0,), (1,)]
    assert frags(plan, 1, 2, "layer.0.latent_kv") == (Fragment(1, 32, 0, 0, 32, 32),)


def test_wire_worked_example_fragments_and_copies() -> None:
    p = parse_contract(WIRE_EXAMPLE)
    d1 = build_contract(wire_spec(tp_size=1, num_pages=5))
    plan = plan_routes(p, 2, d1, 1)
    assert plan.targets(0) == (0, 1)
    for r in range(2):
        link = plan.link(r, 0)
        assert link is not None
        assert [f.field_id for f in link.fields] == [
            "layer.0.k",
            "layer.0.v",
            "layer.1.k",
            "layer.1.v",
        ]
        assert {f.fragments for f in link.fields} == {(Fragment(4, 32, 0, 32 * r, 32, 64),)}
        assert link.bytes_per_page("full_attention") == 4 * 128
    src = BlockManifest((GroupBlocks("full_attention", [2]),), 0, 4)
    dst = BlockManifest((GroupBlocks("full_attention", [5]),), 0, 4)
    copies = plan_copies(plan, 1, 0, src, dst, field_ids=["layer.0.k"])
    assert copies.src.tolist() == [256, 288, 320, 352]
    assert copies.dst.tolist() == [1312, 1376, 1440, 1504]
    assert copies.length.tolist() == [32] * 4
    d4 = build_contract(wire_spec(tp_size=4, num_pages=5))
    plan4 = plan_routes(p, 2, d4, 4)
    for d in range(4):
        assert plan4.targets(d) == (d // 2,)
        assert frags(plan4, d // 2, d) == (Fragment(4, 16, 16 * (d % 2), 0, 32, 16),)


def test_equal_tp_pairs_ranks_and_copies_whole_pages() -> None:
    plan = route(2, 8, 8)  # replicas on both sides, but equal TP wins (wire.md §6.1)
    assert plan.equal_tp
    assert sorted(plan.links) == [(r, r) for r in range(8)]
    assert all(plan.targets(d) == (d,) for d in range(8))
    assert frags(plan, 3, 3) == (Fragment(1, 64, 0, 0, 64, 64),)


def test_replica_groups_send_once() -> None:
    plan = route(2, 8, 2)  # P: 2 shards × 4 replicas; only ranks 0 and 4 send
    assert [plan.targets(d) for d in range(2)] == [(0,), (4,)]
    assert plan.dummies == (1, 2, 3, 5, 6, 7)
    assert plan.contacts(0) == (0, 1, 2, 3, 5, 6, 7)
    assert plan.contacts(1) == (4,)
    # P local extent 1 == D local extent 1 == the piece: the 4 token rows merge into one run.
    assert frags(plan, 4, 1) == (Fragment(1, 64, 0, 0, 64, 64),)
    fan_in = route(2, 1, 8)  # every D rank reads its head from the single P rank
    assert [fan_in.targets(d) for d in range(8)] == [(0,)] * 8
    assert fan_in.destinations(0) == tuple(range(8))
    assert frags(fan_in, 0, 5) == (Fragment(4, 16, 16, 0, 32, 16),)


def test_head_major_pages_make_one_run_per_page() -> None:
    plan = route(8, 4, 2, PageLayout.HND)
    # P: 2 heads × 4 tokens × 8 dims × 2 bytes = 128 bytes, one run into half of D's page.
    assert frags(plan, 1, 0) == (Fragment(1, 128, 0, 128, 128, 256),)
    assert route(8, 4, 2, PageLayout.NHD).link(1, 0) is not None
    assert frags(route(8, 4, 2), 1, 0) == (Fragment(4, 32, 0, 32, 32, 64),)


def test_partition_parts_are_sliced_part_by_part() -> None:
    state = StateSpec(
        layers=(0,),
        key_heads=2,
        value_heads=2,
        key_head_dim=1,
        value_head_dim=2,
        conv_width=1,
        conv_dtype="int32",
        ssm_dtype="int64",  # an ssm page at least as large as a conv page (as in Qwen3.5)
    )
    # Layer 0 is GDN state, layer 1 full attention (a hybrid needs one).
    spec = ArenaSpec(
        layers=2, kv_heads=2, head_dim=1, page_size=4, state=state, num_pages=4, page_alignment=1
    )
    p2 = build_contract(dataclasses.replace(spec, tp_size=2))
    plan = plan_routes(p2, 2, build_contract(spec), 1)
    # conv: parts [Kw=2, Kw=2, Vw=4]; P rank r holds [1, 1, 2] rows of each, D holds all.
    assert frags(plan, 1, 0, "layer.0.conv") == (
        Fragment(1, 4, 0, 4, 16, 32),
        Fragment(1, 4, 4, 12, 16, 32),
        Fragment(1, 8, 8, 24, 16, 32),
    )


def test_route_rejections() -> None:
    c = gqa(2, 1)
    for bad in (0, 1025, True):
        with pytest.raises(RouteError, match=r"TP size must be 1\.\.1024"):
            plan_routes(c, bad, c, 1)  # type: ignore[arg-type]
    with pytest.raises(ContractMismatch, match=r"dtype: bfloat16 vs float16 \(P vs D\)"):
        plan_routes(c, 1, gqa(2, 1, dtype="float16"), 1)
    # A D contract sharded 2 ways (local extent 1 of 2 heads) cannot run at TP 3.
    with pytest.raises(
        RouteError,
        match=r"D field layer\.0\.k cannot map global extent 2 and local extent 1 to TP=3: "
        r"that makes 2 distinct shards",
    ):
        plan_routes(c, 1, gqa(2, 2), 3)
    plan = route(2, 2, 1)
    with pytest.raises(RouteError, match=r"P rank 2 is outside 0..1"):
        plan.destinations(2)
    with pytest.raises(RouteError, match=r"D rank -1 is outside 0..0"):
        plan.targets(-1)
    with pytest.raises(RouteError, match="outside"):
        plan.link(0, 1)


def test_equal_tp_still_needs_a_real_split() -> None:
    """8 KV heads at TP 3 (a rank holding 2 of them, as TokenSpeed's recipe builds it): no
    deployment of TP 3 holds that contract, so TP 3 → TP 3 is refused like TokenSpeed does,
    although rank r ↔ rank r would copy whole pages."""
    two_of_eight = gqa(8, 4)  # local extent 2 of 8: what TokenSpeed builds at TP 3 too
    reason = r"cannot map global extent 8 and local extent 2 to TP=3"
    with pytest.raises(RouteError, match=r"P field layer\.0\.k " + reason):
        plan_routes(two_of_eight, 3, two_of_eight, 3)
    assert plan_routes(two_of_eight, 4, two_of_eight, 4).targets(3) == (3,)


def test_group_without_policy_cannot_be_routed() -> None:
    c = gqa(2, 1)
    off = dataclasses.replace(
        c, group_specs=(dataclasses.replace(c.group_specs[0], transfer_policy=None),)
    )
    with pytest.raises(RouteError, match="no transfer_policy: PD transfer is off"):
        plan_routes(off, 1, off, 1)


def test_prefill_dp_group() -> None:
    assert [prefill_dp_group(room, 4) for room in (0, 5, 2**63 - 1)] == [0, 1, 3]
    with pytest.raises(RouteError, match=r"room must be an integer in 0\.\.2\*\*63-1"):
        prefill_dp_group(2**63, 4)
    with pytest.raises(RouteError, match="prefill_dp_size must be ≥ 1"):
        prefill_dp_group(1, 0)


def test_routes_are_shared_per_geometry_but_complete() -> None:
    c = build_contract(ArenaSpec(layers=61, attention=AttentionKind.MLA, page_size=64, num_pages=2))
    plan = plan_routes(c, 8, c, 2)
    assert [plan.targets(d) for d in range(2)] == [(0,), (4,)]
    assert plan.dummies == (1, 2, 3, 5, 6, 7)
    link = plan.link(4, 1)
    assert link is not None
    assert len(link.fields) == 61  # one latent row (512 + 64) per token and layer
    assert link.bytes_per_page("full_attention") == 61 * 64 * 576 * 2
    page = 64 * 576 * 2
    assert all(f.fragments == (Fragment(1, page, 0, 0, page, page),) for f in link.fields)
