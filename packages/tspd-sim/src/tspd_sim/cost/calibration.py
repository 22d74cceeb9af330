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
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tspd_sim.cost.fitted import DecodeCoeffs, FittedCost, Measurement, PrefillCoeffs
from tspd_sim.cost.roofline import RooflineCost, RooflineKnobs
from tspd_sim.errors import SpecError
from tspd_sim.specs import GpuSpec, ModelSpec

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

#: Calibration shipped with the package: fitted to SplitwiseSim's Llama-2-70B / H100 / TP 8.
BUNDLED_CALIBRATION = "splitwise_llama2_70b_h100_tp8.json"
BUNDLED_MEASUREMENTS = "splitwise_llama2_70b_h100_tp8.csv"


class StepCost(Protocol):
    """What the engines ask of a cost model. Implementations are pure and may be shared."""

    def prefill_time(self, new_tokens: I64, context: I64) -> float: ...

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> F64: ...

    def decode_time(self, batch: int, ctx_sum: int) -> float: ...


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
        if entry is not None and entry.fitted is not None:
            return entry.fitted
        knobs = replace(RooflineKnobs(), **self.knobs)
        if entry is not None:
            knobs = replace(knobs, **entry.knobs)
        return RooflineCost(model, gpu, tp, knobs)

    def describe(self, model: ModelSpec, gpu: GpuSpec, tp: int) -> str:
        """'roofline' or 'fitted', for tables and logs."""
        cost = self.cost_model(model, gpu, tp)
        return "fitted" if isinstance(cost, FittedCost) else "roofline"


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
        if not isinstance(f, dict) or set(f) != {"prefill", "decode"}:
            raise SpecError(f"calibration {where}.fitted: needs 'prefill' and 'decode'")
        fitted = FittedCost(
            _coeffs(f["prefill"], PrefillCoeffs, f"{where}.fitted.prefill"),
            _coeffs(f["decode"], DecodeCoeffs, f"{where}.fitted.decode"),
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


def bundled_measurements() -> list[Measurement]:
    """SplitwiseSim's measured Llama-2-70B / H100 / TP 8 steps (medians of five runs)."""
    res = resources.files("tspd_sim.data.calibration").joinpath(BUNDLED_MEASUREMENTS)
    return read_measurements(res.read_text())


def calibration_document(
    model: str, gpu: str, tp: int, fitted: FittedCost, source: str
) -> dict[str, Any]:
    """The JSON document of a calibration holding one fitted engine (for ``calibrate``)."""
    return {
        "engines": [
            {
                "model": model,
                "gpu": gpu,
                "tp": tp,
                "source": source,
                "fitted": {"prefill": asdict(fitted.prefill), "decode": asdict(fitted.decode)},
            }
        ]
    }
