"""Front-door and round frames: exact round trips and clear refusals."""

from __future__ import annotations

import pytest

from tspd_engine.errors import RequestError
from tspd_engine.frames import (
    Abort,
    FinishReason,
    Output,
    RequestMode,
    Round,
    SamplingParams,
    Shutdown,
    Submit,
    decode,
    encode,
)


def test_every_frame_round_trips() -> None:
    params = SamplingParams(9, 2, (7, 8), True)
    submit = Submit("r1", (256, 104, 105), params, "tcp://x:1", RequestMode.REMOTE_DECODE)
    frames = [
        submit,
        Abort("r1"),
        Shutdown(),
        Output("r1", (1, 2), FinishReason.EOS, "", 3, 0),
        Round((Submit("r2", (1,)), Abort("r1")), shutdown=True),
    ]
    for frame in frames:
        assert decode(encode(frame)) == frame
    assert encode(Abort("r1")) == b'{"op":"abort","rid":"r1"}'


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
         "carries only submit and abort"),
        (b'{"op":"abort"}', "malformed frame: KeyError"),
        (b'{"op":"submit","rid":"a","prompt":[1],"params":[4,0,[],false],"reply":"","mode":7}',
         "unknown request mode 7"),
    ],
)  # fmt: skip
def test_bad_frames_are_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        decode(data)
