"""Synthetic traces: Poisson or Gamma arrivals with length distributions, all seeded.

Gamma inter-arrival times with coefficient of variation ``cv`` are the usual burstiness knob
(as in DistServe / Vidur workloads): ``cv = 1`` is Poisson, ``cv > 1`` is burstier, ``cv < 1``
smoother. The shape is ``1 / cv²`` and the scale ``cv² / rate``, so the mean rate stays ``rate``.

Length distributions are described by small frozen specs so a CLI string maps onto them:

* ``fixed:N``                         every request N tokens
* ``uniform:LO:HI``                   integers in [LO, HI]
* ``lognormal:MEAN:SIGMA``            a lognormal with that mean and log-space sigma
* ``trace:NAME``                      resampled (with replacement) from a bundled trace's lengths

The same seed always yields the same trace, bit for bit (numpy PCG64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_sim.errors import TraceError
from tspd_sim.traces.trace import Trace

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution; ``sample`` returns integers ≥ 1."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    source: str = ""

    def sample(self, rng: np.random.Generator, n: int, column: str) -> I64:
        """n lengths; ``column`` ('input' or 'output') picks the column of a source trace."""
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b), size=n, endpoint=True).astype(float)
        elif self.kind == "lognormal":
            # Choose mu so that the distribution's mean is `a`: E = exp(mu + sigma²/2).
            mu = np.log(self.a) - self.b**2 / 2
            values = rng.lognormal(mu, self.b, size=n)
        elif self.kind == "trace":
            from tspd_sim.traces.loaders import load_trace

            src = load_trace(self.source)
            pool = src.input_len if column == "input" else src.output_len
            values = pool[rng.integers(0, len(pool), size=n)].astype(float)
        else:
            raise TraceError(f"unknown length distribution {self.kind!r}")
        out: I64 = np.maximum(np.rint(values), 1).astype(np.int64)
        return out


def parse_length(spec: str) -> LengthDist:
    """Parse ``fixed:N`` / ``uniform:LO:HI`` / ``lognormal:MEAN:SIGMA`` / ``trace:NAME``."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    try:
        if kind == "fixed" and len(parts) == 1 and int(parts[0]) >= 1:
            return LengthDist("fixed", float(int(parts[0])))
        if kind == "uniform" and len(parts) == 2 and 1 <= int(parts[0]) <= int(parts[1]):
            return LengthDist("uniform", float(int(parts[0])), float(int(parts[1])))
        if kind == "lognormal" and len(parts) == 2 and float(parts[0]) >= 1 and float(parts[1]) > 0:
            return LengthDist("lognormal", float(parts[0]), float(parts[1]))
    except ValueError:
        pass
    if kind == "trace" and len(parts) == 1 and parts[0]:
        return LengthDist("trace", source=parts[0])
    raise TraceError(
        f"bad length distribution {spec!r}; use fixed:N, uniform:LO:HI, "
        f"lognormal:MEAN:SIGMA or trace:NAME"
    )


def synthetic(
    n: int,
    rate: float,
    input_len: LengthDist | str = "lognormal:2048:0.8",
    output_len: LengthDist | str = "lognormal:256:0.8",
    cv: float = 1.0,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """n requests at ``rate`` req/s: Poisson when ``cv == 1``, Gamma with that CV otherwise.

    The first request arrives at its first inter-arrival gap (not at 0), as a Poisson process
    started at time 0 would have it.
    """
    if n < 1:
        raise TraceError(f"synthetic trace: need at least one request, got n={n}")
    if not (np.isfinite(rate) and rate > 0):
        raise TraceError(f"synthetic trace: rate must be a positive number, got {rate}")
    if not (np.isfinite(cv) and cv > 0):
        raise TraceError(f"synthetic trace: cv (burstiness) must be positive, got {cv}")
    rng = np.random.Generator(np.random.PCG64(seed))
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        gaps = rng.gamma(1.0 / cv**2, cv**2 / rate, size=n)
    arrivals = np.cumsum(gaps)
    ind = parse_length(input_len) if isinstance(input_len, str) else input_len
    outd = parse_length(output_len) if isinstance(output_len, str) else output_len
    kind = "poisson" if cv == 1.0 else f"gamma-cv{cv:g}"
    return Trace(
        name or f"synthetic-{kind}-{rate:g}rps",
        arrivals,
        ind.sample(rng, n, "input"),
        outd.sample(rng, n, "output"),
        np.zeros(n + 1, dtype=np.int64),
        np.zeros(0, dtype=np.int64),
        0,
    )
