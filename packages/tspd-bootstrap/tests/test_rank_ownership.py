"""Who may move a registered rank to another address: its lease, an operator, or the credential.

Each case runs a real server on a loopback port whose clock the test moves (the lease is
measured on it), so a lapse is a step of the clock, not a wait.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
import requests
from bootstrap_testkit import wire_layout

from tspd_bootstrap import (
    LEASE_EXTENSION,
    BootstrapClient,
    BootstrapConflict,
    BootstrapServer,
    RankAddress,
)

LEASE_S = 20.0


class Clock:
    """Unix time that moves only when the test says (starts at the real time)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def owned(clock: Clock) -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0, allow_admin=True, lease_s=LEASE_S, clock=clock) as srv:
        yield srv


def put(url: str, rank: int, port: int, layout: str, lease: bool = True) -> requests.Response:
    body: dict[str, object] = {
        "role": "Prefill",
        "world_size": 4,
        "dp_size": 2,
        "rank_ip": "127.0.0.1",
        "rank_port": port,
        "engine_rank": rank,
        "cache_layout": layout,
    }
    if lease:
        body["tspd_extensions"] = [LEASE_EXTENSION]
    return requests.put(f"{url}/route", data=json.dumps(body), timeout=5)


def metric(url: str, name: str) -> str:
    text = requests.get(f"{url}/metrics", timeout=5).text
    return next(line for line in text.splitlines() if line.startswith(name + " "))


def held_body(rank: int, holder: int, by: int, leased: bool) -> dict[str, object]:
    if leased:
        why = f"which renews its lease (it lapses {LEASE_S:g} s after the last renewal)"
        ways = "once that lease lapses, after"
    else:
        why = "which registered without a lease (a rank that registers once keeps its address)"
        ways = "after"
    return {
        "status": 409,
        "error": "rank_held",
        "message": f"engine_rank {rank} is registered at 127.0.0.1:{holder}, {why}; "
        f"127.0.0.1:{by} may take it over only {ways} an operator's DELETE /ranks/{rank}, "
        "or with the cluster credential",
    }


def test_a_rank_without_a_lease_keeps_its_address(owned: BootstrapServer, layout: str) -> None:
    url = owned.url
    for rank in range(4):
        assert put(url, rank, 30000 + rank, layout, lease=False).status_code == 200
    before = owned.snapshot()
    refused = put(url, 0, 39000, layout, lease=False)
    assert (refused.status_code, refused.json()) == (409, held_body(0, 30000, 39000, False))
    assert "Retry-After" not in refused.headers  # no lease: waiting changes nothing
    assert owned.snapshot() == before
    with BootstrapClient(url) as client:
        assert client.rank_address(0, 0) == RankAddress("127.0.0.1", 30000)
    errors = 'tspd_bootstrap_errors_total{status="409",reason="rank_held"}'
    assert metric(url, errors) == f"{errors} 1"
    # The holder itself renews (same address): accepted, counted as a re-registration.
    assert put(url, 0, 30000, layout, lease=False).status_code == 200
    assert metric(url, "tspd_bootstrap_reregistrations_total").endswith(" 1")


def test_a_leased_rank_moves_once_its_lease_lapsed(
    owned: BootstrapServer, clock: Clock, layout: str
) -> None:
    url = owned.url
    for rank in range(4):
        assert put(url, rank, 30000 + rank, layout).status_code == 200
    clock.now += 12.5
    refused = put(url, 2, 39999, layout)
    assert (refused.status_code, refused.json()) == (409, held_body(2, 30002, 39999, True))
    assert refused.headers["Retry-After"] == "8"  # 20 - 12.5 s, rounded up
    assert put(url, 2, 30002, layout).status_code == 200  # the holder renews: a new lease
    clock.now += LEASE_S - 0.5
    assert put(url, 2, 39999, layout).status_code == 409
    clock.now += 0.5  # LEASE_S after the renewal: lapsed
    moved = put(url, 2, 39999, layout)
    assert (moved.status_code, moved.text) == (200, "OK")
    with BootstrapClient(url) as client:
        assert client.rank_address(0, 1) == RankAddress("127.0.0.1", 39999, (LEASE_EXTENSION,))
        entry = client.list_ranks().ranks[2]
    assert (entry.rank_port, entry.registrations) == (39999, 3)
    how = 'tspd_bootstrap_replacements_total{how="lease_lapsed"}'
    assert metric(url, how) == f"{how} 1"
    # The new holder must still agree with the deployment: another layout is refused.
    conflict = put(url, 2, 39999, wire_layout(4))
    assert (conflict.status_code, conflict.json()["error"]) == (409, "layout_conflict")


def test_an_operator_frees_a_held_rank(owned: BootstrapServer, layout: str) -> None:
    url = owned.url
    for rank in range(4):
        assert put(url, rank, 30000 + rank, layout, lease=False).status_code == 200
    with BootstrapClient(url) as client:
        with pytest.raises(BootstrapConflict, match=re.escape("409 rank_held: engine_rank 1 ")):
            client.register_rank(
                engine_rank=1,
                world_size=4,
                dp_size=2,
                rank_ip="127.0.0.1",
                rank_port=41001,
                cache_layout=layout,
            )
        client.deregister_rank(1)
        client.register_rank(
            engine_rank=1,
            world_size=4,
            dp_size=2,
            rank_ip="127.0.0.1",
            rank_port=41001,
            cache_layout=layout,
        )
        assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 41001)
