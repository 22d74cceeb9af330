"""Decode out of pages: preemption (recompute or swap) on a constructed case, the run that used
to crash, and a fuzz over small clusters, traces and flags that must never crash."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tspd_core.layout import PageLayout, PlaneArrangement
from tspd_sim.cli import main
from tspd_sim.cluster import ClusterSpec, EngineTuning, GroupSpec
from tspd_sim.errors import SpecError
from tspd_sim.metrics import SimResult
from tspd_sim.network import NET_PROFILES
from tspd_sim.sim import POLICIES, RoutingSpec, SimConfig, Simulation
from tspd_sim.specs import GPUS, MODELS
from tspd_sim.testing import mooncake_trace, small_config
from tspd_sim.traces import synthetic

PAGE = 16
#: One 16-token page of Llama-3-8B KV on one rank: 32 layers x K,V x 8 heads x 128 x 2 bytes.
PAGE_BYTES = 32 * 2 * 8 * 128 * 2 * PAGE


def _mem_fraction_for(pages: int) -> float:
    """The mem_fraction that leaves exactly ``pages`` KV pages on one H100 with Llama-3-8B."""
    model, gpu = MODELS["llama-3-8b"], GPUS["h100"]
    return (model.weight_bytes_per_gpu(1) + (pages + 0.5) * PAGE_BYTES) / gpu.memory


def _two_requests(policy: str) -> tuple[Simulation, SimResult]:
    """A and B: 64-token prompts (4 pages each) and 97-token outputs (96 decode steps: 10
    pages each at the end) on a D pool of 12 pages, without the output reservation."""
    cfg = small_config(
        page_size=PAGE,
        mem_fraction=_mem_fraction_for(12),
        reserve_output=False,
        decode_prefix_cache=False,
        preemption=policy,
    )
    sim = Simulation(mooncake_trace([(0.0, 64, 97, []), (0.001, 64, 97, [])]), cfg)
    assert sim.d_info[0].num_pages == 12
    return sim, sim.run()


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_the_newest_request_is_preempted_once_and_comes_back_after_the_oldest(
    policy: str,
) -> None:
    # Both prompts take 8 pages at admission: 4 free. A joins first, B a step or two later
    # (j steps); each opens a page at its 1st and 17th steps: 0 free. A's 33rd step needs a
    # page: B, the newest, is preempted (its 96 − j tokens of KV: 6 pages). A, alone, never
    # lacks a page again (10 pages at most, 6 + 4 free); B cannot come back (6 pages) before
    # A finishes, then comes back and decodes to the end.
    sim, res = _two_requests(policy)
    df = res.requests
    assert df["preemptions"].tolist() == [0, 1]
    assert res.info["preemptions_by_engine"] == {"D0": 1}
    summary = res.summary()
    assert (summary["preemptions"], summary["preempted_requests"]) == (1, 1)
    seg = res.segments
    j = int(df.loc[1, "join_step"])
    assert 1 <= j <= 3
    ran = 32 - j  # B's steps before A's 33rd step
    assert seg[["request", "seg", "start_step", "steps"]].values.tolist() == [
        [1, 0, j, ran],
        [1, 1, 96, 96 - ran],  # right after A's 96 steps
    ]
    assert res.info["decode_steps"] == 96 + 96 - ran
    assert len(res.token_times(1)) == 97
    cost = sim.d_engines[0].ctx.cost
    a_end = float(df.loc[0, "finish_s"])
    first_after = float(res.logs[0].ends[96])
    if policy == "recompute":
        assert df["recomputed_tokens"].tolist() == [0, 64 + ran]
        assert df["swap_bytes"].tolist() == [0, 0]
        # D prefills B's prompt and generated tokens again, then the next decode step runs.
        restore = cost.prefill_time(np.array([64 + ran]), np.array([0]))
    else:
        assert df["recomputed_tokens"].tolist() == [0, 0]
        assert df["swap_bytes"].tolist() == [0, 2 * 6 * PAGE_BYTES]  # 6 pages out, 6 in
        restore = 6 * PAGE_BYTES / GPUS["h100"].host_bw
        # The swap-out stalls A's 33rd step by B's 6 pages over the host link.
        a = res.token_times(0)
        stall = 6 * PAGE_BYTES / GPUS["h100"].host_bw
        step = cost.decode_time(1, 64 + 1 + 32)  # A alone, its 33rd step
        assert a[33] - a[32] == pytest.approx(stall + step, rel=1e-9)
    step = cost.decode_time(1, 64 + 1 + ran)  # B alone: its first step back
    assert first_after == pytest.approx(a_end + restore + step, rel=1e-9)
    # The gap B's stream sees across the preemption: from its last step to its first back.
    b = res.token_times(1)
    assert b[ran + 1] - b[ran] == pytest.approx(first_after - float(res.logs[0].ends[31]))


def test_macro_steps_equal_one_step_per_event_under_preemption() -> None:
    for policy in ("recompute", "swap"):
        cfg = small_config(
            "1x1", "1x1", reserve_output=False, preemption=policy, mem_fraction=0.25, page_size=16
        )
        trace = synthetic(120, 10.0, "lognormal:1200:0.8", "lognormal:400:0.8", seed=7)
        fast = Simulation(trace, cfg).run()
        slow = Simulation(trace, replace(cfg, decode_horizon=1)).run()
        assert fast.summary()["preemptions"] > 0
        pd.testing.assert_frame_equal(fast.requests, slow.requests, check_exact=False, rtol=1e-12)
        pd.testing.assert_frame_equal(fast.segments, slow.segments)
        every = [np.diff(fast.token_times(i)) for i in fast.requests.index]
        np.testing.assert_allclose(np.sort(fast.itl()), np.sort(np.concatenate(every)), rtol=1e-12)


def test_the_run_that_crashed_with_pool_exhausted_completes(tmp_path: Path) -> None:
    args = ["run", "--trace", "synthetic", "--requests", "300", "--rate", "20",
            "--input-len", "fixed:1000", "--output-len", "fixed:2000", "--prefill", "1xtp1@h100",
            "--decode", "1xtp1@h100", "--no-reserve-output", "--no-plots", "--quiet",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    df = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(df) == 300
    assert df["finish_s"].notna().all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["preemptions"] == df["preemptions"].sum() > 0
    assert summary["preemptions_by_engine"] == {"D0": int(df["preemptions"].sum())}


# ---- never a crash ---------------------------------------------------------------------------

_GPU = st.sampled_from(sorted(GPUS))
# TP 3 and the big models on one GPU are refused; they stay in the space, less often.
_GROUP = st.builds(
    GroupSpec, st.integers(1, 2), st.sampled_from([1, 1, 2, 4, 8, 3]), st.integers(1, 2), _GPU
)
_MODEL = st.sampled_from(["llama-3-8b", "llama-3-8b", "llama-3-8b", "llama-2-70b", "deepseek-v3"])


Case = tuple[SimConfig | None, list[tuple[float, int, int, list[int]]]]


@st.composite
def _cases(draw: st.DrawFn) -> Case:
    """A random small configuration (None when it is refused with a SpecError up front) and
    trace rows (arrival gap, prompt, output, hash ids). The memory fraction is drawn as the
    KV tokens it leaves a decode engine, and the requests' lengths up to that many tokens
    each, so that pools are small next to the requests as often as not (and some requests
    do not fit at all)."""
    tokens = draw(st.sampled_from([300, 700, 1500, 4000]))
    rows = draw(
        st.lists(
            st.tuples(
                st.floats(0.0, 0.3),
                st.integers(1, tokens * 2 // 3),
                st.integers(1, tokens // 2),
                st.lists(st.integers(0, 3), max_size=4),
            ),
            min_size=1,
            max_size=10,
        )
    )
    return draw(_config(tokens)), rows


@st.composite
def _config(draw: st.DrawFn, tokens: int) -> SimConfig | None:
    try:
        page = draw(st.sampled_from([16, 32, 64, 128]))
        model, d = draw(_MODEL), draw(_GROUP)
        p = d if draw(st.booleans()) else draw(_GROUP)  # P like D half the time
        spec = MODELS[model]
        # The fraction that leaves `tokens` of KV on the side that needs the most memory.
        fraction = max(
            (spec.weight_bytes_per_gpu(g.tp * g.dp) + tokens * spec.kv_bytes_per_token(g.tp))
            / GPUS[str(g.gpu)].memory
            for g in (p, d)
        )
        tuning = EngineTuning(
            page_size=page,
            max_prefill_tokens=draw(st.sampled_from([page, 512, 8192])),
            prefill_max_running=draw(st.integers(1, 4)),
            decode_max_running=draw(st.integers(1, 8)),
            mem_fraction=min(fraction, 1.0),
            layerwise=draw(st.booleans()),
            prefill_prefix_cache=draw(st.booleans()),
            decode_prefix_cache=draw(st.booleans()),
            page_layout=draw(st.sampled_from(list(PageLayout))),
            arrangement=draw(st.sampled_from(list(PlaneArrangement))),
            reserve_output=draw(st.booleans()),
            preemption=draw(st.sampled_from(["recompute", "swap"])),
            decode_rounds=draw(st.booleans()),
            early_first_token=draw(st.booleans()),
        )
        return SimConfig(
            cluster=ClusterSpec(model, (p,), (d,), tuning),
            routing=RoutingSpec(draw(st.sampled_from(POLICIES))),
            net=NET_PROFILES[draw(st.sampled_from(sorted(NET_PROFILES)))],
            seed=draw(st.integers(0, 3)),
        )
    except SpecError:
        return None


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_any_small_cluster_and_trace_completes_or_is_refused(case: Case) -> None:
    config, rows = case
    if config is None:
        return  # refused before the run, with a SpecError
    arrivals = np.cumsum([r[0] for r in rows])
    # Hash ids name 512-token blocks: a prompt has at most one per block.
    trace = mooncake_trace(
        [(t, i, o, h[: -(-i // 512)]) for t, (_, i, o, h) in zip(arrivals, rows, strict=True)]
    )
    res = Simulation(trace, config).run()  # checks: every request finished, no page leaked
    df = res.requests
    assert len(df) == len(rows)
    done = df[~df["rejected"]]
    assert done["finish_s"].notna().all()
    assert (df["rejected"] == (df["reject_reason"] != "")).all()
    assert sum(int(log.sizes.sum()) for log in res.logs) == int((done["output_len"] - 1).sum())
    for i in done.index:
        assert len(res.token_times(int(i))) == done.loc[i, "output_len"]
    if config.cluster.tuning.reserve_output:
        assert not df["preemptions"].any()
