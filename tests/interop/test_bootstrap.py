"""The bootstrap rendezvous across implementations.

TokenSpeed's client code against ``tspd-bootstrap`` (its prefill and encode registrations, its
decode look-ups for D TP 1, 2 and 4, its heartbeat probe), and tspd's ``BootstrapClient``
against TokenSpeed's servers (the KV one and the embedding one). TokenSpeed's functions run as
they are; where they are methods of its managers, they get an object with the attributes they
read (its managers would start Mooncake engines and threads that never end).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator

import pytest
import requests

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)
tokenspeed_env.load()

from tokenspeed.runtime.epd.mooncake import receiver as epd_receiver  # noqa: E402
from tokenspeed.runtime.epd.mooncake.conn import MooncakeEmbeddingBootstrapServer  # noqa: E402
from tokenspeed.runtime.epd.mooncake.encode import MooncakeEmbeddingManagerEncode  # noqa: E402
from tokenspeed.runtime.pd.mooncake import receiver as kv_receiver  # noqa: E402
from tokenspeed.runtime.pd.mooncake.conn import MooncakeKVBootstrapServer  # noqa: E402
from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill  # noqa: E402
from tokenspeed.runtime.pd.topology import PDParallelTopology  # noqa: E402

from tspd_bootstrap import (  # noqa: E402
    BootstrapClient,
    BootstrapNotFound,
    BootstrapRequestError,
    BootstrapServer,
    ParallelInfo,
    RankAddress,
)
from tspd_core.layout import canonical_layout_text, parse_contract, plan_routes  # noqa: E402
from tspd_testing.interop.contracts import Model, tokenspeed_contract  # noqa: E402
from tspd_testing.interop.host import bound_port, loopback_bootstrap  # noqa: E402
from tspd_testing.interop.tspd_side import ErrorLog  # noqa: E402

NS = types.SimpleNamespace
GQA = Model("gqa-8", "mha", layers=2, kv_heads=8, head_dim=16, page=4)
BUDGET = 1 << 20
P_TP, P_DP = 4, 2  # world 8: DP group g holds engine ranks 4g .. 4g+3


@pytest.fixture(scope="module", autouse=True)
def _loopback() -> None:
    loopback_bootstrap()


def _layout(tp: int) -> str:
    return tokenspeed_contract(GQA, tp, BUDGET).to_wire_bytes().decode()


def _tokenspeed_prefill_rank(port: int, engine_rank: int) -> None:
    """TokenSpeed's prefill registration (``MooncakeKVManagerPrefill._register_to_bootstrap``)."""
    layout = tokenspeed_contract(GQA, P_TP, BUDGET)
    topology = PDParallelTopology(
        tp_size=P_TP, tp_rank=engine_rank % P_TP, cp_size=1, cp_rank=0, dp_size=P_DP,
        dp_rank=engine_rank // P_TP, world_size=P_TP * P_DP, global_rank=engine_rank,
    )  # fmt: skip
    manager = NS(
        dist_init_addr="127.0.0.1:0",
        bootstrap_port=port,
        topology=topology,
        rank_port=30000 + engine_rank,
        kv_args=NS(cache_layout=layout),
    )
    MooncakeKVManagerPrefill._register_to_bootstrap(manager)  # type: ignore[arg-type]


@pytest.fixture
def errors() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


def test_tokenspeed_clients_against_tspd_bootstrap(errors: ErrorLog) -> None:
    with BootstrapServer("127.0.0.1", 0) as server:
        address = f"127.0.0.1:{server.port}"
        for rank in range(P_TP):  # DP group 0 complete, group 1 not yet
            _tokenspeed_prefill_rank(server.port, rank)
        info = kv_receiver._get_prefill_parallel_info_from_server(address)
        assert info is not None
        assert (info.tp_size, info.dp_size, info.prefill_tp_size_per_dp_rank) == (8, 2, 4)
        assert info.cache_layout.to_wire_bytes().decode() == canonical_layout_text(_layout(P_TP))
        for d_tp in (1, 2, 4):
            decode = tokenspeed_contract(GQA, d_tp, BUDGET)
            for d_rank in range(d_tp):
                mgr = NS(topology=NS(tp_size=d_tp, tp_rank=d_rank), kv_args=NS(cache_layout=decode))
                plan = kv_receiver._calc(mgr, info)
                receiver = NS(bootstrap_addr=address)
                found = kv_receiver.MooncakeKVReceiver._get_bootstrap_infos(receiver, 0, plan)
                assert found == [
                    {"rank_ip": "127.0.0.1", "rank_port": 30000 + p, "is_dummy": False}
                    for p in plan.target_tp_ranks
                ]
        # DP group 1 is incomplete: TokenSpeed's client gets the 500 it treats as "no info".
        assert kv_receiver._get_bootstrap_info_from_server(address, 0, 1) is None
        for rank in range(P_TP, 2 * P_TP):
            _tokenspeed_prefill_rank(server.port, rank)
        assert kv_receiver._get_bootstrap_info_from_server(address, 3, 1) == {
            "rank_ip": "127.0.0.1",
            "rank_port": 30007,
        }
        health = requests.get(f"http://{address}/health", timeout=(2, 3))  # its heartbeat probe
        assert (health.status_code, health.text) == (200, "OK")
    # TokenSpeed's client logs every non-200 look-up (it would against its own server too).
    assert errors.lines == [
        "ERROR tokenspeed.runtime.pd.mooncake.receiver: Failed to get prefill server info: "
        '500, {"status": 500, "error": "not_ready", "message": "engine_rank 0 of '
        "target_dp_group 1: DP group 1 is incomplete (missing engine_rank 4, 5, 6, 7); retry "
        'later"}'
    ]


def test_tokenspeed_encode_registers_on_a_tspd_embedding_server(errors: ErrorLog) -> None:
    with BootstrapServer("127.0.0.1", 0, embedding=True) as server:
        for rank in range(2):
            encode = NS(
                args=NS(bootstrap_host="127.0.0.1"),
                bootstrap_port=server.port,
                world_size=2,
                dp_size=1,
                rank_port=31000 + rank,
                embedding_args=NS(engine_rank=rank),
            )
            MooncakeEmbeddingManagerEncode._register_to_bootstrap(encode)  # type: ignore[arg-type]
        address = f"127.0.0.1:{server.port}"
        assert epd_receiver._route_get(address, -1, -1) == {
            "prefill_tp_size": 2,
            "prefill_dp_size": 1,
        }
        assert epd_receiver._route_get(address, 1, 0) == {
            "rank_ip": "127.0.0.1",
            "rank_port": 31001,
        }
    assert errors.lines == []


def test_tspd_client_against_tokenspeeds_kv_server(errors: ErrorLog) -> None:
    server = MooncakeKVBootstrapServer(0)
    try:
        client = BootstrapClient(f"127.0.0.1:{bound_port(server)}", retries=0)
        assert client.parallel_info() is None
        ours = parse_contract(_layout(P_TP).encode())
        for rank in range(P_TP):
            client.register_rank(
                engine_rank=rank,
                world_size=P_TP,
                dp_size=1,
                rank_ip="127.0.0.1",
                rank_port=32000 + rank,
                cache_layout=_layout(P_TP),
                extensions=("tspd.stage/2",),  # a TokenSpeed server drops them
            )
        info = client.parallel_info()
        assert info == ParallelInfo(P_TP, 1, _layout(P_TP))
        for d_tp in (1, 2, 4):
            route = plan_routes(ours, P_TP, parse_contract(_layout(d_tp).encode()), d_tp)
            for d_rank in range(d_tp):
                for p in route.contacts(d_rank):
                    assert client.rank_address(p, 0) == RankAddress("127.0.0.1", 32000 + p)
        with pytest.raises(BootstrapNotFound, match="500"):
            client.rank_address(0, 1)  # no DP group 1: TokenSpeed's 500
        with pytest.raises(BootstrapRequestError, match="500"):  # a different layout: its 500
            client.register_rank(
                engine_rank=1,
                world_size=P_TP,
                dp_size=1,
                rank_ip="127.0.0.1",
                rank_port=1,
                cache_layout=_layout(2),
            )
        assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 32001)  # unchanged
        client.health()
        assert client.is_healthy()
        client.close()
    finally:
        server.close()
    # TokenSpeed's server answers the unknown DP group and the conflicting layout by raising
    # (KeyError, ValueError): aiohttp logs each and answers 500. Nothing else went wrong.
    assert errors.lines == ["ERROR aiohttp.server: Error handling request from 127.0.0.1"] * 2


def test_tspd_encode_registration_on_tokenspeeds_embedding_server(errors: ErrorLog) -> None:
    server = MooncakeEmbeddingBootstrapServer(0)
    try:
        with BootstrapClient(f"127.0.0.1:{bound_port(server)}", retries=0) as client:
            for rank in range(2):  # tspd's encode worker registers like this (role Prefill)
                client.register_rank(
                    engine_rank=rank, world_size=2, dp_size=1, rank_ip="127.0.0.1",
                    rank_port=33000 + rank,
                )  # fmt: skip
            assert client.parallel_info() == ParallelInfo(2, 1, None)
            assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 33001)
    finally:
        server.close()
    assert errors.lines == []
