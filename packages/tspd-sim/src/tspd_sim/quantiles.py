"""Exact quantiles of a weighted multiset too large to expand, read a few times in blocks.

The inter-token latencies of a run are every decode step's gap repeated once per request that
saw it — billions of values on a day-long trace. They are kept as (value, weight) blocks
instead, and each wanted rank is located by narrowing histograms: the first pass bins every
value; a bin holding the rank but too many distinct entries to sort is split into 4,096
sub-bins on the next pass, and so on, until the rank's bin is small enough to collect and sort
(or holds one value only). The result is the order statistic ``np.quantile`` (linear
interpolation) would pick from the expanded array; only the interpolation's last bits may
differ. Memory is bounded by :data:`COLLECT` entries, whatever the size of the multiset.

Bins are the top bits of the values' IEEE-754 patterns (for values ≥ 0 the pattern read as an
integer grows with the value): 128 bins per power of two at first, found with a shift instead
of a search; a split takes the next 12 bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Blocks = Callable[[], Iterable[tuple[F64, I64]]]

#: The first pass's bins: a value's bit pattern without its low 45 mantissa bits.
_SHIFT = 45
#: Bits a split adds.
_SPLIT = 12
#: Most entries collected and sorted for one bin (more: split it on another pass).
COLLECT = 1 << 20


def _bits(values: F64) -> I64:
    """Bit patterns (negative values, which latencies never are, count as 0; + 0.0 turns a
    −0.0, whose sign bit would read as a negative integer, into 0.0)."""
    bits: I64 = (np.maximum(values, 0.0) + 0.0).view(np.int64)
    return bits


def _kept(blocks: Blocks) -> Iterable[tuple[F64, I64, I64]]:
    for values, weights in blocks():
        keep = weights > 0
        v = values[keep]
        yield v, weights[keep], _bits(v)


@dataclass
class _Rank:
    """Where the search for one rank stands: it is the ``rank``-th (0-based, by weight) of the
    values whose bits >> ``shift`` equal ``prefix``; ``value`` once found."""

    rank: int
    shift: int
    prefix: int
    value: float | None = None


def weighted_quantiles(blocks: Blocks, qs: Sequence[float]) -> tuple[float, list[float]]:
    """(mean, quantiles ``qs``) of the multiset where each value appears ``weight`` times;
    NaN when it is empty. ``blocks()`` is called once per pass (two or three passes, a few
    more for bins crowded with distinct values) and must yield the same blocks every time."""
    n = 1 << (63 - _SHIFT)
    weight, count = np.zeros(n), np.zeros(n, dtype=np.int64)
    total, weighted = 0, 0.0
    for v, w, bits in _kept(blocks):
        total += int(w.sum())
        weighted += float((v * w).sum())  # not np.dot: it wakes BLAS threads
        b = bits >> _SHIFT
        weight += np.bincount(b, weights=w, minlength=n)
        count += np.bincount(b, minlength=n)
    if total == 0:
        return float("nan"), [float("nan")] * len(qs)
    bounds = []
    for q in qs:
        pos = q * (total - 1)
        lo = int(np.floor(pos))
        bounds.append((lo, min(lo + 1, total - 1), pos - lo))
    ranks = {r: _Rank(r, 63, 0) for lo, hi, _ in bounds for r in (lo, hi)}
    _settle(blocks, list(ranks.values()), _SHIFT, weight, count)
    while pending := [r for r in ranks.values() if r.value is None]:
        _narrow(blocks, pending)
    at = {r: float(state.value) for r, state in ranks.items()}  # type: ignore[arg-type]
    out = [at[lo] + (at[hi] - at[lo]) * frac for lo, hi, frac in bounds]
    return weighted / total, out


def _settle(blocks: Blocks, ranks: list[_Rank], shift: int, weight: F64, count: I64) -> None:
    """Place ranks that share one bin in its sub-bins at ``shift`` (their weights and entry
    counts given); collect the sub-bins small enough."""
    cum = np.cumsum(weight)
    small = []
    for r in ranks:
        sub = int(np.searchsorted(cum, r.rank, side="right"))
        r.rank -= int(cum[sub - 1]) if sub else 0
        r.prefix = (0 if r.shift == 63 else r.prefix << (r.shift - shift)) + sub
        r.shift = shift
        if shift == 0:  # a single bit pattern: a single value
            r.value = float(np.array([r.prefix], dtype=np.int64).view(np.float64)[0])
        elif count[sub] <= COLLECT:
            small.append(r)
    if small:
        _collect(blocks, small)


def _narrow(blocks: Blocks, pending: list[_Rank]) -> None:
    """One pass splitting each crowded bin (shared by several ranks or not) in 4,096."""
    bins = sorted({(r.shift, r.prefix) for r in pending})
    splits = [max(shift - _SPLIT, 0) for shift, _ in bins]
    weight = [np.zeros(1 << (shift - new)) for (shift, _), new in zip(bins, splits, strict=True)]
    count = [np.zeros(len(w), dtype=np.int64) for w in weight]
    for _, w, bits in _kept(blocks):
        for k, ((shift, prefix), new) in enumerate(zip(bins, splits, strict=True)):
            mine = bits >> shift == prefix
            if mine.any():
                sub = (bits[mine] >> new) - (prefix << (shift - new))
                weight[k] += np.bincount(sub, weights=w[mine], minlength=len(weight[k]))
                count[k] += np.bincount(sub, minlength=len(count[k]))
    for k, key in enumerate(bins):
        mine = [r for r in pending if (r.shift, r.prefix) == key]
        _settle(blocks, mine, splits[k], weight[k], count[k])


def _collect(blocks: Blocks, ranks: list[_Rank]) -> None:
    """Sort the values of each rank's (small) bin and read the rank off."""
    parts: list[list[tuple[F64, I64]]] = [[] for _ in ranks]
    for v, w, bits in _kept(blocks):
        for k, r in enumerate(ranks):
            mine = bits >> r.shift == r.prefix
            if mine.any():
                parts[k].append((v[mine], w[mine]))
    for r, found in zip(ranks, parts, strict=True):
        v = np.concatenate([p[0] for p in found])
        w = np.concatenate([p[1] for p in found])
        order = np.argsort(v, kind="stable")
        cum = np.cumsum(w[order])
        r.value = float(v[order][np.searchsorted(cum, r.rank, side="right")])
