"""The tspd-only staging frames: exact bytes, both offer versions, round trips, rejections."""

from __future__ import annotations

import re
import struct
import time

import numpy as np
import pytest

from tspd_bootstrap.auth import FRAMES_DOMAIN, ClusterCredential
from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.wire.frames import (
    ScatterAck,
    ScatterRequest,
    StageOffer,
    decode_d_inbound,
    decode_p_inbound,
    encode_scatter,
    encode_scattered,
    encode_stage_offer,
    seal_frames,
)

PTR = struct.pack("<Q", 0x7F00_0000_2000)
CREDENTIAL = ClusterCredential.from_text("0123456789abcdef0123456789abcdef")


@pytest.mark.parametrize(("ordered", "tag"), [(False, b"tspd.stage/1"), (True, b"tspd.stage/2")])
def test_stage_offer_frames_name_their_version(ordered: bool, tag: bytes) -> None:
    offer = StageOffer("10.0.0.7:16001", 2, 0x7F00_0000_2000, 8 << 20, 2, ordered)
    frames = encode_stage_offer(offer)
    assert frames == [tag, b"10.0.0.7:16001", b"2", PTR, b"8388608", b"2"]
    assert decode_p_inbound(frames) == offer


def test_a_sealed_stage_offer_carries_its_seal_last() -> None:
    offer = StageOffer("10.0.0.7:16001", 2, 0x7F00_0000_2000, 8 << 20, 2, True)
    frames = seal_frames(encode_stage_offer(offer), CREDENTIAL)
    assert len(frames) == 7
    decoded = decode_p_inbound(frames)
    assert decoded == offer
    assert isinstance(decoded, StageOffer)
    CREDENTIAL.check(FRAMES_DOMAIN, frames[:6], decoded.seal, time.time())
    count = "stage offer needs 6 frames, got 8 (a sealed one 7)"
    with pytest.raises(FrameError, match=re.escape(count)):
        decode_p_inbound([*frames, b""])
    why = "stage offer: its extra frame must be a 'tspd.auth/1' seal"
    with pytest.raises(FrameError, match=re.escape(why)):
        decode_p_inbound([*frames[:6], b"tspd.stage/2"])


def test_scatter_request_and_ack_round_trip() -> None:
    req = ScatterRequest(
        Room(77), 2, 1, 9, np.array([4096, 0], np.int64), np.array([16, 32], np.int64)
    )
    frames = encode_scatter(req)
    assert frames[:5] == [b"tspd.scatter/1", b"77", b"2", b"1", b"9"]
    back = decode_d_inbound(frames)
    assert isinstance(back, ScatterRequest)
    assert (back.room, back.grant, back.slot, back.seq) == (77, 2, 1, 9)
    assert (back.dst.tolist(), back.lengths.tolist()) == ([4096, 0], [16, 32])
    ack = ScatterAck("10.0.0.7:16001", 2, 1, 9, False)
    assert encode_scattered(ack) == [
        b"tspd.scattered/1",
        b"10.0.0.7:16001",
        b"2",
        b"1",
        b"9",
        b"0",
    ]
    assert decode_p_inbound(encode_scattered(ack)) == ack


@pytest.mark.parametrize(
    ("frames", "why"),
    [
        ([b"tspd.stage/2", b"h:1", b"0", PTR, b"8388608"], "stage offer"),
        ([b"tspd.stage/2", b"h:1", b"0", b"\0" * 8, b"8388608", b"2"], "base pointer is 0"),
        ([b"tspd.stage/1", b"h:1", b"0", PTR, b"100", b"2"], "slot bytes"),
        ([b"tspd.scatter/1", b"1", b"0", b"0", b"1", b"", b""], "0 offsets and 0 lengths"),
    ],
)
def test_bad_staging_frames_are_refused(frames: list[bytes], why: str) -> None:
    decode = decode_d_inbound if frames[0] == b"tspd.scatter/1" else decode_p_inbound
    with pytest.raises(FrameError, match=why):
        decode(frames)
