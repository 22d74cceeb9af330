"""Per-request results streamed to Parquet while the run goes, so memory stays flat.

A request's row is written when it finishes (or is rejected, at arrival) and the request is
forgotten; rows are buffered and written as Parquet row groups of :data:`GROUP_ROWS` rows, with
the derived timing columns (``ttft_s``, ``tpot_s`` ...) computed per group. Rows are in the
order requests finished; ``idx`` is the request's index in the trace. Requests that were
preempted also get rows in a second file, one per run of decode steps (their token times are
slices of their engine's step log).

Ownership: one :class:`RunFiles` per run, written from the simulation's thread; after
:meth:`RunFiles.close` the files are complete and only read.
"""

from __future__ import annotations

import operator
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

if TYPE_CHECKING:
    from tspd_sim.sim.request import SimRequest

#: Rows per Parquet row group (and per write).
GROUP_ROWS = 16_384

_I, _F, _S = pa.int64(), pa.float64(), pa.string()

#: (column, SimRequest attribute, type) of the values a finished request leaves.
REQUEST_FIELDS: tuple[tuple[str, str, pa.DataType], ...] = (
    ("idx", "idx", _I),
    ("room", "room", _I),
    ("p_engine", "p_engine", _I),
    ("d_engine", "d_engine", _I),
    ("arrival_s", "arrival", _F),
    ("input_len", "input_len", _I),
    ("output_len", "output_len", _I),
    ("p_hit_tokens", "p_hit", _I),
    ("d_hit_tokens", "d_hit", _I),
    ("prefill_tokens", "computed", _I),
    ("chunks", "chunks", _I),
    ("d_admit_s", "t_d_admit", _F),
    ("prefill_start_s", "t_prefill_start", _F),
    ("prefill_end_s", "t_prefill_end", _F),
    ("transfer_start_s", "t_xfer_start", _F),
    ("kv_arrived_s", "t_kv", _F),
    ("first_token_s", "t_first_token", _F),
    ("finish_s", "t_finish", _F),
    ("transfer_bytes", "xfer_bytes", _I),
    ("transfer_descriptors", "xfer_desc", _I),
    ("join_step", "join_step", _I),
    ("first_step_end_s", "t_first_step", _F),
    ("preemptions", "preemptions", _I),
    ("recomputed_tokens", "recomputed", _I),
    ("swap_bytes", "swap_bytes", _I),
    ("reject_reason", "reject", _S),
)
_ROW = operator.attrgetter(*(attr for _, attr, _ in REQUEST_FIELDS))

#: Columns computed from the others, per row group (see :func:`derive`).
DERIVED = (
    "rejected", "queue_s", "prefill_s", "transfer_s", "xfer_exposed_s", "ttft_s", "e2e_s",
    "tpot_s",
)  # fmt: skip

#: One row per run of decode steps of a preempted request (``gap_s``: from the last token of
#: the run before to the first of this one; NaN for the first run).
SEGMENT_FIELDS: tuple[tuple[str, pa.DataType], ...] = (
    ("request", _I),
    ("d_engine", _I),
    ("seg", _I),
    ("start_step", _I),
    ("steps", _I),
    ("gap_s", _F),
)


def derive(c: dict[str, Any]) -> dict[str, Any]:
    """The derived timing columns from a group's raw columns (numpy arrays)."""
    decoded = c["output_len"] - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(decoded > 0, (c["finish_s"] - c["first_token_s"]) / decoded, np.nan)
    return {
        "rejected": c["reject_reason"] != "",
        "queue_s": c["prefill_start_s"] - c["arrival_s"],
        "prefill_s": c["prefill_end_s"] - c["prefill_start_s"],
        "transfer_s": c["kv_arrived_s"] - c["transfer_start_s"],
        "xfer_exposed_s": c["kv_arrived_s"] - c["prefill_end_s"],
        "ttft_s": c["first_token_s"] - c["arrival_s"],
        "e2e_s": c["finish_s"] - c["arrival_s"],
        "tpot_s": tpot,
    }


class ParquetSink:
    """Rows (tuples in ``fields`` order) buffered and written as Parquet row groups."""

    def __init__(self, path: Path, fields: tuple[tuple[str, pa.DataType], ...], derived: bool):
        self.path = path
        self._names = [name for name, _ in fields]
        self._types = [kind for _, kind in fields]
        self._derived = derived
        self._rows: list[tuple[Any, ...]] = []
        self._writer: pq.ParquetWriter | None = None
        self.count = 0

    def add(self, row: tuple[Any, ...]) -> None:
        self._rows.append(row)
        if len(self._rows) >= GROUP_ROWS:
            self._write()

    def _write(self) -> None:
        cols = list(zip(*self._rows, strict=True)) if self._rows else [()] * len(self._names)
        arrays = {
            name: np.array(col, dtype=object if kind == _S else kind.to_pandas_dtype())
            for name, kind, col in zip(self._names, self._types, cols, strict=True)
        }
        if self._derived:
            arrays |= derive(arrays)
        table = pa.table({name: pa.array(col) for name, col in arrays.items()})
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema)
        self._writer.write_table(table)
        self.count += len(self._rows)
        self._rows = []

    def close(self) -> None:
        """Write what is buffered (an empty table if nothing was ever written) and close."""
        if self._rows or self._writer is None:
            self._write()
        assert self._writer is not None
        self._writer.close()


def request_row(req: SimRequest) -> tuple[Any, ...]:
    row: tuple[Any, ...] = _ROW(req)
    return row


def segment_rows(req: SimRequest) -> list[tuple[Any, ...]]:
    """The runs of decode steps of a preempted request (empty if it never was)."""
    runs, gaps = req.segments or [], req.gaps or []
    return [
        (req.idx, req.d_engine, k, start, steps, gaps[k - 1] if k else float("nan"))
        for k, (start, steps) in enumerate(runs)
    ]


class RunFiles:
    """Where one run's results go: ``requests.parquet`` (in ``out`` when given, else in a
    private temporary folder), ``segments.parquet`` and the step logs' spill files (in the
    private folder). The private folder is removed by :meth:`discard`."""

    def __init__(self, out: Path | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="tspd-sim-"))
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        self.requests_path = (out or self.tmp) / "requests.parquet"
        self.segments_path = self.tmp / "segments.parquet"
        fields = tuple((name, kind) for name, _, kind in REQUEST_FIELDS)
        self.requests = ParquetSink(self.requests_path, fields, derived=True)
        self.segments = ParquetSink(self.segments_path, SEGMENT_FIELDS, derived=False)

    def spill(self, engine: int) -> Path:
        """The spill file of D engine ``engine``'s step log."""
        return self.tmp / f"steps_d{engine}.f64"

    def finished(self, req: SimRequest) -> None:
        """Write a finished or rejected request's rows."""
        self.requests.add(request_row(req))
        if req.segments:
            for row in segment_rows(req):
                self.segments.add(row)

    def close(self) -> None:
        self.requests.close()
        self.segments.close()

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
