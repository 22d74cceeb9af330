"""D's heartbeat: wire.md §3's probe bounds (2 s connect, 3 s read) and the verdict bound.

The probes go to real sockets: a real bootstrap server, a port that accepts but never answers
(the read times out), a port whose accept queue is full (the connect times out) and a closed
port (refused at once).
"""

from __future__ import annotations

import queue
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tspd_bootstrap.client import HEALTH_TIMEOUT
from tspd_bootstrap.server import BootstrapServer
from tspd_core.pd.decode.heartbeat import PROBE_TIMEOUT, Heartbeat, bound_for


def test_probe_timeout_is_wires_pair() -> None:
    assert PROBE_TIMEOUT == HEALTH_TIMEOUT == (2.0, 3.0)


def test_bound_is_limit_times_interval_plus_one_probe() -> None:
    assert bound_for(5.0, 2) == 20.0  # TokenSpeed's defaults
    assert bound_for(2.0, 1) == 7.0
    assert bound_for(0.5, 0) == 7.0  # the floors: interval 2 s, limit 1
    assert bound_for(3.0, 3) == 24.0


@contextmanager
def _silent_port() -> Iterator[int]:
    """Listens (the kernel completes the handshake) but never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield int(server.getsockname()[1])


@contextmanager
def _full_backlog_port() -> Iterator[int]:
    """A full accept queue: the kernel drops further SYNs, so a connect times out."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = int(server.getsockname()[1])
        fillers = [socket.socket() for _ in range(4)]
        try:
            for sock in fillers:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
            yield port
        finally:
            for sock in fillers:
                sock.close()


@contextmanager
def _refused_port() -> Iterator[int]:
    """Bound, never listening, held for the block: connecting is refused."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


def _run(heartbeat: Heartbeat, posted: queue.Queue[Callable[[], None]], n: int) -> None:
    """Run ``n`` posted results on this thread (the worker's control thread in real life)."""
    for _ in range(n):
        posted.get(timeout=30)()


def test_probes_fail_by_wires_bounds_and_a_200_resets_the_count() -> None:
    posted: queue.Queue[Callable[[], None]] = queue.Queue()
    results: list[tuple[str, bool]] = []
    dead: dict[str, str] = {}
    hb = Heartbeat(0.0, 2, posted.put, lambda a, ok: results.append((a, ok)), dead.__setitem__)
    assert (hb.interval_s, hb.limit, hb.bound_s) == (2.0, 2, 14.0)
    with (
        BootstrapServer("127.0.0.1", 0) as server,
        _silent_port() as silent,
        _full_backlog_port() as full,
        _refused_port() as closed,
    ):
        live, refused = f"127.0.0.1:{server.port}", f"127.0.0.1:{closed}"
        addresses = [live, f"127.0.0.1:{silent}", f"127.0.0.1:{full}", refused]
        try:
            hb.tick(100.0, addresses)
            _run(hb, posted, 4)
            assert sorted(results) == sorted([(live, True)] + [(a, False) for a in addresses[1:]])
            assert [hb.failures(a) for a in addresses] == [0, 1, 1, 1]
            assert dead == {}
            hb.tick(101.0, addresses)  # not due: nothing probed
            assert posted.empty()
            hb.tick(102.0, addresses)
            _run(hb, posted, 4)
        finally:
            hb.close()
    assert [hb.failures(a) for a in addresses] == [0, 0, 0, 0]  # the verdict clears the count
    assert dead == {
        f"127.0.0.1:{silent}": "2 heartbeats failed (bootstrap server http://127.0.0.1:"
        f"{silent}: GET /health failed: read timed out after 3 s (after 1 attempt))",
        f"127.0.0.1:{full}": "2 heartbeats failed (bootstrap server http://127.0.0.1:"
        f"{full}: GET /health failed: connect timed out after 2 s (after 1 attempt))",
        refused: "2 heartbeats failed (bootstrap server http://"
        f"{refused}: GET /health failed: connection refused (after 1 attempt))",
    }
