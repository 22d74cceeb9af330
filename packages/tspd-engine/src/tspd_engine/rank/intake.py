"""Rank 0's front door (ZMQ) and the per-round broadcast that keeps every rank in step.

Only rank 0 talks to clients: it PULLs submit/abort/abort_room/shutdown/query frames and
PUSHes outputs to the reply address each submit names (counters to the address each query
names). The first output of every submit it takes is its acknowledgement, an output with no
tokens that is not the last (the engine itself never sends one: :meth:`Sequence.take_output`):
a client bounds its wait for it (:mod:`tspd_engine.rank.client`), since a frame the intake
drops is never answered. Aborts and room aborts are not answered.

Every message on the intake is two ZMQ frames, the replica's token and the frame: the launcher
draws the token and hands it only to its own clients, so another local process can neither
stop the replica nor make rank 0 connect anywhere (messages without it are dropped unread).
Rank 0 keeps at most :data:`MAX_REPLY_SOCKETS` reply sockets that no request in flight needs
(least recently used first out), so per-client state stays bounded however many addresses it
sees.

Once per
scheduler round it broadcasts the intake it collected (a :class:`~tspd_engine.frames.Round`)
to the other ranks over the TP group, so every rank admits and aborts the same requests in the
same order and its scheduler keeps the same block ids as rank 0's. That is what lets PD peers
on each rank agree later.

Threading: owned by the rank's engine thread.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch
import zmq

from tspd_core import trace
from tspd_engine.frames import (
    MAX_FRAME_BYTES,
    Abort,
    Event,
    FinishReason,
    Frame,
    Output,
    Query,
    RoomAbort,
    Round,
    Shutdown,
    Stats,
    Submit,
    decode,
    encode,
)
from tspd_engine.model.tp import TpGroup
from tspd_serving.errors import RequestError

log = logging.getLogger(__name__)
#: Pending outputs per client socket before sends are dropped (a client that went away).
SEND_HWM = 100_000
#: Reply sockets kept open with no request or query in flight on them.
MAX_REPLY_SOCKETS = 64
#: A reply address: ``tcp://host:port`` (what :class:`EngineClient` binds) or ``ipc://path``.
REPLY_ADDRESS = re.compile(
    r"tcp://[\w.\-]+:\d{1,5}|tcp://\[[0-9a-fA-F:]+\]:\d{1,5}|ipc://[\w./\-]+"
)
#: Seconds between two warnings about dropped intake messages (an attacker must not flood logs).
DROP_LOG_EVERY_S = 10.0


class Intake:
    """Rank 0's sockets: requests in, outputs out. ``close`` releases both.

    ``token``: what every message must carry as its first frame (see the module docstring).
    """

    def __init__(
        self, address: str, token: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._token = token.encode()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # ZMQ drops a larger message (and its connection) before Python allocates it.
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + len(self._token))
        self._pull.bind(address)
        self.address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        #: Open reply sockets, least recently used first.
        self._replies: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()
        self._reply_of: dict[str, str] = {}
        self._needed: Counter[str] = Counter()  # address -> requests and queries on it
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._woken_by: set[int] = set()  # other descriptors that end a wait (collect)
        #: Queries received and not answered yet (answered after the round, by rank 0 only).
        self.queries: list[Query] = []
        self.dropped = 0  #: messages dropped unread (no token, malformed): a metric
        self._drop_logged = float("-inf")

    def collect(self, wait_s: float, wake: Sequence[int] = ()) -> Round:
        """Drain pending frames, waiting up to ``wait_s`` for the first one; return the round
        to broadcast. A shutdown frame ends the drain. Each submit taken is acknowledged at
        once. Malformed frames and frames without the token are dropped (logged, at most
        every :data:`DROP_LOG_EVERY_S`); a submit whose id is still in flight is answered
        with an ERROR at once and never reaches the scheduler (its outputs would go to the
        other client).

        ``wake``: descriptors that end the wait too when they turn readable (a PD peer's
        worker notes), so the round that acts on them starts at once; the caller drains them
        in that round (an undrained one would end every wait)."""
        events: list[Event] = []
        self._watch(wake)
        deadline = time.monotonic() + wait_s
        while True:
            timeout_ms = 0 if events else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(self._poller.poll(timeout_ms))
            if self._pull not in ready:
                return Round(tuple(events))
            frame = self._receive()
            if frame is None:
                continue
            if isinstance(frame, Shutdown):
                return Round(tuple(events), shutdown=True)
            if isinstance(frame, Submit):
                if frame.rid in self._reply_of:
                    why = f"request id {frame.rid!r} is already in use"
                    self._send(frame.reply, Output(frame.rid, (), FinishReason.ERROR, why))
                    self._trim()
                    continue
                trace.mark(frame.rid, "rank.intake")
                self._reply_of[frame.rid] = frame.reply
                self._needed[frame.reply] += 1
                self._send(frame.reply, Output(frame.rid, ()))  # taken: the client's ack
                events.append(
                    Submit(frame.rid, frame.prompt, frame.params, mode=frame.mode, pd=frame.pd)
                )
            elif isinstance(frame, Abort | RoomAbort):
                events.append(frame)
            elif isinstance(frame, Query):
                self.queries.append(frame)
                self._needed[frame.reply] += 1
            else:
                self._drop(f"a {type(frame).__name__} frame has no place on the intake")

    def _watch(self, fds: Sequence[int]) -> None:
        """Poll exactly ``fds`` besides the intake socket (registrations change rarely)."""
        wanted = set(fds)
        if wanted == self._woken_by:
            return
        for fd in self._woken_by - wanted:
            self._poller.unregister(fd)
        for fd in wanted - self._woken_by:
            self._poller.register(fd, zmq.POLLIN)
        self._woken_by = wanted

    @property
    def watched(self) -> frozenset[int]:
        """The descriptors the last :meth:`collect` watched besides the intake socket."""
        return frozenset(self._woken_by)

    @property
    def reply_sockets(self) -> int:
        """Reply sockets open now (bounded: see :data:`MAX_REPLY_SOCKETS`)."""
        return len(self._replies)

    def _receive(self) -> Frame | None:
        """The next message's frame, or None (dropped: no token, malformed, bad address)."""
        try:
            parts = self._pull.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        if len(parts) != 2 or not hmac.compare_digest(parts[0], self._token):
            self._drop(f"a message of {len(parts)} frame(s) without the replica's token")
            return None
        try:
            frame = decode(parts[1])
        except RequestError as exc:
            self._drop(f"a malformed frame: {exc}")
            return None
        reply = frame.reply if isinstance(frame, Submit | Query) else None
        if reply is not None and not REPLY_ADDRESS.fullmatch(reply):
            self._drop(f"a frame with the reply address {reply[:60]!r}")
            return None
        return frame

    def _drop(self, what: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._drop_logged >= DROP_LOG_EVERY_S:
            self._drop_logged = now
            log.warning("intake: dropped %s (%d dropped so far)", what, self.dropped)

    def send(self, outputs: list[Output]) -> None:
        """Push each output to its request's client; forget finished requests' addresses."""
        for out in outputs:
            address = self._reply_of.get(out.rid)
            if address is None:
                continue
            trace.mark(out.rid, "rank.send")
            self._send(address, out)
            if out.finished:
                del self._reply_of[out.rid]
                self._release(address)

    def answer(self, values: dict[str, float]) -> None:
        """Answer every pending query with ``values`` (rank 0's counters after a round)."""
        queries, self.queries = self.queries, []
        for q in queries:
            self._send(q.reply, Stats(q.qid, values))
            self._release(q.reply)

    def _release(self, address: str) -> None:
        self._needed[address] -= 1
        if self._needed[address] <= 0:
            del self._needed[address]
        self._trim()

    def _trim(self) -> None:
        """Close the least recently used reply sockets nobody in flight needs, down to
        :data:`MAX_REPLY_SOCKETS` of them (their pending outputs still go out: linger)."""
        idle = [a for a in self._replies if a not in self._needed]
        for address in idle[: max(0, len(idle) - MAX_REPLY_SOCKETS)]:
            self._replies.pop(address).close(linger=1000)

    def _send(self, address: str, out: Frame) -> None:
        # A bad or unreachable reply address costs that client its outputs, never the rank.
        try:
            sock = self._replies.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a gone client: back off
                self._replies[address] = sock
                sock.connect(address)
            self._replies.move_to_end(address)
            sock.send(encode(out), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("client %s is not reading; dropped %s", address, _what(out))
        except zmq.ZMQError as exc:
            log.warning("cannot reach client %r (%s); dropped %s", address, exc, _what(out))

    def close(self) -> None:
        for sock in [self._pull, *self._replies.values()]:
            sock.close(linger=0)
        self._replies.clear()


def _what(frame: Frame) -> str:
    return f"output of {frame.rid}" if isinstance(frame, Output) else type(frame).__name__


def broadcast_round(tp: TpGroup, rnd: Round | None) -> Round:
    """Rank 0 passes its round; every rank returns the same round (two gloo broadcasts)."""
    if tp.size == 1:
        assert rnd is not None, "rank 0 must supply the round"
        return rnd
    payload = b""
    if tp.rank == 0:
        assert rnd is not None, "rank 0 must supply the round"
        empty = not rnd.events and not rnd.shutdown
        payload = b"" if empty else encode(rnd)
    size = tp.broadcast(torch.tensor([len(payload)], dtype=torch.int64))
    if int(size[0]) == 0:
        return Round()
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if tp.rank == 0 else None
    if buf is None:
        buf = torch.empty(int(size[0]), dtype=torch.uint8)
    tp.broadcast(buf)
    frame = decode(buf.numpy().tobytes())
    if not isinstance(frame, Round):
        raise RequestError(f"round broadcast carried a {type(frame).__name__} frame")
    return frame
