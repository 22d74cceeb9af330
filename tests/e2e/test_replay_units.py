"""The trace replay's parts that need no cluster: prompts, the window of a trace, the stream
parser (hostile lines fail the request, not the replay), the table it writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tspd_launch.replay import (
    PROMPT_IDS,
    Outcome,
    ReplayError,
    ReplayReport,
    _event,
    select_trace,
    synth_prompts,
    write_replay,
)
from tspd_sim.records import DERIVED, REQUEST_FIELDS
from tspd_sim.testing import mooncake_trace
from tspd_sim.traces import load_trace


def test_prompts_have_the_trace_lengths_and_are_repeatable() -> None:
    trace = load_trace("azure-conv").head(5).scale_lengths(1 / 8, 1)
    prompts = synth_prompts(trace, seed=3)
    assert [len(p) for p in prompts] == trace.input_len.tolist() == [47, 50, 110, 11, 11]
    assert all(PROMPT_IDS[0] <= t < PROMPT_IDS[1] for p in prompts for t in p)
    assert synth_prompts(trace, seed=3) == prompts
    assert synth_prompts(trace, seed=4) != prompts
    assert prompts[3] != prompts[4]  # equal lengths, other tokens


def test_a_shared_prefix_block_gets_the_same_tokens() -> None:
    # Requests 0 and 1 share block 7 (512 tokens); 1 and 2 nothing.
    trace = mooncake_trace([(0.0, 600, 4, [7, 8]), (1.0, 530, 4, [7, 9]), (2.0, 100, 4, [10])])
    a, b, c = synth_prompts(trace)
    assert (len(a), len(b), len(c)) == (600, 530, 100)
    assert a[:512] == b[:512]
    assert a[512:530] != b[512:]
    assert a[:100] != c


def test_the_window_rate_and_lengths() -> None:
    trace = mooncake_trace([(t, 100 + t, 10, []) for t in (0, 10, 11, 13, 20, 21)])
    picked = select_trace(trace, start_s=10, requests=3, rate=1.0, input_scale=0.5)
    # Arrivals 10, 11, 13 re-based to 0, 1, 3: 2 gaps in 3 s, 2/3 req/s; at 1 req/s they
    # come 1.5 times as fast.
    assert picked.arrival_s.tolist() == pytest.approx([0.0, 1 / 1.5, 3 / 1.5], rel=1e-12)
    assert picked.rate == pytest.approx(1.0)
    assert picked.input_len.tolist() == [55, 56, 56]  # 110, 111, 113 halved, rounded to even
    with pytest.raises(ReplayError, match=r"^trace 'test' has no request from 30 s on$"):
        select_trace(trace, start_s=30)
    with pytest.raises(ReplayError, match=r"^--rate needs a rate > 0 and at least two"):
        select_trace(trace, requests=1, rate=1.0)
    with pytest.raises(ReplayError, match=r"^--start must be >= 0 and --requests >= 1$"):
        select_trace(trace, start_s=-1)


def _line(event: object) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n"


def test_the_stream_parser_counts_token_ids_and_keeps_their_times() -> None:
    out = Outcome()
    _event(b": keep-alive\n", 0.1, out)
    _event(_line({"choices": [{"text": "ab", "token_ids": [5, 6]}]}), 0.5, out)
    _event(_line({"choices": [{"text": "", "token_ids": []}]}), 0.6, out)
    _event(_line({"choices": [{"text": "c", "token_ids": [7]}]}), 0.9, out)
    _event(_line({"choices": [], "usage": {"completion_tokens": 3}}), 1.0, out)
    _event(b"data: [DONE]\n", 1.1, out)
    assert (out.tokens, out.first_token_s, out.second_token_s, out.finish_s) == (3, 0.5, 0.5, 0.9)
    failed = Outcome()
    _event(_line({"error": {"message": "transfer failed", "type": "x"}}), 1.0, failed)
    assert failed.error == "stream error: transfer failed"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"data: {not json\n", r"Expecting property name"),
        (b"data: [1, 2]\n", r"^a stream event that is not an object$"),
        (_line({"choices": {"a": 1}}), r"^'choices' is not a list$"),
        (_line({"choices": [{"token_ids": 5}]}), r"^'token_ids' is not a list$"),
    ],
)
def test_a_malformed_stream_line_is_an_error(raw: bytes, message: str) -> None:
    # _one turns the ValueError into that request's error: the replay goes on.
    with pytest.raises(ValueError, match=message):
        _event(raw, 0.0, Outcome())


def test_the_table_has_the_simulators_columns(tmp_path: Path) -> None:
    trace = mooncake_trace([(5.0, 10, 3, []), (5.5, 20, 1, []), (7.0, 30, 2, [])])
    outcomes = [
        Outcome(0.001, 0.2, 0.3, 0.4, 3),
        Outcome(0.501, 0.7, float("nan"), 0.7, 1),
        Outcome(2.002, float("nan"), float("nan"), float("nan"), 0, "HTTP 400: too long"),
    ]
    report = ReplayReport("http://x", "m", "test", 3, 0, 1, completed=2, failed=1)
    table, meta = write_replay(tmp_path / "r" / "requests.parquet", trace, outcomes, report)
    frame = pd.read_parquet(table)
    assert list(frame.columns) == [name for name, _, _ in REQUEST_FIELDS] + list(DERIVED)
    assert frame["idx"].tolist() == [0, 1, 2]
    assert frame["arrival_s"].tolist() == [0.0, 0.5, 2.0]
    assert frame["reject_reason"].tolist() == ["", "", "HTTP 400: too long"]
    assert frame["rejected"].tolist() == [False, False, True]
    assert frame["ttft_s"].tolist()[:2] == pytest.approx([0.2, 0.2])
    assert frame["tpot_s"].tolist()[0] == pytest.approx(0.1)
    assert np.isnan(frame["tpot_s"][1])
    assert frame["first_step_end_s"].tolist()[0] == 0.3
    assert frame["p_engine"].isna().all()  # only a simulation knows it
    assert json.loads(meta.read_text())["failed"] == 1
