"""Fitted step-time coefficients: a linear model calibrated on measured step times.

::

    prefill step = const + per_token·Σnᵢ + per_pair·Σ(nᵢ·cᵢ + nᵢ(nᵢ+1)/2) + per_seq·sequences
    decode step  = const + per_seq·batch + per_ctx_token·Σcontext

The regressors are the same quantities the roofline counts (tokens through the GEMMs, causal
attention pairs, sequences, KV tokens read), so a fit on a handful of measured points carries
to batches it never saw. :func:`fit_step_model` fits them by least squares with non-negative
coefficients (a coefficient the data pushes below zero is dropped and the rest refit).

Measured steps come as :class:`Measurement` rows (uniform batches: SplitwiseSim's table) or as
:class:`StepSample` rows (the sums of one real round, as a node's step log writes them); a
fit may cover one phase only (:func:`fit_phase`: a prefill node's log has no decode steps), and
:class:`FittedCost` then prices the other phase with a fallback model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from tspd_sim.errors import SpecError

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class PrefillCoeffs:
    const_s: float
    per_token_s: float
    per_pair_s: float
    per_seq_s: float


@dataclass(frozen=True, slots=True)
class DecodeCoeffs:
    const_s: float
    per_seq_s: float
    per_ctx_token_s: float


class StepCost(Protocol):
    """What the engines ask of a cost model. Implementations are pure and may be shared."""

    def prefill_time(self, new_tokens: I64, context: I64) -> float: ...

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> F64: ...

    def decode_time(self, batch: int, ctx_sum: int) -> float: ...


class FittedCost:
    """Step times from fitted coefficients (same interface as the roofline; pure, shareable).

    A phase without coefficients (``None``) is priced by ``fallback``; a calibration supplies
    the engine's roofline there (:meth:`tspd_sim.cost.calibration.Calibration.cost_model`).
    """

    def __init__(
        self,
        prefill: PrefillCoeffs | None,
        decode: DecodeCoeffs | None,
        fallback: StepCost | None = None,
    ) -> None:
        if prefill is None and decode is None:
            raise SpecError("fitted coefficients need at least one phase (prefill or decode)")
        for coeffs in (prefill, decode):
            if coeffs is None:
                continue
            for name in coeffs.__slots__:
                value = getattr(coeffs, name)
                if not (np.isfinite(value) and value >= 0):
                    raise SpecError(
                        f"fitted coefficient {type(coeffs).__name__}.{name}="
                        f"{value}: must be a finite number ≥ 0"
                    )
        self.prefill, self.decode, self.fallback = prefill, decode, fallback

    def prefill_time(self, new_tokens: I64, context: I64) -> float:
        """Seconds for one prefill step (see the module docstring)."""
        if self.prefill is None:
            return self._other("prefill").prefill_time(new_tokens, context)
        n = new_tokens.astype(np.float64)
        pairs = float(np.dot(n, context.astype(np.float64)) + np.dot(n, n + 1) / 2)
        p = self.prefill
        return (
            p.const_s + p.per_token_s * float(n.sum()) + p.per_pair_s * pairs + p.per_seq_s * len(n)
        )

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> F64:
        """Seconds of ``steps`` consecutive decode steps (context grows by ``batch`` per step)."""
        d = self.decode
        if d is None:
            return self._other("decode").decode_times(batch, ctx_sum, steps)
        ctx = ctx_sum + batch * np.arange(steps, dtype=np.float64)
        return d.const_s + d.per_seq_s * batch + d.per_ctx_token_s * ctx

    def decode_time(self, batch: int, ctx_sum: int) -> float:
        return float(self.decode_times(batch, ctx_sum, 1)[0])

    @property
    def complete(self) -> bool:
        """Whether both phases have coefficients (no fallback is needed)."""
        return self.prefill is not None and self.decode is not None

    def _other(self, phase: str) -> StepCost:
        if self.fallback is None:
            raise SpecError(f"no fitted {phase} coefficients and no fallback model to price it")
        return self.fallback


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured step: ``batch`` sequences of ``new_tokens`` each on ``context`` cached tokens
    (prefill), or one decode step of ``batch`` sequences with ``context`` tokens each."""

    phase: str
    batch: int
    new_tokens: int
    context: float
    seconds: float

    def sample(self) -> StepSample:
        """The step as sums over its sequences (what the fit reads)."""
        b, n, c = self.batch, self.new_tokens, self.context
        if self.phase == "prefill":
            pairs = b * (n * c + n * (n + 1) / 2)
            return StepSample("prefill", b, b * n, pairs, b * c, self.seconds)
        return StepSample("decode", b, b, 0.0, b * c, self.seconds)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step as sums over its sequences: ``seqs`` prefill chunks (or decode rows),
    ``tokens`` new tokens Σn (a decode step: one per row), ``pairs`` causal query-key pairs
    Σ(n·c + n(n+1)/2) (prefill), ``ctx`` cached tokens Σc (prefill) or keys attended Σcontext
    (decode), and the engine's ``tp`` (0: not recorded)."""

    phase: str
    seqs: int
    tokens: int
    pairs: float
    ctx: float
    seconds: float
    tp: int = 0


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """The coefficients of one phase and how well they fit their rows: ``rows`` used,
    ``trimmed`` left out as outliers, the predicted/measured ratios' median and 10th and 90th
    percentiles on the rows used, and their summed times' ratio."""

    coeffs: PrefillCoeffs | DecodeCoeffs
    rows: int
    trimmed: int
    ratio_p10: float
    ratio_p50: float
    ratio_p90: float
    #: Σ predicted / Σ measured over the rows used (1 for a fit in seconds with a constant).
    total_ratio: float = 1.0


def _nonneg_lstsq(x: F64, y: F64) -> F64:
    """Least squares with coefficients ≥ 0: drop the most negative column and refit."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if np.all(coef >= 0) or len(keep) == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.maximum(coef, 0)
            return out
        del keep[int(np.argmin(coef))]


def _regressors(rows: Sequence[StepSample], phase: str) -> tuple[F64, F64]:
    if phase == "prefill":
        x = [[1.0, r.tokens, r.pairs, r.seqs] for r in rows]
    else:
        x = [[1.0, r.seqs, r.ctx] for r in rows]
    return np.array(x, dtype=np.float64), np.array([r.seconds for r in rows], dtype=np.float64)


def _fit(x: F64, y: F64, relative: bool) -> F64:
    """Least squares with coefficients ≥ 0: relative (a 40 ms step weighs as much as a 4 s
    one) or in seconds (the mean step time of each shape)."""
    if relative:
        return _nonneg_lstsq(x / y[:, None], np.ones(len(y)))
    return _nonneg_lstsq(x, y)


#: Trimming: rows whose predicted/measured ratio lies more than this many robust standard
#: deviations (1.4826 · MAD) from the median ratio are left out of the next fit ...
TRIM_SIGMAS = 4.0
#: ... and so are no rows within this relative distance of it, however tight the rest fit.
TRIM_FLOOR = 0.02


def fit_phase(
    rows: Sequence[Measurement | StepSample],
    phase: str,
    trim: bool = False,
    relative: bool = True,
) -> PhaseFit:
    """Fit one phase's coefficients on its rows (the other phase's rows are ignored).

    ``relative``: relative least squares, for measured medians over a wide range of step
    sizes (SplitwiseSim's table); off: least squares in seconds, for a real node's step log,
    whose rounds of one shape scatter widely on a shared machine — relative least squares
    would fit the fast ones (it minimises Σ(predicted/measured − 1)², which a noisy
    measurement pulls low: 30 % below the median round on this machine's logs), while the
    simulator must reproduce the mean round, which the time a request waits adds up.
    ``trim``: fit, leave out the rows the fit misses by more than :data:`TRIM_SIGMAS` robust
    standard deviations (and more than :data:`TRIM_FLOOR`), fit again, until the rows kept
    settle — for a real node's step log, whose rounds include a few another process held up.
    Needs ≥ 2 rows of the phase with a positive duration."""
    if phase not in ("prefill", "decode"):
        raise SpecError(f"phase {phase!r}: use 'prefill' or 'decode'")
    samples = [r.sample() if isinstance(r, Measurement) else r for r in rows]
    mine = [r for r in samples if r.phase == phase and r.seconds > 0]
    if len(mine) < 2:
        raise SpecError(f"fitting {phase} needs ≥ 2 measured {phase} steps, got {len(mine)}")
    x, y = _regressors(mine, phase)
    keep = np.ones(len(y), dtype=bool)
    # A trimmed fit starts from the relative one, which a stalled (long) round hardly moves.
    coef = _fit(x, y, relative or trim)
    for i in range(10 if trim else 0):  # refit until the rows kept stay the same
        ratio = x @ coef / y
        med = float(np.median(ratio[keep]))
        spread = 1.4826 * float(np.median(np.abs(ratio[keep] - med)))
        now = np.abs(ratio - med) <= max(TRIM_SIGMAS * spread, TRIM_FLOOR)
        if now.sum() < 2 or (i > 0 and (now == keep).all()):
            break
        keep = now
        coef = _fit(x[keep], y[keep], relative)
    pred = x[keep] @ coef
    ratio = pred / y[keep]
    trimmed = int((~keep).sum())
    cls = PrefillCoeffs if phase == "prefill" else DecodeCoeffs
    p10, p50, p90 = (float(v) for v in np.quantile(ratio, (0.1, 0.5, 0.9)))
    total = float(pred.sum() / y[keep].sum())
    return PhaseFit(cls(*map(float, coef)), int(keep.sum()), trimmed, p10, p50, p90, total)


def describe_fit(fit: PhaseFit) -> str:
    """One line: the coefficients in ms / µs, the rows, and how close the fit came."""
    c = fit.coeffs
    if isinstance(c, PrefillCoeffs):
        terms = (
            f"{1e3 * c.const_s:.2f} ms + {1e3 * c.per_token_s:.4f} ms/token + "
            f"{1e6 * c.per_pair_s:.4f} µs/pair + {1e3 * c.per_seq_s:.3f} ms/chunk"
        )
    else:
        terms = (
            f"{1e3 * c.const_s:.2f} ms + {1e3 * c.per_seq_s:.3f} ms/row + "
            f"{1e6 * c.per_ctx_token_s:.4f} µs/context token"
        )
    trimmed = f", {fit.trimmed} trimmed" if fit.trimmed else ""
    return (
        f"{terms} ({fit.rows} steps{trimmed}; predicted/measured p10 {fit.ratio_p10:.2f}, "
        f"p50 {fit.ratio_p50:.2f}, p90 {fit.ratio_p90:.2f}, in total {fit.total_ratio:.2f})"
    )


def fit_step_model(rows: Sequence[Measurement | StepSample], trim: bool = False) -> FittedCost:
    """Fit prefill and decode coefficients from measured steps (relative least squares, so a
    40 ms step weighs as much as a 4 s one). Needs ≥ 2 rows of each phase."""
    pre = sum(r.phase == "prefill" for r in rows)
    dec = sum(r.phase == "decode" for r in rows)
    if pre < 2 or dec < 2:
        raise SpecError(
            f"fitting needs ≥ 2 prefill and ≥ 2 decode measurements, got {pre} and {dec}"
        )
    prefill = fit_phase(rows, "prefill", trim).coeffs
    decode = fit_phase(rows, "decode", trim).coeffs
    assert isinstance(prefill, PrefillCoeffs)
    assert isinstance(decode, DecodeCoeffs)
    return FittedCost(prefill, decode)
