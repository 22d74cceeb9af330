"""Node ``/metrics``: the engine counters' exposition (types, names, labels), exactly."""

from __future__ import annotations

import subprocess
import sys
import time

from tspd_engine.node.metrics import COUNTERS, GAUGES, number, render
from tspd_serving import process_metrics


def test_counters_are_counters_named_total_and_levels_are_gauges() -> None:
    replicas = [
        {"held": 2.0, "preemptions": 3.0, "pd_transfer_seconds_sum": 0.25, "pd_new_thing": 1.0},
        {"held": 0.0, "preemptions": 0.0},
    ]
    at = 'role="prefill",replica='
    assert render("prefill", replicas).splitlines() == [
        "# HELP tspd_node_held requests whose pages are held until their transfer ends",
        "# TYPE tspd_node_held gauge",
        f'tspd_node_held{{{at}"0"}} 2',
        f'tspd_node_held{{{at}"1"}} 0',
        "# HELP tspd_node_pd_new_thing pd new thing",
        "# TYPE tspd_node_pd_new_thing gauge",
        f'tspd_node_pd_new_thing{{{at}"0"}} 1',
        "# HELP tspd_node_pd_transfer_seconds_total seconds of succeeded transfers "
        "(P: hand-over to Succeeded; D: register to KV in)",
        "# TYPE tspd_node_pd_transfer_seconds_total counter",
        f'tspd_node_pd_transfer_seconds_total{{{at}"0"}} 0.25',
        "# HELP tspd_node_preemptions_total requests preempted (recomputed) after a page shortage",
        "# TYPE tspd_node_preemptions_total counter",
        f'tspd_node_preemptions_total{{{at}"0"}} 3',
        f'tspd_node_preemptions_total{{{at}"1"}} 0',
    ]


def test_every_counter_name_ends_in_total_and_no_key_is_both() -> None:
    assert all(name.endswith("_total") for name, _ in COUNTERS.values())
    assert not set(COUNTERS) & set(GAUGES)
    assert render("decode", []) == ""


def test_sample_values_keep_every_digit() -> None:
    # ":g" rendered 1234567 tokens as 1.23457e+06 and cut seconds to six digits.
    text = render("decode", [{"forward_tokens": 1234567.0, "decode_round_seconds": 0.0227830799}])
    assert (
        text.splitlines()[-1] == 'tspd_node_forward_tokens_total{role="decode",replica="0"} 1234567'
    )
    assert 'tspd_node_decode_round_seconds_total{role="decode",replica="0"} 0.0227830799' in text
    assert [number(v) for v in (2.0, 0.25, 0.1, -3.0, float("inf"))] == [
        "2",
        "0.25",
        "0.1",
        "-3",
        "+Inf",
    ]
    assert [number(v) for v in (float("-inf"), float("nan"))] == ["-Inf", "NaN"]


def test_process_start_time_is_the_kernels_start_of_that_process() -> None:
    """A process started between two clock reads reports a start time between them (the
    kernel's boot time is whole seconds: up to 1 s earlier), and it differs from ours."""
    before = time.time()
    code = "from tspd_serving import process_metrics as p; print(p.exposition())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60)  # fmt: skip
    after = time.time()
    help_line, type_line, sample = child.stdout.splitlines()[:3]
    assert (help_line, type_line) == (
        "# HELP process_start_time_seconds Unix time the process started.",
        "# TYPE process_start_time_seconds gauge",
    )
    name, value = sample.split()
    assert name == "process_start_time_seconds"
    assert before - 1.0 <= float(value) <= after
    assert float(value) != process_metrics.STARTED
