"""A real server on a loopback port: register → parallel info → look-up, restarts, redeploys."""

from __future__ import annotations

import json
import re

import pytest
import requests
from bootstrap_testkit import wire_layout

from tspd_bootstrap import (
    BootstrapClient,
    BootstrapNotFound,
    BootstrapRejected,
    BootstrapServer,
    ParallelInfo,
    RankAddress,
    Role,
)


def register_all(
    client: BootstrapClient, world: int, dp: int, layout: str, base: int, forward: bool = False
) -> None:
    for rank in range(world) if forward else reversed(range(world)):  # reversed: out of order
        client.register_rank(
            engine_rank=rank,
            world_size=world,
            dp_size=dp,
            rank_ip="127.0.0.1",
            rank_port=base + rank,
            cache_layout=layout,
        )


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("tp", range(1, 9))
def test_full_flow(
    server: BootstrapServer, client: BootstrapClient, layout: str, dp: int, tp: int
) -> None:
    world = dp * tp
    assert client.parallel_info() is None
    pretty = json.dumps(json.loads(layout), indent=2)  # every rank sends it pretty-printed
    client.register_rank(
        engine_rank=world - 1,
        world_size=world,
        dp_size=dp,
        rank_ip="127.0.0.1",
        rank_port=20000 + world - 1,  # where register_all puts it again (a renewal)
        cache_layout=pretty,
    )
    if tp > 1:
        incomplete = (
            f"500 not_ready: engine_rank {tp - 1} of target_dp_group {dp - 1}: DP group {dp - 1} "
            f"is incomplete (missing engine_rank {world - tp}"
        )
        with pytest.raises(BootstrapNotFound, match=re.escape(incomplete)) as info:
            client.rank_address(tp - 1, dp - 1)  # registered, but its DP group is incomplete
        assert (info.value.status, info.value.code) == (500, "not_ready")
    elif dp > 1:
        # A one-rank DP group is complete with its rank: it answers, the other group waits.
        assert client.rank_address(0, dp - 1) == RankAddress("127.0.0.1", 20000 + dp - 1)
        with pytest.raises(BootstrapNotFound, match="DP group 0 is incomplete"):
            client.rank_address(0, 0)
    register_all(client, world, dp, pretty, base=20000)
    assert client.parallel_info() == ParallelInfo(world, dp, layout)  # canonical, not pretty
    for group in range(dp):
        for rank in range(tp):
            want = RankAddress("127.0.0.1", 20000 + group * tp + rank)
            assert client.rank_address(rank, group) == want
    beyond = (
        f"400 out_of_range: engine_rank {tp} / target_dp_group 0 out of range: the deployment "
        f"has {dp} DP group(s) of {tp} TP rank(s)"
    )
    with pytest.raises(BootstrapRejected, match=f"{re.escape(beyond)}$") as out:
        client.rank_address(tp, 0)
    assert (out.value.status, out.value.code) == (400, "out_of_range")
    view = client.list_ranks()
    assert view.complete
    assert [(e.engine_rank, e.dp_group, e.tp_rank) for e in view.ranks] == [
        (r, r // tp, r % tp) for r in range(world)
    ]
    assert server.snapshot() == view


def test_wire_bytes_match_tokenspeed(server: BootstrapServer, layout: str) -> None:
    url = server.url
    nulls = requests.get(f"{url}/route?engine_rank=-1&target_dp_group=-1", timeout=5)
    assert (nulls.status_code, nulls.json()) == (
        200,
        {"prefill_tp_size": None, "prefill_dp_size": None, "cache_layout": None},
    )
    assert nulls.headers["Content-Type"] == "application/json; charset=utf-8"
    body = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "10.0.0.5",
        "rank_port": 41000,
        "engine_rank": 0,
        "cache_layout": layout,
    }
    for rank in (0, 1):
        put = requests.put(f"{url}/route", json={**body, "engine_rank": rank}, timeout=5)
        assert (put.status_code, put.text) == (200, "OK")
    info = requests.get(f"{url}/route?engine_rank=-1&target_dp_group=-1", timeout=5).json()
    assert list(info) == ["prefill_tp_size", "prefill_dp_size", "cache_layout"]
    assert info == {"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": layout}
    rank = requests.get(f"{url}/route?engine_rank=1&target_dp_group=0", timeout=5)
    assert (rank.status_code, rank.json()) == (200, {"rank_ip": "10.0.0.5", "rank_port": 41000})
    health = requests.get(f"{url}/health", timeout=5)
    assert (health.status_code, health.text) == (200, "OK")


def test_redeploy_through_reset_and_through_a_lone_rank(
    client: BootstrapClient, layout: str
) -> None:
    register_all(client, 2, 1, layout, base=31000)
    assert client.reset() == 2
    assert client.parallel_info() is None
    small = wire_layout(9)
    register_all(client, 1, 1, small, base=32000)
    assert client.parallel_info() == ParallelInfo(1, 1, small)
    # the only registered rank comes back with new sizes and layout: a redeploy, accepted
    register_all(client, 2, 1, layout, base=32000, forward=True)
    assert client.parallel_info() == ParallelInfo(2, 1, layout)
    assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 32001)
    client.deregister_rank(1)
    with pytest.raises(
        BootstrapNotFound,
        match=re.escape(
            "DELETE /ranks/1 failed: 404 not_registered: engine_rank 1 is not registered"
        )
        + "$",
    ) as gone:
        client.deregister_rank(1)
    assert (gone.value.status, gone.value.code) == (404, "not_registered")
    with pytest.raises(
        BootstrapNotFound,
        match=re.escape(
            "500 not_ready: engine_rank 0 of target_dp_group 0: DP group 0 is incomplete "
            "(missing engine_rank 1); retry later"
        ),
    ):
        client.rank_address(0, 0)  # incomplete again


def test_embedding_server_flow(embedding_server: BootstrapServer) -> None:
    with BootstrapClient(embedding_server.url) as client:
        for rank in range(2):
            # TokenSpeed E ranks say Prefill; a plain string works as well as the enum
            role = Role.PREFILL if rank == 0 else "Encode"
            client.register_rank(
                engine_rank=rank,
                world_size=2,
                dp_size=1,
                rank_ip="10.9.0.1",
                rank_port=6000 + rank,
                role=role,
            )
        raw = requests.get(
            f"{embedding_server.url}/route?engine_rank=-1&target_dp_group=-1", timeout=5
        )
        assert raw.json() == {"prefill_tp_size": 2, "prefill_dp_size": 1}
        assert client.parallel_info() == ParallelInfo(2, 1, None)
        assert client.rank_address(1, 0) == RankAddress("10.9.0.1", 6001)
        assert [e.role for e in client.list_ranks().ranks] == [Role.PREFILL, Role.ENCODE]


def test_injected_canonicalizer_decides(layout: str) -> None:
    def strict(text: str) -> str:
        obj = json.loads(text)
        if "retention" not in obj["group_specs"][0]:
            raise ValueError("group_specs[0] lacks 'retention'")
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))

    with (
        BootstrapServer("127.0.0.1", 0, layout_canonicalizer=strict) as server,
        BootstrapClient(server.url) as client,
    ):
        register_all(client, 1, 1, layout, base=34000)
        expected = json.dumps(json.loads(layout), sort_keys=True, separators=(",", ":"))
        assert client.parallel_info() == ParallelInfo(1, 1, expected)
        broken = layout.replace('"retention":"full_history",', "")
        with pytest.raises(
            BootstrapRejected,
            match=re.escape(
                "400 bad_layout: cache_layout rejected: group_specs[0] lacks 'retention'"
            )
            + "$",
        ) as info:
            register_all(client, 1, 1, broken, base=34000)
        assert (info.value.status, info.value.code) == (400, "bad_layout")
        assert info.value.reason == "cache_layout rejected: group_specs[0] lacks 'retention'"


def test_a_complete_dp_group_answers_while_another_registers(
    server: BootstrapServer, layout: str
) -> None:
    """World 4, DP 2: a decode rank of DP group 0 needs ranks 0 and 1 only (TokenSpeed's
    server answers as soon as they are there; so does this one)."""
    body = {
        "role": "Prefill",
        "world_size": 4,
        "dp_size": 2,
        "rank_ip": "10.0.0.5",
        "cache_layout": layout,
    }
    for rank in (0, 1):
        put = {**body, "engine_rank": rank, "rank_port": 42000 + rank}
        assert requests.put(f"{server.url}/route", json=put, timeout=5).status_code == 200
    url = f"{server.url}/route?engine_rank={{}}&target_dp_group={{}}"
    answer = requests.get(url.format(1, 0), timeout=5)
    assert (answer.status_code, answer.json()) == (200, {"rank_ip": "10.0.0.5", "rank_port": 42001})
    waiting = requests.get(url.format(0, 1), timeout=5)
    assert (waiting.status_code, waiting.json()["error"]) == (500, "not_ready")


def test_equivalent_layouts_agree_and_extensions_reach_the_lookup(
    server: BootstrapServer, client: BootstrapClient, layout: str
) -> None:
    sparse = json.loads(layout)
    for key in ("sliding_window_tokens", "family", "checkpoint_granularity"):
        del sparse["group_specs"][0][key]  # their defaults: the same layout
    client.register_rank(
        engine_rank=0,
        world_size=2,
        dp_size=1,
        rank_ip="10.0.0.5",
        rank_port=43000,
        cache_layout=layout,
    )
    put = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "10.0.0.6",
        "rank_port": 43001,
        "engine_rank": 1,
        "cache_layout": json.dumps(sparse),
        "tspd_extensions": ["tspd.stage/2"],
    }
    resp = requests.put(f"{server.url}/route", json=put, timeout=5)
    assert (resp.status_code, resp.text) == (200, "OK")
    raw = requests.get(f"{server.url}/route?engine_rank=1&target_dp_group=0", timeout=5).json()
    assert raw == {"rank_ip": "10.0.0.6", "rank_port": 43001, "tspd_extensions": ["tspd.stage/2"]}
    assert client.rank_address(1, 0) == RankAddress("10.0.0.6", 43001, ("tspd.stage/2",))
    assert client.rank_address(0, 0) == RankAddress("10.0.0.5", 43000)
