"""Trace loaders: Mooncake JSONL, Azure LLM CSV, and the traces bundled with the package.

Bundled traces (see ``tspd_sim/data/README.md`` for licences and attribution):

=================  =========================================================================
name               file
=================  =========================================================================
``mooncake``       Mooncake FAST'25 conversation trace (12,031 requests, ~1 h, prefix ids)
``azure-code``     Azure LLM inference trace 2023, code service (8,819 requests)
``azure-conv``     Azure LLM inference trace 2023, conversation service (19,366 requests)
=================  =========================================================================
"""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tspd_sim.errors import TraceError
from tspd_sim.traces.trace import MOONCAKE_BLOCK_TOKENS, Trace, gather_rows

BUNDLED: dict[str, str] = {
    "mooncake": "mooncake_conversation_trace.jsonl",
    "azure-code": "azure_llm_2023_code.csv",
    "azure-conv": "azure_llm_2023_conv.csv",
}

_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


def bundled_text(name: str) -> str:
    """The raw text of a bundled trace (read through importlib.resources)."""
    if name not in BUNDLED:
        raise TraceError(f"no bundled trace {name!r}; bundled: {sorted(BUNDLED)}")
    return resources.files("tspd_sim.data").joinpath(BUNDLED[name]).read_text(encoding="utf-8")


def load_trace(source: str | Path) -> Trace:
    """A bundled trace by name, or a file: ``*.jsonl`` as Mooncake, ``*.csv`` as Azure."""
    if isinstance(source, str) and source in BUNDLED:
        text = bundled_text(source)
        if BUNDLED[source].endswith(".jsonl"):
            return parse_mooncake(text, name=source)
        return parse_azure(text, name=source)
    path = Path(source)
    if not path.is_file():
        raise TraceError(
            f"trace {str(source)!r} is neither a bundled trace {sorted(BUNDLED)} "
            f"nor a readable file"
        )
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return parse_mooncake(text, name=path.stem)
    if path.suffix == ".csv":
        return parse_azure(text, name=path.stem)
    raise TraceError(
        f"trace file {path}: unknown format {path.suffix!r}; use .jsonl (Mooncake) or .csv (Azure)"
    )


def parse_mooncake(
    text: str, name: str = "mooncake", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Trace:
    """Parse Mooncake JSONL: one object per line with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and optional ``hash_ids`` (chained ids of ``block_tokens``-token blocks).

    Arrivals are re-based so the first request arrives at 0 s; lines out of time order are
    stably sorted. Every malformed line is reported with its line number.
    """
    ts: list[float] = []
    inp: list[int] = []
    out: list[int] = []
    counts: list[int] = []
    flat: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row = _mooncake_row(line, lineno, name)
        ts.append(float(row["timestamp"]))
        inp.append(int(row["input_length"]))
        out.append(int(row["output_length"]))
        ids = row.get("hash_ids", [])
        counts.append(len(ids))
        flat.extend(ids)
    if not ts:
        raise TraceError(f"trace {name!r}: no requests")
    return _assemble(name, np.asarray(ts) / 1000.0, inp, out, counts, flat, block_tokens)


def _mooncake_row(line: str, lineno: int, name: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"trace {name!r} line {lineno}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise TraceError(f"trace {name!r} line {lineno}: expected an object, got {type(row)}")
    for key in _MOONCAKE_KEYS:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TraceError(
                f"trace {name!r} line {lineno}: {key!r} must be a number, got {value!r}"
            )
    for key in _MOONCAKE_KEYS[1:]:
        if int(row[key]) != row[key] or row[key] < 1:
            raise TraceError(
                f"trace {name!r} line {lineno}: {key!r} must be an integer ≥ 1, got {row[key]!r}"
            )
    ids = row.get("hash_ids", [])
    if not isinstance(ids, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids
    ):
        raise TraceError(f"trace {name!r} line {lineno}: 'hash_ids' must be a list of integers ≥ 0")
    return row


def parse_azure(text: str, name: str = "azure") -> Trace:
    """Parse the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    Timestamps are wall-clock datetimes; arrivals are re-based to the first. The trace has no
    prefix identities, so every prompt is unique to the simulator.
    """
    try:
        df = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise TraceError(f"trace {name!r}: not a CSV ({exc})") from exc
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(df.columns)
    if missing:
        raise TraceError(
            f"trace {name!r}: missing column(s) {sorted(missing)}; Azure traces have "
            f"TIMESTAMP, ContextTokens, GeneratedTokens"
        )
    if df.empty:
        raise TraceError(f"trace {name!r}: no requests")
    try:
        stamps = pd.to_datetime(df["TIMESTAMP"], format="ISO8601")
    except (ValueError, TypeError) as exc:
        raise TraceError(f"trace {name!r}: bad TIMESTAMP ({exc})") from exc
    secs = (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    lengths = []
    for col in ("ContextTokens", "GeneratedTokens"):
        values = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = ~np.isfinite(values) | (values < 1) | (values != np.round(values))
        if bad.any():
            row = int(np.argmax(bad))
            raise TraceError(
                f"trace {name!r} data row {row + 1}: {col} must be an integer ≥ 1, "
                f"got {df[col].iloc[row]!r}"
            )
        lengths.append(values.astype(np.int64))
    n = len(secs)
    return _assemble(name, secs, lengths[0], lengths[1], [0] * n, [], 0)


def _assemble(
    name: str,
    secs: np.ndarray,
    inp: object,
    out: object,
    counts: list[int],
    flat: list[int],
    block_tokens: int,
) -> Trace:
    """Build a trace from unsorted rows: stable sort by arrival, re-base to the first."""
    secs = np.asarray(secs, dtype=np.float64)
    if not np.all(np.isfinite(secs)):
        raise TraceError(f"trace {name!r}: arrival times must be finite")
    order = np.argsort(secs, kind="stable")
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=offsets[1:])
    new_offsets, new_flat = gather_rows(offsets, np.asarray(flat, dtype=np.int64), order)
    return Trace(
        name,
        secs[order] - secs.min(),
        np.asarray(inp, dtype=np.int64)[order],
        np.asarray(out, dtype=np.int64)[order],
        new_offsets,
        new_flat,
        block_tokens if flat else 0,
    )
