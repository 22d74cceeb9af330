"""Time-weighted bins filled while the run goes: utilisation timelines in constant memory.

Every timeline of a run (NIC rates, pages in use) is a step function of time. Instead of keeping
every change (millions on a day-long trace), each series keeps its integral at the edges of one
shared grid of equal bins, so a bin's mean is an exact integral divided by its width. The grid
starts with :data:`BINS` bins over the trace's arrival span and doubles its width (merging bins
two by two, still exact) whenever the run outgrows ``2 · BINS`` bins, so a run ends with
``BINS`` to ``2 · BINS`` full bins plus a last, partial one.

Ownership: one :class:`BinGrid` per simulation, shared by its :class:`StepIntegral` series;
everything runs on the simulation's thread, with non-decreasing times.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

#: Bins over the trace's arrival span at the start (the grid may double its width later).
BINS = 240


class BinGrid:
    """Equal bins ``[k·width, (k+1)·width)`` from time 0; ``generation`` counts doublings."""

    def __init__(self, span_s: float, bins: int = BINS) -> None:
        self.width = max(span_s, 1.0) / bins
        self.max_edges = 2 * bins
        self.generation = 0

    def reach(self, t: float) -> None:
        """Widen the grid (doubling its width) until ``t`` lies within ``max_edges`` edges."""
        while t > self.width * self.max_edges:
            self.width *= 2
            self.generation += 1

    def full_bins(self, end: float) -> int:
        """Edges ``k·width ≤ end`` with k ≥ 1 (computed as the series compute them)."""
        k = int(end // self.width)
        while (k + 1) * self.width <= end:
            k += 1
        while k > 0 and k * self.width > end:
            k -= 1
        return k

    def edges(self, end: float) -> F64:
        """Edges of the bins that cover ``[0, end]``: full bins, then a partial one if any
        (the grid widens first if ``end`` needs it, as every series' ``bin_means`` does)."""
        self.reach(end)
        full = self.full_bins(end)
        edges = np.arange(full + 1, dtype=np.float64) * self.width
        return np.append(edges, end) if end > edges[-1] else edges


class StepIntegral:
    """The integral of a vector-valued step function over the grid's bins, kept online.

    :meth:`set` gives the value from time ``t`` on; :meth:`bin_means` the mean of each
    component over each bin of :meth:`BinGrid.edges`. Memory: one vector per bin edge.
    """

    __slots__ = ("_area", "_gen", "_grid", "_next", "_snaps", "_t", "_value")

    def __init__(self, grid: BinGrid, size: int) -> None:
        self._grid = grid
        self._gen = grid.generation
        self._t = 0.0
        self._value = [0.0] * size
        self._area = [0.0] * size  #: integral from 0 to _t
        self._snaps: list[list[float]] = []  #: integral from 0 to edge k + 1
        self._next = grid.width  #: the next edge to snapshot (in the grid's width then)

    @property
    def grid(self) -> BinGrid:
        return self._grid

    def set(self, t: float, value: list[float]) -> None:
        """The function equals ``value`` from ``t`` on (``t`` never decreases)."""
        # Called at every occupancy or rate change: the common case crosses no bin edge.
        # (A grid widened since keeps its edges among ours: ``t`` below our next edge is
        # below its next one too.)
        if t >= self._next:
            self._cross(t)
        if t > self._t:
            dt = t - self._t
            area, old = self._area, self._value
            for i, v in enumerate(old):
                if v:
                    area[i] += v * dt
            self._t = t
        self._value = value

    def _cross(self, t: float) -> None:
        """Snapshot the integral at every edge up to ``t``, widening the grid as needed."""
        grid = self._grid
        grid.reach(t)
        if self._gen != grid.generation:
            step = 1 << (grid.generation - self._gen)
            self._snaps = self._snaps[step - 1 :: step]
            self._gen = grid.generation
        width, area, value, t0 = grid.width, self._area, self._value, self._t
        k = len(self._snaps) + 1
        while k * width <= t:  # the same test as BinGrid.full_bins
            dt = k * width - t0
            self._snaps.append([a + v * dt for a, v in zip(area, value, strict=True)])
            k += 1
        self._next = k * width

    def _advance(self, t: float) -> None:
        self._cross(t)  # also catches up with a grid another series widened
        if t > self._t:
            dt = t - self._t
            self._area = [a + v * dt for a, v in zip(self._area, self._value, strict=True)]
            self._t = t

    def bin_means(self, end: float) -> F64:
        """Mean value per bin over ``[0, end]`` (shape: bins × components)."""
        self._advance(end)
        edges = self._grid.edges(end)
        full = self._grid.full_bins(end)
        points = [[0.0] * len(self._area), *self._snaps[:full]]
        if len(edges) > full + 1:
            points.append(self._area)
        integral = np.asarray(points, dtype=np.float64)
        return np.diff(integral, axis=0) / np.diff(edges)[:, None]
