"""Copy descriptors: coalescing, selections, batches, the per-page oracle, coverage, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_testkit import draw_case, naive_copies

from tspd_core.layout.copies import Copies, iter_batches, plan_copies
from tspd_core.layout.errors import LayoutError, ManifestError, RouteError
from tspd_core.layout.manifest import BlockManifest, GroupBlocks, chunk_positions
from tspd_core.layout.recipe import ArenaSpec, PageLayout, PlaneArrangement, build_contract
from tspd_core.layout.routes import RoutePlan, plan_routes

G = "full_attention"
PAGE = 4 * 4 * 2 * 4  # 4 heads × 4 tokens × dim 2 × float32 = 128 bytes per field page


def plan(
    p: int,
    d: int,
    arrangement: PlaneArrangement,
    layout: PageLayout = PageLayout.HND,
    layers: int = 2,
) -> RoutePlan:
    spec = ArenaSpec(
        layers=layers,
        kv_heads=4,
        head_dim=2,
        dtype="float32",
        page_size=4,
        page_layout=layout,
        arrangement=arrangement,
        num_pages=16,
    )
    pc = build_contract(dataclasses.replace(spec, tp_size=p))
    dc = build_contract(dataclasses.replace(spec, tp_size=d, num_pages=20))
    return plan_routes(pc, p, dc, d)


def manifests(src: list[int], dst: list[int], prefix: int = 0) -> tuple[BlockManifest, ...]:
    prompt = prefix + 4 * len(src)
    return (
        BlockManifest((GroupBlocks(G, np.array(src)),), prefix, prompt),
        BlockManifest((GroupBlocks(G, np.array(dst)),), prefix, prompt),
    )


def test_page_major_equal_tp_contiguous_pages_become_one_descriptor() -> None:
    route = plan(1, 1, PlaneArrangement.PAGE_MAJOR)
    copies = plan_copies(route, 0, 0, *manifests([3, 4, 5], [7, 8, 9]))
    assert copies.raw_count == 3 * 4  # 3 pages × 4 fields
    assert copies.src.tolist() == [route.p_contract.page_offset("layer.0.k", 3)]
    assert copies.dst.tolist() == [route.d_contract.page_offset("layer.0.k", 7)]
    assert copies.length.tolist() == [3 * 4 * PAGE]


def test_page_major_fragmented_pages_still_send_whole_pages() -> None:
    route = plan(1, 1, PlaneArrangement.PAGE_MAJOR)
    copies = plan_copies(route, 0, 0, *manifests([9, 2, 6], [1, 5, 3]))
    assert copies.length.tolist() == [4 * PAGE] * 3  # one run per page: 4 fields merged
    pc, dc = route.p_contract, route.d_contract
    assert copies.src.tolist() == [pc.page_offset("layer.0.k", p) for p in (2, 6, 9)]
    assert copies.dst.tolist() == [dc.page_offset("layer.0.k", p) for p in (5, 3, 1)]


def test_per_field_planes_merge_across_pages_in_any_manifest_order() -> None:
    route = plan(1, 1, PlaneArrangement.PER_FIELD)
    copies = plan_copies(route, 0, 0, *manifests([5, 3, 4], [9, 7, 8]))
    assert copies.raw_count == 12
    assert copies.length.tolist() == [3 * PAGE] * 4
    pc = route.p_contract
    firsts = sorted(pc.page_offset(f.field_id, 3) for f in pc.plan.fields)
    assert sorted(copies.src.tolist()) == firsts
    broken = plan_copies(route, 0, 0, *manifests([5, 3, 4], [9, 8, 7]))
    assert len(broken) == 12  # destination runs backwards: nothing merges


def test_unequal_tp_head_major_slices_do_not_merge_across_pages() -> None:
    route = plan(2, 1, PlaneArrangement.PER_FIELD)
    copies = plan_copies(route, 1, 0, *manifests([1, 2], [1, 2]))
    # P rank 1's 2 heads fill the second half of each D page: one run per page and field.
    assert copies.length.tolist() == [PAGE // 2] * 8
    dc = route.d_contract
    want = [dc.page_offset("layer.0.k", p) + PAGE // 2 for p in (1, 2)]
    assert copies.dst[:2].tolist() == want


def test_selections_layers_fields_positions() -> None:
    route = plan(1, 1, PlaneArrangement.PER_FIELD, layers=3)
    src, dst = manifests([4, 5, 6, 7], [1, 2, 3, 9], prefix=8)
    full = plan_copies(route, 0, 0, src, dst)
    by_layer = plan_copies(route, 0, 0, src, dst, layers=(1, 2))
    by_field = plan_copies(route, 0, 0, src, dst, field_ids={"layer.1.k", "layer.1.v"})
    assert by_layer.src.tolist() == by_field.src.tolist()
    assert by_layer.nbytes == 2 * 4 * PAGE
    assert plan_copies(route, 0, 0, src, dst, layers=(3, 9)).raw_count == 0
    chunks = [
        plan_copies(
            route,
            0,
            0,
            src,
            dst,
            positions=chunk_positions(route.p_contract, src, lo, hi, first=lo == 8),
        )
        for lo, hi in ((8, 13), (13, 20), (20, 24))
    ]
    # 6 fields; slots 2..5 are in the manifest. Tokens [8, 13) complete slot 2, [13, 20)
    # slots 3 and 4, and the final chunk the ragged slot 5.
    assert [c.raw_count for c in chunks] == [6, 12, 6]
    assert sum(c.nbytes for c in chunks) == full.nbytes
    pieces = {(s, d) for c in chunks for s, d in zip(c.src.tolist(), c.dst.tolist(), strict=True)}
    assert len(pieces) == sum(len(c) for c in chunks)


def test_batches_and_absolute_addresses() -> None:
    route = plan(2, 1, PlaneArrangement.PER_FIELD, PageLayout.NHD)
    copies = plan_copies(route, 0, 0, *manifests([1, 3, 5], [2, 4, 6]))
    assert len(copies) == 3 * 4 * 4  # token rows of 16 bytes never merge here
    batches = list(iter_batches(copies, 20))
    assert [(len(b), b.raw_count) for b in batches] == [(20, 20), (20, 20), (8, 8)]
    assert np.concatenate([b.src for b in batches]).tolist() == copies.src.tolist()
    assert sum(b.nbytes for b in batches) == copies.nbytes == 48 * 16
    src, dst, length = copies.absolute(1 << 40, 1 << 41)
    assert (src - copies.src == 1 << 40).all()
    assert (dst - copies.dst == 1 << 41).all()
    assert length is copies.length
    with pytest.raises(LayoutError, match="max_descriptors must be ≥ 1"):
        list(iter_batches(copies, 0))


def test_dummy_ranks_and_unserved_pairs_copy_nothing() -> None:
    spec = ArenaSpec(
        layers=1, kv_heads=2, head_dim=2, page_size=4, num_pages=8, page_layout=PageLayout.HND
    )
    p4 = build_contract(dataclasses.replace(spec, tp_size=4))
    route = plan_routes(p4, 4, build_contract(spec), 1)
    src, dst = manifests([1], [2])
    empty = plan_copies(route, 1, 0, src, dst)
    assert (len(empty), empty.nbytes, empty.raw_count) == (0, 0, 0)
    assert len(plan_copies(route, 2, 0, src, dst)) == 2  # k and v, one head each


def test_copy_rejections() -> None:
    route = plan(1, 1, PlaneArrangement.PER_FIELD)
    src, dst = manifests([1, 2], [3, 4])
    with pytest.raises(ManifestError, match="differ from the destination's"):
        plan_copies(route, 0, 0, src, manifests([1, 2], [4, 5], prefix=4)[1])
    with pytest.raises(ManifestError, match="appears at positions 0 and 1"):
        plan_copies(route, 0, 0, *manifests([1, 1], [3, 4]))
    with pytest.raises(ManifestError, match=r"block id 21 at position 1 is outside 1\.\.20"):
        plan_copies(route, 0, 0, *manifests([1, 2], [3, 21]))
    with pytest.raises(LayoutError, match=r"must name every group exactly: missing \['full"):
        plan_copies(route, 0, 0, src, dst, positions={})
    with pytest.raises(LayoutError, match=r"positions\['full_attention'\] = \(1, 3\) is outside"):
        plan_copies(route, 0, 0, src, dst, positions={G: (1, 3)})
    with pytest.raises(LayoutError, match=r"does not have: \['layer\.5\.k'\]"):
        plan_copies(route, 0, 0, src, dst, field_ids=["layer.5.k"])
    with pytest.raises(LayoutError, match="not one string"):
        plan_copies(route, 0, 0, src, dst, field_ids="layer.0.k")
    with pytest.raises(LayoutError, match="half-open interval"):
        plan_copies(route, 0, 0, src, dst, layers=(2, 1))
    with pytest.raises(RouteError, match=r"P rank 1 is outside 0\.\.0"):
        plan_copies(route, 1, 0, src, dst)


def _as_list(c: Copies) -> list[tuple[int, int, int]]:
    return list(zip(c.src.tolist(), c.dst.tolist(), c.length.tolist(), strict=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_numpy_plan_equals_per_page_oracle(data: st.DataObject) -> None:
    import tspd_core.layout.copies as copies_module

    route, src, dst = draw_case(data)
    layers = data.draw(st.none() | st.tuples(st.integers(0, 2), st.integers(2, 4)))
    few = copies_module.FEW_DESCRIPTORS
    try:
        for limit in (few, 0):  # the drawn cases are small: once in Python, once in numpy
            copies_module.FEW_DESCRIPTORS = limit
            for p, d in route.links:
                got = plan_copies(route, p, d, src, dst, layers=layers)
                want, raw = naive_copies(route, p, d, src, dst, layers=layers)
                assert got.raw_count == raw
                assert sorted(_as_list(got)) == sorted(want)
    finally:
        copies_module.FEW_DESCRIPTORS = few


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_destination_byte_is_written_exactly_once(data: st.DataObject) -> None:
    route, src, dst = draw_case(data)
    pc, dc = route.p_contract, route.d_contract
    readable = np.zeros(pc.plan.arena_bytes, dtype=bool)
    for f in pc.plan.fields:
        for page in src.block_ids(f.group_id).tolist():
            lo = pc.page_offset(f.field_id, page)
            readable[lo : lo + f.payload_bytes] = True
    wanted = np.zeros(dc.plan.arena_bytes, dtype=np.int64)
    for f in dc.plan.fields:
        for page in dst.block_ids(f.group_id).tolist():
            lo = dc.page_offset(f.field_id, page)
            wanted[lo : lo + f.payload_bytes] = 1
    for d in range(route.d_tp):
        written = np.zeros(dc.plan.arena_bytes, dtype=np.int64)
        for p in range(route.p_tp):
            read = np.zeros(pc.plan.arena_bytes, dtype=np.int64)
            for s, t, n in _as_list(plan_copies(route, p, d, src, dst)):
                assert s + n <= readable.size
                assert readable[s : s + n].all(), "read outside the source pages"
                read[s : s + n] += 1
                written[t : t + n] += 1
            assert read.max(initial=0) <= 1, "a source byte was sent twice to one D rank"
        assert np.array_equal(written, wanted), f"D rank {d}: coverage differs"


CASES = [(4, 1, 4), (1, 2, 2), (2, 3, 6), (3, 2, 6), (8, 2, 8)]


def _paths_case(
    p: int, d: int, heads: int, layout: PageLayout, arrangement: PlaneArrangement
) -> tuple[RoutePlan, BlockManifest, BlockManifest]:
    spec = ArenaSpec(
        layers=3,
        kv_heads=heads,
        head_dim=2,
        dtype="bfloat16",
        page_size=4,
        page_layout=layout,
        arrangement=arrangement,
        num_pages=12,
    )
    pc = build_contract(dataclasses.replace(spec, tp_size=p))
    dc = build_contract(dataclasses.replace(spec, tp_size=d, num_pages=14))
    src, dst = manifests([3, 4, 5, 11, 1, 2], [7, 8, 9, 10, 2, 1], prefix=4)
    return plan_routes(pc, p, dc, d), src, dst


@pytest.mark.parametrize("layout", list(PageLayout))
@pytest.mark.parametrize("arrangement", list(PlaneArrangement))
@pytest.mark.parametrize(("p", "d", "heads"), CASES)
def test_every_layout_path_matches_the_oracle(
    p: int,
    d: int,
    heads: int,
    layout: PageLayout,
    arrangement: PlaneArrangement,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Token-major per-field arenas take the blocked path; page-major and head-major ones the
    two vectorized paths; a few descriptors the Python path; forcing the generic
    sort-and-merge fallback gives the same result."""
    import tspd_core.layout.copies as copies_module

    route, src, dst = _paths_case(p, d, heads, layout, arrangement)
    expected = {link: naive_copies(route, *link, src, dst) for link in route.links}
    for few in (copies_module.FEW_DESCRIPTORS, 10**9, 0):  # as is, all Python, all numpy
        monkeypatch.setattr(copies_module, "FEW_DESCRIPTORS", few)
        for link, (want, raw) in expected.items():
            got = plan_copies(route, *link, src, dst)
            assert (sorted(_as_list(got)), got.raw_count) == (sorted(want), raw)
    monkeypatch.setattr(copies_module, "_row_major_sorted", lambda rows, s: False)
    monkeypatch.setattr(copies_module, "_page_major_sorted", lambda rows: False)
    monkeypatch.setattr(copies_module, "_plane_blocks", lambda rows, s: None)
    for link, (want, raw) in expected.items():
        got = plan_copies(route, *link, src, dst)
        assert (sorted(_as_list(got)), got.raw_count) == (sorted(want), raw)
