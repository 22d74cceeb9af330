"""The ZMQ control plane over real loopback sockets."""

from __future__ import annotations

import threading

import pytest
import zmq

from tspd_core.pd.errors import PeerError
from tspd_core.pd.proc.control import ControlPlane, route_source_ip


@pytest.fixture
def planes() -> object:
    a, b = ControlPlane("127.0.0.1"), ControlPlane("127.0.0.1")
    yield a, b
    a.close()
    b.close()


def test_push_reaches_pull_as_one_multipart(planes: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = planes
    a.send("127.0.0.1", b.port, [b"None", b"x", b""])
    assert b.recv(5000) == [b"None", b"x", b""]
    assert b.recv(10) is None
    assert b.endpoint == f"tcp://127.0.0.1:{b.port}"


def test_concurrent_senders_keep_per_sender_order(
    planes: tuple[ControlPlane, ControlPlane],
) -> None:
    a, b = planes
    n, threads = 200, 4

    def burst(t: int) -> None:
        for i in range(n):
            a.send("127.0.0.1", b.port, [str(t).encode(), str(i).encode()])

    workers = [threading.Thread(target=burst, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    got: dict[int, list[int]] = {t: [] for t in range(threads)}
    for _ in range(n * threads):
        msg = b.recv(5000)
        assert msg is not None
        got[int(msg[0])].append(int(msg[1]))
    for w in workers:
        w.join()
    assert got == {t: list(range(n)) for t in range(threads)}


def test_oversized_frame_is_dropped_by_zmq_and_socket_keeps_serving(
    planes: tuple[ControlPlane, ControlPlane],
) -> None:
    _, b = planes
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(b.endpoint)
    raw.send_multipart([b"1", b"h:1", b"x" * (9 << 20)])
    raw.close(linger=1000)
    assert b.recv(300) is None
    ok = ControlPlane("127.0.0.1")
    ok.send("127.0.0.1", b.port, [b"still", b"alive"])
    assert b.recv(5000) == [b"still", b"alive"]
    ok.close()


def test_closed_plane_refuses_to_send(planes: tuple[ControlPlane, ControlPlane]) -> None:
    a, b = planes
    a.close()
    with pytest.raises(PeerError, match="closed"):
        a.send("127.0.0.1", b.port, [b"x"])


def test_route_source_ip_falls_back_without_a_route() -> None:
    ip = route_source_ip("127.0.0.1")
    parts = ip.split(".")
    assert len(parts) == 4
    assert all(p.isdigit() for p in parts)
