"""The identity-tagged arena oracle: global tags, re-slicing consistency, exact checks."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.layout import ArenaSpec, PageLayout, build_contract
from tspd_testing.identity import (
    RankView,
    check_identity,
    fill_identity,
    identity_pages,
    page_mask,
)


def _view(tp: int, rank: int, layout: PageLayout = PageLayout.HND) -> RankView:
    spec = ArenaSpec(
        layers=2,
        kv_heads=4,
        head_dim=8,
        page_size=4,
        tp_size=tp,
        tp_rank=rank,
        num_pages=6,
        page_layout=layout,
    )
    contract = build_contract(spec)
    return RankView(np.zeros(contract.plan.arena_bytes, np.uint8), contract, tp, rank)


@pytest.mark.parametrize("layout", [PageLayout.HND, PageLayout.NHD])
def test_tp2_shards_concatenate_to_the_tp1_page(layout: PageLayout) -> None:
    whole = _view(1, 0, layout)
    halves = [_view(2, r, layout) for r in range(2)]
    axis = whole.contract.partition("layer.1.v")
    assert axis is not None
    got = np.concatenate(
        [identity_pages(h, "layer.1.v", [3, 5], salt=9) for h in halves], axis=1 + axis.axis
    )
    assert np.array_equal(got, identity_pages(whole, "layer.1.v", [3, 5], salt=9))


def test_tags_differ_across_fields_slots_and_salts() -> None:
    v = _view(1, 0)
    a = identity_pages(v, "layer.0.k", [1], 1)
    assert not np.array_equal(a, identity_pages(v, "layer.0.v", [1], 1))
    assert not np.array_equal(a, identity_pages(v, "layer.0.k", [2], 1))
    assert not np.array_equal(a, identity_pages(v, "layer.0.k", [1], 2))
    assert len(np.unique(a)) > a.size * 0.9  # tags inside one page are (nearly) all distinct


def test_fill_then_check_and_detect_a_single_corrupt_byte() -> None:
    v = _view(2, 1)
    fill_identity(v, {"full_attention": [0, 4, 2, 6]}, salt=5)  # slot 0 unused (page 0)
    assert check_identity(v, "full_attention", [1, 2, 3], [4, 2, 6], 5) == []
    f = v.contract.field("layer.1.k")
    v.arena[v.contract.page_offset("layer.1.k", 2) + f.payload_bytes - 1] ^= 0xFF
    problems = check_identity(v, "full_attention", [1, 2, 3], [4, 2, 6], 5)
    assert problems == ["layer.1.k slot 2 page 2: 1 of 64 elements differ"]


def test_page_mask_covers_exactly_the_field_payloads() -> None:
    v = _view(1, 0)
    mask = page_mask(v.contract, {"full_attention": [2, 5]})
    per_page = sum(f.payload_bytes for f in v.contract.fields_for_group("full_attention"))
    assert int(mask.sum()) == 2 * per_page
    fill_identity(v, {"full_attention": [0, 0, 2, 0, 0, 5]}, salt=1)
    assert not v.arena[~mask].any()
