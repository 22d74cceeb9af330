"""The engine's front door for callers in any process: submit prompts, stream tokens back.

An :class:`EngineClient` PUSHes submit/abort frames to rank 0's intake address and binds its
own PULL socket for outputs; a receiver thread routes each output to the request's stream.
Any number of clients (in any processes) may talk to one engine, each with the replica's
token (every message carries it: :mod:`tspd_engine.rank.intake`).

Threading: every public method is thread-safe; each :class:`RequestStream` is meant to be
consumed by one thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import zmq

from tspd_engine.errors import EngineDeadError, RequestError
from tspd_engine.frames import (
    MAX_FRAME_BYTES,
    MAX_TOKEN_ID,
    Abort,
    FinishReason,
    Output,
    PdTarget,
    Query,
    RequestMode,
    SamplingParams,
    Shutdown,
    Stats,
    Submit,
)
from tspd_engine.frames import decode as decode_frame
from tspd_engine.frames import encode as encode_frame

_POLL_MS = 100
log = logging.getLogger(__name__)


class RequestStream:
    """Outputs of one request, in order; iterating yields each chunk of new tokens."""

    def __init__(self, rid: str, client: EngineClient) -> None:
        self.rid = rid
        self._client = client
        self._queue: queue.Queue[Output] = queue.Queue()
        self.tokens: list[int] = []
        self.final: Output | None = None

    def _put(self, out: Output) -> None:
        self._queue.put(out)

    def next_output(self, timeout: float | None = None) -> Output:
        """The next output; raises :class:`EngineDeadError` if the engine died meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                out = self._queue.get(timeout=0.2)
            except queue.Empty:
                self._client.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"request {self.rid}: no output in {timeout} s") from None
                continue
            self.tokens.extend(out.tokens)
            if out.finished:
                self.final = out
                self._client._forget(self.rid)
            return out

    def __iter__(self) -> Iterator[list[int]]:
        while self.final is None:
            out = self.next_output()
            if out.tokens:
                yield list(out.tokens)
        if self.final.finish == FinishReason.ERROR:
            raise RequestError(f"request {self.rid} failed: {self.final.error}")

    def result(self, timeout: float | None = None) -> Output:
        """Block until the request finishes; return its final output (all tokens in .tokens)."""
        while self.final is None:
            self.next_output(timeout)
        f = self.final
        return Output(
            f.rid, tuple(self.tokens), f.finish, f.error, f.prompt_tokens, f.cached_tokens
        )


class EngineClient:
    """Talks to one engine replica's rank 0 at ``intake_address`` (``tcp://host:port``).

    ``token`` is the replica's intake token (:attr:`RankAddresses.token`); ``alive``
    (optional) says whether the engine's processes still run; waits poll it so a dead engine
    fails requests with :class:`EngineDeadError` instead of hanging.
    """

    def __init__(
        self, intake_address: str, token: str, alive: Callable[[], bool] | None = None
    ) -> None:
        self._ctx = zmq.Context()
        self._token = token.encode()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(intake_address)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.bind("tcp://127.0.0.1:0")
        self.reply_address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._alive = alive
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._queries: dict[int, queue.Queue[Stats]] = {}
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid()}-{id(self):x}-"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="engine-client", daemon=True)
        self._thread.start()

    def check_alive(self) -> None:
        if self._alive is not None and not self._alive():
            raise EngineDeadError("the engine's rank processes have exited")

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        mode: RequestMode = RequestMode.GENERATE,
        pd: PdTarget | None = None,
    ) -> RequestStream:
        """Send one request; returns its stream at once (the engine validates it). ``mode``
        selects a PD half and ``pd`` its room and P's bootstrap server (see docs/engine.md);
        the default prefills and decodes here."""
        if not prompt:
            raise RequestError("prompt must hold at least one token id")
        ids = tuple(int(t) for t in prompt)
        if not all(0 <= t <= MAX_TOKEN_ID for t in ids):
            # The intake drops frames it cannot read, so this must be said here.
            raise RequestError(f"prompt token ids must lie in 0..{MAX_TOKEN_ID}")
        rid = rid or f"{self._prefix}{next(self._ids)}"
        stream = RequestStream(rid, self)
        frame = Submit(rid, ids, params or SamplingParams(), self.reply_address, mode, pd)
        with self._lock:
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in flight on this client")
            self._streams[rid] = stream
            self._send(frame)
        return stream

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int = 16,
        timeout: float | None = None,
        **params: object,
    ) -> list[int]:
        """Greedy continuation of ``prompt`` (blocking); extra keywords go to SamplingParams."""
        sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        out = self.submit(prompt, sp).result(timeout)
        if out.finish == FinishReason.ERROR:
            raise RequestError(f"request {out.rid} failed: {out.error}")
        return list(out.tokens)

    def stream(
        self, prompt: Sequence[int], max_tokens: int = 16, **params: object
    ) -> Iterator[int]:
        """Yield generated token ids one at a time as the engine produces them."""
        sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        for chunk in self.submit(prompt, sp):
            yield from chunk

    def abort(self, rid: str) -> None:
        with self._lock:
            self._send(Abort(rid))

    def stats(self, timeout: float = 5.0) -> dict[str, float]:
        """Rank 0's counters (KV pool, queues, PD transfers), read after its current round.

        Raises :class:`EngineDeadError` if the engine is gone and :class:`TimeoutError` if it
        does not answer within ``timeout`` seconds."""
        qid = next(self._ids)
        box: queue.Queue[Stats] = queue.Queue()
        with self._lock:
            self._queries[qid] = box
            self._send(Query(self.reply_address, qid))
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    return box.get(timeout=0.2).values
                except queue.Empty:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the engine did not answer in {timeout} s") from None
        finally:
            with self._lock:
                self._queries.pop(qid, None)

    def shutdown_engine(self) -> None:
        """Ask the engine to stop (every rank exits after finishing its current round)."""
        with self._lock:
            self._send(Shutdown())

    def _send(self, frame: Submit | Abort | Query | Shutdown) -> None:
        """One message to the intake: the token, then the frame (callers hold the lock)."""
        self._push.send_multipart([self._token, encode_frame(frame)])

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def _receive(self) -> None:
        # This thread is the only way outputs reach their requests: nothing a frame holds may
        # end it (the reply socket is reachable by any local process).
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if poller.poll(_POLL_MS):
                    self._route(self._pull.recv(zmq.NOBLOCK))
            except RequestError as exc:
                log.warning("engine client: dropping a malformed reply: %s", exc)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._closed.is_set():
                    return
                log.warning("engine client: reply socket error: %s", exc)
            except Exception:
                log.exception("engine client: a reply could not be routed; dropped")

    def _route(self, data: bytes) -> None:
        out = decode_frame(data)
        if isinstance(out, Output):
            with self._lock:
                stream = self._streams.get(out.rid)
            if stream is not None:
                stream._put(out)
        elif isinstance(out, Stats):
            with self._lock:
                box = self._queries.get(out.qid)
            if box is not None:
                box.put(out)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self._push.close(linger=500)
        self._pull.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
