"""Front-door and round frames: exact round trips and clear refusals."""

from __future__ import annotations

import pytest

from tspd_engine.frames import (
    Abort,
    FinishReason,
    Output,
    RequestMode,
    RoomAbort,
    Round,
    SamplingParams,
    Shutdown,
    Submit,
    decode,
    encode,
)
from tspd_serving.errors import RequestError


def test_every_frame_round_trips() -> None:
    params = SamplingParams(9, 2, (7, 8), True)
    submit = Submit("r1", (256, 104, 105), params, "tcp://x:1", RequestMode.REMOTE_DECODE)
    frames = [
        submit,
        Abort("r1"),
        Shutdown(),
        Output("r1", (1, 2), FinishReason.EOS, "", 3, 0),
        Round((Submit("r2", (1,)), Abort("r1")), shutdown=True),
        RoomAbort(2**63 - 1, "the prefill node was at capacity"),
        Round((RoomAbort(0, "x"), Submit("r3", (1,)), Abort("r3"))),
    ]
    for frame in frames:
        assert decode(encode(frame)) == frame
    assert encode(Abort("r1")) == b'{"op":"abort","rid":"r1"}'
    assert encode(RoomAbort(7, "busy")) == b'{"op":"abort_room","room":7,"reason":"busy"}'


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\xff", "malformed frame"),
        (b"[]", "must be a JSON object"),
        (b'{"op":"launch"}', "unknown frame op 'launch'"),
        (b'{"op":"abort","rid":""}', "request id must be a string of 1..256 chars"),
        (b'{"op":"submit","rid":"a","prompt":[1,"2"],"params":[1,0,[],false],"reply":""}',
         "token ids must be a list of integers"),
        (b'{"op":"submit","rid":"a","prompt":[1],"params":[0,0,[],false],"reply":""}',
         "max_tokens must be >= 1"),
        (b'{"op":"submit","rid":"a","prompt":[1],"params":[4,5,[],false],"reply":""}',
         "min_tokens must lie in 0..max_tokens"),
        (b'{"op":"submit","rid":"a","prompt":[1],"params":[4],"reply":""}',
         "params must be"),
        (b'{"op":"round","events":[{"op":"shutdown"}],"shutdown":false}',
         "carries only submit, abort and abort_room"),
        (b'{"op":"abort"}', "malformed frame: KeyError"),
        (b'{"op":"submit","rid":"a","prompt":[1],"params":[4,0,[],false],"reply":"","mode":7}',
         "unknown request mode 7"),
    ],
)  # fmt: skip
def test_bad_frames_are_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        decode(data)


ROOM_WHY = r"room must be an integer in 0\.\.2\*\*63-1"
REASON_WHY = r"a room abort's reason must be 1\.\.200 characters"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b'{"op":"abort_room","room":-1,"reason":"x"}', ROOM_WHY + ", got -1$"),
        (b'{"op":"abort_room","room":9223372036854775808,"reason":"x"}', ROOM_WHY),
        (b'{"op":"abort_room","room":1e3,"reason":"x"}', ROOM_WHY + ", got 1000.0$"),
        (b'{"op":"abort_room","room":true,"reason":"x"}', ROOM_WHY + ", got True$"),
        (b'{"op":"abort_room","room":"5","reason":"x"}', ROOM_WHY + ", got '5'$"),
        (b'{"op":"abort_room","room":[5],"reason":"x"}', ROOM_WHY),
        (b'{"op":"abort_room","room":5,"reason":""}', REASON_WHY),
        (b'{"op":"abort_room","room":5,"reason":"' + b"r" * 201 + b'"}', REASON_WHY),
        (b'{"op":"abort_room","room":5,"reason":7}', REASON_WHY),
        (b'{"op":"abort_room","room":5,"reason":null}', REASON_WHY),
        (b'{"op":"abort_room","room":5}', "malformed frame: KeyError"),
        (b'{"op":"abort_room","reason":"x"}', "malformed frame: KeyError"),
        (b'{"op":"round","events":[{"op":"abort_room","room":-5,"reason":"x"}],'
         b'"shutdown":false}', ROOM_WHY),
        (b'{"op":"round","events":[{"op":"query","reply":"tcp://x:1","qid":1}],'
         b'"shutdown":false}', "carries only submit, abort and abort_room"),
    ],
)  # fmt: skip
def test_a_room_abort_is_refused_unless_its_room_and_reason_are_exact(
    data: bytes, why: str
) -> None:
    # A room abort fails a room on every P rank's worker: only a room id in range, with a
    # short reason (it goes to the workers' log), is ever taken, from any process.
    with pytest.raises(RequestError, match=why):
        decode(data)
    assert RoomAbort(5, "r" * 200).reason == "r" * 200  # the bound is inclusive
