"""Tables for the terminal (rich) and files on disk (Parquet/CSV, JSON, PNG) for a run."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq  # type: ignore[import-untyped]
from rich.console import Console
from rich.table import Table

from tspd_sim.metrics import SimResult, Slo

#: (summary key, label, scale, format) rows of the summary table.
ROWS: tuple[tuple[str, str, float, str], ...] = (
    ("requests", "requests", 1, "{:,.0f}"),
    ("rejected", "rejected", 1, "{:,.0f}"),
    ("span_s", "simulated span (s)", 1, "{:,.1f}"),
    ("throughput_rps", "throughput (req/s)", 1, "{:.2f}"),
    ("output_tok_s", "output tokens/s", 1, "{:,.0f}"),
    ("slo_attainment", "SLO attainment (%)", 100, "{:.1f}"),
    ("slo_met_rps", "SLO-met rate (req/s)", 1, "{:.3f}"),
    ("slo_met_rps_per_gpu", "SLO-met rate per GPU (req/s)", 1, "{:.3f}"),
    ("ttft_p50", "TTFT p50 (s)", 1, "{:.3f}"),
    ("ttft_p90", "TTFT p90 (s)", 1, "{:.3f}"),
    ("ttft_p99", "TTFT p99 (s)", 1, "{:.3f}"),
    ("tpot_p50", "TPOT p50 (ms)", 1e3, "{:.1f}"),
    ("tpot_p90", "TPOT p90 (ms)", 1e3, "{:.1f}"),
    ("tpot_p99", "TPOT p99 (ms)", 1e3, "{:.1f}"),
    ("itl_p99", "ITL p99 (ms)", 1e3, "{:.1f}"),
    ("e2e_p50", "E2E p50 (s)", 1, "{:.2f}"),
    ("e2e_p99", "E2E p99 (s)", 1, "{:.2f}"),
    ("queue_p90", "queueing p90 (s)", 1, "{:.3f}"),
    ("xfer_exposed_p99", "exposed transfer p99 (ms)", 1e3, "{:.2f}"),
    ("preemptions", "preemptions (decode out of pages)", 1, "{:,.0f}"),
    ("transfer_bytes", "KV moved (GB)", 1e-9, "{:,.1f}"),
    ("transfer_descriptors", "descriptors (M)", 1e-6, "{:,.2f}"),
    ("p_prefix_hit_frac", "P prefix hit (% of prompt)", 100, "{:.1f}"),
    ("d_prefix_hit_frac", "D prefix hit (% of prompt)", 100, "{:.1f}"),
    ("wall_s", "wall time (s)", 1, "{:.2f}"),
    ("sim_requests_per_wall_s", "simulated req per wall s", 1, "{:,.0f}"),
)


def _cell(summary: Mapping[str, float], key: str, scale: float, fmt: str) -> str:
    value = summary.get(key)
    if value is None or value != value:
        return "–"
    return fmt.format(value * scale)


def summary_table(summaries: Mapping[str, Mapping[str, float]], title: str) -> Table:
    """One column per run."""
    table = Table(title=title, show_lines=False)
    table.add_column("metric", style="bold")
    for label in summaries:
        table.add_column(label, justify="right")
    for key, name, scale, fmt in ROWS:
        table.add_row(name, *(_cell(s, key, scale, fmt) for s in summaries.values()))
    return table


def print_table(table: Table) -> None:
    Console().print(table)


def write_run(result: SimResult, slo: Slo, out: Path, fmt: str) -> list[Path]:
    """requests.<fmt>, summary.json, links.csv, pools.csv, held.csv (and in_system.csv, and
    segments.<fmt> when requests were preempted) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [_write_requests(result, out / f"requests.{fmt}", fmt)]
    if len(result.segments):
        written.append(write_frame(result.segments, out / f"segments.{fmt}", fmt))
    summary = {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        **result.info,
        "summary": result.summary(slo),
    }
    path = out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    written.append(path)
    for name in ("links", "pools", "held"):
        frame: pd.DataFrame = result.timelines[name]
        written.append(
            write_frame(frame.rename_axis("t_s").reset_index(), out / f"{name}.csv", "csv")
        )
    series = result.timelines.get("in_system")
    if series is not None:
        written.append(
            write_frame(series.rename_axis("t_s").reset_index(), out / "in_system.csv", "csv")
        )
    return written


def _write_requests(result: SimResult, path: Path, fmt: str) -> Path:
    """The per-request table, from the file the run streamed it to when there is one (row
    group by row group: the rows of a long run never all sit in memory)."""
    source = result.requests_path
    if source is None:
        return write_frame(result.requests, path, fmt)
    if fmt == "parquet":
        if source.resolve() != path.resolve():
            shutil.copyfile(source, path)
        return path
    header = True
    with path.open("w", newline="") as f:
        for batch in pq.ParquetFile(source).iter_batches():
            batch.to_pandas().to_csv(f, index=False, header=header)
            header = False
    return path


def write_frame(df: pd.DataFrame, path: Path, fmt: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        df.to_parquet(path, index=False)
    else:
        df.to_csv(path, index=False)
    return path
