"""Hypothesis against the running server: no 5xx but wire.md §3.3's "not yet", and a refused request
never changes the registry."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from bootstrap_testkit import WIRE_LAYOUT, wire_layout
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tspd_bootstrap import BootstrapClient, BootstrapServer, RankAddress

pytestmark = pytest.mark.slow
WORLD, DP = 4, 2
MISSING = object()  # a key left out of the body

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[BootstrapServer, requests.Session, str]]:
    layout = _layout()
    with BootstrapServer("127.0.0.1", 0) as server, requests.Session() as session:
        client = BootstrapClient(server.url)
        for rank in range(WORLD - 1):  # one rank short: look-ups are "not yet" at first
            client.register_rank(
                engine_rank=rank,
                world_size=WORLD,
                dp_size=DP,
                rank_ip="10.0.0.1",
                rank_port=7000 + rank,
                cache_layout=layout,
            )
        yield server, session, layout
        metrics = session.get(f"{server.url}/metrics", timeout=5).text
        assert 'reason="internal"' not in metrics


def _layout() -> str:
    return WIRE_LAYOUT


def near_valid(data: st.DataObject, layout: str) -> dict[str, Any]:
    """A real registration (of this deployment or a conflicting one) with up to two fields
    perturbed or left out."""
    other = wire_layout(5)
    body: dict[str, Any] = {
        "role": data.draw(st.sampled_from(["Prefill", "prefill", "PREFILL"])),
        "world_size": WORLD,
        "dp_size": DP,
        "rank_ip": data.draw(st.sampled_from(["10.0.0.9", "::1", "node-3.local"])),
        "rank_port": data.draw(st.integers(min_value=1, max_value=65535)),
        "engine_rank": data.draw(st.integers(min_value=0, max_value=WORLD - 1)),
        "cache_layout": data.draw(st.sampled_from([layout, layout, other])),
    }
    perturbations = {
        "role": st.sampled_from(["Decode", "Encode", ""]),
        "world_size": st.sampled_from([8, 0, -4, True, 4.0]) | st.integers(),
        "dp_size": st.sampled_from([1, 3, 0, 2.0, "2"]),
        "rank_ip": st.sampled_from(["", "a b", "x/y"]) | st.text(max_size=12),
        "rank_port": st.sampled_from([0, 65536, "7100", None]) | st.integers(),
        "engine_rank": st.sampled_from([-1, WORLD, False, 1.5]),
        "cache_layout": st.sampled_from(["{}", "", "[", layout + " x"]) | st.text(max_size=20),
    }
    for key in sorted(data.draw(st.sets(st.sampled_from(sorted(body)), max_size=2))):
        value = data.draw(perturbations[key] | json_values | st.just(MISSING), label=key)
        if value is MISSING:
            del body[key]
        else:
            body[key] = value
    return body


def state(server: BootstrapServer, session: requests.Session) -> tuple[object, object]:
    url = f"{server.url}/route?engine_rank=-1&target_dp_group=-1"
    return server.snapshot(), session.get(url, timeout=5).json()


def check_put(live: tuple[BootstrapServer, requests.Session, str], raw: bytes) -> None:
    server, session, _ = live
    before = state(server, session)
    resp = session.put(f"{server.url}/route", data=raw, timeout=10)
    event(f"PUT -> {resp.status_code}")
    assert resp.status_code in (200, 400, 409, 413), resp.text
    if resp.status_code != 200:
        assert resp.json()["message"]
        assert state(server, session) == before
        return
    body = json.loads(raw)  # accepted: the registry holds exactly what was sent
    rank = body["engine_rank"]
    entry = next(e for e in server.snapshot().ranks if e.engine_rank == rank)
    assert entry.address == RankAddress(body["rank_ip"], body["rank_port"])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_put_bodies(
    live: tuple[BootstrapServer, requests.Session, str], data: st.DataObject
) -> None:
    if data.draw(st.integers(min_value=0, max_value=4)):
        obj: object = near_valid(data, live[2])
    else:
        obj = data.draw(json_values | st.dictionaries(st.text(max_size=12), json_values))
    check_put(live, json.dumps(obj).encode())


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(raw=st.binary(max_size=64))
def test_put_raw_bytes(live: tuple[BootstrapServer, requests.Session, str], raw: bytes) -> None:
    check_put(live, raw)


query_values = st.integers(min_value=-3, max_value=9).map(str) | st.text(max_size=8)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pairs=st.lists(
        st.tuples(st.sampled_from(["engine_rank", "target_dp_group", "x", ""]), query_values),
        max_size=4,
    ),
    garbage=st.text(max_size=16),
)
def test_query_strings(
    live: tuple[BootstrapServer, requests.Session, str], pairs: list[tuple[str, str]], garbage: str
) -> None:
    server, session, _ = live
    before = state(server, session)
    for query in (urllib.parse.urlencode(pairs), garbage):
        resp = session.get(f"{server.url}/route?{query}", timeout=10)
        assert resp.status_code in (200, 400, 500), resp.text
        if resp.status_code == 500:
            assert resp.json()["error"] == "not_ready"  # the only 500: wire.md §3.3's "not yet"
        elif resp.status_code == 200:
            assert set(resp.json()) <= {
                "prefill_tp_size",
                "prefill_dp_size",
                "cache_layout",
                "rank_ip",
                "rank_port",
            }
    assert state(server, session) == before
