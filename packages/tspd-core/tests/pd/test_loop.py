"""The control loop every worker runs (PD's transfer workers and EPD's encode worker).

Real pipes and real ZMQ sockets; the loop runs on its own thread as in a worker process.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection

import pytest
import zmq

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.loop import ControlLoop, Posted
from tspd_core.pd.wire import ipc
from tspd_core.pd.worker.spec import TRANSFER_WORKER


class Recorder(ControlLoop[ipc.Message]):
    """Records what reaches each hook; peer frames ``[b"bad"]`` are refused."""

    def __init__(self, notes: Connection) -> None:
        super().__init__(TRANSFER_WORKER, notes)
        self.control = ControlPlane("127.0.0.1")
        self.seen: list[tuple[str, object]] = []

    def on_peer(self, frames: list[bytes]) -> None:
        if frames == [b"bad"]:
            raise FrameError("bad frame")
        if frames == [b"boom"]:
            raise KeyError("a bug in a handler")
        self.seen.append(("peer", frames))

    def handle_command(self, msg: ipc.Message) -> None:
        self.seen.append(("command", msg))
        self.post(lambda: self.seen.append(("posted", msg)))

    def count_rejected(self, source: str) -> None:
        self.seen.append(("rejected", source))

    def close(self) -> None:  # no Mooncake engine in this test
        self.control.close()
        self._posted.close()


def test_loop_survives_bad_input_and_stops_on_shutdown() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    note_r, note_w = mp.Pipe(duplex=False)
    loop = Recorder(note_w)
    thread = threading.Thread(target=loop.run, args=(cmd_r,))
    thread.start()
    peer = ControlPlane("127.0.0.1")
    try:
        for frames in ([b"bad"], [b"boom"], [b"ok", b"1"]):
            peer.send("127.0.0.1", loop.control.port, frames)
        cmd_w.send_bytes(b"\xff garbage")  # an unknown tag: refused, the loop goes on
        cmd_w.send_bytes(ipc.encode(ipc.ReleaseRoom(Room(3), "gone")))
        done = threading.Event()
        deadline = time.monotonic() + 20
        while not done.is_set():  # the peer frames arrive asynchronously
            assert time.monotonic() < deadline, f"the good frame never arrived: {loop.seen}"
            loop.post(lambda: done.set() if ("peer", [b"ok", b"1"]) in loop.seen else None)
            done.wait(0.05)
        cmd_w.send_bytes(ipc.encode(ipc.Shutdown()))
        thread.join(10)
        assert not thread.is_alive()
    finally:
        peer.close()
        loop.close()
    release = ipc.ReleaseRoom(Room(3), "gone")
    peer_seen = [e for e in loop.seen if e[0] == "peer" or e == ("rejected", "peer")]
    assert peer_seen == [("rejected", "peer"), ("peer", [b"ok", b"1"])]  # boom: logged only
    engine_seen = [e for e in loop.seen if e[0] in ("command", "posted") or e[1] == "engine"]
    assert engine_seen == [("rejected", "engine"), ("command", release), ("posted", release)]
    assert not note_r.poll()  # nothing was published to the engine


def test_posted_runs_every_callback_in_each_threads_order() -> None:
    posted = Posted()
    got: list[tuple[int, int]] = []

    def poster(t: int) -> None:
        for i in range(200):
            posted.post(lambda i=i: got.append((t, i)))  # type: ignore[misc]

    threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    posted.run(lambda callback: callback())
    assert sorted(got) == [(t, i) for t in range(4) for i in range(200)]
    for t in range(4):
        assert [i for th, i in got if th == t] == list(range(200))
    posted.run(lambda callback: callback())  # nothing left: returns at once
    assert len(got) == 800
    posted.close()
    posted.post(lambda: got.append((9, 9)))  # after close: dropped, no error
    assert len(got) == 800


class Ticker(Recorder):
    """Ticks every 10 ms; ``ticked`` is set at the fifth."""

    def __init__(self, notes: Connection) -> None:
        super().__init__(notes)
        self.ticks = 0
        self.ticked = threading.Event()

    def tick_s(self) -> float:
        return 0.01

    def on_tick(self, now: float) -> None:
        self.ticks += 1
        if self.ticks == 5:
            self.ticked.set()


def test_an_idle_loop_sleeps_until_its_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between ticks an idle loop waits in one poll: a timeout of 0 (poll and come straight
    back) only when a tick is due, never the remainder of a millisecond spent spinning."""
    timeouts: list[int] = []
    real = zmq.Poller.poll

    def poll(self: zmq.Poller, timeout: int | None = None) -> list[tuple[object, int]]:
        timeouts.append(-1 if timeout is None else int(timeout))
        return real(self, timeout)

    monkeypatch.setattr(zmq.Poller, "poll", poll)
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    _, note_w = mp.Pipe(duplex=False)
    loop = Ticker(note_w)
    thread = threading.Thread(target=loop.run, args=(cmd_r,))
    thread.start()
    try:
        assert loop.ticked.wait(20)
        cmd_w.send_bytes(ipc.encode(ipc.Shutdown()))
        thread.join(10)
        assert not thread.is_alive()
    finally:
        loop.close()
    ticks = loop.ticks
    zero = timeouts.count(0)
    # The first turn ticks at once; each later tick may find its poll returned a hair early
    # (once) or the shutdown (once) woke it: at most one zero-timeout poll per tick, plus one.
    assert zero <= ticks + 1, (zero, ticks, timeouts[:40])
    assert all(t > 0 for t in timeouts if t != 0)
