"""The EPD frame codec: exact bytes of each frame kind, round trips and every rejection."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd_core.epd.wire import (
    EmbeddingRegistration,
    EmbeddingStatus,
    ItemInfo,
    decode_encode_inbound,
    decode_item_info,
    decode_registration,
    decode_status,
    encode_item_info,
    encode_registration,
    encode_status,
)
from tspd_core.ids import MAX_ROOM, Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll

PTR = 0x7F00_0000_2000
INFO = ItemInfo(
    room=Room(987654321),
    endpoint="10.0.0.9",
    port=6000,
    session_id="10.0.0.9:17001",
    dst_ptr=PTR,
    deepstack_ptr=PTR + 4096,
    n_tokens=7,
    hidden=64,
    dtype="torch.bfloat16",
    has_deepstack=True,
    required_dst_info_num=2,
    row_start=8,
    span=15,
)


def test_registration_is_exactly_six_frames() -> None:
    reg = EmbeddingRegistration("10.0.0.9", 6000, "10.0.0.9:17001")
    frames = encode_registration(reg)
    assert frames == [
        b"None",
        b"10.0.0.9",
        b"6000",
        b"10.0.0.9:17001",
        b"\0" * 8,
        b"\0" * 8,
    ]
    assert decode_encode_inbound(frames) == reg


def test_item_info_is_exactly_thirteen_frames() -> None:
    frames = encode_item_info(INFO)
    assert frames == [
        b"987654321",
        b"10.0.0.9",
        b"6000",
        b"10.0.0.9:17001",
        struct.pack("<Q", PTR),
        struct.pack("<Q", PTR + 4096),
        b"7",
        b"64",
        b"torch.bfloat16",
        b"1",
        b"2",
        b"8",
        b"15",
    ]
    assert decode_encode_inbound(frames) == INFO
    assert not INFO.is_identity


def test_item_info_extra_frames_are_ignored_up_to_a_limit() -> None:
    frames = encode_item_info(INFO)
    assert decode_item_info([*frames, b"x", b"y"]) == INFO
    with pytest.raises(FrameError, match=r"item info needs 13\.\.29 frames, got 30"):
        decode_item_info(frames + [b""] * 17)


def test_status_is_three_frames() -> None:
    msg = EmbeddingStatus(Room(MAX_ROOM), TransferPoll.SUCCESS, 3)
    assert encode_status(msg) == [str(MAX_ROOM).encode(), b"5", b"3"]
    assert decode_status([b"1", b"0", b"0"]) == EmbeddingStatus(Room(1), TransferPoll.FAILED, 0)


def _with(i: int, value: bytes) -> list[bytes]:
    frames = encode_item_info(INFO)
    frames[i] = value
    return frames


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([], "empty message"),
        (encode_item_info(INFO)[:12], "item info needs 13..29 frames, got 12"),
        (_with(0, b"-1"), "item info room -1 is outside"),
        (_with(0, b"007"), "item info room must be an ASCII integer"),
        (_with(1, b"bad host"), "item info endpoint must be 1..255 printable"),
        (_with(2, b"0"), "item info port 0 is outside 1..65535"),
        (_with(3, b"nohost"), "session id must be '<ip>:<rpc_port>'"),
        (_with(4, b"\1\2"), "destination pointer must be 8 bytes"),
        (_with(4, b"\0" * 8), "7 rows wanted at pointer 0"),
        (_with(5, b"\0" * 8), "deepstack wanted at pointer 0"),
        (_with(6, b"x"), "item info n_tokens must be an ASCII integer"),
        (_with(7, b"0"), "item info hidden 0 is outside"),
        (_with(8, b"bfloat16"), "dtype must look like b'torch.bfloat16'"),
        (_with(9, b"yes"), "has_deepstack must be b'1' or b'0'"),
        (_with(9, b"0"), "a deepstack pointer without has_deepstack"),
        (_with(10, b"0"), "required_dst_info_num 0 is outside 1..1024"),
        (_with(11, b"-3"), "row_start -3 is outside"),
        (_with(12, b"1 "), "span must be an ASCII integer"),
    ],
)
def test_item_info_rejections(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_encode_inbound(frames)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"None", b"h", b"1", b"h:1", b"\0" * 8], "needs 6 frames, got 5"),
        ([b"None", b"h", b"1", b"h:1", b"\0" * 8, b"\0" * 7], "deepstack pointer must be 8"),
        ([b"None", b"h", b"99999", b"h:1", b"\0" * 8, b"\0" * 8], "port 99999 is outside"),
    ],
)
def test_registration_rejections(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_registration(frames)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"1", b"5"], "needs 3 frames, got 2"),
        ([b"1", b"6", b"0"], "status value 6 is outside 0..5"),
        ([b"1", b"5", b"-1"], "sender rank -1 is outside"),
        ([b"x", b"5", b"0"], "room must be an ASCII integer"),
    ],
)
def test_status_rejections(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_status(frames)


def test_zero_row_shard_may_carry_any_pointer() -> None:
    info = ItemInfo(Room(5), "h", 1, "h:2", 0, 0, 0, 8, "torch.float32", False, 4, 3, 3)
    assert decode_item_info(encode_item_info(info)) == info


@given(
    room=st.integers(0, MAX_ROOM),
    n=st.integers(0, 1 << 24),
    hidden=st.integers(1, 1 << 20),
    row_start=st.integers(0, 1 << 24),
    span=st.integers(0, 1 << 24),
    deep=st.booleans(),
    required=st.integers(1, 1024),
)
def test_item_info_round_trips(
    room: int, n: int, hidden: int, row_start: int, span: int, deep: bool, required: int
) -> None:
    info = ItemInfo(
        room=Room(room),
        endpoint="127.0.0.1",
        port=65535,
        session_id="127.0.0.1:1",
        dst_ptr=PTR,
        deepstack_ptr=PTR * deep,
        n_tokens=n,
        hidden=hidden,
        dtype="torch.float16",
        has_deepstack=deep,
        required_dst_info_num=required,
        row_start=row_start,
        span=span,
    )
    assert decode_encode_inbound(encode_item_info(info)) == info
