"""D's zeroing of a manifest's pages before it is published (``decode.peer._FieldPages``).

Every field's payload of every listed page of every group becomes zero, and not one byte
besides: checked against a field-by-field, page-by-page mask over an arena of noise, on a
hybrid contract (full attention, sliding window, state: three groups of different fields).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.manifest import BlockManifest, build_manifest
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
    build_contract,
)
from tspd_core.pd.decode.peer import _FieldPages

NOISE = 0xA5


def _hybrid(layout: PageLayout, arrangement: PlaneArrangement) -> CacheContract:
    spec = ArenaSpec(
        layers=6,
        attention=AttentionKind.GQA,
        kv_heads=2,
        head_dim=3,
        dtype="bfloat16",
        page_size=4,
        page_layout=layout,
        arrangement=arrangement,
        num_pages=48,
        sliding_layers=(1, 4),
        sliding_window_tokens=5,
        page_alignment=1,
        state=StateSpec(
            layers=(0, 3),
            key_heads=2,
            value_heads=2,
            key_head_dim=4,
            value_head_dim=4,
            conv_width=1,
            conv_dtype="int8",
            ssm_dtype="int8",
        ),
    )
    return build_contract(spec)


def _tables(contract: CacheContract, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Scattered page ids per group, each group in parents of its own (a scheduler's way)."""
    out, parent = {}, 1
    for gid in contract.group_ids():
        k = contract.group(gid).cache_blocks_per_lcm_block
        span = np.arange((parent - 1) * k + 1, (parent + 4 - 1) * k + 1)
        out[gid] = rng.permutation(span)[:4]  # a 16-token prompt: four 4-token slots
        parent += 4
    return out


def _expected(contract: CacheContract, manifests: list[BlockManifest]) -> np.ndarray:
    mask = np.zeros(contract.plan.arena_bytes, dtype=bool)
    for manifest in manifests:
        for group in manifest.groups:
            for f in contract.fields_for_group(group.group_id):
                for page in group.block_ids:
                    start = contract.page0_offset(f.field_id) + int(page) * f.page_stride_bytes
                    mask[start : start + f.payload_bytes] = True
    return mask


@pytest.mark.parametrize("layout", list(PageLayout))
@pytest.mark.parametrize("arrangement", list(PlaneArrangement))
def test_the_pages_of_every_group_are_zeroed_and_nothing_else(
    layout: PageLayout, arrangement: PlaneArrangement
) -> None:
    contract = _hybrid(layout, arrangement)
    assert len(contract.group_ids()) == 3
    arena = torch.full((contract.plan.arena_bytes,), NOISE, dtype=torch.uint8)
    rng = np.random.default_rng(5)
    tables = [_tables(contract, rng) for _ in range(2)]
    # Two manifests at once (two requests staged in one call), pages of one not the other's.
    second = {gid: ids[:1] for gid, ids in tables[1].items()}
    manifests = [build_manifest(contract, tables[0], 0, 16), build_manifest(contract, second, 0, 4)]
    _FieldPages(contract, arena).zero(manifests)
    mask = _expected(contract, manifests)
    got = arena.numpy()
    assert mask.any()
    assert not mask.all()
    np.testing.assert_array_equal(got[mask], 0)
    np.testing.assert_array_equal(got[~mask], NOISE)


def test_no_manifest_touches_nothing() -> None:
    contract = _hybrid(PageLayout.NHD, PlaneArrangement.PER_FIELD)
    arena = torch.full((contract.plan.arena_bytes,), NOISE, dtype=torch.uint8)
    _FieldPages(contract, arena).zero([])
    assert bool((arena == NOISE).all())
