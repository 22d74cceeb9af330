"""Planner benchmark: copies for one 128k-token request, numpy planner vs a per-page loop.

Scenarios (one P rank → one D rank link, the unit each rank plans on its own):

* DeepSeek-V3 (61 MLA layers, latent 512 + rope 64, bf16, 64-token pages), TP 1 → 1;
* Llama-3-8B-shaped GQA (32 layers, 8 KV heads, head dim 128, bf16, 16-token HND pages),
  P TP 4 → D TP 2 (P rank 0 → D rank 0);
* the same GQA request at equal TP in a page-major arena, where coalescing shines.

Each runs with contiguous block ids (a fresh pool) and scattered ones (after churn). The
baseline is the straightforward loop over pages, fields and fragment rows that appends one
descriptor at a time and then merges neighbours in Python, on the same inputs in the same
process; its output is checked equal to the planner's. Also timed: ``transfer_stats`` (the
simulator's path, no descriptors built), and the token-major (NHD) GQA descriptor count
TokenSpeed-style planning would face, counted by ``transfer_stats`` rather than built.
Targets: planning ≤ 20 ms and ≥ 20× faster than the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table

from tspd_core.layout import (
    ArenaSpec,
    BlockManifest,
    GroupBlocks,
    PageLayout,
    PlaneArrangement,
    RoutePlan,
    build_contract,
    deepseek_v3,
    llama3_8b,
    plan_copies,
    plan_routes,
    transfer_stats,
)

TARGET_MS = 20.0
TARGET_SPEEDUP = 20.0


def _route(spec_p: ArenaSpec, p_tp: int, spec_d: ArenaSpec, d_tp: int) -> RoutePlan:
    return plan_routes(build_contract(spec_p), p_tp, build_contract(spec_d), d_tp)


def _manifests(route: RoutePlan, tokens: int, scattered: bool) -> tuple[BlockManifest, ...]:
    group = route.p_contract.group_ids()[0]
    n = -(-tokens // route.p_contract.plan.prefix_granularity)
    pages = route.p_contract.group(group).page_count - 1
    rng = np.random.default_rng(0)
    if scattered:
        src, dst = rng.permutation(pages)[:n] + 1, rng.permutation(pages)[:n] + 1
    else:
        src, dst = np.arange(1, n + 1), np.arange(3, n + 3)
    return (
        BlockManifest((GroupBlocks(group, src),), 0, tokens),
        BlockManifest((GroupBlocks(group, dst),), 0, tokens),
    )


def per_page_loop(
    route: RoutePlan, p: int, d: int, src: BlockManifest, dst: BlockManifest
) -> list[tuple[int, int, int]]:
    """The baseline: one Python iteration per page, field and fragment row, then a merge."""
    link = route.link(p, d)
    assert link is not None
    pc, dc = route.p_contract, route.d_contract
    raw = []
    for froute in link.fields:
        s_ids = src.block_ids(froute.group_id).tolist()
        d_ids = dst.block_ids(froute.group_id).tolist()
        s0, d0 = pc.page0_offset(froute.field_id), dc.page0_offset(froute.field_id)
        sp = pc.field(froute.field_id).page_stride_bytes
        sd = dc.field(froute.field_id).page_stride_bytes
        for s_page, d_page in zip(s_ids, d_ids, strict=True):
            for frag in froute.fragments:
                for row in range(frag.rows):
                    raw.append(  # noqa: PERF401 (the baseline is a plain loop on purpose)
                        (
                            s0 + s_page * sp + frag.src_offset + row * frag.src_stride,
                            d0 + d_page * sd + frag.dst_offset + row * frag.dst_stride,
                            frag.nbytes,
                            sp,
                            sd,
                        )
                    )
    raw.sort()
    out: list[tuple[int, int, int]] = []
    last_cls = (0, 0)
    for s, t, n, sp, sd in raw:
        if (
            out
            and last_cls == (sp, sd)
            and out[-1][0] + out[-1][2] == s
            and out[-1][1] + out[-1][2] == t
        ):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, t, n))
        last_cls = (sp, sd)
    return out


def _scenarios(tokens: int) -> list[tuple[str, RoutePlan, int, int]]:
    mla = deepseek_v3(num_pages=-(-tokens // 64) + 64)
    gqa = llama3_8b(num_pages=-(-tokens // 16) + 64, page_layout=PageLayout.HND)
    major = dataclasses.replace(gqa, arrangement=PlaneArrangement.PAGE_MAJOR, tp_size=2)
    return [
        ("DeepSeek-V3 MLA 61L, TP1→1", _route(mla, 1, mla, 1), 0, 0),
        (
            "GQA 32L 8kv HND, TP4→2",
            _route(dataclasses.replace(gqa, tp_size=4), 4, dataclasses.replace(gqa, tp_size=2), 2),
            0,
            0,
        ),
        ("GQA 32L page-major, TP2→2", _route(major, 2, major, 2), 0, 0),
    ]


def _measure(
    name: str, route: RoutePlan, p: int, d: int, tokens: int, scattered: bool, repeat: int
) -> dict[str, object]:
    src, dst = _manifests(route, tokens, scattered)
    copies = plan_copies(route, p, d, src, dst)  # warm the per-link row cache
    plan_s = best_of(lambda: plan_copies(route, p, d, src, dst), repeat=repeat)
    stats_s = best_of(lambda: transfer_stats(route, p, d, src, dst), repeat=repeat)
    t0 = time.perf_counter()
    baseline = per_page_loop(route, p, d, src, dst)
    loop_s = time.perf_counter() - t0
    got = list(zip(copies.src.tolist(), copies.dst.tolist(), copies.length.tolist(), strict=True))
    assert sorted(got) == baseline, f"{name}: planner and loop disagree"
    stats = transfer_stats(route, p, d, src, dst)
    assert (stats.descriptors, stats.nbytes) == (len(copies), copies.nbytes)
    met = plan_s * 1e3 <= TARGET_MS and loop_s / plan_s >= TARGET_SPEEDUP
    return {
        "scenario": name,
        "block_ids": "scattered" if scattered else "contiguous",
        "tokens": tokens,
        "bytes": copies.nbytes,
        "raw_descriptors": copies.raw_count,
        "descriptors": len(copies),
        "plan_ms": plan_s * 1e3,
        "loop_ms": loop_s * 1e3,
        "speedup": loop_s / plan_s,
        "stats_ms": stats_s * 1e3,
        "meets_targets": met,
        "mb": round(copies.nbytes / 1e6, 1),
        "verdict": "met" if met else "MISSED",
    }


def _token_major_count(tokens: int) -> dict[str, object]:
    """Descriptors a token-major (NHD) arena needs at P TP 4 → D TP 2, counted not built."""
    gqa = llama3_8b(num_pages=-(-tokens // 16) + 64, page_layout=PageLayout.NHD)
    route = _route(dataclasses.replace(gqa, tp_size=4), 4, dataclasses.replace(gqa, tp_size=2), 2)
    src, dst = _manifests(route, tokens, scattered=False)
    t0 = time.perf_counter()
    per_link = transfer_stats(route, 0, 0, src, dst)
    return {
        "nhd_descriptors_per_link": per_link.descriptors,
        "nhd_descriptors_all_links": per_link.descriptors * len(route.links),
        "nhd_bytes_per_descriptor": per_link.nbytes // per_link.descriptors,
        "nhd_stats_ms": (time.perf_counter() - t0) * 1e3,
    }


def _print(rows: list[dict[str, object]], nhd: dict[str, object]) -> None:
    headers = [
        "scenario",
        "block ids",
        "MB",
        "raw desc",
        "coalesced",
        "plan ms",
        "loop ms",
        "speedup",
        "stats ms",
        "targets",
    ]
    keys = [
        "scenario",
        "block_ids",
        "mb",
        "raw_descriptors",
        "descriptors",
        "plan_ms",
        "loop_ms",
        "speedup",
        "stats_ms",
        "verdict",
    ]
    print(table(headers, [[r[k] for k in keys] for r in rows]))
    print(
        f"token-major (NHD) pages at TP4→2 would need {nhd['nhd_descriptors_per_link']:,} "
        f"descriptors of {nhd['nhd_bytes_per_descriptor']} B per link "
        f"({nhd['nhd_descriptors_all_links']:,} over the route); counted by transfer_stats in "
        f"{nhd['nhd_stats_ms']:.2f} ms without building them"
    )


def run(args: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="bench_planner", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 16k-token request")
    parser.add_argument("--tokens", type=int, default=None, help="prompt length (128k)")
    parser.add_argument("--repeat", type=int, default=7, help="best of this many runs")
    opts = parser.parse_args(args)
    tokens = opts.tokens or (16384 if opts.quick else 131072)
    rows = []
    for name, route, p, d in _scenarios(tokens):
        for scattered in (False, True):
            rows.append(_measure(name, route, p, d, tokens, scattered, opts.repeat))
            print(f"  measured {name} ({rows[-1]['block_ids']})", flush=True)
    nhd = _token_major_count(tokens)
    _print(rows, nhd)
    return {
        "tokens": tokens,
        "target_ms": TARGET_MS,
        "target_speedup": TARGET_SPEEDUP,
        "scenarios": rows,
        **nhd,
    }


if __name__ == "__main__":
    run(sys.argv[1:])
