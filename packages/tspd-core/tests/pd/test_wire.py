"""The ZMQ frame codec: exact bytes for each frame kind, round trips, and every rejection."""

from __future__ import annotations

import re
import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd_bootstrap.auth import FRAMES_DOMAIN, ClusterCredential
from tspd_core.ids import MAX_ROOM, Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll, advance
from tspd_core.pd.wire.frames import (
    MAX_CONTRACT_BYTES,
    MAX_MANIFEST_BYTES,
    PreAllocation,
    Registration,
    StatusMessage,
    abort_message,
    decode_p_inbound,
    decode_status,
    encode_pre_allocation,
    encode_registration,
    encode_status,
    seal_frames,
)

REG = Registration(
    endpoint="10.0.0.7",
    port=5757,
    session_id="10.0.0.7:16001",
    base_ptr=0x7F00_0000_1000,
    contract=b'{"plan":{}}',
    tp_size=2,
    tp_rank=1,
)


def test_registration_frames_are_exactly_the_wire_layout() -> None:
    frames = encode_registration(REG)
    assert frames == [
        b"None",
        b"10.0.0.7",
        b"5757",
        b"10.0.0.7:16001",
        struct.pack("<Q", 0x7F00_0000_1000),
        b'{"plan":{}}',
        b"2",
        b"1",
    ]
    assert decode_p_inbound(frames) == REG
    assert REG.rpc_port == 16001


def test_a_sealed_registration_is_the_wire_layout_and_a_seal_frame() -> None:
    credential = ClusterCredential.from_text("0123456789abcdef0123456789abcdef")
    frames = seal_frames(encode_registration(REG), credential)
    assert frames[:8] == encode_registration(REG)
    assert frames[8].startswith(b"tspd.auth/1 ")
    decoded = decode_p_inbound(frames)
    assert isinstance(decoded, Registration)
    assert decoded == REG  # the seal is not part of equality: a renewed one is identical
    assert decoded.seal == frames[8].decode()[len("tspd.auth/1 ") :]
    checked = credential.check(FRAMES_DOMAIN, frames[:8], decoded.seal, time.time())
    assert checked.text == decoded.seal


def test_pre_allocation_frames_and_dummy() -> None:
    real = PreAllocation(Room(12345), "10.0.0.7:16001", b'{"groups":[]}')
    assert encode_pre_allocation(real) == [b"12345", b"10.0.0.7:16001", b'{"groups":[]}']
    dummy = decode_p_inbound([b"0", b"h:1", b""])
    assert dummy == PreAllocation(Room(0), "h:1", b"")
    assert dummy.is_dummy
    assert not real.is_dummy


def test_status_five_frames_by_default_seven_with_usage() -> None:
    ok = StatusMessage(Room(MAX_ROOM), TransferPoll.SUCCESS, 3, 42, (7, -1, 9))
    frames = encode_status(ok)
    assert frames == [
        str(MAX_ROOM).encode(),
        b"5",
        b"3",
        b"42",
        struct.pack("<3i", 7, -1, 9),
    ]
    assert decode_status(frames) == ok
    usage = StatusMessage(Room(1), TransferPoll.SUCCESS, 0, 5, (), 64, -0.25)
    frames7 = encode_status(usage)
    assert frames7[5:] == [b"64", struct.pack("<d", -0.25)]
    assert decode_status(frames7) == usage


def test_abort_is_failed_with_no_token_and_empty_spec_frame() -> None:
    assert encode_status(abort_message(Room(9), 1)) == [b"9", b"0", b"1", b"-1", b""]


def test_status_absent_frames_take_defaults() -> None:
    assert decode_status([b"4", b"0", b"2"]) == StatusMessage(Room(4), TransferPoll.FAILED, 2)
    assert decode_status([b"4", b"5", b"0", b"11"]).bootstrap_token == 11
    assert decode_status([b"4", b"5", b"0", b"1", b"", b"3", b""]).bootstrap_logprob is None


@given(
    room=st.integers(0, MAX_ROOM),
    status=st.sampled_from(list(TransferPoll)),
    rank=st.integers(0, 1 << 20),
    token=st.integers(-1, 2**31 - 1),
    spec=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
    cached=st.integers(0, 1 << 40),
    logprob=st.none() | st.floats(max_value=0.0, allow_nan=False),
)
def test_status_round_trip(
    room: int,
    status: TransferPoll,
    rank: int,
    token: int,
    spec: list[int],
    cached: int,
    logprob: float | None,
) -> None:
    msg = StatusMessage(Room(room), status, rank, token, tuple(spec), cached, logprob)
    assert decode_status(encode_status(msg)) == msg


GOOD = encode_registration(REG)


def _with(**changes: bytes) -> list[bytes]:
    """The good registration with some frames (``f<index>=...``) replaced."""
    frames = list(GOOD)
    for key, value in changes.items():
        frames[int(key[1:])] = value
    return frames


BAD_REGISTRATIONS = [
    (GOOD[:7], "registration needs 8 frames, got 7 (a sealed one 9)"),
    ([*GOOD, b"tspd.auth/1 1.2.3", b"x"], "registration needs 8 frames, got 10"),
    ([*GOOD, b"x"], "registration: its extra frame must be a 'tspd.auth/1' seal, got b'x'"),
    ([*GOOD, b"tspd.auth/1 " + b"0" * 200], "must be a 'tspd.auth/1' seal"),
    ([*GOOD, b"tspd.auth/1 a b"], "registration seal must be 1..160 printable ASCII chars"),
    (_with(f1=b""), "endpoint must be 1..255"),
    (_with(f1=b"a b"), "endpoint must be 1..255"),
    (_with(f2=b"0"), "port 0 is outside 1..65535"),
    (_with(f2=b"080"), "without padding"),
    (_with(f3=b"nocolon"), "'<ip>:<rpc_port>'"),
    (_with(f3=b"h:x"), "session id port"),
    (_with(f4=b"\0" * 8), "base pointer is 0"),
    (_with(f4=b"\1" * 7), "must be 8 bytes"),
    (_with(f5=b""), "contract is 0 bytes"),
    (_with(f5=b"x" * (MAX_CONTRACT_BYTES + 1)), "contract is 262145 bytes"),
    (_with(f7=b"2"), "tp rank 2 is outside 0..1"),
    (_with(f6=b"1025", f7=b"0"), "tp size 1025"),
    (_with(f6=b" 2"), "without padding"),
]


@pytest.mark.parametrize(("frames", "why"), BAD_REGISTRATIONS)
def test_bad_registration_rejected_with_reason(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=re.escape(why)):
        decode_p_inbound(frames)
    assert issubclass(FrameError, ValueError)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([], "empty message"),
        ([b"1", b"h:1"], "needs 3 frames, got 2"),
        ([b"1", b"h:1", b"", b""], "needs 3 frames, got 4"),
        ([b"-1", b"h:1", b"{}"], "-1 is outside"),
        ([str(MAX_ROOM + 1).encode(), b"h:1", b"{}"], "is outside"),
        ([b"abc", b"h:1", b"{}"], "ASCII integer"),
        ([b"-0", b"h:1", b"{}"], "ASCII integer"),
        ([b"1", b"h:1", b"x" * (MAX_MANIFEST_BYTES + 1)], "at most 2097152"),
        ([b"1", "h\u00e9:1".encode(), b"{}"], "printable ASCII"),
    ],
)
def test_bad_pre_allocation_rejected(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_p_inbound(frames)


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"1", b"5"], "3..7 frames, got 2"),
        ([b"1", b"5", b"0", b"-1", b"", b"0", b"", b"x"], "3..7 frames, got 8"),
        ([b"1", b"6", b"0"], "status value 6"),
        ([b"1", b"5", b"0", b"-2"], "token -2"),
        ([b"1", b"5", b"0", b"1", b"abc"], "int32 LE"),
        ([b"1", b"5", b"0", b"1", b"", b"-3"], "cached_tokens -3"),
        ([b"1", b"5", b"0", b"1", b"", b"0", b"1234"], "8 bytes"),
        ([b"1", b"5", b"0", b"1", b"", b"0", struct.pack("<d", 0.5)], "<= 0"),
    ],
)
def test_bad_status_rejected(frames: list[bytes], why: str) -> None:
    with pytest.raises(FrameError, match=why):
        decode_status(frames)


def test_encoders_refuse_what_decoders_reject() -> None:
    with pytest.raises(FrameError, match="tp rank 4"):
        encode_registration(Registration("h", 1, "h:1", 1, b"{}", 4, 4))
    with pytest.raises(FrameError, match="is outside"):
        encode_pre_allocation(PreAllocation(Room(-5), "h:1", b"{}"))


def test_advance_is_forward_only_and_failed_is_sticky() -> None:
    s = TransferPoll
    assert advance(None, s.BOOTSTRAPPED) is s.BOOTSTRAPPED
    assert advance(s.BOOTSTRAPPED, s.BOOTSTRAPPING) is s.BOOTSTRAPPED
    assert advance(s.BOOTSTRAPPED, s.SUCCESS) is s.SUCCESS
    assert advance(s.SUCCESS, s.FAILED) is s.FAILED
    assert advance(s.FAILED, s.SUCCESS) is s.FAILED
    assert [x.is_final for x in s] == [True, False, False, False, False, True]
    assert [int(x) for x in s] == [0, 1, 2, 3, 4, 5]
