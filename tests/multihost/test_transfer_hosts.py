"""The transfer peers' loopback harness split over two hosts (what the transfer benchmark's
veth column runs): P's bootstrap server, ranks and transfer workers on one network namespace,
D's on another, every byte of KV across the veth between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tspd_core.layout import ArenaSpec
from tspd_core.pd.events import RemotePrefill, Succeeded
from tspd_testing.loopback import LoopbackCluster, plan_rooms
from tspd_testing.netns import Network, clean_leftovers, ip, unavailable

pytestmark = [pytest.mark.multiproc]

SPEC = ArenaSpec(layers=2, kv_heads=2, head_dim=64, page_size=16, num_pages=64)


@pytest.fixture(scope="module")
def net() -> Iterator[Network]:
    why = unavailable()
    if why:
        pytest.skip(f"multi-host tests: {why}")
    clean_leftovers()
    with Network(("p", "d")) as network:
        yield network


def _pids(net: Network, host: str) -> set[int]:
    return {int(p) for p in ip("netns", "pids", net.hosts[host].netns).split()}


def test_p_tp2_to_d_tp1_across_two_hosts_moves_exact_bytes_over_the_veth(net: Network) -> None:
    p_specs = [dataclasses.replace(SPEC, tp_size=2, tp_rank=r) for r in range(2)]
    p_host, d_host = net.hosts["p"].address, net.hosts["d"].address
    with LoopbackCluster(p_specs, [SPEC], host=p_host, d_host=d_host, within=net.call,
                         start_method="spawn") as cluster:  # fmt: skip
        # Each side's workers run inside its own host (and nothing else of ours does).
        assert [r.peer.host() for r in cluster.p] == [p_host, p_host]
        assert cluster.d[0].peer.host() == d_host
        assert (len(_pids(net, "p")), len(_pids(net, "d"))) == (2, 1)
        assert cluster.server.url == f"http://{p_host}:{cluster.server.port}"
        rooms = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, 6, 60, seed=5)
        snapshots = cluster.tag(rooms)
        received = net.counters("d")[0]
        outcome = cluster.drive(rooms, timeout_s=120)
        assert outcome.final("p", 0) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert outcome.final("p", 1) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        assert cluster.verify(rooms, snapshots) == []
        moved = int(sum(r.peer.counters()["bytes"] for r in cluster.p))
        assert moved > 0
        assert net.counters("d")[0] - received >= moved  # it all came in through eth0
    assert _pids(net, "p") == _pids(net, "d") == set()  # the workers stopped with the cluster
