"""The simulator's per-link counts (``KvPlanner.links``: the planner's link profiles over one
pair counter) equal the layout planner's stats and its materialised copies."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tspd_core.layout import build_manifest, chunk_positions
from tspd_core.layout.copies import plan_copies
from tspd_core.layout.stats import transfer_stats
from tspd_sim.cluster import EngineTuning
from tspd_sim.sim.kv import KvPlanner
from tspd_sim.specs import model_spec

PAGES = 96

# (model, P TP, D TP) pairs the planner supports for these models.
PAIRS = [
    ("llama-3-8b", 1, 1),
    ("llama-3-8b", 2, 1),
    ("llama-3-8b", 1, 4),
    ("llama-3-8b", 4, 2),
    ("llama-3-8b", 8, 8),
    ("deepseek-v3", 8, 4),
]


@st.composite
def _case(draw: st.DrawFn) -> tuple[object, ...]:
    model, p_tp, d_tp = draw(st.sampled_from(PAIRS))
    arrangement = draw(st.sampled_from(["per_field", "page_major"]))
    layout = draw(st.sampled_from(["hnd", "nhd"]))
    n = draw(st.integers(1, 40))
    # Page tables: either runs of consecutive ids (fresh pools) or scattered (after churn).
    if draw(st.booleans()):
        a = draw(st.integers(1, PAGES - n + 1))
        b = draw(st.integers(1, PAGES - n + 1))
        src, dst = np.arange(a, a + n), np.arange(b, b + n)
    else:
        src = np.array(draw(st.permutations(range(1, PAGES + 1)))[:n])
        dst = np.array(draw(st.permutations(range(1, PAGES + 1)))[:n])
    prefix_pages = draw(st.integers(0, n - 1))
    return model, p_tp, d_tp, arrangement, layout, src, dst, prefix_pages


@settings(max_examples=60, deadline=None)
@given(_case())
def test_adapter_link_counts_equal_planner_stats_and_copies(case: tuple[object, ...]) -> None:
    model, p_tp, d_tp, arrangement, layout, src, dst, prefix_pages = case
    tuning = EngineTuning(page_size=16, arrangement=arrangement, page_layout=layout)  # type: ignore[arg-type]
    planner = KvPlanner(model_spec(model), tuning)  # type: ignore[arg-type]
    p, d = planner.layout(p_tp, PAGES), planner.layout(d_tp, PAGES)  # type: ignore[arg-type]
    n = len(src)  # type: ignore[arg-type]
    prompt = n * 16 - 5
    prefix = prefix_pages * 16  # type: ignore[operator]
    gid = p.contract.group_ids()[0]
    full_src = np.zeros(n, dtype=np.int64)
    full_dst = np.zeros(n, dtype=np.int64)
    full_src[:], full_dst[:] = src, dst  # type: ignore[assignment]
    s_m = build_manifest(p.contract, {gid: full_src}, prefix, prompt)
    d_m = build_manifest(d.contract, {gid: full_dst}, prefix, prompt)
    route = planner.route(p, d)
    cut = prefix + (prompt - prefix) // 2 + 1  # a chunk boundary inside a page, mostly
    chunks = [
        None,
        chunk_positions(p.contract, s_m, prefix, cut, first=True),
        chunk_positions(p.contract, s_m, cut, prompt, first=False),
    ]
    for positions in chunks:
        got = {(a, b): (nb, nd) for a, b, nb, nd in planner.links(p, d, s_m, d_m, positions)}
        for pr, dr in route.links:
            stats = transfer_stats(route, pr, dr, s_m, d_m, positions=positions)
            copies = plan_copies(route, pr, dr, s_m, d_m, positions=positions)
            assert (stats.nbytes, stats.descriptors) == (copies.nbytes, len(copies))
            assert got.get((int(pr), int(dr)), (0, 0)) == (copies.nbytes, len(copies))
