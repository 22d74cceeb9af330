"""Errors raised by the simulator, rooted at :class:`tspd_core.errors.TspdError`.

Each also subclasses the builtin that matches its meaning, so callers may catch either:
``ValueError`` for bad input (a malformed trace, an unknown model, an impossible cluster),
``RuntimeError`` for a simulation that cannot proceed (a broken invariant found at run time).
"""

from __future__ import annotations

from tspd_core.errors import TspdError


class SimError(TspdError):
    """Base of every error tspd_sim raises on purpose."""


class TraceError(SimError, ValueError):
    """A trace file or a synthetic-trace request is malformed (says which line or knob)."""


class SpecError(SimError, ValueError):
    """An unknown model, GPU or calibration, or a cluster description that cannot work."""


class SimulationError(SimError, RuntimeError):
    """The simulation reached a state it cannot leave (a broken invariant; a bug to report)."""
