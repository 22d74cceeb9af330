"""The identity-tagged arena test: plan, copy with a plain memcpy, compare every byte.

Every P rank's arena holds, in each page of the request, elements that encode (field, layer,
token position, global head, dim); the rest is random garbage. D arenas use other, scrambled
block ids, already hold a prefix, and are garbage elsewhere. After every P rank's copies are
applied, each D arena must equal exactly what it held before except the destination pages,
which must hold the codes of D's own heads.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import cache

import numpy as np
import pytest
from layout_testkit import apply_copies, parent_spans, tag_pages

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.copies import plan_copies
from tspd_core.layout.errors import ContractError
from tspd_core.layout.manifest import BlockManifest, build_manifest, slot_range
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
    build_contract,
)
from tspd_core.layout.routes import RoutePlan, plan_routes
from tspd_core.layout.strided import plan_runs

TPS = (1, 2, 3, 4, 8)
PAGE = 4
PAGES = 36  # parents: the hybrid's three groups hold 12-slot tables side by side

MODELS: dict[str, ArenaSpec] = {
    "mha24": ArenaSpec(
        layers=2,
        attention=AttentionKind.MHA,
        kv_heads=24,
        head_dim=2,
        dtype="int32",
        page_size=PAGE,
        num_pages=PAGES,
    ),
    "gqa1": ArenaSpec(
        layers=2, kv_heads=1, head_dim=3, dtype="bfloat16", page_size=PAGE, num_pages=PAGES
    ),
    "gqa2": ArenaSpec(
        layers=2, kv_heads=2, head_dim=2, dtype="float32", page_size=PAGE, num_pages=PAGES
    ),
    "gqa8": ArenaSpec(
        layers=2,
        kv_heads=8,
        head_dim=2,
        dtype="int32",
        page_size=PAGE,
        num_pages=PAGES,
        draft_layers=1,
    ),
    "mla": ArenaSpec(
        layers=3,
        attention=AttentionKind.MLA,
        latent_dim=4,
        rope_dim=2,
        dtype="int32",
        page_size=PAGE,
        num_pages=PAGES,
    ),
    "hybrid": ArenaSpec(
        layers=6,
        kv_heads=8,
        head_dim=2,
        dtype="int32",
        page_size=PAGE,
        num_pages=PAGES,
        sliding_layers=(1, 4),
        sliding_window_tokens=9,
        # TokenSpeed's packing ties the state pages to the K/V pages sharing their planes;
        # tiny pages need alignment 1 (the hybrid default, 256, is for real model sizes).
        page_alignment=1,
        state=StateSpec(
            layers=(0, 3),
            key_heads=8,
            value_heads=8,
            key_head_dim=4,
            value_head_dim=4,
            conv_width=1,
            conv_dtype="int32",
            ssm_dtype="int32",
        ),
    ),
}


@cache
def contracts(
    model: str, layout: PageLayout, arrangement: PlaneArrangement, tp: int, pages: int
) -> tuple[CacheContract, ...] | None:
    base = dataclasses.replace(
        MODELS[model], page_layout=layout, arrangement=arrangement, tp_size=tp, num_pages=pages
    )
    try:
        return tuple(build_contract(dataclasses.replace(base, tp_rank=r)) for r in range(tp))
    except ContractError:
        return None  # the model does not allow this TP size (e.g. 8 KV heads over TP 3)


@cache
def route(
    model: str, layout: PageLayout, arrangement: PlaneArrangement, p: int, d: int
) -> RoutePlan | None:
    pc = contracts(model, layout, arrangement, p, PAGES)
    dc = contracts(model, layout, arrangement, d, PAGES + 5)
    if pc is None or dc is None:
        return None
    return plan_routes(pc[0], p, dc[0], d)


def run_case(
    model: str,
    layout: PageLayout,
    arrangement: PlaneArrangement,
    p: int,
    d: int,
    prefix: int,
    prompt: int,
    seed: int,
) -> bool:
    """Plan and copy one request; False when the model does not allow these TP sizes."""
    plan = route(model, layout, arrangement, p, d)
    pcs = contracts(model, layout, arrangement, p, PAGES)
    dcs = contracts(model, layout, arrangement, d, PAGES + 5)
    if plan is None or pcs is None or dcs is None:
        return False
    rng = np.random.default_rng(seed)
    gids = pcs[0].group_ids()
    n_slots = -(-prompt // PAGE)
    p_tables = _tables(pcs[0], gids, n_slots, rng)
    d_tables = _tables(dcs[0], gids, n_slots, rng)
    src = build_manifest(pcs[0], p_tables, prefix, prompt)
    dst = build_manifest(dcs[0], d_tables, prefix, prompt)
    p_arenas = []
    for rank, c in enumerate(pcs):
        arena = rng.integers(0, 256, c.plan.arena_bytes, dtype=np.uint8)
        tag_pages(arena, c, p, rank, p_tables, {g: range(n_slots) for g in gids})
        p_arenas.append(arena)
    for rank, c in enumerate(dcs):
        check_d_rank(plan, rank, c, p_arenas, src, dst, d_tables, rng)
    return True


def _tables(
    contract: CacheContract, gids: tuple[str, ...], n: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Shuffled block tables whose groups never share a parent (groups sharing a plane take
    turns in its bytes, so a scheduler hands out parents)."""
    order = [gids[i] for i in rng.permutation(len(gids))]
    spans = parent_spans(contract, n, order)
    return {g: rng.permutation(np.asarray(spans[g]))[:n] for g in gids}


def check_d_rank(
    plan: RoutePlan,
    rank: int,
    contract: CacheContract,
    p_arenas: list[np.ndarray],
    src: BlockManifest,
    dst: BlockManifest,
    d_tables: dict[str, np.ndarray],
    rng: np.random.Generator,
) -> None:
    """Apply every P rank's copies to D rank ``rank`` and compare its whole arena."""
    prefix, prompt = dst.prefix_len, dst.prompt_len
    moved = {g: slot_range(contract.spec(g), prefix, prompt) for g in contract.group_ids()}
    held = {g: range(min(prefix // PAGE, moved[g].start)) for g in contract.group_ids()}
    before = rng.integers(0, 256, contract.plan.arena_bytes, dtype=np.uint8)
    tag_pages(before, contract, plan.d_tp, rank, d_tables, held)  # the prefix D already holds
    expected = before.copy()
    tag_pages(expected, contract, plan.d_tp, rank, d_tables, moved)
    arena, by_runs = before.copy(), before.copy()
    senders = []
    for q, p_arena in enumerate(p_arenas):
        copies = plan_copies(plan, q, rank, src, dst)
        if len(copies):
            senders.append(q)
        apply_copies(copies, p_arena, arena)
        apply_copies(plan_runs(plan, q, rank, src, dst).expand(), p_arena, by_runs)
    assert tuple(senders) == plan.targets(rank)
    assert np.array_equal(arena, expected), f"D rank {rank} differs"
    assert np.array_equal(by_runs, expected), f"D rank {rank} differs (strided runs)"


LAYOUTS = [
    (PageLayout.NHD, PlaneArrangement.PER_FIELD),
    (PageLayout.HND, PlaneArrangement.PER_FIELD),
    (PageLayout.HND, PlaneArrangement.PAGE_MAJOR),
    (PageLayout.NHD, PlaneArrangement.PAGE_MAJOR),
]


@pytest.mark.parametrize(("p", "d"), list(itertools.product(TPS, TPS)))
def test_identity_tagged_arenas(p: int, d: int) -> None:
    ran = []
    for model in ("mha24", "gqa1", "gqa2", "gqa8", "mla"):
        for i, (layout, arrangement) in enumerate(LAYOUTS):
            if model == "mla" and layout == PageLayout.NHD:
                continue  # MLA pages have no head axis
            for prefix, prompt in ((0, 24), (8, 22)) if i % 2 else ((0, 21), (8, 24)):
                if run_case(model, layout, arrangement, p, d, prefix, prompt, seed=p * 10 + d):
                    ran.append(model)
    # Every model that allows both TP sizes ran: MHA with 24 heads and GQA with one KV head
    # fit every size; 2 and 8 KV heads do not split over 3 ranks.
    want = {"mha24", "gqa1", "mla"} | ({"gqa2", "gqa8"} if 3 not in (p, d) else set())
    assert set(ran) == want


@pytest.mark.parametrize(("p", "d"), [(1, 1), (1, 2), (2, 1), (2, 8), (8, 4), (4, 4)])
@pytest.mark.parametrize("arrangement", list(PlaneArrangement))
def test_identity_tagged_hybrid_arena(p: int, d: int, arrangement: PlaneArrangement) -> None:
    """Sliding-window and state groups (GDN parts) next to full attention."""
    for prefix, prompt in ((0, 23), (4, 17), (12, 48)):
        assert run_case("hybrid", PageLayout.HND, arrangement, p, d, prefix, prompt, seed=p + d)
