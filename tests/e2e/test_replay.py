"""The trace replay and the simulator's calibration against a real ``launch_pd.py local``
cluster (tiny seeded model, prefill node at TP 2, decode node at TP 1, router; every role a
process), with both nodes writing their step logs.

Timing is never asserted: what is exact is the request count, each request's arrival and
lengths in the table, the order the requests went out, the table's columns, and what the
nodes' step logs say the cluster computed for them (prompt tokens on P, decode rows on D).
"""

from __future__ import annotations

import asyncio
import csv
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import requests

from tspd_launch.replay import ReplaySpec, replay, write_replay
from tspd_sim.cli import main as sim_main
from tspd_sim.records import DERIVED, REQUEST_FIELDS
from tspd_sim.testing import mooncake_trace
from tspd_sim.traces import Trace

from .conftest import LAUNCHER, child_env
from .test_openai_local import Local, start_local

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CPU_SPEC = ROOT / "experiments" / "data" / "04_fidelity" / "cpu.toml"
#: The tiny seeded model (tspd_engine.model.config.ModelConfig's defaults) as tspd-sim sees it.
TINY_SPEC = """[model]
name = "tspd-tiny"
layers = 2
hidden = 128
heads = 4
kv_heads = 2
head_dim = 32
intermediate = 256
vocab = 259
max_context = 512
weight_dtype = "float32"
kv_dtype = "float32"
"""
#: (arrival s, prompt tokens, output tokens, prefix block ids: distinct, so no prefix hits)
ROWS = [(0.0, 40, 6), (0.2, 70, 3), (0.25, 25, 8), (0.6, 90, 1), (0.7, 33, 5), (1.1, 60, 4)]


def _trace(rows: list[tuple[float, int, int]] = ROWS) -> Trace:
    return mooncake_trace([(t, i, o, [100 + k]) for k, (t, i, o) in enumerate(rows)])


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("step-logs")


@pytest.fixture(scope="module")
def cluster(logs: Path) -> Iterator[Local]:
    local = start_local(["--step-logs", str(logs), "--max-model-len", "512"])
    try:
        yield local
    finally:
        local.stop()


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open())) if path.exists() else []


def _sum(rows: list[dict[str, str]], column: str) -> int:
    return sum(int(r[column]) for r in rows)


def test_replay_writes_the_simulators_table_and_the_nodes_log_its_work(
    cluster: Local, logs: Path, tmp_path: Path
) -> None:
    trace_file = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": round(t * 1000), "input_length": i, "output_length": o, "hash_ids": [100 + k]}
        for k, (t, i, o) in enumerate(ROWS)
    ]
    trace_file.write_text("\n".join(json.dumps(line) for line in lines))
    before = {role: len(_rows(logs / f"{role}.csv")) for role in ("prefill", "decode")}
    discarded = _discarded(cluster)
    out = tmp_path / "run" / "requests.parquet"
    argv = [sys.executable, str(LAUNCHER), "replay", "--url", cluster.urls["router"],
            "--trace", str(trace_file), "--out", str(out), "--quiet"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0].startswith("replaying 6 requests of trace over 1.1 s (4.55")
    assert done.stdout.splitlines()[-1] == f"wrote {out} and {out.with_name('replay.json')}"

    table = pd.read_parquet(out)
    assert list(table.columns) == [name for name, _, _ in REQUEST_FIELDS] + list(DERIVED)
    assert table["idx"].tolist() == list(range(6))
    assert table["arrival_s"].tolist() == [t for t, _, _ in ROWS]
    assert table["input_len"].tolist() == [i for _, i, _ in ROWS]
    assert table["output_len"].tolist() == [o for _, _, o in ROWS]
    assert table["reject_reason"].tolist() == [""] * 6
    assert (table["first_token_s"] > table["arrival_s"]).all()
    assert (table["finish_s"] >= table["first_token_s"]).all()
    # A second token (the first decode step's) exactly where the output has one.
    assert table["first_step_end_s"].isna().tolist() == [o == 1 for _, _, o in ROWS]
    meta = json.loads(out.with_name("replay.json").read_text())
    assert (meta["requests"], meta["completed"], meta["failed"], meta["warmup"]) == (6, 6, 0, 1)
    assert meta["started_unix"] < meta["ended_unix"]

    # What the nodes computed, from their own step logs: P prefilled the warm-up prompt (as
    # long as request 0's) and every prompt in full (random prompts: no prefix hit); D ran one
    # decode row per token after the first (the warm-up's 4 tokens, then the trace's), and the
    # rows of requests that ended with the step in flight (its fed step launched past their
    # stop: D's discarded_steps).
    extra = _discarded(cluster) - discarded  # (its answer also means: D's rows are logged)
    _logged(cluster, "prefill")
    prefill = _rows(logs / "prefill.csv")[before["prefill"] :]
    decode = _rows(logs / "decode.csv")[before["decode"] :]
    assert {(r["tp"], r["decode_batch"]) for r in prefill} == {("2", "0")}
    assert {(r["tp"], r["prefill_seqs"]) for r in decode} == {("1", "0")}
    assert _sum(prefill, "prefill_tokens") == 40 + sum(i for _, i, _ in ROWS)
    assert _sum(decode, "decode_batch") == (4 - 1) + sum(o - 1 for _, _, o in ROWS) + extra


def _logged(cluster: Local, role: str) -> dict[str, float]:
    """The node's ``/stats``; rank 0 answers after its round, once it sent the round's
    outputs and then logged the round, so every round that sent a token the client saw is in
    the node's step log by then."""
    (stats,) = requests.get(cluster.urls[role] + "/stats", timeout=30).json()["replicas"]
    return dict(stats)


def _discarded(cluster: Local) -> int:
    return int(_logged(cluster, "decode")["discarded_steps"])


def test_requests_go_out_in_arrival_order_and_a_refused_one_is_recorded(
    cluster: Local, tmp_path: Path
) -> None:
    # Request 2's prompt does not fit the cluster's 512-token context: the router refuses it
    # (400); it is recorded with the router's reason and the others complete.
    rows = [(0.0, 30, 3), (0.05, 31, 2), (0.1, 600, 2), (0.1, 32, 4), (0.3, 33, 2)]
    trace = _trace(rows)
    spec = ReplaySpec(cluster.urls["router"], "tspd-tiny", seed=7, warmup=0)
    outcomes, report = asyncio.run(replay(trace, spec))
    sent = [o.sent_s for o in outcomes]
    assert sent == sorted(sent)
    assert [o.tokens for o in outcomes] == [3, 2, 0, 4, 2]
    assert [o.error for o in outcomes[:2] + outcomes[3:]] == [""] * 4
    assert outcomes[2].error == (
        "HTTP 400: the prompt has 600 tokens, which leaves no room below the context limit 512"
    )
    assert (report.completed, report.failed, report.errors) == (4, 1, {"HTTP 400": 1})
    table, _ = write_replay(tmp_path / "requests.csv", trace, outcomes, report)
    frame = pd.read_csv(table, keep_default_na=False, na_values=[""])
    assert frame["rejected"].tolist() == [False, False, True, False, False]


def test_calibrate_fits_the_real_nodes_step_logs_and_fidelity_replays_the_run(
    cluster: Local, logs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = ReplaySpec(cluster.urls["router"], "tspd-tiny", seed=11, warmup=1)
    trace = _trace()
    outcomes, report = asyncio.run(replay(trace, spec))
    assert report.failed == 0
    for role in ("prefill", "decode"):  # every round of the run is in the step logs
        _logged(cluster, role)
    table, _ = write_replay(tmp_path / "requests.parquet", trace, outcomes, report)
    model = tmp_path / "tiny.toml"
    model.write_text(TINY_SPEC)
    prefill, decode = logs / "prefill.csv", logs / "decode.csv"
    cal = tmp_path / "cal.json"
    argv = ["calibrate", str(prefill), str(decode), "--model", str(model), "--gpu", "cpu",
            "--gpu-spec", str(CPU_SPEC), "-o", str(cal)]  # fmt: skip
    assert sim_main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(cal.read_text())
    # One engine per node: P's TP 2 with the prefill phase, D's TP 1 with the decode phase.
    assert [(e["model"], e["gpu"], e["tp"], sorted(e["fitted"])) for e in doc["engines"]] == [
        ("tspd-tiny", "cpu", 1, ["decode"]),
        ("tspd-tiny", "cpu", 2, ["prefill"]),
    ]
    for engine in doc["engines"]:
        for coeffs in engine["fitted"].values():
            assert all(np.isfinite(v) and v >= 0 for v in coeffs.values())
    # Every logged round of each phase was either fitted or trimmed.
    for phase, path in (("prefill", prefill), ("decode", decode)):
        line = next(
            x
            for x in printed.splitlines()
            if x.startswith(f"  {phase}: ") and "predicted/measured" in x
        )
        counts = re.search(r"\((\d+) steps(?:, (\d+) trimmed)?; predicted/measured", line)
        assert counts is not None, line
        assert int(counts[1]) + int(counts[2] or 0) == len(_rows(path)), line

    out = tmp_path / "fidelity"
    argv = ["fidelity", "--real", str(table), "--model", str(model), "--gpu-spec",
            str(CPU_SPEC), "--prefill", "1xtp2", "--decode", "1xtp1", "--calibration",
            str(cal), "--page-size", "16", "--num-pages", "1024", "--net", "tcp-dev",
            "--no-layerwise", "--decode-rounds", "--out", str(out), "--quiet"]  # fmt: skip
    assert sim_main(argv) == 0
    figures = pd.read_csv(out / "fidelity.csv")
    assert figures["figure"].tolist() == [
        "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "throughput_rps", "output_tok_s",
    ]  # fmt: skip
    assert (figures["measured"] > 0).all()
    assert (figures["simulated"] > 0).all()
    simulated = pd.read_parquet(out / "requests.parquet").sort_values("idx")
    assert simulated["input_len"].tolist() == [i for _, i, _ in ROWS]
    assert (simulated["reject_reason"] == "").all()


def test_replay_refuses_a_router_that_is_not_there(tmp_path: Path) -> None:
    with socket.socket() as held:  # bound, never listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        argv = [sys.executable, str(LAUNCHER), "replay", "--url", url, "--requests", "3",
                "--out", str(tmp_path / "r.parquet")]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 2
    err = done.stderr.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"launch_pd.py replay: error: cannot reach the router at {url}: ")
    assert not (tmp_path / "r.parquet").exists()
