"""The step log: what each round's forwards computed (exact regressors), rank 0's CSV lines and
the round counters of ``/stats`` and ``/metrics`` (rank/steps.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.loop.runner import RoundShape
from tspd_engine.node.metrics import render
from tspd_engine.rank.launch import check_config, launch
from tspd_engine.rank.steps import COLUMNS, StepLog, replica_log
from tspd_serving.errors import ConfigError

from .conftest import small_config


def _shapes(engine: Engine) -> list[RoundShape]:
    shapes = []
    while engine.core.has_work:
        engine.step()
        shapes.append(engine.core.runner.take_shape())
    return shapes


def test_round_shapes_count_chunks_context_pairs_and_decode_keys() -> None:
    # Prompts of 20 and 6 tokens under an 8-token prefill budget: the 20-token prompt is
    # chunked 8 + 8 + 4 (on 0, 8 and 16 cached tokens), the 6-token one waits for the budget.
    engine = Engine(small_config(max_prefill_tokens=8))
    try:
        engine.add(list(range(1, 21)), SamplingParams(max_tokens=3, ignore_eos=True))
        engine.add(list(range(30, 36)), SamplingParams(max_tokens=2, ignore_eos=True))
        shapes = _shapes(engine)
    finally:
        engine.close()
    pairs = lambda n, c: n * c + n * (n + 1) // 2  # noqa: E731
    assert shapes == [
        RoundShape(1, 8, 0, pairs(8, 0)),
        RoundShape(1, 8, 8, pairs(8, 8)),
        # The long prompt's last chunk and the short one's first 4 tokens in one forward; the
        # long one's first token came from its last chunk and it decodes (position 20: 21 keys).
        RoundShape(2, 4 + 4, 16 + 0, pairs(4, 16) + pairs(4, 0), 1, 21),
        # The short one's last 2 tokens on 4 cached; both decode (22 and 7 keys).
        RoundShape(1, 2, 4, pairs(2, 4), 2, 22 + 7),
        RoundShape(),  # the fed step in flight settles: no forward
    ]


def test_a_replica_logs_each_round_with_a_forward_and_counts_it(tmp_path: Path) -> None:
    log = tmp_path / "steps.csv"
    handle = launch(small_config(step_log=log), in_process=True)
    try:
        assert handle.client.generate(list(range(1, 21)), 5, ignore_eos=True)
        stats = handle.client.stats()
    finally:
        handle.shutdown()
    rows = list(csv.DictReader(log.open()))
    assert tuple(rows[0]) == COLUMNS
    shapes = [[int(r[c]) for c in COLUMNS[2:]] for r in rows]
    # A colocated engine decodes in the round its prompt is prefilled: one mixed round (20
    # tokens, 210 pairs, and the first decode step attending 21 keys), then 3 decode steps.
    assert shapes == [
        [1, 1, 20, 0, 210, 1, 21],
        [1, 0, 0, 0, 0, 1, 22],
        [1, 0, 0, 0, 0, 1, 23],
        [1, 0, 0, 0, 0, 1, 24],
    ]
    ends = [float(r["end_s"]) for r in rows]
    assert ends == sorted(ends)
    seconds = [float(r["seconds"]) for r in rows]
    assert all(s > 0 for s in seconds)
    assert (stats["mixed_rounds"], stats["decode_rounds"], stats["prefill_rounds"]) == (1, 3, 0)
    # The log rounds to the microsecond.
    assert stats["mixed_round_seconds"] == pytest.approx(seconds[0], abs=1e-6)
    assert stats["decode_round_seconds"] == pytest.approx(sum(seconds[1:]), abs=3e-6)


def test_the_log_is_appended_to_with_one_header(tmp_path: Path) -> None:
    log = tmp_path / "steps.csv"
    for _ in range(2):
        handle = launch(small_config(step_log=log), in_process=True)
        try:
            handle.client.generate([5, 6, 7], 2, ignore_eos=True)
        finally:
            handle.shutdown()
    lines = log.read_text().splitlines()
    assert [i for i, line in enumerate(lines) if line.startswith("end_s,")] == [0]
    assert [line.split(",")[3:] for line in lines[1:]] == [["1", "3", "0", "6", "1", "4"]] * 2


def test_an_unwritable_log_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    where = tmp_path / "missing" / "steps.csv"
    with pytest.raises(ConfigError, match=r"^--step-log .*steps\.csv: cannot write it \("):
        check_config(small_config(step_log=where))
    assert not where.parent.exists()


def test_replicas_write_their_own_files() -> None:
    assert replica_log(Path("/x/steps.csv"), 0, 1) == Path("/x/steps.csv")
    assert [replica_log(Path("/x/steps.csv"), i, 2) for i in range(2)] == [
        Path("/x/steps.r0.csv"),
        Path("/x/steps.r1.csv"),
    ]


def test_round_counters_render_as_counters() -> None:
    steps = StepLog(tp=2)
    steps.record(RoundShape(decode_batch=3, decode_ctx=30), 0.25)
    steps.record(RoundShape(decode_batch=2, decode_ctx=20), 0.5)
    steps.record(RoundShape(), 9.0)  # no forward: neither counted nor logged
    stats = steps.stats()
    assert stats == {
        "prefill_rounds": 0, "prefill_round_seconds": 0.0, "decode_rounds": 2,
        "decode_round_seconds": 0.75, "mixed_rounds": 0, "mixed_round_seconds": 0.0,
    }  # fmt: skip
    text = render("decode", [stats])
    assert 'tspd_node_decode_round_seconds_total{role="decode",replica="0"} 0.75' in text
    assert "# TYPE tspd_node_decode_rounds_total counter" in text
    assert (
        "# HELP tspd_node_decode_rounds_total scheduler rounds that ran a forward "
        "(one decode step only)"
    ) in text
