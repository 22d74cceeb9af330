"""Bad frames from a raw ZMQ socket: rejected, logged, and the peers keep serving.

A raw PUSH socket plays a broken or hostile D (towards P) and a broken P (towards D). Every
message below must be refused with a log line that says why; a fake D session that sends a bad
manifest gets the exact abort frames of wire.md §2.4; and afterwards a real room still moves
byte-exact between the same two peers.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, encode_contract
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    PdEvent,
    PdTunables,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
)
from tspd_core.pd.wire.frames import ScatterRequest, encode_scatter
from tspd_testing.loopback import LoopbackCluster, plan_rooms, poll_events

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    logging.getLogger("tspd_core.pd").setLevel(logging.INFO)
    with LoopbackCluster([SPEC], [SPEC]) as c:
        yield c
    logging.getLogger("tspd_core.pd").setLevel(logging.NOTSET)


@pytest.fixture
def raw() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes], int]]:
    """A PUSH socket to send from, and a PULL socket (with its port) to receive aborts on."""
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield push, pull, port
    push.close(linger=0)
    pull.close(linger=0)


def _await_log(caplog: pytest.LogCaptureFixture, needle: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in caplog.records:
            if needle in record.getMessage():
                return record.getMessage()
        time.sleep(0.02)
    seen = [r.getMessage() for r in caplog.records]
    raise AssertionError(f"no log line containing {needle!r}; saw {seen}")


def _registration(cluster: LoopbackCluster, port: int, session: str) -> list[bytes]:
    contract = encode_contract(cluster.d[0].view.contract)
    ptr = struct.pack("<Q", 0x10000)
    return [b"None", b"127.0.0.1", str(port).encode(), session.encode(), ptr, contract, b"1", b"0"]


BAD_TO_P = [
    ([b"None", b"127.0.0.1", b"5000"], "registration needs 8 frames, got 3"),
    ([b"None", b"127.0.0.1", b"port", b"h:1", b"\1" * 8, b"{}", b"1", b"0"], "port must be"),
    ([b"None", b"127.0.0.1", b"5000", b"h:1", b"\1" * 4, b"{}", b"1", b"0"], "must be 8 bytes"),
    ([b"12", b"127.0.0.1:1", b"x" * (3 << 20)], "manifest is 3145728 bytes"),
    ([b"-12", b"127.0.0.1:1", b"{}"], "pre-allocation room -12 is outside"),
    ([b"77", b"127.0.0.1:1", b"{}"], "room 77: pre-allocation from unregistered 127.0.0.1:1"),
    ([b"77", b"127.0.0.1:1", b"{}", b"extra"], "pre-allocation needs 3 frames, got 4"),
]

BAD_TO_D = [
    ([b"5", b"5"], "status needs 3..7 frames, got 2"),
    ([b"5", b"yes", b"0"], "status value must be"),
    ([b"5", b"5", b"0", b"1", b"abc"], "int32 LE"),
    ([b"31337", b"5", b"0", b"1", b""], "ignored status SUCCESS for unknown room 31337"),
]


@pytest.mark.multiproc
@pytest.mark.parametrize(("frames", "why"), BAD_TO_P, ids=[w for _, w in BAD_TO_P])
def test_prefill_rejects_and_logs(
    cluster: LoopbackCluster,
    raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes], int],
    caplog: pytest.LogCaptureFixture,
    frames: list[bytes],
    why: str,
) -> None:
    push, _, _ = raw
    push.connect(f"tcp://127.0.0.1:{cluster.p[0].peer.port()}")
    push.send_multipart(frames)
    assert why in _await_log(caplog, why)


@pytest.mark.multiproc
@pytest.mark.parametrize(("frames", "why"), BAD_TO_D, ids=[w for _, w in BAD_TO_D])
def test_decode_rejects_and_logs(
    cluster: LoopbackCluster,
    raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes], int],
    caplog: pytest.LogCaptureFixture,
    frames: list[bytes],
    why: str,
) -> None:
    push, _, _ = raw
    push.connect(f"tcp://127.0.0.1:{cluster.d[0].peer.port()}")
    push.send_multipart(frames)
    assert why in _await_log(caplog, why)


@pytest.mark.multiproc
def test_bad_manifest_from_a_registered_session_gets_the_exact_abort(
    cluster: LoopbackCluster,
    raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes], int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    push, pull, port = raw
    push.connect(f"tcp://127.0.0.1:{cluster.p[0].peer.port()}")
    push.send_multipart(_registration(cluster, port, "127.0.0.1:2"))
    bad = b'{"groups":[{"group_id":"full_attention","block_ids":[999]}],' + (
        b'"prefix_len":0,"prompt_len":3}'
    )
    push.send_multipart([b"4242", b"127.0.0.1:2", bad])
    assert pull.poll(10_000), "P sent no abort"
    assert pull.recv_multipart() == [b"4242", b"0", b"0", b"-1", b""]
    _await_log(caplog, "room 4242: bad manifest from 127.0.0.1:2")
    # The room is Failed now: a second pre-allocation is answered with Failed at once.
    push.send_multipart([b"4242", b"127.0.0.1:2", b'{"groups":[]}'])
    assert pull.poll(10_000)
    assert pull.recv_multipart() == [b"4242", b"0", b"0", b"-1", b""]
    # A different registration for the same session is refused and remembered.
    other = _registration(cluster, port, "127.0.0.1:2")
    other[7 - 1] = b"2"  # tp size 2 for the same session
    push.send_multipart(other)
    _await_log(caplog, "rejected registration of 127.0.0.1:2")


@pytest.mark.multiproc
def test_real_rooms_still_move_after_the_garbage(cluster: LoopbackCluster) -> None:
    rooms = plan_rooms(cluster.p[0].view.contract, cluster.d[0].view.contract, 6, 20, seed=3)
    snapshots = cluster.tag(rooms)
    outcome = cluster.drive(rooms, timeout_s=60)
    assert outcome.final("p", 0) == {r.rid: Succeeded(r.rid) for r in rooms}
    assert outcome.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
    assert cluster.verify(rooms, snapshots) == []


@pytest.mark.multiproc
def test_success_before_the_manifest_fails_the_room_instead_of_faking_a_prefill(
    cluster: LoopbackCluster, raw: tuple[zmq.Socket[bytes], zmq.Socket[bytes], int]
) -> None:
    d = cluster.d[0].peer
    rid = RequestId("early")
    d.register(rid, BootstrapInfo(*cluster.bootstrap, Room(515)))
    assert poll_events(d) == [Bootstrapped(rid)]
    push, _, _ = raw
    push.connect(f"tcp://127.0.0.1:{d.port()}")
    push.send_multipart([b"515", b"5", b"0", b"42", b""])  # Success, token 42, from P rank 0
    assert poll_events(d, timeout_s=10) == [
        Failed(rid, "Success from P rank 0 before the manifest")
    ]


@pytest.mark.multiproc
def test_a_piece_d_cannot_scatter_fails_the_room_on_d() -> None:
    """P may send Success without waiting for scatter acks (ordered offers), so a piece D
    refuses must fail the room on D itself, never let a RemotePrefill through."""
    fast_p = PdTunables(bootstrap_timeout_s=3.0)  # P's answer makes D's failed room quiet
    with LoopbackCluster([SPEC], [SPEC], tunables=fast_p) as cluster:
        d = cluster.d[0]
        host, port = cluster.bootstrap
        rid, room = RequestId("refused"), Room(4242)
        d.peer.register(rid, BootstrapInfo(host, port, room))  # P never admits it: no writes
        events: list[PdEvent] = poll_events(d.peer)
        assert events == [Bootstrapped(rid)]
        plan = plan_rooms(cluster.p[0].view.contract, d.view.contract, 1, 8, seed=3)[0]
        manifest = cluster.d_manifest(d.view.contract, plan)
        assert isinstance(d.outbox, DecodeOutbox)
        d.outbox.stage_remote_prefill([RemotePrefillRow(rid, manifest)])
        assert d.outbox.hand_over_remote_prefill() == 1
        ctx = zmq.Context.instance()
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{d.peer.port()}")
        far = np.array([d.arena.numel() - 8], np.int64)  # runs past D's arena
        bad = encode_scatter(ScatterRequest(room, 0, 0, 1, far, np.array([64], np.int64)))
        # Until D published the manifest a refused piece changes nothing; from then on the
        # first one fails the room. So keep sending until it does.
        deadline = time.monotonic() + 30
        while not any(isinstance(e, Failed) for e in events):
            assert time.monotonic() < deadline, f"D never failed the room: {events}"
            push.send_multipart(bad)
            events += d.peer.poll()
            d.peer.wait(0.05)
        push.close(linger=0)
        failed = events[-1]
        assert isinstance(failed, Failed)
        assert (failed.rid, failed.cause) == (rid, "write")
        assert "could not be scattered" in failed.reason
