"""How a KV bootstrap server checks and canonicalises the cache layouts prefill ranks register.

A KV server demands byte-identical *canonical* layouts from every prefill rank (wire.md §3).
Canonical means "parse as a cache transfer contract, then re-serialise" — so a layout that
omits keys with defaults compares equal to the full one, and a layout the contract parser
refuses (which includes every layout TokenSpeed's server refuses) is refused at registration.

There is one canonical form: tspd_core's strict contract parser
(``tspd_core.layout:canonical_layout_text``). This package cannot import tspd_core (tspd_core
depends on it), so a KV server created without an explicit canonicaliser resolves that one by
name when it is built, as ``--layout-canonicalizer MODULE:FUNCTION`` would; where tspd_core is
not installed, the server refuses to start and says so.

A canonicaliser is any ``Callable[[str], str]``; it reports a layout it refuses by raising (a
``ValueError`` with the reason, by convention): the server answers 400 with that reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

LayoutCanonicalizer = Callable[[str], str]

#: The strict canonical form every tspd KV server uses unless told otherwise.
DEFAULT_CANONICALIZER = "tspd_core.layout:canonical_layout_text"


def load_canonicalizer(spec: str) -> LayoutCanonicalizer:
    """Import ``module:function``; ``ValueError`` naming what is missing."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"layout canonicalizer {spec!r}: expected MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"layout canonicalizer {spec!r}: cannot import {module_name!r} ({exc}); a KV "
            "bootstrap server checks layouts with tspd_core's contract parser: install "
            "tspd-core, or pass --layout-canonicalizer MODULE:FUNCTION"
        ) from exc
    func = getattr(module, attr, None)
    if not callable(func):
        raise ValueError(f"layout canonicalizer {spec!r}: {module_name} has no callable {attr!r}")
    checked: LayoutCanonicalizer = func
    return checked


def default_canonicalizer() -> LayoutCanonicalizer:
    """The strict contract canonicaliser (:data:`DEFAULT_CANONICALIZER`)."""
    return load_canonicalizer(DEFAULT_CANONICALIZER)
