"""Route planning against TokenSpeed's planner, over (P TP, D TP) ∈ {1, 2, 3, 4, 8}².

For MHA (8 KV heads), GQA (2 KV heads) and MLA, with the contracts TokenSpeed's recipe builds
at each TP: wherever TokenSpeed plans the pair, tspd plans the same targets per D rank, the
same dummies, the same fan-out per P rank and the same contacts for D rank 0, and its copies
move exactly the bytes TokenSpeed's descriptors move, from the same source byte to the same
destination byte (and so do its strided runs, expanded); wherever TokenSpeed refuses, tspd
refuses for the same reason.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)
tokenspeed_env.load()

from tokenspeed.runtime.pd import cache_protocol as ts  # noqa: E402
from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill  # noqa: E402
from tokenspeed.runtime.pd.transfer_plan import CacheTransferPlanner  # noqa: E402

from tspd_core.layout import (  # noqa: E402
    BlockManifest,
    CacheContract,
    GroupBlocks,
    RouteError,
    encode_manifest,
    parse_contract,
    plan_copies,
    plan_routes,
    plan_runs,
)
from tspd_testing.interop.contracts import Model, tokenspeed_contract  # noqa: E402

TPS = (1, 2, 3, 4, 8)
MODELS = [
    Model("mha-8", "mha", layers=2, kv_heads=8, head_dim=32, page=16),
    Model("gqa-2", "mha", layers=2, kv_heads=2, head_dim=32, page=16),
    Model("mla", "mla", layers=2, page=16, kv_lora_rank=64, rope_dim=16),
]
BUDGET = 1 << 22
PREFIX, PROMPT = 16, 70  # D holds one page; pages 2..5 move (the last one partly filled)


def _contracts(m: Model, tp: int) -> tuple[ts.CacheTransferContract, CacheContract]:
    theirs = tokenspeed_contract(m, tp, BUDGET)
    return theirs, parse_contract(theirs.to_wire_bytes())


def _manifest(ids: list[int]) -> BlockManifest:
    return BlockManifest((GroupBlocks("full_attention", np.asarray(ids)),), PREFIX, PROMPT)


SRC = [9, 3, 4, 5]  # P's pages: a run and a jump
DST = [7, 8, 2, 11]  # D's pages


def _merged(descs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Descriptors sorted by source, neighbours that continue on both sides merged: the byte
    mapping itself, however either planner cut it."""
    out: list[list[int]] = []
    for s, d, n in sorted(descs):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [(s, d, n) for s, d, n in out]


def _tokenspeed_copies(
    planner: CacheTransferPlanner,
    p_layout: ts.CacheTransferContract,
    d_layout: ts.CacheTransferContract,
    p: int,
    d: int,
) -> list[tuple[int, int, int]]:
    """TokenSpeed's own descriptor generator (its prefill manager's method) with both arena
    bases at 0, so its addresses are offsets."""
    fragments = planner.plan_for_decode_rank(d).fragments_by_prefill_rank.get(p)
    if fragments is None:
        return []
    manager = types.SimpleNamespace(
        kv_args=types.SimpleNamespace(kv_data_ptr=0, cache_layout=p_layout)
    )
    wire = ts.CachePDBlockManifest.from_wire_bytes
    return list(
        MooncakeKVManagerPrefill._cache_transfer_blocks(
            manager,  # type: ignore[arg-type]
            dst_ptr=0,
            src_block_manifest=wire(encode_manifest(_manifest(SRC))),
            dst_block_manifest=wire(encode_manifest(_manifest(DST))),
            transfer_fragments=fragments,
            dst_cache_layout=d_layout,
        )
    )


@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_routes_and_copies_equal_tokenspeeds(model: Model) -> None:
    planned = refused = 0
    for p_tp, d_tp in itertools.product(TPS, TPS):
        (p_ts, p_ours), (d_ts, d_ours) = _contracts(model, p_tp), _contracts(model, d_tp)
        try:
            planner = CacheTransferPlanner(
                prefill_tp_size=p_tp, decode_tp_size=d_tp, prefill_layout=p_ts, decode_layout=d_ts
            )
        except ValueError as exc:
            reason = str(exc).split("cannot map ", 1)[1]
            with pytest.raises(RouteError, match="cannot map " + reason.replace(".", r"\.")):
                plan_routes(p_ours, p_tp, d_ours, d_tp)
            refused += 1
            continue
        route = plan_routes(p_ours, p_tp, d_ours, d_tp)
        planned += 1
        where = f"{model.name} P TP {p_tp} -> D TP {d_tp}"
        by_p = planner.decode_ranks_by_prefill_rank
        for d in range(d_tp):
            targets = planner.plan_for_decode_rank(d).target_prefill_ranks
            assert route.targets(d) == targets, where
        assert route.dummies == tuple(p for p in range(p_tp) if not by_p[p]), where
        assert [route.destinations(p) for p in range(p_tp)] == [
            tuple(sorted(by_p[p])) for p in range(p_tp)
        ], where
        dummies = tuple(p for p, ranks in by_p.items() if not ranks)
        rank0 = planner.plan_for_decode_rank(0).target_prefill_ranks
        assert route.contacts(0) == tuple(sorted({*rank0, *dummies})), where
        for p, d in itertools.product(range(p_tp), range(d_tp)):
            ours = plan_copies(route, p, d, _manifest(SRC), _manifest(DST))
            mine = list(
                zip(ours.src.tolist(), ours.dst.tolist(), ours.length.tolist(), strict=True)
            )
            theirs = _tokenspeed_copies(planner, p_ts, d_ts, p, d)
            assert _merged(mine) == _merged(theirs), f"{where}, P{p} -> D{d}"
            assert ours.nbytes == sum(n for _, _, n in theirs)
            # The strided runs, expanded where TokenSpeed enumerates, move the same bytes.
            runs = plan_runs(route, p, d, _manifest(SRC), _manifest(DST)).expand()
            pieces = zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist(), strict=True)
            assert _merged(list(pieces)) == _merged(theirs), f"{where}, P{p} -> D{d} (runs)"
    # TP 3 splits neither 8 nor 2 KV heads: refused by both; the replicated latent goes anywhere.
    assert (planned, refused) == ((25, 0) if model.family == "mla" else (16, 9))
