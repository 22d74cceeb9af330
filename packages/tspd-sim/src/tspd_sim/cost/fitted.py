"""Fitted step-time coefficients: a linear model calibrated on measured step times.

::

    prefill step = const + per_token·Σnᵢ + per_pair·Σ(nᵢ·cᵢ + nᵢ(nᵢ+1)/2) + per_seq·sequences
    decode step  = const + per_seq·batch + per_ctx_token·Σcontext

The regressors are the same quantities the roofline counts (tokens through the GEMMs, causal
attention pairs, sequences, KV tokens read), so a fit on a handful of measured points carries
to batches it never saw. :func:`fit_step_model` fits them by least squares with non-negative
coefficients (a coefficient the data pushes below zero is dropped and the rest refit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


class FittedCost:
    """Step times from fitted coefficients (same interface as the roofline; pure, shareable)."""

    def __init__(self, prefill: PrefillCoeffs, decode: DecodeCoeffs) -> None:
        for coeffs in (prefill, decode):
            for name in coeffs.__slots__:
                value = getattr(coeffs, name)
                if not (np.isfinite(value) and value >= 0):
                    raise SpecError(
                        f"fitted coefficient {type(coeffs).__name__}.{name}="
                        f"{value}: must be a finite number ≥ 0"
                    )
        self.prefill, self.decode = prefill, decode

    def prefill_time(self, new_tokens: I64, context: I64) -> float:
        """Seconds for one prefill step (see the module docstring)."""
        n = new_tokens.astype(np.float64)
        pairs = float(np.dot(n, context.astype(np.float64)) + np.dot(n, n + 1) / 2)
        p = self.prefill
        return (
            p.const_s + p.per_token_s * float(n.sum()) + p.per_pair_s * pairs + p.per_seq_s * len(n)
        )

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> F64:
        """Seconds of ``steps`` consecutive decode steps (context grows by ``batch`` per step)."""
        d = self.decode
        ctx = ctx_sum + batch * np.arange(steps, dtype=np.float64)
        return d.const_s + d.per_seq_s * batch + d.per_ctx_token_s * ctx

    def decode_time(self, batch: int, ctx_sum: int) -> float:
        return float(self.decode_times(batch, ctx_sum, 1)[0])


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured step: ``batch`` sequences of ``new_tokens`` each on ``context`` cached tokens
    (prefill), or one decode step of ``batch`` sequences with ``context`` tokens each."""

    phase: str
    batch: int
    new_tokens: int
    context: float
    seconds: float


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


def fit_step_model(rows: Sequence[Measurement]) -> FittedCost:
    """Fit prefill and decode coefficients from measured steps (relative least squares, so a
    40 ms step weighs as much as a 4 s one). Needs ≥ 2 rows of each phase."""
    pre = [r for r in rows if r.phase == "prefill"]
    dec = [r for r in rows if r.phase == "decode"]
    if len(pre) < 2 or len(dec) < 2:
        raise SpecError(
            f"fitting needs ≥ 2 prefill and ≥ 2 decode measurements, got {len(pre)} and {len(dec)}"
        )
    xp = np.array(
        [
            [
                1.0,
                r.batch * r.new_tokens,
                r.batch * (r.new_tokens * r.context + r.new_tokens * (r.new_tokens + 1) / 2),
                r.batch,
            ]
            for r in pre
        ]
    )
    yp = np.array([r.seconds for r in pre])
    xd = np.array([[1.0, r.batch, r.batch * r.context] for r in dec])
    yd = np.array([r.seconds for r in dec])
    cp = _nonneg_lstsq(xp / yp[:, None], np.ones(len(yp)))
    cd = _nonneg_lstsq(xd / yd[:, None], np.ones(len(yd)))
    return FittedCost(PrefillCoeffs(*map(float, cp)), DecodeCoeffs(*map(float, cd)))
