"""The default cache-layout canonicaliser of the KV bootstrap server.

A KV server demands byte-identical *canonical* layouts from every prefill rank (WIRE.md §3).
Canonical means "parse, then re-serialise" with the contract serializer of WIRE.md §4: compact
separators, ASCII, and the three top-level keys in their wire order.

This package cannot import tspd_core (tspd_core depends on it), so the default checks only the
envelope: a JSON object with ``plan`` (object), ``group_specs`` (array) and ``transfer_schema``
(object); nested values keep their key order. Unknown top-level keys are dropped, as the contract
parser does (it ignores unknown keys outside the constructor-checked entries). A prefill process
embedding the server passes tspd_core's strict contract parser instead (``layout_canonicalizer``).

A canonicaliser is any ``Callable[[str], str]``; it reports a layout it refuses by raising (a
``ValueError`` with the reason, by convention): the server answers 400 with that reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable

LayoutCanonicalizer = Callable[[str], str]

_TOP_LEVEL: tuple[tuple[str, type, str], ...] = (
    ("plan", dict, "object"),
    ("group_specs", list, "array"),
    ("transfer_schema", dict, "object"),
)


def canonical_layout(text: str) -> str:
    """Canonical form of a cache layout, or ``ValueError`` saying what is wrong with it."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ValueError("cache_layout nests too deeply") from exc
    except ValueError as exc:
        raise ValueError(f"cache_layout is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"cache_layout must be a JSON object, got {type(obj).__name__}")
    missing = [key for key, _, _ in _TOP_LEVEL if key not in obj]
    if missing:
        raise ValueError(f"cache_layout lacks top-level key(s): {', '.join(missing)}")
    for key, kind, name in _TOP_LEVEL:
        if not isinstance(obj[key], kind):
            raise ValueError(f"cache_layout '{key}' must be a JSON {name}")
    canonical = {key: obj[key] for key, _, _ in _TOP_LEVEL}
    try:
        return json.dumps(canonical, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except RecursionError as exc:
        raise ValueError("cache_layout nests too deeply") from exc


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed in a cache layout")
