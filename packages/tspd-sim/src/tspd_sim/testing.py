"""Small builders for tests and notebooks: traces and cluster configs written in code."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace

from tspd_sim.cluster import ClusterSpec, EngineTuning, GroupSpec, parse_group
from tspd_sim.network import NetKnobs
from tspd_sim.sim.context import SimConfig
from tspd_sim.sim.router import RoutingSpec
from tspd_sim.traces import Trace, parse_mooncake


def mooncake_trace(rows: Sequence[tuple[float, int, int, list[int]]], name: str = "test") -> Trace:
    """A trace from (arrival s, prompt tokens, output tokens, hash ids) rows, through the real
    Mooncake parser (hash ids name 512-token blocks)."""
    text = "\n".join(
        json.dumps(
            {"timestamp": round(t * 1000), "input_length": i, "output_length": o, "hash_ids": h}
        )
        for t, i, o, h in rows
    )
    return parse_mooncake(text, name=name)


def small_config(
    prefill: str | GroupSpec = "1x1",
    decode: str | GroupSpec = "1x1",
    model: str = "llama-3-8b",
    routing: str = "round_robin",
    net: NetKnobs | None = None,
    **tuning: object,
) -> SimConfig:
    """One P group and one D group (``COUNTxTP...`` specs); ``tuning`` overrides
    :class:`EngineTuning` fields."""
    p = parse_group(prefill) if isinstance(prefill, str) else prefill
    d = parse_group(decode) if isinstance(decode, str) else decode
    cluster = ClusterSpec(model, (p,), (d,), replace(EngineTuning(), **tuning))  # type: ignore[arg-type]
    return SimConfig(cluster=cluster, routing=RoutingSpec(routing), net=net or NetKnobs())


def fields_close(actual: object, expected: object, rel: float = 1e-9) -> list[str]:
    """The float fields of two dataclasses of one type that differ by more than ``rel``
    (relative), as ``"name: actual != expected"`` lines; empty when all agree.

    Least-squares fits and other BLAS results differ in their last bits with the OpenBLAS
    kernel the CPU selects, so tests compare them field by field with a stated tolerance
    (``pytest.approx`` does not look inside a dataclass and falls back to ``==``).
    """
    if type(actual) is not type(expected) or not is_dataclass(actual):
        raise TypeError(f"not two dataclasses of one type: {actual!r}, {expected!r}")
    out = []
    for f in fields(actual):
        a, e = getattr(actual, f.name), getattr(expected, f.name)
        same = math.isclose(a, e, rel_tol=rel) if isinstance(a, float) else a == e
        if not same:
            out.append(f"{f.name}: {a!r} != {e!r}")
    return out
