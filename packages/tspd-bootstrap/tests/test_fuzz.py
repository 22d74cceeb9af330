"""Hypothesis against the running server: no 5xx but WIRE's "not yet", and a refused request
never changes the registry."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tspd_bootstrap import BootstrapClient, BootstrapServer, RankAddress

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
    return json.dumps({"plan": {"n": 1}, "group_specs": [{"g": "a"}], "transfer_schema": {}})


def near_valid(layout: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies close to a real registration: each field valid, perturbed, or missing."""
    fields = {
        "role": st.sampled_from(["Prefill", "prefill", "Decode", "Encode", ""]),
        "world_size": st.sampled_from([WORLD, 8, 0, -4, True]) | st.integers(),
        "dp_size": st.sampled_from([DP, 1, 3, 0, 2.0]),
        "rank_ip": st.sampled_from(["10.0.0.9", "", "a b", "::1"]) | st.text(max_size=12),
        "rank_port": st.sampled_from([7100, 0, 65536, "7100", None]) | st.integers(),
        "engine_rank": st.integers(min_value=-2, max_value=WORLD + 1)
        | st.sampled_from([False, 1.5]),
        "cache_layout": st.sampled_from([layout, "{}", "", "[", layout + " "])
        | st.text(max_size=20),
    }
    perturbed = {k: v | json_values | st.just(MISSING) for k, v in fields.items()}
    return st.fixed_dictionaries(perturbed).map(
        lambda d: {k: v for k, v in d.items() if v is not MISSING}
    ) | st.dictionaries(st.text(max_size=12), json_values, max_size=6)


def state(server: BootstrapServer, session: requests.Session) -> tuple[object, object]:
    url = f"{server.url}/route?engine_rank=-1&target_dp_group=-1"
    return server.snapshot(), session.get(url, timeout=5).json()


def check_put(live: tuple[BootstrapServer, requests.Session, str], raw: bytes) -> None:
    server, session, _ = live
    before = state(server, session)
    resp = session.put(f"{server.url}/route", data=raw, timeout=10)
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
    layout = live[2]
    obj = data.draw(near_valid(layout) | json_values, label="body")
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
            assert resp.json()["error"] == "not_ready"  # the only 500: WIRE's "not yet"
        elif resp.status_code == 200:
            assert set(resp.json()) <= {
                "prefill_tp_size",
                "prefill_dp_size",
                "cache_layout",
                "rank_ip",
                "rank_port",
            }
    assert state(server, session) == before
