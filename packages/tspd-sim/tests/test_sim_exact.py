"""Exact small cases: one request on an idle cluster, prefix hits, unequal TP bytes."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.layout import build_manifest
from tspd_core.layout.copies import plan_copies
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.sim.request import SimRequest
from tspd_sim.testing import mooncake_trace
from tspd_sim.testing import small_config as config


def _planner_truth(sim: Simulation, req: SimRequest) -> dict[tuple[int, int], tuple[int, int]]:
    """(bytes, descriptors) per link from the planner's materialised copies (plan_copies)."""
    p, d = sim.p_engines[req.p_engine], sim.d_engines[req.d_engine]
    rid, d_hit, prompt = req.rid, req.d_hit, req.input_len
    route = sim.planner.route(p.layout, d.layout)
    gid = p.layout.contract.group_ids()[0]
    src = build_manifest(p.layout.contract, {gid: p.kv.page_table(rid)}, d_hit, prompt)
    dst = build_manifest(d.layout.contract, {gid: d.kv.page_table(rid)}, d_hit, prompt)
    out = {}
    for pr, dr in route.links:
        c = plan_copies(route, pr, dr, src, dst)
        out[(int(pr), int(dr))] = (c.nbytes, len(c))
    return out


class _Spy:
    """Captures each request's page tables at KV arrival (before the engines free them)."""

    def __init__(self, sim: Simulation) -> None:
        self.truth: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}
        inner = sim.transfers._on_done

        def landed(req, p, d):  # type: ignore[no-untyped-def]
            self.truth[req.idx] = _planner_truth(sim, req)
            inner(req, p, d)

        sim.transfers._on_done = landed


def _run(trace: object, cfg: SimConfig) -> tuple[Simulation, object, _Spy]:
    sim = Simulation(trace, cfg)  # type: ignore[arg-type]
    spy = _Spy(sim)
    return sim, sim.run(), spy


def test_one_request_idle_cluster_ttft_is_prefill_plus_transfer() -> None:
    prompt, output = 3000, 20
    # The first token leaves D as the KV lands: a router holding it, D outside rounds.
    cfg = config(layerwise=False, decode_rounds=False, early_first_token=False)
    sim, res, spy = _run(mooncake_trace([(0.0, prompt, output, [])]), cfg)
    row = res.requests.loc[0]  # type: ignore[attr-defined]
    cost = sim.p_engines[0].ctx.cost
    prefill = cost.prefill_time(np.array([prompt]), np.array([0]))
    ((link, (nbytes, ndesc)),) = spy.truth[0].items()
    assert link == (0, 0)
    transfer = sim.net.ideal_time(0, 0, nbytes, ndesc)
    assert row["queue_s"] == 0.0
    assert row["prefill_s"] == pytest.approx(prefill, rel=1e-12)
    assert row["ttft_s"] == pytest.approx(prefill + transfer, rel=1e-12)
    assert (row["transfer_bytes"], row["transfer_descriptors"]) == (nbytes, ndesc)
    # 3000 tokens in 64-token pages on fresh pools: pages 1..47 on both sides, one run per
    # field (64 fields) and 47 pages of 16 KiB per (layer, k|v) field (8 heads x 64 x 128 x 2).
    assert nbytes == 47 * 64 * 8 * 64 * 128 * 2
    assert ndesc == 64
    decode = cost.decode_times(1, prompt + 1, output - 1)
    times = res.token_times(0)  # type: ignore[attr-defined]
    assert times[0] == row["first_token_s"]
    assert np.allclose(np.diff(times), decode, rtol=1e-12, atol=0)
    assert row["finish_s"] == pytest.approx(row["first_token_s"] + decode.sum(), rel=1e-12)
    assert row["tpot_s"] == pytest.approx(decode.mean(), rel=1e-9)


def test_layerwise_overlaps_the_transfer_with_the_prefill() -> None:
    prompt = 3000
    held = config(layerwise=True, decode_rounds=False, early_first_token=False)  # TTFT: KV on D
    sim, res, spy = _run(mooncake_trace([(0.0, prompt, 2, [])]), held)
    row = res.requests.loc[0]  # type: ignore[attr-defined]
    layers = sim.model.layers
    t = sim.p_engines[0].ctx.cost.prefill_time(np.array([prompt]), np.array([0]))
    ((_, (nbytes, ndesc)),) = spy.truth[0].items()
    whole = sim.net.ideal_time(0, 0, nbytes, ndesc)
    last_layer = sim.net.ideal_time(0, 0, nbytes / layers, -(-ndesc // layers))
    assert row["transfer_start_s"] == pytest.approx(t / layers)
    expect = max(t / layers + whole, t + last_layer)
    assert row["ttft_s"] == pytest.approx(expect, rel=1e-12)
    assert row["xfer_exposed_s"] == pytest.approx(expect - t, rel=1e-9)


@pytest.mark.parametrize(
    ("p", "d", "model"),
    [
        ("1x2", "1x1", "llama-3-8b"),
        ("1x4", "1x2", "llama-3-8b"),
        ("1x1", "1x4", "llama-3-8b"),
        ("1x8@h200", "1x4dp2@h200", "deepseek-v3"),
    ],
)
def test_unequal_tp_moves_exactly_the_planned_bytes(p: str, d: str, model: str) -> None:
    rows = [(0.0, 5000, 4, []), (0.001, 700, 3, []), (0.002, 9000, 2, [])]
    sim, res, spy = _run(
        mooncake_trace(rows), config(p, d, model=model, layerwise=False, page_size=64)
    )
    df = res.requests  # type: ignore[attr-defined]
    for idx in range(3):
        truth = spy.truth[idx]
        assert df.loc[idx, "transfer_bytes"] == sum(b for b, _ in truth.values())
        assert df.loc[idx, "transfer_descriptors"] == sum(n for _, n in truth.values())
    # Every D rank receives the request's whole KV for its heads: total bytes = pages x the
    # KV bytes one page holds on the D side (per rank) x D ranks, with GQA heads split.
    m = sim.model
    d_tp = sim.d_info[0].group.tp  # every D rank of the engine receives its share
    pages = -(-df["input_len"] // 64)
    per_page = m.kv_bytes_per_token(d_tp) * 64 * d_tp
    assert df["transfer_bytes"].tolist() == (pages * per_page).tolist()


def test_prefix_hits_reduce_prefill_and_transfer_exactly_as_hash_chains_say() -> None:
    rows = [
        (0.0, 1500, 2, [1, 2, 3]),  # cold: computes everything
        (30.0, 1500, 2, [1, 2, 9]),  # shares blocks 1 and 2: 1024 tokens hit
        (60.0, 1500, 2, [1, 2, 3]),  # identical prompt: all full pages but the last hit
        (90.0, 1100, 2, [1, 7, 8]),  # shares block 1 only: 512 tokens
        (120.0, 400, 2, [5]),  # nothing shared
    ]
    sim, res, _ = _run(mooncake_trace(rows), config(page_size=64))
    df = res.requests  # type: ignore[attr-defined]
    # A prompt that is all prefix keeps its last token to compute: hits stop at
    # (prompt − 1) // page pages = 23 pages = 1472 tokens for 1500 tokens.
    assert df["p_hit_tokens"].tolist() == [0, 1024, 1472, 512, 0]
    assert df["prefill_tokens"].tolist() == [1500, 476, 28, 588, 400]
    assert df["d_hit_tokens"].tolist() == [0, 1024, 1472, 512, 0]
    page_bytes = sim.model.kv_bytes_per_token(1) * 64
    sent_pages = [24, 24 - 16, 24 - 23, 18 - 8, 7]
    assert df["transfer_bytes"].tolist() == [n * page_bytes for n in sent_pages]


def test_decode_prefix_cache_off_transfers_every_page() -> None:
    rows = [(0.0, 1500, 2, [1, 2, 3]), (30.0, 1500, 2, [1, 2, 9])]
    sim, res, _ = _run(mooncake_trace(rows), config(decode_prefix_cache=False))
    df = res.requests  # type: ignore[attr-defined]
    assert df["p_hit_tokens"].tolist() == [0, 1024]
    assert df["d_hit_tokens"].tolist() == [0, 0]
    page_bytes = sim.model.kv_bytes_per_token(1) * 64
    assert df["transfer_bytes"].tolist() == [24 * page_bytes, 24 * page_bytes]


def test_prefill_prefix_cache_off_computes_every_prompt_in_full() -> None:
    rows = [(0.0, 1500, 2, [1, 2, 3]), (30.0, 1500, 2, [1, 2, 9])]
    sim, res, _ = _run(mooncake_trace(rows), config(prefill_prefix_cache=False))
    df = res.requests  # type: ignore[attr-defined]
    assert df["p_hit_tokens"].tolist() == [0, 0]
    assert df["prefill_tokens"].tolist() == [1500, 1500]
    # D still holds the shared 16 pages: only the other 8 of 24 move.
    assert df["d_hit_tokens"].tolist() == [0, 1024]
    page_bytes = sim.model.kv_bytes_per_token(1) * 64
    assert df["transfer_bytes"].tolist() == [24 * page_bytes, 8 * page_bytes]
    assert sim.p_engines[0].kv.store is None
