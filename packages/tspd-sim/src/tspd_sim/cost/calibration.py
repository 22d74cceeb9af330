"""Calibration files: override the roofline's knobs, or replace it with fitted coefficients.

A calibration file is JSON (``.json``) or TOML (``.toml``)::

    {
      "roofline": {"mfu": 0.4, "mbu": 0.65},          # optional: knobs for every engine
      "engines": [                                    # optional: per (model, GPU, TP) engine
        {"model": "llama-2-70b", "gpu": "h100", "tp": 8,
         "roofline": {"step_overhead_s": 0.01},       # knobs for this engine only, or
         "fitted": {"prefill": {"const_s": ..., "per_token_s": ..., "per_pair_s": ...,
                                "per_seq_s": ...},
                    "decode": {"const_s": ..., "per_seq_s": ..., "per_ctx_token_s": ...}}}
      ]
    }

An engine with ``fitted`` coefficients uses :class:`~tspd_sim.cost.fitted.FittedCost`; every
other engine uses the roofline with the default knobs, overridden by the top-level knobs, then
by its entry's knobs. Unknown keys are errors (a typo must not silently fall back to defaults).
"""

from __future__ import annotations

import csv
import io
import json
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_sim.cost.fitted import (
    DecodeCoeffs,
    FittedCost,
    Measurement,
    PrefillCoeffs,
    StepCost,
    StepSample,
)
from tspd_sim.cost.roofline import RooflineCost, RooflineKnobs
from tspd_sim.errors import SpecError
from tspd_sim.specs import GpuSpec, ModelSpec

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Calibration shipped with the package: fitted to SplitwiseSim's Llama-2-70B / H100 / TP 8.
BUNDLED_CALIBRATION = "splitwise_llama2_70b_h100_tp8.json"
BUNDLED_MEASUREMENTS = "splitwise_llama2_70b_h100_tp8.csv"


@dataclass(frozen=True, slots=True)
class EngineCalibration:
    model: str
    gpu: str
    tp: int
    knobs: dict[str, float] = field(default_factory=dict)
    fitted: FittedCost | None = None


@dataclass(frozen=True, slots=True)
class Calibration:
    """Parsed calibration; ``Calibration()`` is the pure default roofline."""

    knobs: dict[str, float] = field(default_factory=dict)
    engines: tuple[EngineCalibration, ...] = ()
    source: str = "defaults"

    def cost_model(self, model: ModelSpec, gpu: GpuSpec, tp: int) -> StepCost:
        """The step-time model of one engine of ``tp`` GPUs."""
        entry = next(
            (e for e in self.engines if (e.model, e.gpu, e.tp) == (model.name, gpu.name, tp)), None
        )
        if entry is not None and entry.fitted is not None and entry.fitted.complete:
            return entry.fitted
        knobs = replace(RooflineKnobs(), **self.knobs)
        if entry is not None:
            knobs = replace(knobs, **entry.knobs)
        roofline = RooflineCost(model, gpu, tp, knobs)
        if entry is not None and entry.fitted is not None:  # one phase fitted: the roofline
            return FittedCost(entry.fitted.prefill, entry.fitted.decode, roofline)  # the other
        return roofline

    def describe(self, model: ModelSpec, gpu: GpuSpec, tp: int) -> str:
        """'roofline', 'fitted', or the fitted phase with the roofline for the other
        ('fitted prefill' / 'fitted decode'), for tables and logs."""
        cost = self.cost_model(model, gpu, tp)
        if not isinstance(cost, FittedCost):
            return "roofline"
        if cost.complete:
            return "fitted"
        return "fitted prefill" if cost.prefill is not None else "fitted decode"


_KNOB_NAMES = {f.name for f in fields(RooflineKnobs)}


def _knobs(raw: object, where: str) -> dict[str, float]:
    if not isinstance(raw, dict):
        raise SpecError(f"calibration {where}: 'roofline' must be a table of knobs")
    unknown = set(raw) - _KNOB_NAMES
    if unknown:
        raise SpecError(
            f"calibration {where}: unknown roofline knob(s) {sorted(unknown)}; "
            f"known: {sorted(_KNOB_NAMES)}"
        )
    out = {k: float(v) for k, v in raw.items()}
    replace(RooflineKnobs(), **out)  # validates ranges with a clear error
    return out


def _coeffs(raw: object, cls: type[PrefillCoeffs] | type[DecodeCoeffs], where: str) -> Any:
    names = [f.name for f in fields(cls)]
    if not isinstance(raw, dict) or set(raw) != set(names):
        raise SpecError(f"calibration {where}: needs exactly the keys {names}")
    return cls(**{k: float(raw[k]) for k in names})


def _engine(raw: object, i: int) -> EngineCalibration:
    where = f"engines[{i}]"
    if not isinstance(raw, dict):
        raise SpecError(f"calibration {where}: must be a table")
    unknown = set(raw) - {"model", "gpu", "tp", "roofline", "fitted", "source"}
    if unknown or not {"model", "gpu", "tp"} <= set(raw):
        raise SpecError(
            f"calibration {where}: needs model, gpu, tp and optionally roofline, "
            f"fitted, source (unknown: {sorted(unknown)})"
        )
    fitted = None
    if "fitted" in raw:
        f = raw["fitted"]
        if not isinstance(f, dict) or not f or not set(f) <= {"prefill", "decode"}:
            raise SpecError(
                f"calibration {where}.fitted: needs 'prefill', 'decode' or both (a phase "
                "left out is priced by the roofline)"
            )
        fitted = FittedCost(
            _coeffs(f["prefill"], PrefillCoeffs, f"{where}.fitted.prefill")
            if "prefill" in f
            else None,
            _coeffs(f["decode"], DecodeCoeffs, f"{where}.fitted.decode") if "decode" in f else None,
        )
    knobs = _knobs(raw.get("roofline", {}), where)
    return EngineCalibration(
        str(raw["model"]).lower(), str(raw["gpu"]).lower(), int(raw["tp"]), knobs, fitted
    )


def parse_calibration(data: dict[str, Any], source: str = "<memory>") -> Calibration:
    """A calibration from its parsed JSON/TOML document (errors name the offending key)."""
    unknown = set(data) - {"roofline", "engines", "comment"}
    if unknown:
        raise SpecError(
            f"calibration {source}: unknown key(s) {sorted(unknown)}; expected roofline, engines"
        )
    engines = data.get("engines", [])
    if not isinstance(engines, list):
        raise SpecError(f"calibration {source}: 'engines' must be a list")
    return Calibration(
        _knobs(data.get("roofline", {}), "roofline"),
        tuple(_engine(e, i) for i, e in enumerate(engines)),
        source,
    )


def load_calibration(path: str | Path | None) -> Calibration:
    """Read a calibration file (``.json`` or ``.toml``); ``None`` or 'default' → defaults,
    'splitwise' → the bundled SplitwiseSim fit."""
    if path is None or str(path) == "default":
        return Calibration()
    if str(path) == "splitwise":
        text = resources.files("tspd_sim.data.calibration").joinpath(BUNDLED_CALIBRATION)
        return parse_calibration(json.loads(text.read_text()), "bundled:splitwise")
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"calibration file {p} does not exist")
    try:
        data = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"calibration file {p}: cannot parse ({exc})") from exc
    if not isinstance(data, dict):
        raise SpecError(f"calibration file {p}: the top level must be a table/object")
    return parse_calibration(data, str(p))


def read_measurements(text: str) -> list[Measurement]:
    """Measured steps from CSV with columns phase,batch,new_tokens,context,seconds."""
    rows = []
    for i, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        try:
            rows.append(
                Measurement(
                    row["phase"],
                    int(row["batch"]),
                    int(row["new_tokens"]),
                    float(row["context"]),
                    float(row["seconds"]),
                )
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise SpecError(
                f"measurements line {i}: need phase,batch,new_tokens,context,seconds ({exc})"
            ) from exc
    return rows


#: The columns of a node's step log (``--step-log``; tspd_engine/rank/steps.py).
STEP_LOG_COLUMNS = (
    "end_s", "seconds", "tp", "prefill_seqs", "prefill_tokens", "prefill_ctx", "prefill_pairs",
    "decode_batch", "decode_ctx",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepLog:
    """The rounds of a node's step log that the fit can use: prefill-only and decode-only
    rounds as :class:`StepSample` rows (with their TP); ``mixed`` counts the rounds that ran
    both (a colocated engine's: their time cannot be split between the phases) and are left
    out."""

    samples: list[StepSample]
    mixed: int


def read_step_log(text: str, source: str = "step log") -> StepLog:
    """A node's step log (CSV, :data:`STEP_LOG_COLUMNS`); every bad line is a
    :class:`SpecError` naming it."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(header) != STEP_LOG_COLUMNS:
        want = ",".join(STEP_LOG_COLUMNS)
        raise SpecError(f"{source}: not a step log (its header must be {want})")
    samples: list[StepSample] = []
    mixed = 0
    for i, row in enumerate(reader, start=2):
        try:
            if len(row) != len(STEP_LOG_COLUMNS):
                raise ValueError(f"{len(row)} fields")
            seconds = float(row[1])
            tp, pseqs, ptok, pctx, ppairs, dbatch, dctx = (int(v) for v in row[2:])
            if not (np.isfinite(seconds) and seconds > 0) or tp < 1:
                raise ValueError("seconds must be > 0 and tp ≥ 1")
            if min(pseqs, ptok, pctx, ppairs, dbatch, dctx) < 0 or not (pseqs or dbatch):
                raise ValueError("counts must be ≥ 0 and the round must have run a forward")
        except ValueError as exc:
            raise SpecError(f"{source} line {i}: {exc}") from None
        if pseqs and dbatch:
            mixed += 1
        elif pseqs:
            samples.append(StepSample("prefill", pseqs, ptok, ppairs, pctx, seconds, tp))
        else:
            samples.append(StepSample("decode", dbatch, dbatch, 0.0, dctx, seconds, tp))
    return StepLog(samples, mixed)


def is_step_log(text: str) -> bool:
    """Whether ``text`` starts with a step log's header (else: a measurements CSV)."""
    return text.split("\n", 1)[0].strip() == ",".join(STEP_LOG_COLUMNS)


def collect_steps(
    paths: Sequence[Path], tp: int | None = None
) -> tuple[dict[int, list[StepSample]], set[int], int]:
    """The measured steps of ``paths`` by engine TP: step logs (each line names its TP; with
    ``tp``, only that TP's lines) and measurements CSVs (their engine is ``tp``, required).
    Also returns the TPs with rows from a step log and the count of mixed rounds left out."""
    rows: dict[int, list[StepSample]] = {}
    logged: set[int] = set()
    mixed = 0
    for path in paths:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"{path}: cannot read it ({exc})") from exc
        if is_step_log(text):
            log = read_step_log(text, str(path))
            mixed += log.mixed
            for sample in log.samples:
                if tp is None or sample.tp == tp:
                    rows.setdefault(sample.tp, []).append(sample)
                    logged.add(sample.tp)
            continue
        if tp is None:
            raise SpecError(
                f"{path}: a measurements CSV does not say its engine's TP: give --tp "
                "(a node's step log does)"
            )
        rows.setdefault(tp, []).extend(m.sample() for m in read_measurements(text))
    return rows, logged, mixed


def bundled_measurements() -> list[Measurement]:
    """SplitwiseSim's measured Llama-2-70B / H100 / TP 8 steps (medians of five runs)."""
    res = resources.files("tspd_sim.data.calibration").joinpath(BUNDLED_MEASUREMENTS)
    return read_measurements(res.read_text())


def calibration_document(
    model: str, gpu: str, fits: dict[int, FittedCost], source: str
) -> dict[str, Any]:
    """The JSON document of a calibration with one fitted engine per TP (for ``calibrate``);
    a phase a fit lacks is left out (the roofline prices it)."""
    engines = []
    for tp, fitted in sorted(fits.items()):
        phases = {
            name: asdict(coeffs)
            for name, coeffs in (("prefill", fitted.prefill), ("decode", fitted.decode))
            if coeffs is not None
        }
        engines.append({"model": model, "gpu": gpu, "tp": tp, "source": source, "fitted": phases})
    return {"engines": engines}
