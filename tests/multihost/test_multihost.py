"""PD across hosts: the cluster of conftest.py, one role per network namespace.

* Requests through the router get the colocated tokens, P TP 2 -> D TP 1 across hosts, the
  router spreading them over both decode hosts; the KV really crosses the links (each host's
  eth0 byte counters grow by at least the KV bytes its node reports moved).
* Nothing listens on an address other hosts reach except the one each role was given
  (``ss`` in every namespace), Mooncake's two wildcard listeners per transfer worker aside:
  Mooncake cannot bind one address (docs/OPERATIONS.md, "What listens where").

Partitions of the same cluster (cables pulled mid-load): test_partitions.py.
"""

from __future__ import annotations

import pytest

from .answers import colocated_texts, complete_all
from .conftest import Cluster

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

#: Mooncake's listeners take ports from [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT] (its defaults).
MOONCAKE_PORTS = range(15000, 17001)
#: Transfer workers per host: P's two ranks, each decode node's one.
WORKERS = {"r": 0, "b": 0, "p": 2, "d1": 1, "d2": 1}
#: Every listener on a host (docs/OPERATIONS.md, "What listens where"): a node's HTTP port and
#: its replica's two loopback sockets (rendezvous, client), each rank's two on loopback (gloo,
#: metrics) plus rank 0's intake, each transfer worker's control socket and Mooncake's two.
LISTENERS = {"r": 1, "b": 1, "p": 3 + 3 + 2 + 2 * 3, "d1": 3 + 3 + 3, "d2": 3 + 3 + 3}
#: Of those, on the host's own address: the HTTP port and each worker's control socket.
ON_ADDRESS = {"r": 1, "b": 1, "p": 1 + 2, "d1": 1 + 1, "d2": 1 + 1}


def test_pd_across_hosts_gives_the_colocated_tokens_and_uses_both_decode_hosts(
    cluster: Cluster,
) -> None:
    c = cluster
    c.whole()
    prompts = [f"host {i}: {'across the bridge ' * (i % 5)}end" for i in range(8)]
    want = colocated_texts(prompts, 16)
    before = {h: c.stats(h)["pd_transfers_ok"] for h in ("p", "d1", "d2")}
    assert complete_all(c, prompts, 16) == want
    after = {h: c.stats(h)["pd_transfers_ok"] for h in ("p", "d1", "d2")}
    # Round robin over the two decode hosts: four requests each, all from P's one instance.
    assert {h: after[h] - before[h] for h in ("d1", "d2")} == {"d1": 4, "d2": 4}
    info = c.get("r", c.url("p") + "/info").json()
    assert (info["tp"], info["bootstrap"], info["bootstrap_hosted"]) == (
        2, f"{c.address('b')}:8998", False)  # fmt: skip


def test_the_kv_crosses_the_links(cluster: Cluster) -> None:
    c = cluster
    c.whole()
    prompts = [f"{i} " + "bytes on the wire. " * 20 for i in range(4)]
    want = colocated_texts(prompts, 4)
    kv_before = {h: c.stats(h)["pd_kv_bytes_in"] for h in ("d1", "d2")}
    links_before = {h: c.net.counters(h) for h in ("p", "d1", "d2")}
    assert complete_all(c, prompts, 4) == want
    kv = {h: c.stats(h)["pd_kv_bytes_in"] - kv_before[h] for h in ("d1", "d2")}
    links = {h: [a - b for a, b in zip(c.net.counters(h), links_before[h], strict=True)]
             for h in ("p", "d1", "d2")}  # fmt: skip
    assert kv["d1"] > 0
    assert kv["d2"] > 0
    for host in ("d1", "d2"):  # received: at least the KV that landed in its arena
        assert links[host][0] >= kv[host], (host, links[host], kv[host])
    assert links["p"][1] >= kv["d1"] + kv["d2"], (links["p"], kv)  # sent: all of it
    print(f"\nKV bytes moved {kv}; eth0 (rx, tx) bytes {links}")


def test_nothing_listens_beyond_each_hosts_address(cluster: Cluster) -> None:
    c = cluster
    c.whole()
    for host in ("r", "b", "p", "d1", "d2"):
        sockets = c.net.listening(host)
        mooncake = [s for s in sockets if s.wildcard]
        # Everything else is on the host's address (HTTP, the bootstrap server, the ranks'
        # ZMQ control sockets) or on loopback (a replica's rendezvous, gloo, intake, metrics).
        others = {s.address for s in sockets if not s.wildcard}
        assert others <= {c.address(host), "127.0.0.1"}, (host, sockets)
        assert len(sockets) == LISTENERS[host], (host, sockets)
        assert [s.address for s in sockets].count(c.address(host)) == ON_ADDRESS[host], sockets
        # Mooncake's: a handshake and a data listener per transfer worker, in its port range.
        owners: dict[int, list[str]] = {}
        for s in mooncake:
            assert s.port in MOONCAKE_PORTS, (host, s)
            (pid,) = s.pids
            owners.setdefault(pid, []).append(s.address)
        assert len(owners) == WORKERS[host], (host, mooncake)
        for addresses in owners.values():
            assert sorted(addresses) == ["*", "0.0.0.0"], (host, mooncake)
