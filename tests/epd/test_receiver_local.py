"""The prefill receiver in this process against a real encode node: what it refuses, how it
fails when the encode side cannot be found or gives up, and how it shrugs off bad status frames.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator

import pytest
import torch

from tspd_bootstrap import BootstrapClient, BootstrapServer
from tspd_core.epd import (
    EmbeddingItem,
    EmbeddingReceiver,
    EmbeddingReceiverConfig,
    Settlement,
    ToyVisionTower,
    open_embedding_receiver,
)
from tspd_core.epd.loopback import EncodeNode
from tspd_core.ids import RequestId, Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import UsageError
from tspd_core.pd.peer.agreement import SOLO
from tspd_core.pd.proc.control import ControlPlane

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TOWER = ToyVisionTower(32, 0, torch.float16)


@pytest.fixture(scope="module")
def node() -> Iterator[EncodeNode]:
    with EncodeNode(1, PdTunables(bootstrap_timeout_s=1.0)) as enc:
        yield enc


def _receiver(**kw: object) -> EmbeddingReceiver:
    config = {"hidden": 32, "dtype": torch.float16, "host": "127.0.0.1", "pool_bytes": 1 << 18}
    config.update(kw)
    return open_embedding_receiver(EmbeddingReceiverConfig(**config))  # type: ignore[arg-type]


@pytest.fixture
def receiver() -> Iterator[EmbeddingReceiver]:
    r = _receiver()
    yield r
    r.shutdown()


def _settle(r: EmbeddingReceiver, timeout_s: float = 20.0, **kw: object) -> Settlement:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = r.settle(**kw)  # type: ignore[arg-type]
        if s.admitted or s.failed:
            return s
        time.sleep(0.005)
    raise AssertionError("nothing settled")


def _whole(r: EmbeddingReceiver) -> bool:
    pool = r.stats().pool
    return pool.free_blocks == pool.total_blocks


def test_refusals(receiver: EmbeddingReceiver, node: EncodeNode) -> None:
    host, port = node.bootstrap
    item = EmbeddingItem(Room(1), host, port, 4)
    receiver.stage(RequestId("a"), [item])
    with pytest.raises(UsageError, match="request 'a' is already staged"):
        receiver.stage(RequestId("a"), [])
    with pytest.raises(UsageError, match="room 1 is already in use"):
        receiver.stage(RequestId("b"), [item])
    twice = EmbeddingItem(Room(2), host, port, 4)
    with pytest.raises(UsageError, match="room 2 is already in use"):
        receiver.stage(RequestId("c"), [twice, twice])
    with pytest.raises(UsageError, match="not admitted"):
        receiver.release(RequestId("a"))
    assert receiver.abort(RequestId("zzz")) is False
    assert receiver.abort(RequestId("a"), "test over")
    assert receiver.settle().failed[0].reason == "test over"
    wide = _receiver(tp_size=2, tp_rank=1)
    try:
        with pytest.raises(UsageError, match="must settle over its replica group"):
            wide.settle()
    finally:
        wide.shutdown()


def test_empty_request_is_admitted_at_once(receiver: EmbeddingReceiver) -> None:
    receiver.stage(RequestId("text-only"), [])
    s = receiver.settle()
    assert [(landed.rid, landed.items) for landed in s.admitted] == [("text-only", ())]
    receiver.release(RequestId("text-only"))


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port held for the test where connecting is refused: bound, never listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield int(held.getsockname()[1])


def test_unreachable_bootstrap_fails_without_holding_buffers(
    receiver: EmbeddingReceiver, refused_port: int
) -> None:
    port = refused_port
    receiver.stage(RequestId("lost"), [EmbeddingItem(Room(3), "127.0.0.1", port, 8)])
    (failed,) = _settle(receiver).failed
    assert failed.rid == "lost"
    assert failed.reason.startswith(f"item of room 3: encode bootstrap 127.0.0.1:{port}: ")
    assert "connection refused" in failed.reason
    assert _whole(receiver)  # never advertised: nothing to quarantine


def test_empty_or_mismatched_encode_deployment(receiver: EmbeddingReceiver) -> None:
    with BootstrapServer("127.0.0.1", 0, embedding=True) as server:
        receiver.stage(RequestId("early"), [EmbeddingItem(Room(4), "127.0.0.1", server.port, 8)])
        (failed,) = _settle(receiver).failed
        assert failed.reason == (
            f"item of room 4: encode bootstrap 127.0.0.1:{server.port}: "
            "no (complete) parallel info yet: no encode rank registered"
        )
        with BootstrapClient(server.url) as client:  # an encode node of TP 2 (addresses only)
            for rank in range(2):
                client.register_rank(
                    engine_rank=rank, world_size=2, dp_size=1, rank_ip="127.0.0.1", rank_port=9
                )
        odd = _receiver(tp_size=3, tp_rank=2)
        try:
            odd.stage(RequestId("odd"), [EmbeddingItem(Room(5), "127.0.0.1", server.port, 8)])
            (failed,) = _settle(odd, group=SOLO.replica_group(0)).failed
            assert failed.reason == (
                f"item of room 5: encode bootstrap 127.0.0.1:{server.port}: "
                "prefill TP 3 is not a multiple of encode TP 2"
            )
            assert _whole(odd)
        finally:
            odd.shutdown()
    assert _whole(receiver)


def test_encode_rank_gives_up_first_and_the_pool_frees_at_once(
    receiver: EmbeddingReceiver, node: EncodeNode
) -> None:
    host, port = node.bootstrap
    receiver.stage(RequestId("orphan"), [EmbeddingItem(Room(6), host, port, 8)], Room(77))
    (failed,) = _settle(receiver).failed  # the encode rank's 1 s, long before our 300 s
    assert (failed.rid, failed.pd_room) == ("orphan", 77)
    assert failed.reason == "item of room 6: encode rank 0 failed the item"
    assert _whole(receiver)
    stats = receiver.stats()
    assert (stats.failed_total, stats.timed_out_total, stats.pending) == (1, 0, 0)


def test_bad_status_frames_are_dropped_and_logged(
    receiver: EmbeddingReceiver, node: EncodeNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tspd_core.epd")
    rogue = ControlPlane("127.0.0.1")  # closed last: closing drops frames still queued
    for frames in ([b"8"], [b"8", b"five", b"0"], [b"8", b"9", b"0"], [b"-8", b"5", b"0"]):
        rogue.send("127.0.0.1", receiver.port, frames)
    # Well-formed, for a room nobody stages (frames on the wire have no order with the stage
    # below: a status for the staged room could arrive after it and settle it early).
    rogue.send("127.0.0.1", receiver.port, [b"88", b"5", b"0"])
    host, port = node.bootstrap
    receiver.stage(RequestId("fine"), [EmbeddingItem(Room(8), host, port, 9)])
    node.send(TOWER.chunk(Room(8), 9))
    (landed,) = _settle(receiver).admitted
    assert torch.equal(landed.items[0].embedding, TOWER(8, 9)[0])
    receiver.release(RequestId("fine"))
    assert _whole(receiver)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = [r.getMessage() for r in caplog.records if r.name == "tspd_core.epd.sink"]
        if len(got) >= 4:
            break
        time.sleep(0.02)
    rogue.close()
    assert got == [
        "rejected embedding status: embedding status needs 3 frames, got 1",
        "rejected embedding status: embedding status value must be an ASCII integer without "
        "padding, got b'five'",
        "rejected embedding status: embedding status value 9 is outside 0..5",
        "rejected embedding status: embedding status room -8 is outside 0..9223372036854775807",
    ]
