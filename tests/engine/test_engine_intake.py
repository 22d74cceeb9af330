"""Rank 0's intake wait: it ends on a submit, or on a watched descriptor (a PD peer's notes)."""

from __future__ import annotations

import os
import threading

import zmq

from tspd_engine.frames import Round, SamplingParams, Submit, encode
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
