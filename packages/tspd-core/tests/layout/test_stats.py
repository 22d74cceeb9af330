"""transfer_stats counts exactly what plan_copies builds, without building it."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_testkit import draw_case

from tspd_core.layout.copies import plan_copies
from tspd_core.layout.manifest import BlockManifest, GroupBlocks, chunk_positions
from tspd_core.layout.models import llama3_8b
from tspd_core.layout.recipe import PageLayout, PlaneArrangement, build_contract
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.layout.stats import (
    PairCounter,
    TransferStats,
    link_profile,
    route_stats,
    transfer_stats,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_stats_equal_the_materialized_plan(data: st.DataObject) -> None:
    route, src, dst = draw_case(data)
    layers = data.draw(st.none() | st.tuples(st.integers(0, 2), st.integers(2, 4)))
    first = data.draw(st.integers(0, src.prompt_len - 1))
    end = data.draw(st.integers(first + 1, src.prompt_len))
    positions = data.draw(
        st.none() | st.just(chunk_positions(route.p_contract, src, first, end, first=True))
    )
    every = route_stats(route, src, dst, layers=layers, positions=positions)
    assert set(every) == set(route.links)
    for p in range(route.p_tp):
        for d in range(route.d_tp):
            copies = plan_copies(route, p, d, src, dst, layers=layers, positions=positions)
            stats = transfer_stats(route, p, d, src, dst, layers=layers, positions=positions)
            assert stats == TransferStats(copies.nbytes, len(copies), copies.raw_count)
            if (p, d) in every:
                assert every[(p, d)] == stats


def _llama(p: int, d: int, arrangement: PlaneArrangement) -> RoutePlan:
    base = llama3_8b(num_pages=4096, page_layout=PageLayout.HND, arrangement=arrangement)
    pc = build_contract(dataclasses.replace(base, tp_size=p))
    dc = build_contract(dataclasses.replace(base, tp_size=d))
    return plan_routes(pc, p, dc, d)


def _manifests(src: np.ndarray, dst: np.ndarray) -> tuple[BlockManifest, BlockManifest]:
    prompt = 16 * src.size
    group = "full_attention"
    return (
        BlockManifest((GroupBlocks(group, src),), 0, prompt),
        BlockManifest((GroupBlocks(group, dst),), 0, prompt),
    )


def test_llama_8b_4k_prompt_numbers() -> None:
    """4,096 tokens of Llama-3-8B (256 pages of 16 tokens, 2 MiB each) from P TP 4 to D TP 2."""
    route = _llama(4, 2, PlaneArrangement.PER_FIELD)
    rng = np.random.default_rng(7)
    contiguous = _manifests(np.arange(1, 257), np.arange(1001, 1257))
    scattered = _manifests(rng.permutation(4096)[:256] + 1, rng.permutation(4096)[:256] + 1)
    assert route.targets(0) == (0, 1)
    for src, dst in (contiguous, scattered):
        stats = transfer_stats(route, 1, 0, src, dst)
        # Each P rank holds 2 of D's 4 heads: half of D's 1 MiB of K/V per page over 64 fields.
        assert stats.nbytes == 256 * 64 * 2 * 16 * 128 * 2
        assert stats.raw_descriptors == 256 * 64
    assert transfer_stats(route, 1, 0, *contiguous).descriptors == 256 * 64
    equal = _llama(2, 2, PlaneArrangement.PER_FIELD)
    assert transfer_stats(equal, 0, 0, *contiguous).descriptors == 64
    assert transfer_stats(equal, 0, 0, *scattered).descriptors == 256 * 64
    page_major = _llama(2, 2, PlaneArrangement.PAGE_MAJOR)
    assert transfer_stats(page_major, 0, 0, *contiguous).descriptors == 1
    assert transfer_stats(page_major, 0, 0, *scattered).descriptors == 256


def test_profile_is_cached_and_counts_offsets() -> None:
    route = _llama(2, 2, PlaneArrangement.PAGE_MAJOR)
    profile = link_profile(route, 1, 1)
    assert profile is link_profile(route, 1, 1)
    (group,) = profile.groups
    # 64 fields side by side (63 in-page joins), and the last field joins the next page's first.
    assert group.deltas == ((0, 0, 63), (1, 1, 1))
    assert group.bytes_per_page == 64 * 4 * 16 * 128 * 2
    # Page ids beyond 2**31 take the slow, exact path.
    big = np.array([2**40, 2**40 + 1, 7], dtype=np.int64)
    stats = profile.stats([big], [big + 5])
    assert stats == TransferStats(3 * group.bytes_per_page, 3 * 64 - 63 * 3 - 1, 3 * 64)


def test_offsets_no_page_pair_can_reach_are_pruned() -> None:
    route = _llama(1, 1, PlaneArrangement.PER_FIELD)
    (group,) = link_profile(route, 0, 0).groups
    # Per-field planes of 4,096 pages: each page's field joins the next page's (64 joins at
    # δ = 1); a plane's last page would join the next plane's first at δ = -4096, but block
    # ids lie in 1 .. 4096, so no two differ by 4,096: that offset is not in the profile.
    assert group.deltas == ((1, 1, 64),)
    # Per request: offsets wider than the ids' spread count 0 without a search.
    counter = PairCounter(np.array([5, 6, 9, 4000]), np.array([3, 4, 8, 2]))
    assert counter.pairs(-3999, -3999) == 0
    assert counter._keys is None  # pruned: no key table was sorted, nothing searched
    assert counter.pairs(1, 1) == 1  # 5 -> 6 on P, 3 -> 4 on D
    assert counter.pairs(3, 4) == 1  # 6 -> 9, 4 -> 8: within the spread, searched
    assert counter._keys is not None
    assert PairCounter(np.array([4000, 1]), np.array([4000, 1])).pairs(-3999, -3999) == 1
    src, dst = _manifests(np.array([4096, 1]), np.array([4096, 1]))
    stats = transfer_stats(route, 0, 0, src, dst)
    assert stats.descriptors == len(plan_copies(route, 0, 0, src, dst)) == 2 * 64
