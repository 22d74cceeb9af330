"""Planner benchmark: copies for one 128k-token request, numpy planner vs a per-page loop.

Scenarios (one P rank → one D rank link, the unit each rank plans on its own):

* DeepSeek-V3 (61 MLA layers, latent 512 + rope 64, bf16, 64-token pages), TP 1 → 1;
* Llama-3-8B-shaped GQA (32 layers, 8 KV heads, head dim 128, bf16, 16-token HND pages),
  P TP 4 → D TP 2 (P rank 0 → D rank 0);
* the same GQA request at equal TP in a page-major arena, where coalescing shines;
* the GQA request in token-major (NHD) pages, TokenSpeed's layout, at TP 2 → 2 and 4 → 2.

``plan ms`` times :func:`plan_runs` — the transports' planner: strided copies kept as runs
(a count and two steps), expanded only where a transport needs single descriptors — and
``plan_copies ms`` the coalescing planner that builds one descriptor per piece (8.4 M per link
for NHD at TP 4 → 2); both are checked to move the same bytes to the same places.

Each runs with contiguous block ids (a fresh pool) and scattered ones (after churn). The
baseline is the straightforward loop over pages, fields and fragment rows that appends one
descriptor at a time and then merges neighbours in Python, on the same inputs in the same
process; its output is checked equal to the planner's (NHD 4 → 2, with 8.4 M raw descriptors
per link at 128k tokens, skips it). Also timed: ``transfer_stats`` (the simulator's path, no
descriptors built).

The **TokenSpeed** column, when its runtime is at ``../shared/interop/tokenspeed`` (the
interop fixture): its prefill manager's own descriptor generator and batching
(``_cache_transfer_blocks`` → ``_transfer_data``, the Mooncake call replaced by a count) on
the same contracts and manifests, for the scenarios TokenSpeed can lay out (MLA and NHD GQA
per-field; it has no head-major or page-major arenas). Its planner object is built once per
pairing, as it is per registration; the time is its per-request work, like ``plan ms``.
Targets: planning ≤ 20 ms, ≥ 20× faster than the loop, and for a 128k-token request ≥ 1000×
faster than TokenSpeed (``--quick`` requests are too short for that ratio to mean much).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, table

from tspd_core.layout import (
    ArenaSpec,
    BlockManifest,
    Copies,
    GroupBlocks,
    PageLayout,
    PlaneArrangement,
    RoutePlan,
    build_contract,
    deepseek_v3,
    encode_contract,
    encode_manifest,
    llama3_8b,
    plan_copies,
    plan_routes,
    plan_runs,
    transfer_stats,
)
from tspd_core.layout.copies import merge_runs

TARGET_MS = 20.0
TARGET_SPEEDUP = 20.0
TARGET_VS_TOKENSPEED = 1000.0
#: Raw descriptors above which the per-page loop is skipped (its list and sort would take
#: gigabytes and minutes; the planner is checked against transfer_stats there).
LOOP_LIMIT = 4_000_000


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
    nhd = dataclasses.replace(gqa, page_layout=PageLayout.NHD)

    def at(spec: ArenaSpec, p: int, d: int) -> RoutePlan:
        return _route(
            dataclasses.replace(spec, tp_size=p), p, dataclasses.replace(spec, tp_size=d), d
        )

    return [
        ("DeepSeek-V3 MLA 61L, TP1→1", _route(mla, 1, mla, 1), 0, 0),
        ("GQA 32L 8kv HND, TP4→2", at(gqa, 4, 2), 0, 0),
        ("GQA 32L page-major, TP2→2", _route(major, 2, major, 2), 0, 0),
        ("GQA 32L 8kv NHD, TP2→2", at(nhd, 2, 2), 0, 0),
        ("GQA 32L 8kv NHD, TP4→2", at(nhd, 4, 2), 0, 0),
    ]


def _measure(
    name: str,
    route: RoutePlan,
    p: int,
    d: int,
    tokens: int,
    scattered: bool,
    repeat: int,
    tokenspeed: Any,
) -> dict[str, object]:
    src, dst = _manifests(route, tokens, scattered)
    runs = plan_runs(route, p, d, src, dst)  # warm the per-link tables
    plan_s = best_of(lambda: plan_runs(route, p, d, src, dst), repeat=repeat)
    copies = plan_copies(route, p, d, src, dst)
    copies_s = best_of(lambda: plan_copies(route, p, d, src, dst), repeat=min(repeat, 3))
    stats_s = best_of(lambda: transfer_stats(route, p, d, src, dst), repeat=repeat)
    stats = transfer_stats(route, p, d, src, dst)
    assert (stats.descriptors, stats.nbytes) == (len(copies), copies.nbytes)
    assert (runs.nbytes, runs.raw_count) == (copies.nbytes, copies.raw_count)
    assert _same_mapping(runs.expand(), copies), f"{name}: runs and copies differ"
    loop_s = None
    if copies.raw_count <= LOOP_LIMIT:
        t0 = time.perf_counter()
        baseline = per_page_loop(route, p, d, src, dst)
        loop_s = time.perf_counter() - t0
        got = zip(copies.src.tolist(), copies.dst.tolist(), copies.length.tolist(), strict=True)
        assert sorted(got) == baseline, f"{name}: planner and loop disagree"
    ts_s = None
    if tokenspeed is not None and tokenspeed.can_plan(route):
        ts_s, ts_count, ts_bytes = tokenspeed.time(route, p, d, src, dst)
        assert ts_bytes == copies.nbytes, f"{name}: TokenSpeed moves {ts_bytes} bytes"
        assert ts_count == copies.raw_count, f"{name}: TokenSpeed writes {ts_count} descriptors"
    speedup = None if loop_s is None else loop_s / plan_s
    vs_ts = None if ts_s is None else ts_s / plan_s
    met = (
        plan_s * 1e3 <= TARGET_MS
        and (speedup is None or speedup >= TARGET_SPEEDUP)
        and (vs_ts is None or tokens < 131072 or vs_ts >= TARGET_VS_TOKENSPEED)
    )
    return {
        "scenario": name,
        "block_ids": "scattered" if scattered else "contiguous",
        "tokens": tokens,
        "bytes": copies.nbytes,
        "raw_descriptors": copies.raw_count,
        "descriptors": len(copies),
        "runs": len(runs),
        "run_pieces": runs.pieces,
        # The plan's own memory: six int64 columns per run (against three per descriptor).
        "runs_mb": round(6 * 8 * len(runs) / 1e6, 2),
        "copies_mb": round(3 * 8 * len(copies) / 1e6, 2),
        "plan_ms": plan_s * 1e3,
        "plan_copies_ms": copies_s * 1e3,
        "loop_ms": None if loop_s is None else loop_s * 1e3,
        "speedup": speedup,
        "tokenspeed_ms": None if ts_s is None else ts_s * 1e3,
        "vs_tokenspeed": vs_ts,
        "stats_ms": stats_s * 1e3,
        "meets_targets": met,
        "mb": round(copies.nbytes / 1e6, 1),
        "verdict": "met" if met else "MISSED",
    }


def _same_mapping(a: Copies, b: Copies) -> bool:
    """Whether two descriptor sets move the same bytes to the same places."""
    pairs = zip(_byte_mapping(a), _byte_mapping(b), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


def _byte_mapping(copies: Copies) -> tuple[np.ndarray, ...]:
    """Descriptors sorted by source with neighbours that continue on both sides merged: the
    byte mapping itself, however a planner cut it."""
    order = np.argsort(copies.src, kind="stable")
    src, dst, length = copies.src[order], copies.dst[order], copies.length[order]
    same = np.ones(src.size, dtype=bool)
    src, dst, length = merge_runs(src, dst, length, same)
    return src, dst, length


class TokenSpeedPlanner:
    """TokenSpeed's per-request descriptor path, from the interop fixture, on our inputs."""

    def __init__(self, env: Any) -> None:
        env.load()
        self._ts = importlib.import_module("tokenspeed.runtime.pd.cache_protocol")
        self._plan = importlib.import_module("tokenspeed.runtime.pd.transfer_plan")
        self._prefill = importlib.import_module("tokenspeed.runtime.pd.mooncake.prefill")
        self._planners: dict[int, Any] = {}

    @staticmethod
    def can_plan(route: RoutePlan) -> bool:
        """TokenSpeed has per-field planes only, and token-major K/V pages."""
        fields = route.p_contract.plan.fields
        per_field = all(not f.plane_id.startswith("page.") for f in fields)
        parts = [route.p_contract.partition(f.field_id) for f in fields]
        return per_field and all(part is None or part.axis == 1 for part in parts)

    def time(
        self, route: RoutePlan, p: int, d: int, src: BlockManifest, dst: BlockManifest
    ) -> tuple[float, int, int]:
        """Seconds of one request's descriptors (generated and batched for the engine),
        the descriptor count and the bytes."""
        contract = self._ts.CacheTransferContract.from_wire_bytes
        p_layout = contract(encode_contract(route.p_contract))
        d_layout = contract(encode_contract(route.d_contract))
        planner = self._planners.get(id(route))
        if planner is None:
            planner = self._plan.CacheTransferPlanner(
                prefill_tp_size=route.p_tp,
                decode_tp_size=route.d_tp,
                prefill_layout=p_layout,
                decode_layout=d_layout,
            )
            self._planners[id(route)] = planner
        fragments = planner.plan_for_decode_rank(d).fragments_by_prefill_rank[p]
        counted = [0, 0]

        def count(session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> int:
            counted[0] += len(lengths)
            counted[1] += sum(lengths)
            return 0

        manager = types.SimpleNamespace(
            kv_args=types.SimpleNamespace(kv_data_ptr=0, cache_layout=p_layout),
            engine=types.SimpleNamespace(batch_transfer_sync=count),
        )
        wire = self._ts.CachePDBlockManifest.from_wire_bytes
        src_m, dst_m = wire(encode_manifest(src)), wire(encode_manifest(dst))
        cls = self._prefill.MooncakeKVManagerPrefill
        t0 = time.perf_counter()
        blocks = cls._cache_transfer_blocks(
            manager,
            dst_ptr=0,
            src_block_manifest=src_m,
            dst_block_manifest=dst_m,
            transfer_fragments=fragments,
            dst_cache_layout=d_layout,
        )
        assert cls._transfer_data(manager, "session", blocks) == 0
        return time.perf_counter() - t0, counted[0], counted[1]


def load_tokenspeed() -> TokenSpeedPlanner | None:
    """TokenSpeed's planner when the interop fixture is present, else ``None``."""
    env = importlib.import_module("tspd_testing.interop.env")
    if env.MISSING:
        print(f"no TokenSpeed column: {env.MISSING}")
        return None
    return TokenSpeedPlanner(env)


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
        "runs",
        "runs MB",
        "copies MB",
        f"plan ms (≤ {TARGET_MS:g})",
        "plan_copies ms",
        "loop ms",
        f"speedup (≥ {TARGET_SPEEDUP:g})",
        "TokenSpeed ms",
        f"vs TokenSpeed (≥ {TARGET_VS_TOKENSPEED:g})",
        "stats ms",
        "targets",
    ]
    keys = [
        "scenario",
        "block_ids",
        "mb",
        "raw_descriptors",
        "descriptors",
        "runs",
        "runs_mb",
        "copies_mb",
        "plan_ms",
        "plan_copies_ms",
        "loop_ms",
        "speedup",
        "tokenspeed_ms",
        "vs_tokenspeed",
        "stats_ms",
        "verdict",
    ]
    shown = [["—" if r[k] is None else r[k] for k in keys] for r in rows]
    print(table(headers, shown))
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
    tokenspeed = load_tokenspeed()
    rows = []
    for (name, route, p, d), scattered in itertools.product(_scenarios(tokens), (False, True)):
        rows.append(_measure(name, route, p, d, tokens, scattered, opts.repeat, tokenspeed))
        print(f"  measured {name} ({rows[-1]['block_ids']})", flush=True)
    nhd = _token_major_count(tokens)
    _print(rows, nhd)
    return {
        "tokens": tokens,
        "target_ms": TARGET_MS,
        "target_speedup": TARGET_SPEEDUP,
        "target_vs_tokenspeed": TARGET_VS_TOKENSPEED,
        "tokenspeed": tokenspeed is not None,
        "scenarios": rows,
        **nhd,
    }


if __name__ == "__main__":
    run(sys.argv[1:])
