"""The encode rank against raw prefill frames: parking, the reaper, tombstones, shard checks and
malformed frames, with a real encode worker process, real ZMQ and real Mooncake.

The "prefill ranks" here are this test process: a real Mooncake engine with a registered buffer
and a real PULL socket per fake rank, speaking the wire directly (wire.md §2.5), so each case can
send exactly the frames it needs, including the ones a correct receiver never sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tspd_core.epd import EmbeddingChunk, ToyVisionTower
from tspd_core.epd.loopback import EncodeNode
from tspd_core.epd.sender import EmbeddingSender, SendOutcome
from tspd_core.epd.wire import (
    EmbeddingRegistration,
    EmbeddingStatus,
    ItemInfo,
    decode_status,
    encode_item_info,
    encode_registration,
)
from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import UsageError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.transfer.mooncake import MooncakeEngine

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

HIDDEN = 16
TOWER = ToyVisionTower(HIDDEN, 1, torch.float32)  # 64-byte rows + 64-byte deepstack rows


@dataclass
class FakeRank:
    """A prefill rank made of parts: engine, buffer, PULL socket."""

    engine: MooncakeEngine
    control: ControlPlane
    buffer: torch.Tensor

    def info(
        self, room: int, required: int, start: int, n: int, span: int, at: int = 0
    ) -> ItemInfo:
        base = self.buffer.data_ptr() + at
        return ItemInfo(
            room=Room(room),
            endpoint="127.0.0.1",
            port=self.control.port,
            session_id=self.engine.session_id,
            dst_ptr=base,
            deepstack_ptr=base + 32768,
            n_tokens=n,
            hidden=HIDDEN,
            dtype="torch.float32",
            has_deepstack=True,
            required_dst_info_num=required,
            row_start=start,
            span=span,
        )

    def push(self, sender: EmbeddingSender, frames: list[bytes]) -> None:
        self.control.send("127.0.0.1", sender.port, frames)

    def status(self, timeout_ms: int = 10_000) -> EmbeddingStatus:
        frames = self.control.recv(timeout_ms)
        assert frames is not None, "no status from the encode rank"
        return decode_status(frames)

    def rows(self, n: int, at: int = 0) -> tuple[bytes, bytes]:
        main = self.buffer[at : at + n * 64].numpy().tobytes()
        deep = self.buffer[at + 32768 : at + 32768 + n * 64].numpy().tobytes()
        return main, deep


@pytest.fixture(scope="module")
def node() -> Iterator[EncodeNode]:
    # Rooms are reaped after 1 s but remembered for 60 s, so a test's late chunk or info meets
    # the concluded room however slowly the machine runs.
    tunables = PdTunables(bootstrap_timeout_s=1.0)
    with EncodeNode(1, tunables, buffer_bytes=64 * 1024, tombstone_s=60.0) as enc:
        yield enc


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[FakeRank]]:
    out = []
    for _ in range(2):
        engine = MooncakeEngine("127.0.0.1")
        buffer = torch.zeros(65536, dtype=torch.uint8)
        engine.register(buffer.data_ptr(), buffer.numel())
        out.append(FakeRank(engine, ControlPlane("127.0.0.1"), buffer))
    yield out
    for rank in out:
        rank.control.close()
        rank.engine.close()


def _raw(t: torch.Tensor | None) -> bytes:
    assert t is not None
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _outcome(node: EncodeNode, room: int) -> SendOutcome:
    (outcome,) = node.wait_for([Room(room)], timeout_s=30.0)[Room(room)]
    return outcome


def test_item_lands_after_the_chunk_was_parked(node: EncodeNode, ranks: list[FakeRank]) -> None:
    sender, rank = node.senders[0], ranks[0]
    reg = EmbeddingRegistration("127.0.0.1", rank.control.port, rank.engine.session_id)
    rank.push(sender, encode_registration(reg))
    node.send(TOWER.chunk(Room(10), 5))
    sender.sync()  # the worker holds the chunk before the item info is sent: it parks
    rank.push(sender, encode_item_info(rank.info(10, 1, 0, 5, 5)))
    assert rank.status() == EmbeddingStatus(Room(10), TransferPoll.SUCCESS, 0)
    main, deep = TOWER(10, 5)
    assert rank.rows(5) == (_raw(main), _raw(deep))
    outcome = _outcome(node, 10)
    assert outcome == SendOutcome(Room(10), TransferPoll.SUCCESS, "", True, 1, 5 * 128)


def test_reaper_fails_a_chunk_whose_receivers_never_all_came(
    node: EncodeNode, ranks: list[FakeRank]
) -> None:
    sender, rank = node.senders[0], ranks[0]
    node.send(TOWER.chunk(Room(20), 4))
    rank.push(sender, encode_item_info(rank.info(20, 2, 0, 4, 4)))  # 1 of the 2 it names
    assert rank.status() == EmbeddingStatus(Room(20), TransferPoll.FAILED, 0)
    why = "1 of 2 receivers registered within 1 s"
    assert _outcome(node, 20) == SendOutcome(Room(20), TransferPoll.FAILED, why, True, 1, 0)
    node.send(TOWER.chunk(Room(21), 4))  # nobody ever asks for this one
    why = "0 of ? receivers registered within 1 s"
    assert _outcome(node, 21) == SendOutcome(Room(21), TransferPoll.FAILED, why, True, 0, 0)
    assert sender.stats().buffer.free_blocks == sender.stats().buffer.total_blocks


def test_receivers_without_a_chunk_are_told_and_the_room_stays_closed(
    node: EncodeNode, ranks: list[FakeRank]
) -> None:
    sender, rank = node.senders[0], ranks[0]
    rank.push(sender, encode_item_info(rank.info(30, 1, 0, 4, 4)))
    assert rank.status() == EmbeddingStatus(Room(30), TransferPoll.FAILED, 0)  # after ~1 s
    node.send(TOWER.chunk(Room(30), 4))
    reason = "the room was aborted or failed"
    assert _outcome(node, 30) == SendOutcome(Room(30), TransferPoll.FAILED, reason)
    rank.push(sender, encode_item_info(rank.info(30, 1, 0, 4, 4)))  # a late asker: told at once
    assert rank.status(2000) == EmbeddingStatus(Room(30), TransferPoll.FAILED, 0)


def test_latest_info_per_session_wins(node: EncodeNode, ranks: list[FakeRank]) -> None:
    sender, (a, b) = node.senders[0], ranks
    a.buffer.zero_()
    # one connection carries all three frames, so the encode rank reads them in this order
    a.push(sender, encode_item_info(a.info(40, 2, 0, 3, 3, at=4096)))
    a.push(sender, encode_item_info(a.info(40, 2, 0, 3, 3, at=0)))  # same session: replaces
    a.push(sender, encode_item_info(b.info(40, 2, 0, 3, 3, at=0)))  # the second receiver
    node.send(TOWER.chunk(Room(40), 3))
    main, deep = TOWER(40, 3)
    for rank in (a, b):
        assert rank.status() == EmbeddingStatus(Room(40), TransferPoll.SUCCESS, 0)
        assert rank.rows(3) == (_raw(main), _raw(deep))
    assert not a.buffer[4096 : 4096 + 192].any()  # the replaced pointer saw nothing
    assert _outcome(node, 40).nbytes == 2 * 3 * 128


def test_row_shards_go_to_each_receiver(node: EncodeNode, ranks: list[FakeRank]) -> None:
    sender = node.senders[0]
    for rank, (start, n) in zip(ranks, [(0, 3), (3, 2)], strict=True):
        rank.push(sender, encode_item_info(rank.info(50, 2, start, n, 5, at=1024)))
    node.send(TOWER.chunk(Room(50), 5))
    main, deep = TOWER(50, 5)
    for rank, (start, n) in zip(ranks, [(0, 3), (3, 2)], strict=True):
        assert rank.status() == EmbeddingStatus(Room(50), TransferPoll.SUCCESS, 0)
        assert rank.rows(n, at=1024) == (
            _raw(main[start : start + n]),
            _raw(deep[start : start + n]),
        )
    assert _outcome(node, 50).nbytes == 5 * 128


@pytest.mark.parametrize(
    ("shards", "why"),
    [
        ([(0, 2), (3, 2)], "row shards are not contiguous: [0, 2) then [3, ...)"),
        ([(0, 5), (1, 4)], "row shards are not contiguous: [0, 5) then [1, ...)"),
        ([(0, 3), (3, 3)], "asks rows [3, 6) of 5"),
    ],
)
def test_inconsistent_shards_fail_the_room_for_everyone(
    node: EncodeNode, ranks: list[FakeRank], shards: list[tuple[int, int]], why: str
) -> None:
    sender = node.senders[0]
    room = 60 + shards[1][0] * 10 + shards[1][1]
    for rank, (start, n) in zip(ranks, shards, strict=True):
        rank.push(sender, encode_item_info(rank.info(room, 2, start, n, 5)))
    node.send(TOWER.chunk(Room(room), 5))
    for rank in ranks:
        assert rank.status() == EmbeddingStatus(Room(room), TransferPoll.FAILED, 0)
    outcome = _outcome(node, room)
    assert (outcome.status, outcome.receivers, outcome.nbytes) == (TransferPoll.FAILED, 2, 0)
    assert outcome.reason.endswith(why)


BAD_FRAMES: list[tuple[list[bytes], str]] = [
    ([b"garbage"], "item info needs 13..29 frames, got 1"),
    ([b"None", b"127.0.0.1"], "embedding registration needs 6 frames, got 2"),
    ([b"x"] * 13, "item info room must be an ASCII integer without padding, got b'x'"),
    ([b"\xff" * 70_000], "item info needs 13..29 frames, got 1"),
]


def test_malformed_frames_are_rejected_and_logged_and_serving_goes_on(
    node: EncodeNode, ranks: list[FakeRank], caplog: pytest.LogCaptureFixture
) -> None:
    sender, rank = node.senders[0], ranks[1]
    caplog.set_level(logging.WARNING, logger="tspd_core.epd")
    bad_info = rank.info(70, 1, 0, 2, 2)
    frames = encode_item_info(bad_info)
    frames[8] = b"float32"
    cases = [
        *BAD_FRAMES,
        (frames, "item info dtype must look like b'torch.bfloat16', got b'float32'"),
    ]
    for raw, _ in cases:
        rank.push(sender, raw)
    rank.push(sender, encode_item_info(rank.info(71, 1, 0, 2, 2)))
    node.send(TOWER.chunk(Room(71), 2))
    assert rank.status() == EmbeddingStatus(Room(71), TransferPoll.SUCCESS, 0)
    main, deep = TOWER(71, 2)
    assert rank.rows(2) == (_raw(main), _raw(deep))
    want = [f"rejected peer message: {why}" for _, why in cases]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # worker logs cross a queue into this process
        got = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected")]
        if len(got) >= len(want):
            break
        time.sleep(0.05)
    assert got == want
    assert _outcome(node, 71).status is TransferPoll.SUCCESS


def test_send_refusals(node: EncodeNode) -> None:
    sender = node.senders[0]
    with pytest.raises(UsageError, match="exceed the send buffer"):
        sender.send(TOWER.chunk(Room(80), 600))  # 76,800 bytes > 64 KiB
    big = EmbeddingChunk(Room(81), torch.zeros(250, HIDDEN), torch.zeros(250, HIDDEN))
    assert sender.send(big) == 32_000
    with pytest.raises(UsageError, match="room 81 is already being sent"):
        sender.send(big)
    assert (
        sender.send(EmbeddingChunk(Room(82), torch.zeros(250, HIDDEN), torch.zeros(250, HIDDEN)))
        == 32_000
    )
    assert sender.send(TOWER.chunk(Room(83), 1)) is None  # full: expected shortage, not an error
    sender.abort_room(Room(81))
    sender.abort_room(Room(82))
    outcomes = node.wait_for([Room(81), Room(82)])
    reason = "aborted by the encode engine"
    assert outcomes == {
        Room(r): [SendOutcome(Room(r), TransferPoll.FAILED, reason, parked=True)] for r in (81, 82)
    }
    assert sender.stats().buffer.free_blocks == sender.stats().buffer.total_blocks
