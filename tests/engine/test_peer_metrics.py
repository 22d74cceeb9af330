"""Node ``/metrics`` from the ranks' transfer peers: responders and the scraper over real ZMQ
sockets, fed by real metrics registries (the same ``tspd_core.pd.metrics.registry`` a peer
snapshots), merged into one exposition. The whole path through real peers and workers runs in
tests/e2e (test_openai_local, test_kill_prefill).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from tspd_core.pd import MetricsSnapshot, PeerError
from tspd_core.pd.metrics.registry import Registry, labels
from tspd_engine.node.replicas import Node, NodeInfo, NodeRole
from tspd_engine.pdlink.peer_metrics import MetricsResponder, PeerScraper, merge
from tspd_engine.rank.client import EngineClient
from tspd_engine.rank.process import ANY_PORT


def _registry(rank: int) -> Registry:
    reg = Registry()
    reg.counter("transfer_bytes_total", "bytes written")
    reg.inc("tspd_pd_transfer_bytes_total", 1000.0 * (rank + 1))
    reg.counter("room_failures_total", "rooms failed, by cause")
    reg.inc("tspd_pd_room_failures_total", 2, labels(cause="heartbeat"))
    reg.histogram("transfer_seconds", "per job", [0.01, 0.1])
    reg.observe("tspd_pd_transfer_seconds", 0.05)
    return reg


@pytest.fixture
def nobody() -> Iterator[str]:
    """A loopback address where nobody listens: its port is held by a bound socket that never
    listens (connections are refused), so no other process can take it during the test."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield f"tcp://127.0.0.1:{held.getsockname()[1]}"


@pytest.fixture
def responders() -> Iterator[list[MetricsResponder]]:
    # Each binds a port the OS picks as it binds; ``address`` is then the bound one.
    started = [MetricsResponder(ANY_PORT, lambda _t, r=r: _registry(r).snapshot()).start()
               for r in range(2)]  # fmt: skip
    yield started
    for responder in started:
        responder.close()


def test_a_scrape_returns_each_ranks_snapshot_exactly(responders: list[MetricsResponder]) -> None:
    assert all(r.address.startswith("tcp://127.0.0.1:") for r in responders)
    assert not any(r.address.endswith(":*") for r in responders)
    scraper = PeerScraper()
    try:
        got = scraper.scrape([r.address for r in responders])
    finally:
        scraper.close()
    assert got == [_registry(0).snapshot(), _registry(1).snapshot()]


def test_merged_ranks_render_one_family_each_with_their_labels() -> None:
    merged = merge([({"replica": "0", "rank": str(r)}, _registry(r).snapshot()) for r in (0, 1)])
    text = merged.render({"role": "prefill"})
    at = 'role="prefill",replica="0"'
    assert text.splitlines() == [
        "# HELP tspd_pd_room_failures_total rooms failed, by cause",
        "# TYPE tspd_pd_room_failures_total counter",
        f'tspd_pd_room_failures_total{{{at},rank="0",cause="heartbeat"}} 2',
        f'tspd_pd_room_failures_total{{{at},rank="1",cause="heartbeat"}} 2',
        "# HELP tspd_pd_transfer_bytes_total bytes written",
        "# TYPE tspd_pd_transfer_bytes_total counter",
        f'tspd_pd_transfer_bytes_total{{{at},rank="0"}} 1000',
        f'tspd_pd_transfer_bytes_total{{{at},rank="1"}} 2000',
        "# HELP tspd_pd_transfer_seconds per job",
        "# TYPE tspd_pd_transfer_seconds histogram",
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="0",le="0.01"}} 0',
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="0",le="0.1"}} 1',
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="0",le="+Inf"}} 1',
        f'tspd_pd_transfer_seconds_sum{{{at},rank="0"}} 0.05',
        f'tspd_pd_transfer_seconds_count{{{at},rank="0"}} 1',
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="1",le="0.01"}} 0',
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="1",le="0.1"}} 1',
        f'tspd_pd_transfer_seconds_bucket{{{at},rank="1",le="+Inf"}} 1',
        f'tspd_pd_transfer_seconds_sum{{{at},rank="1"}} 0.05',
        f'tspd_pd_transfer_seconds_count{{{at},rank="1"}} 1',
    ]
    assert merged.total("tspd_pd_transfer_bytes_total") == 3000


def test_node_metrics_mark_a_silent_or_failing_rank_down(
    responders: list[MetricsResponder], nobody: str
) -> None:
    def broken(_timeout: float) -> MetricsSnapshot:
        raise PeerError("the prefill peer is shut down")

    failing = MetricsResponder(ANY_PORT, broken).start()
    silent = nobody  # nobody listens: the scrape waits its timeout, then gives up
    replicas = [[responders[0].address, failing.address], [responders[1].address, silent]]
    clients = [EngineClient(nobody, "") for _ in replicas]  # never used: no engine behind
    node = Node(clients, NodeInfo(role=NodeRole.PREFILL, dp=2), replicas)
    try:
        text = node.peer_metrics(timeout=0.5)
    finally:
        node.close()
        failing.close()
        for client in clients:
            client.close()
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("tspd_node_peer_metrics_up")] == [
        'tspd_node_peer_metrics_up{role="prefill",replica="0",rank="0"} 1',
        'tspd_node_peer_metrics_up{role="prefill",replica="0",rank="1"} 0',
        'tspd_node_peer_metrics_up{role="prefill",replica="1",rank="0"} 1',
        'tspd_node_peer_metrics_up{role="prefill",replica="1",rank="1"} 0',
    ]
    assert [line for line in lines if line.startswith("tspd_pd_transfer_bytes_total")] == [
        'tspd_pd_transfer_bytes_total{role="prefill",replica="0",rank="0"} 1000',
        'tspd_pd_transfer_bytes_total{role="prefill",replica="1",rank="0"} 2000',
    ]
    assert lines.count("# TYPE tspd_pd_transfer_bytes_total counter") == 1


def test_a_node_without_peers_has_no_peer_metrics(nobody: str) -> None:
    client = EngineClient(nobody, "")
    try:
        assert Node([client], NodeInfo()).peer_metrics() == ""
    finally:
        client.close()


def test_scrapes_from_many_threads_each_get_their_answer(
    responders: list[MetricsResponder],
) -> None:
    scraper = PeerScraper()
    results: list[list[MetricsSnapshot | None]] = []
    lock = threading.Lock()

    def scrape() -> None:
        got = scraper.scrape([r.address for r in responders])
        with lock:
            results.append(got)

    threads = [threading.Thread(target=scrape) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    scraper.close()
    want = [_registry(0).snapshot(), _registry(1).snapshot()]
    assert results == [want] * 8


def test_the_responder_survives_any_request_and_answers_the_next_scrape(
    responders: list[MetricsResponder],
) -> None:
    """Issue 18.4: a 2-frame REQ used to kill the metrics thread (every /metrics then waited
    3 s and peer_metrics_up stayed 0). Each odd request gets an error answer, an oversized one
    is dropped by ZMQ unread, and a real scrape right after gets the exact snapshot."""
    import zmq

    target = responders[0]
    ctx = zmq.Context()
    try:
        for request in ([b"metrics", b"x"], [b"x"], [b"[" * 1000], [b""]):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(target.address)
            sock.send_multipart(request)
            assert sock.poll(10_000), f"no answer to {request!r}"
            answer = sock.recv_multipart()
            want = f'{{"error": "not a metrics scrape ({len(request)} frame(s))"}}'.encode()
            assert answer == [want]
            sock.close()
        big = ctx.socket(zmq.REQ)  # above the responder's MAXMSGSIZE: dropped, no answer
        big.setsockopt(zmq.LINGER, 0)
        big.connect(target.address)
        big.send(b"m" * 100_000)
        scraper = PeerScraper()
        try:
            assert scraper.scrape([target.address], timeout_s=10) == [_registry(0).snapshot()]
        finally:
            scraper.close()
        assert big.poll(200) == 0
        big.close()
    finally:
        ctx.destroy(linger=0)  # closes whatever a failed assertion left open
