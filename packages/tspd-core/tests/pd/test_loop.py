"""The control loop every worker runs (PD's transfer workers and EPD's encode worker).

Real pipes and real ZMQ sockets; the loop runs on its own thread as in a worker process.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import threading
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest
import zmq

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError, PeerError
from tspd_core.pd.proc.control import ControlPlane
from tspd_core.pd.proc.handle import (
    BATCH_MARK,
    MAX_BATCH,
    ProcessHandle,
    pack_batch,
    unpack_batch,
)
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


# ---- batched commands: one write to the pipe, each message handled in order --------------


def _handle(cmd_w: Connection) -> ProcessHandle[ipc.Message, ipc.WorkerReady]:
    """The engine's end of a pipe (no process behind it: only the writes are under test)."""
    _, note_r = mp.Pipe(duplex=False)
    proc = SimpleNamespace(pid=0, join=lambda timeout: None, is_alive=lambda: False)
    return ProcessHandle(TRANSFER_WORKER, proc, cmd_w, note_r)


def test_held_commands_ride_with_the_next_write_in_one_frame() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    handle = _handle(cmd_w)
    a, b, c, d = (ipc.ReleaseRoom(Room(n), "") for n in (1, 2, 3, 4))
    handle.defer(a)
    assert handle.holding()
    assert not cmd_r.poll()
    with handle.batch():
        handle.send(b)
        with handle.batch():  # nested: held until the outer block ends
            handle.send(c)
        assert not cmd_r.poll()
    frame = cmd_r.recv_bytes()
    assert frame[0] == BATCH_MARK
    assert [ipc.decode(m) for m in unpack_batch(frame)] == [a, b, c]
    assert not handle.holding()
    assert not cmd_r.poll()
    handle.send(d)  # nothing held: the message alone, as before batching existed
    assert cmd_r.recv_bytes() == ipc.encode(d)
    handle.flush()  # nothing held: no write
    assert not cmd_r.poll()


def test_a_batch_holds_only_its_own_threads_sends() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    handle = _handle(cmd_w)
    mine, theirs = ipc.ReleaseRoom(Room(1), ""), ipc.ReleaseRoom(Room(2), "")
    with handle.batch():
        handle.send(mine)
        other = threading.Thread(target=handle.send, args=(theirs,))
        other.start()
        other.join()
        # The other thread's write went out at once, carrying what was held before it.
        assert [ipc.decode(m) for m in unpack_batch(cmd_r.recv_bytes())] == [mine, theirs]
    assert not cmd_r.poll()  # the block's end found nothing left to write


def test_a_batch_left_by_an_exception_still_writes_what_it_held() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    handle = _handle(cmd_w)
    msg = ipc.ReleaseRoom(Room(5), "")

    def bug() -> None:
        with handle.batch():
            handle.send(msg)
            raise KeyError("a bug after the send")

    with pytest.raises(KeyError):
        bug()
    assert cmd_r.poll(10)
    assert cmd_r.recv_bytes() == ipc.encode(msg)


def test_close_writes_the_held_commands_before_the_shutdown() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    handle = _handle(cmd_w)
    msg = ipc.ReleaseRoom(Room(6), "")
    handle.defer(msg)
    handle.close(0.1)
    assert [ipc.decode(m) for m in unpack_batch(cmd_r.recv_bytes())] == [msg, ipc.Shutdown()]
    with pytest.raises(PeerError, match="shut down"):
        handle.send(msg)
    with pytest.raises(PeerError, match="shut down"):
        handle.defer(msg)


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (bytes([BATCH_MARK]), "unpack"),  # no count
        (bytes([BATCH_MARK]) + struct.pack("<I", 0), "0 messages"),
        (bytes([BATCH_MARK]) + struct.pack("<I", MAX_BATCH + 1), "messages"),
        (bytes([BATCH_MARK]) + struct.pack("<II", 1, 0), "a part of 0 bytes"),
        (bytes([BATCH_MARK]) + struct.pack("<II", 1, 9) + b"short", "a part of 9 bytes"),
        (bytes([BATCH_MARK]) + struct.pack("<II", 1, 1) + b"ab", "1 trailing bytes"),
        (bytes([BATCH_MARK]) + struct.pack("<II", 2, 1) + b"a", "unpack"),  # one part short
    ],
)
def test_a_batch_frame_that_does_not_add_up_is_refused(frame: bytes, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        unpack_batch(frame)


class Pending(Recorder):
    """Also records, at each command, whether more commands wait unread."""

    def handle_command(self, msg: ipc.Message) -> None:
        super().handle_command(msg)
        self.seen.append(("pending", self.commands_pending()))


def test_the_loop_handles_a_batch_in_order_and_refuses_a_bad_one_whole() -> None:
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    _, note_w = mp.Pipe(duplex=False)
    loop = Pending(note_w)
    a, b, c = (ipc.ReleaseRoom(Room(n), "") for n in (1, 2, 3))
    good = pack_batch([ipc.encode(a), ipc.encode(b)])
    bad = good[:-1]  # b's last byte missing: neither a nor b may be handled
    cmd_w.send_bytes(bad)
    cmd_w.send_bytes(good)
    # A shutdown inside a batch stops the loop: what follows it is not handled.
    cmd_w.send_bytes(pack_batch([ipc.encode(c), ipc.encode(ipc.Shutdown()), ipc.encode(a)]))
    thread = threading.Thread(target=loop.run, args=(cmd_r,))
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    loop.close()
    commands = [e for e in loop.seen if e[0] in ("command", "rejected", "pending")]
    assert commands == [
        ("rejected", "engine"),
        ("command", a),
        ("pending", True),  # b is still unread
        ("command", b),
        ("pending", True),  # the third frame is in the pipe
        ("command", c),
        ("pending", True),  # the shutdown
    ]
