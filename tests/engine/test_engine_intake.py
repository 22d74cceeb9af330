"""Rank 0's intake wait: it ends on a submit, or on a watched descriptor (a PD peer's notes)."""

from __future__ import annotations

import os
import threading

import zmq

from tspd_engine.frames import RoomAbort, Round, SamplingParams, Submit, encode
from tspd_engine.rank.intake import Intake
from tspd_engine.rank.process import ANY_PORT


def test_a_readable_watched_descriptor_ends_the_wait_with_an_empty_round() -> None:
    intake = Intake(ANY_PORT, "secret")
    r, w = os.pipe()
    try:
        os.write(w, b"\0")  # the worker published a note
        # A wait the watched descriptor does not end would last 600 s (the test's timeout).
        assert intake.collect(600.0, [r]) == Round(())
        os.read(r, 1)  # drained: it no longer ends waits
        assert intake.collect(0.0, [r]) == Round(())
    finally:
        intake.close()
        os.close(r)
        os.close(w)


def test_a_submit_still_ends_the_wait_and_a_descriptor_can_leave() -> None:
    intake = Intake(ANY_PORT, "secret")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(intake.address)
    r, w = os.pipe()
    submit = Submit("s1", (1, 2, 3), SamplingParams(max_tokens=2), "tcp://127.0.0.1:1")
    try:
        sender = threading.Timer(0.05, push.send_multipart, [[b"secret", encode(submit)]])
        sender.start()
        got = intake.collect(600.0, [r])  # nothing on the pipe: the submit ends it
        sender.join()
        assert [e.rid for e in got.events] == ["s1"]
        os.write(w, b"\0")
        assert intake.collect(0.0, []) == Round(())  # the pipe is no longer watched
        assert intake.watched == frozenset()
    finally:
        push.close(linger=0)
        intake.close()
        os.close(r)
        os.close(w)


def test_room_aborts_join_the_round_in_order_and_hostile_ones_are_dropped() -> None:
    intake = Intake(ANY_PORT, "secret")
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(intake.address)
    submit = Submit("s1", (1, 2, 3), SamplingParams(max_tokens=2), "tcp://127.0.0.1:1")
    hostile = [
        [b"secret", b'{"op":"abort_room","room":-1,"reason":"x"}'],
        [b"secret", b'{"op":"abort_room","room":1,"reason":"' + b"r" * 201 + b'"}'],
        [b"wrong", encode(RoomAbort(3, "no token"))],
        [encode(RoomAbort(4, "one frame"))],
    ]
    try:
        valid = [RoomAbort(5, "busy"), submit, RoomAbort(6, "bad")]
        for parts in [*hostile, *([b"secret", encode(frame)] for frame in valid)]:
            push.send_multipart(parts)
        events: list[object] = []
        while len(events) < 3:
            events += intake.collect(5.0).events
        assert events == [RoomAbort(5, "busy"), Submit("s1", (1, 2, 3), SamplingParams(2)),
                          RoomAbort(6, "bad")]  # fmt: skip
        assert intake.dropped == len(hostile)
    finally:
        push.close(linger=0)
        intake.close()
