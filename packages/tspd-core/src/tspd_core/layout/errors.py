"""Errors of the layout planner.

Every error here is bad input (a malformed or incompatible contract, an inconsistent manifest,
a route the rank sets cannot support), so each subclasses both :class:`TspdError` and
``ValueError``. Messages name the offending property and say what would fix it.
"""

from __future__ import annotations

from tspd_core.errors import TspdError


class LayoutError(TspdError, ValueError):
    """Base of the layout planner's errors."""


class ContractError(LayoutError):
    """A cache transfer contract (or the arena description it is built from) is invalid."""


class ContractMismatch(LayoutError):
    """Two peers' contracts disagree on a property that must match (wire.md §4).

    ``path`` names the property (e.g. ``group full_attention field layer.3.k dtype``);
    ``ours`` and ``theirs`` are the two values as text.
    """

    def __init__(
        self,
        path: str,
        ours: object,
        theirs: object,
        labels: tuple[str, str] = ("ours", "peer"),
        hint: str | None = None,
    ) -> None:
        self.path = path
        self.ours = ours
        self.theirs = theirs
        self.hint = hint
        advice = hint or (
            "this property must match between P and D, so both sides must run the same "
            "model, dtype, page size and cache recipe"
        )
        super().__init__(
            f"cache contracts differ: {path}: {ours} vs {theirs} ({labels[0]} vs {labels[1]}); "
            f"{advice}"
        )


class ManifestError(LayoutError):
    """A block manifest is malformed, or invalid against a contract."""


class RouteError(LayoutError):
    """The two rank sets cannot be routed (TP sizes, shard counts, unknown ranks)."""
