"""Strided runs: the same bytes as the coalescing planner, a run per fragment and page at most."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_testkit import draw_case

from tspd_core.layout.copies import Copies, plan_copies
from tspd_core.layout.errors import LayoutError
from tspd_core.layout.manifest import BlockManifest, GroupBlocks, build_manifest, chunk_positions
from tspd_core.layout.models import deepseek_v3, llama3_8b
from tspd_core.layout.recipe import ArenaSpec, PageLayout, PlaneArrangement, build_contract
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.layout.strided import Runs, plan_one_page, plan_runs

G = "full_attention"
I64 = np.int64


def _route(
    p: int,
    d: int,
    *,
    layout: PageLayout = PageLayout.NHD,
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD,
    heads: int = 4,
    layers: int = 2,
) -> RoutePlan:
    spec = ArenaSpec(
        layers=layers,
        kv_heads=heads,
        head_dim=2,
        dtype="bfloat16",
        page_size=4,
        page_layout=layout,
        arrangement=arrangement,
        num_pages=16,
    )
    pc = build_contract(dataclasses.replace(spec, tp_size=p))
    dc = build_contract(dataclasses.replace(spec, tp_size=d, num_pages=20))
    return plan_routes(pc, p, dc, d)


def _manifests(src: list[int], dst: list[int], prefix: int = 0) -> tuple[BlockManifest, ...]:
    prompt = prefix + 4 * len(src)
    return (
        BlockManifest((GroupBlocks(G, np.array(src)),), prefix, prompt),
        BlockManifest((GroupBlocks(G, np.array(dst)),), prefix, prompt),
    )


def byte_map(copies: Copies, dst_size: int) -> np.ndarray:
    """For every destination byte, the source byte written to it (−1: none); each
    destination byte is written at most once."""
    out = np.full(dst_size, -1, dtype=np.int64)
    for s, t, n in zip(
        copies.src.tolist(), copies.dst.tolist(), copies.length.tolist(), strict=True
    ):
        assert n > 0
        assert (out[t : t + n] == -1).all(), f"destination byte {t} written twice"
        out[t : t + n] = np.arange(s, s + n)
    return out


def _same_bytes(route: RoutePlan, runs: Runs, copies: Copies) -> None:
    size = route.d_contract.plan.arena_bytes
    expanded = runs.expand()
    assert np.array_equal(byte_map(expanded, size), byte_map(copies, size))
    assert (runs.nbytes, runs.raw_count) == (copies.nbytes, copies.raw_count)
    assert (expanded.nbytes, len(expanded), expanded.raw_count) == (
        runs.nbytes,
        runs.pieces,
        runs.raw_count,
    )


def test_nhd_head_slice_on_contiguous_pages_is_one_run_per_field() -> None:
    route = _route(4, 2)  # P rank 0 holds head 0 of D rank 0's heads 0-1
    runs = plan_runs(route, 0, 0, *_manifests([3, 4, 5], [7, 8, 9]))
    head = 2 * 2  # one head × dim 2 × bfloat16
    field_page = 4 * 2 * head  # D pages hold 2 heads × 4 tokens
    assert len(runs) == 4  # k and v of 2 layers
    assert runs.length.tolist() == [head] * 4
    assert runs.count.tolist() == [3 * 4] * 4  # 3 pages × 4 tokens
    assert runs.src_step.tolist() == [head] * 4
    assert runs.dst_step.tolist() == [2 * head] * 4
    assert runs.dst[0] == route.d_contract.page_offset("layer.0.k", 7)
    assert runs.src[0] == route.p_contract.page_offset("layer.0.k", 3)
    assert runs.raw_count == 3 * 4 * 4 == runs.pieces
    assert runs.nbytes == 3 * 4 * field_page // 2
    _same_bytes(route, runs, plan_copies(route, 0, 0, *_manifests([3, 4, 5], [7, 8, 9])))


def test_nhd_scattered_pages_are_one_run_per_field_page() -> None:
    route = _route(4, 2)
    src, dst = _manifests([9, 2, 6], [1, 5, 3])
    runs = plan_runs(route, 1, 0, src, dst)
    assert len(runs) == 4 * 3
    assert runs.count.tolist() == [4] * 12
    _same_bytes(route, runs, plan_copies(route, 1, 0, src, dst))


def test_page_major_nhd_chains_fields_and_pages_into_one_run() -> None:
    """P's k then v rows are contiguous, and on D each field's rows end where the next
    field's begin: the whole link is one strided run."""
    route = _route(2, 1, arrangement=PlaneArrangement.PAGE_MAJOR)
    src, dst = _manifests([3, 4, 5], [7, 8, 9])
    runs = plan_runs(route, 0, 0, src, dst)
    assert (len(runs), runs.pieces) == (1, 3 * 4 * 4)
    _same_bytes(route, runs, plan_copies(route, 0, 0, src, dst))


def test_groups_without_strided_fragments_match_the_coalescing_planner_exactly() -> None:
    for route in (_route(2, 2), _route(4, 2, layout=PageLayout.HND)):
        src, dst = _manifests([9, 2, 6], [1, 5, 3])
        copies, runs = plan_copies(route, 0, 0, src, dst), plan_runs(route, 0, 0, src, dst)
        assert not runs.strided
        assert runs.count.tolist() == [1] * len(copies)
        got = (runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), runs.raw_count)
        assert got == (
            copies.src.tolist(),
            copies.dst.tolist(),
            copies.length.tolist(),
            copies.raw_count,
        )
        assert runs.src_step.tolist() == runs.length.tolist() == runs.dst_step.tolist()


def test_expand_enumerates_every_piece_in_order() -> None:
    a = np.array
    runs = Runs(
        a([0, 100], I64), a([50, 500], I64), a([4, 8], I64), a([3, 1], I64),
        a([4, 8], I64), a([10, 8], I64), 4,
    )  # fmt: skip
    out = runs.expand()
    assert (out.src.tolist(), out.dst.tolist(), out.length.tolist()) == (
        [0, 4, 8, 100],
        [50, 60, 70, 500],
        [4, 4, 4, 8],
    )
    assert (runs.pieces, runs.nbytes, out.raw_count) == (4, 20, 4)
    part = runs.take(1, 2)
    assert (part.src.tolist(), part.raw_count) == ([100], 1)


def test_selections_and_errors_follow_plan_copies() -> None:
    route = _route(4, 2, layers=3)
    src, dst = _manifests([1, 2, 3], [4, 5, 6])
    full = plan_runs(route, 0, 0, src, dst)
    by_layer = plan_runs(route, 0, 0, src, dst, layers=(1, 2))
    by_field = plan_runs(route, 0, 0, src, dst, field_ids={"layer.1.k", "layer.1.v"})
    assert by_layer.nbytes == by_field.nbytes == full.nbytes // 3
    _same_bytes(route, by_layer, plan_copies(route, 0, 0, src, dst, layers=(1, 2)))
    positions = chunk_positions(route.d_contract, dst, 4, 8, first=False)
    chunk = plan_runs(route, 0, 0, src, dst, positions=positions)
    assert (len(chunk), chunk.pieces) == (6, 6 * 4)
    assert len(plan_runs(route, 2, 0, src, dst)) == 0  # P rank 2 feeds D rank 1 only
    with pytest.raises(LayoutError, match="does not have"):
        plan_runs(route, 0, 0, src, dst, field_ids=["layer.7.k"])
    with pytest.raises(LayoutError, match="half-open"):
        plan_runs(route, 0, 0, src, dst, layers=(2, 1))


CASES = [(4, 1, 4), (1, 2, 2), (2, 3, 6), (3, 2, 6), (8, 2, 8), (2, 4, 4)]


@pytest.mark.parametrize("layout", list(PageLayout))
@pytest.mark.parametrize("arrangement", list(PlaneArrangement))
@pytest.mark.parametrize(("p", "d", "heads"), CASES)
def test_every_layout_moves_the_same_bytes_as_plan_copies(
    p: int,
    d: int,
    heads: int,
    layout: PageLayout,
    arrangement: PlaneArrangement,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As planned, and with the fast paths off (every fragment and page built, chained):
    the same bytes, and the same runs."""
    import tspd_core.layout.strided as strided

    route = _route(p, d, layout=layout, arrangement=arrangement, heads=heads, layers=3)
    cases = [_manifests(*ids) for ids in ((SCATTERED_SRC, SCATTERED_DST), ([1, 2, 3], [4, 5, 6]))]
    planned = {}
    for i, (src, dst) in enumerate(cases):
        for link in route.links:
            runs = plan_runs(route, *link, src, dst)
            _same_bytes(route, runs, plan_copies(route, *link, src, dst))
            assert len(runs) <= len(plan_copies(route, *link, src, dst))
            planned[i, link] = runs
    monkeypatch.setattr(strided, "_by_page_steps", lambda t, s, d: None)
    monkeypatch.setattr(strided, "_one_run_per_page", lambda t, alike: None)
    route.cache.clear()
    for i, (src, dst) in enumerate(cases):
        for link in route.links:
            slow, fast = plan_runs(route, *link, src, dst), planned[i, link]
            _same_bytes(route, slow, plan_copies(route, *link, src, dst))
            assert _columns(slow) == _columns(fast)


SCATTERED_SRC, SCATTERED_DST = [3, 4, 5, 11, 1, 2], [7, 8, 9, 10, 2, 1]


def _columns(runs: Runs) -> list[list[int]]:
    cols = (runs.src, runs.dst, runs.length, runs.count, runs.src_step, runs.dst_step)
    return [c.tolist() for c in cols]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_cases_move_the_same_bytes_as_plan_copies(data: st.DataObject) -> None:
    route, src, dst = draw_case(data)
    layers = data.draw(st.none() | st.tuples(st.integers(0, 2), st.integers(2, 4)))
    for p, d in route.links:
        runs = plan_runs(route, p, d, src, dst, layers=layers)
        _same_bytes(route, runs, plan_copies(route, p, d, src, dst, layers=layers))


@pytest.mark.parametrize(
    ("model", "p_tp", "d_tp", "overrides"),
    [(llama3_8b, 2, 1, {}), (llama3_8b, 4, 2, {}), (llama3_8b, 3, 1, {"kv_heads": 6}),
     (llama3_8b, 1, 2, {"page_layout": PageLayout.HND}), (deepseek_v3, 2, 1, {})],
)  # fmt: skip
def test_a_one_page_plan_is_what_the_copy_planner_plans_for_one_token(
    model: Any, p_tp: int, d_tp: int, overrides: dict[str, Any]
) -> None:
    """The planner's warm-up at a D rank's registration plans what a one-token room would
    move, for every pair of ranks that exchange bytes (it raised on none of these layouts)."""
    p = [build_contract(model(p_tp, r, num_pages=4, **overrides)) for r in range(p_tp)]
    d = [build_contract(model(d_tp, r, num_pages=4, **overrides)) for r in range(d_tp)]
    route = plan_routes(p[0], p_tp, d[0], d_tp)
    for d_rank in range(d_tp):
        for p_rank in route.targets(d_rank):
            src = build_manifest(p[p_rank], {g.group_id: [1] for g in p[p_rank].group_specs}, 0, 1)
            dst = build_manifest(d[d_rank], {g.group_id: [1] for g in d[d_rank].group_specs}, 0, 1)
            want = len(plan_copies(route, p_rank, d_rank, src, dst))
            assert want > 0
            assert plan_one_page(route, p[p_rank], p_rank, d[d_rank], d_rank) == want
