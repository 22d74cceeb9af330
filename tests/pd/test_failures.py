"""Failure paths with real peers: every stuck or broken room ends Failed, on time, once.

Write failures (an unreachable Mooncake session), aborts pushed to D, local timeouts on both
sides (wire.md §1), a bootstrap server that is not there, and a transfer worker that dies.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from tspd_core.ids import RequestId, Room
from tspd_core.layout import (
    ArenaSpec,
    build_contract,
    build_manifest,
    encode_contract,
    encode_manifest,
)
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    FirstToken,
    PdTunables,
    PeerError,
    PrefillOutbox,
    PrefillPeer,
    PrefillPeerConfig,
    RemoteDecodeRow,
    RemotePrefillRow,
)
from tspd_testing.loopback import LoopbackCluster
from tspd_testing.loopback import poll_events as _events

from .conftest import UnusedPorts

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)
# D gives up waiting well before P's sweep would abort a room its engine never admitted.
FAST = PdTunables(bootstrap_timeout_s=2.5, waiting_timeout_s=1.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster([SPEC], [SPEC], tunables=FAST) as c:
        yield c


@pytest.mark.multiproc
def test_write_failure_fails_the_room_on_p_and_aborts_d(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    p = cluster.p[0]
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{p.peer.port()}")
    session = f"127.0.0.1:{unused_ports.refused()}"  # no Mooncake there: every write fails
    contract = cluster.d[0].view.contract
    push.send_multipart(
        [
            b"None",
            b"127.0.0.1",
            str(port).encode(),
            session.encode(),
            b"\0\0\1\0\0\0\0\0",
            encode_contract(contract),
            b"1",
            b"0",
        ]
    )
    rid, room = RequestId("doomed"), Room(9001)
    p.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    manifest = build_manifest(contract, {"full_attention": np.array([3, 4])}, 0, 6)
    push.send_multipart([b"9001", session.encode(), encode_manifest(manifest)])
    assert _events(p.peer) == [Bootstrapped(rid)]
    assert isinstance(p.outbox, PrefillOutbox)
    p.outbox.stage_remote_decode([RemoteDecodeRow(rid, np.array([5, 6]), 0, 6)])
    p.outbox.hand_over_remote_decode({rid: FirstToken(1)})
    [event] = _events(p.peer)
    assert isinstance(event, Failed)
    assert event.rid == rid
    assert f"Mooncake write to {session} failed" in event.reason
    assert pull.poll(10_000)
    assert pull.recv_multipart() == [b"9001", b"0", b"0", b"-1", b""]
    assert not p.peer.has_in_flight()
    pull.close(linger=0)
    push.close(linger=0)


@pytest.mark.multiproc
def test_p_room_never_pre_allocated_times_out(cluster: LoopbackCluster) -> None:
    p = cluster.p[0].peer
    t0 = time.monotonic()  # before the room exists: its timeout cannot start earlier
    p.register(RequestId("lonely"), BootstrapInfo(*cluster.bootstrap, Room(77)))
    [event] = _events(p)
    assert event == Failed(RequestId("lonely"), "still bootstrapping after 2.5 s")
    assert time.monotonic() - t0 >= 2.5


@pytest.mark.multiproc
def test_d_room_waiting_for_input_times_out(cluster: LoopbackCluster) -> None:
    d = cluster.d[0]
    rid = RequestId("no-prefill")
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, Room(78)))
    assert _events(d.peer) == [Bootstrapped(rid)]
    manifest = build_manifest(d.view.contract, {"full_attention": np.array([8])}, 0, 3)
    assert isinstance(d.outbox, DecodeOutbox)
    d.outbox.stage_remote_prefill([RemotePrefillRow(rid, manifest)])
    assert d.outbox.hand_over_remote_prefill() == 1
    [event] = _events(d.peer)
    assert event == Failed(rid, "no Success from P ranks [0] in 1 s")
    # P has the room Bootstrapped (it got the pre-allocation) and no engine asked for it:
    # its sweep forgets it after the bootstrap timeout.


@pytest.mark.multiproc
def test_unreachable_bootstrap_server_fails_the_room(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    d = cluster.d[0].peer
    port = unused_ports.refused()
    d.register(RequestId("nowhere"), BootstrapInfo("127.0.0.1", port, Room(79)))
    [event] = _events(d)
    assert isinstance(event, Failed)
    assert event.reason.startswith(f"bootstrap 127.0.0.1:{port}:")


@pytest.mark.multiproc
def test_transfer_workers_name_their_processes(cluster: LoopbackCluster) -> None:
    # Forked from a forkserver (its command line), a worker is found by its name.
    comms = [
        Path(f"/proc/{rank.peer._worker.pid}/comm").read_text().strip()
        for rank in (*cluster.p, *cluster.d)
    ]
    assert comms == ["tspd-p-xfer0", "tspd-d-xfer0"]


@pytest.mark.multiproc
def test_dead_worker_fails_every_room_and_refuses_new_ones(unused_ports: UnusedPorts) -> None:
    # The rooms' look-ups go to a server that never answers: they are still waiting (a 5 s
    # read, twice) when the worker dies, so every room fails for that reason and no other.
    port = unused_ports.silent()
    with LoopbackCluster([SPEC], [SPEC], tunables=FAST) as c:
        d = c.d[0].peer
        rids = [RequestId(f"r{i}") for i in range(3)]
        for i, rid in enumerate(rids):
            d.register(rid, BootstrapInfo("127.0.0.1", port, Room(100 + i)))
        os.kill(d._worker.pid, signal.SIGKILL)
        events = _events(d, want=3)
        assert [e.rid for e in events] == rids
        assert all(isinstance(e, Failed) and "transfer worker lost" in e.reason for e in events)
        assert {e.cause for e in events if isinstance(e, Failed)} == {"worker_lost"}
        assert d.worker_lost is not None
        # Still tracked (a replica's ranks keep the same requests), then Failed at once.
        d.register(RequestId("late"), BootstrapInfo("127.0.0.1", port, Room(200)))
        [late] = _events(d)
        assert isinstance(late, Failed)
        assert late.rid == "late"
        assert late.reason.startswith("transfer worker lost")
        assert not d.has_in_flight()
        assert d.metrics().value("tspd_pd_worker_up") == 0.0
    with pytest.raises(PeerError, match="decode peer is shut down"):
        d.register(RequestId("later"), BootstrapInfo("127.0.0.1", port, Room(201)))


def _start_prefill(bootstrap_url: str) -> None:
    contract = build_contract(SPEC)
    arena = torch.zeros(contract.plan.arena_bytes, dtype=torch.uint8)
    config = PrefillPeerConfig(
        contract=encode_contract(contract).decode(), arena=arena, bootstrap_url=bootstrap_url
    )
    PrefillPeer.start(config)


@pytest.mark.multiproc
def test_prefill_start_fails_clearly_without_its_bootstrap_server(
    unused_ports: UnusedPorts,
) -> None:
    # wire.md §3: P PUTs once, no retry.
    port = unused_ports.refused()
    want = (
        "transfer worker failed to start: BootstrapUnavailable: bootstrap server "
        f"http://127.0.0.1:{port}: PUT /route (engine_rank 0) failed: connection refused "
        "(after 1 attempt)"
    )
    with pytest.raises(PeerError, match=f"^{re.escape(want)}$") as info:
        _start_prefill(f"127.0.0.1:{port}")
    assert str(info.value) == want


@pytest.mark.multiproc
@pytest.mark.slow
def test_prefill_start_gives_a_silent_bootstrap_server_one_5s_put() -> None:
    with socket.socket() as server:  # accepts (in the kernel), never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        tail = (
            f"http://127.0.0.1:{port}: PUT /route (engine_rank 0) failed: read timed out after "
            "5 s (after 1 attempt)"
        )
        with pytest.raises(PeerError, match=f"{re.escape(tail)}$") as info:
            _start_prefill(f"127.0.0.1:{port}")
    assert str(info.value).endswith(tail)


@pytest.mark.multiproc
def test_abort_on_both_sides_keeps_d_pages_until_p_answers(cluster: LoopbackCluster) -> None:
    p, d = cluster.p[0], cluster.d[0]
    rid, info = RequestId("gone"), BootstrapInfo(*cluster.bootstrap, Room(4711))
    d.peer.register(rid, info)
    p.peer.register(rid, info)
    assert _events(d.peer) == [Bootstrapped(rid)]
    assert isinstance(d.outbox, DecodeOutbox)
    manifest = build_manifest(d.view.contract, {"full_attention": np.array([9, 10])}, 0, 7)
    d.outbox.stage_remote_prefill([RemotePrefillRow(rid, manifest)])
    d.outbox.hand_over_remote_prefill()
    assert _events(p.peer) == [Bootstrapped(rid)]
    d.peer.abort(rid, "client went away")
    # A call answered after the abort (one pipe, read in order): D's worker has failed the
    # room before P's Failed push below can reach it, so D reports its own reason.
    d.peer.counters()
    # The manifest is out: P may be writing, so D keeps the room (and its pages) for now.
    assert _events(d.peer, timeout_s=0.5) == []
    p.peer.abort(rid, "client went away")  # P fails the room and pushes Failed to D
    assert _events(p.peer) == [Failed(rid, "client went away")]
    assert _events(d.peer) == [Failed(rid, "client went away")]
    assert not p.peer.has_in_flight()
    assert not d.peer.has_in_flight()


@pytest.mark.multiproc
def test_failed_session_is_refused_until_it_registers_again(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    """wire.md §8: after a failed write P refuses the session — at submit for a room already
    bootstrapped, at pre-allocation for a new one — until the TTL or a re-registration."""
    p = cluster.p[0]
    assert isinstance(p.outbox, PrefillOutbox)
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{p.peer.port()}")
    session = f"127.0.0.1:{unused_ports.refused()}"  # no Mooncake there: every write fails
    contract = cluster.d[0].view.contract
    registration = [
        b"None", b"127.0.0.1", str(port).encode(), session.encode(), b"\0\0\1\0\0\0\0\0",
        encode_contract(contract), b"1", b"0",
    ]  # fmt: skip
    push.send_multipart(registration)
    manifest = encode_manifest(build_manifest(contract, {"full_attention": np.array([3])}, 0, 2))

    def pre_allocate(n: int) -> RequestId:
        rid = RequestId(f"ttl-{n}")
        p.peer.register(rid, BootstrapInfo(*cluster.bootstrap, Room(9100 + n)))
        push.send_multipart([str(9100 + n).encode(), session.encode(), manifest])
        return rid

    def hand_over(rid: RequestId) -> None:
        assert isinstance(p.outbox, PrefillOutbox)
        p.outbox.stage_remote_decode([RemoteDecodeRow(rid, np.array([5]), 0, 2)])
        p.outbox.hand_over_remote_decode({rid: FirstToken(1)})

    def abort_pushed() -> list[bytes]:
        assert pull.poll(10_000), "P pushed no Failed"
        return list(pull.recv_multipart())

    first, second = pre_allocate(1), pre_allocate(2)
    assert _events(p.peer, want=2) == [Bootstrapped(first), Bootstrapped(second)]
    hand_over(first)
    [e] = _events(p.peer)
    assert (e.rid, e.cause) == (first, "write")
    assert abort_pushed() == [b"9101", b"0", b"0", b"-1", b""]
    hand_over(second)  # bootstrapped before the failure: refused at submit, nothing written
    [e] = _events(p.peer)
    assert e == Failed(second, f"session {session} failed a write recently (failed-session TTL)")
    assert abort_pushed()[:2] == [b"9102", b"0"]
    third = pre_allocate(3)  # a new room from the failed session fails at its pre-allocation
    [e] = _events(p.peer)
    assert e == Failed(third, f"room 9103: session {session} failed a write recently")
    assert abort_pushed()[:2] == [b"9103", b"0"]
    push.send_multipart(registration)  # the same registration again clears the mark
    fourth = pre_allocate(4)
    assert _events(p.peer) == [Bootstrapped(fourth)]
    p.peer.abort(fourth, "done")
    assert _events(p.peer) == [Failed(fourth, "done")]
    pull.close(linger=0)
    push.close(linger=0)


@pytest.mark.multiproc
def test_conflicting_re_registration_fails_the_rooms_that_use_the_session(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    p = cluster.p[0]
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{p.peer.port()}")
    session = f"127.0.0.1:{unused_ports.refused()}"  # never written to: an id, held
    contract = cluster.d[0].view.contract
    first = [
        b"None", b"127.0.0.1", str(port).encode(), session.encode(), b"\0\0\1\0\0\0\0\0",
        encode_contract(contract), b"1", b"0",
    ]  # fmt: skip
    push.send_multipart(first)
    manifest = encode_manifest(build_manifest(contract, {"full_attention": np.array([3])}, 0, 2))
    rid = RequestId("conflict")
    p.peer.register(rid, BootstrapInfo(*cluster.bootstrap, Room(9200)))
    push.send_multipart([b"9200", session.encode(), manifest])
    assert _events(p.peer) == [Bootstrapped(rid)]
    second = list(first)
    second[4] = b"\0\0\2\0\0\0\0\0"  # another arena under the same session id
    push.send_multipart(second)
    [e] = _events(p.peer)
    assert isinstance(e, Failed)
    assert (e.rid, e.cause) == (rid, "rejected")
    assert e.reason == (
        f"session {session} was rejected: a different registration for an already "
        "registered session"
    )
    assert pull.poll(10_000)
    assert pull.recv_multipart() == [b"9200", b"0", b"0", b"-1", b""]
    push.send_multipart([b"9201", session.encode(), manifest])  # refused until it registers
    assert pull.poll(10_000)
    assert pull.recv_multipart() == [b"9201", b"0", b"0", b"-1", b""]
    push.send_multipart(second)  # registering afresh is accepted
    rid2 = RequestId("afresh")
    p.peer.register(rid2, BootstrapInfo(*cluster.bootstrap, Room(9202)))
    push.send_multipart([b"9202", session.encode(), manifest])
    assert _events(p.peer) == [Bootstrapped(rid2)]
    p.peer.abort(rid2, "done")
    assert _events(p.peer) == [Failed(rid2, "done")]
    pull.close(linger=0)
    push.close(linger=0)
