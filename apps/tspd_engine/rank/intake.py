"""Rank 0's front door (ZMQ) and the per-round broadcast that keeps every rank in step.

Only rank 0 talks to clients: it PULLs submit/abort/shutdown/query frames and PUSHes outputs
to the reply address each submit names (counters to the address each query names). Once per
scheduler round it broadcasts the intake it collected (a :class:`~tspd_engine.frames.Round`)
to the other ranks over the TP group, so every rank admits and aborts the same requests in the
same order and its scheduler keeps the same block ids as rank 0's. That is what lets PD peers
on each rank agree later.

Threading: owned by the rank's engine thread.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from tspd_engine.errors import RequestError
from tspd_engine.frames import (
    Abort,
    FinishReason,
    Frame,
    Output,
    Query,
    Round,
    Shutdown,
    Stats,
    Submit,
    decode,
    encode,
)
from tspd_engine.model.tp import TpGroup

log = logging.getLogger(__name__)
#: Pending outputs per client socket before sends are dropped (a client that went away).
SEND_HWM = 100_000


class Intake:
    """Rank 0's sockets: requests in, outputs out. ``close`` releases both."""

    def __init__(self, address: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(address)
        self.address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replies: dict[str, zmq.Socket[bytes]] = {}
        self._reply_of: dict[str, str] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        #: Queries received and not answered yet (answered after the round, by rank 0 only).
        self.queries: list[Query] = []

    def collect(self, wait_s: float) -> Round:
        """Drain pending frames, waiting up to ``wait_s`` for the first one; return the round
        to broadcast. A shutdown frame ends the drain. Malformed frames are dropped (logged);
        a submit whose id is still in flight is answered with an ERROR at once and never
        reaches the scheduler (its outputs would go to the other client)."""
        events: list[Submit | Abort] = []
        deadline = time.monotonic() + wait_s
        while True:
            timeout_ms = 0 if events else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._poller.poll(timeout_ms):
                return Round(tuple(events))
            try:
                frame = decode(self._pull.recv(zmq.NOBLOCK))
            except RequestError as exc:
                log.warning("dropping malformed frame: %s", exc)
                continue
            if isinstance(frame, Shutdown):
                return Round(tuple(events), shutdown=True)
            if isinstance(frame, Submit):
                if frame.rid in self._reply_of:
                    why = f"request id {frame.rid!r} is already in use"
                    self._send(frame.reply, Output(frame.rid, (), FinishReason.ERROR, why))
                    continue
                self._reply_of[frame.rid] = frame.reply
                events.append(
                    Submit(frame.rid, frame.prompt, frame.params, mode=frame.mode, pd=frame.pd)
                )
            elif isinstance(frame, Abort):
                events.append(frame)
            elif isinstance(frame, Query):
                self.queries.append(frame)
            else:
                log.warning("dropping %s frame on the intake socket", type(frame).__name__)

    def send(self, outputs: list[Output]) -> None:
        """Push each output to its request's client; forget finished requests' addresses."""
        for out in outputs:
            address = self._reply_of.get(out.rid)
            if address is None:
                continue
            self._send(address, out)
            if out.finished:
                del self._reply_of[out.rid]

    def answer(self, values: dict[str, float]) -> None:
        """Answer every pending query with ``values`` (rank 0's counters after a round)."""
        queries, self.queries = self.queries, []
        for q in queries:
            self._send(q.reply, Stats(q.qid, values))

    def _send(self, address: str, out: Frame) -> None:
        # A bad or unreachable reply address costs that client its outputs, never the rank.
        try:
            sock = self._replies.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                self._replies[address] = sock
                sock.connect(address)
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
