"""The engine's front door for callers in any process: submit prompts, stream tokens back.

An :class:`EngineClient` PUSHes submit/abort/abort_room frames to rank 0's intake address and
binds its own PULL socket for outputs; a receiver thread routes each output to the request's
stream. Any number of clients (in any processes) may talk to one engine, each with the
replica's token (every message carries it: :mod:`tspd_engine.rank.intake`).

No wait on the engine is unbounded (the engine is other processes, which may die, stop or
drop a frame):

* a submit is checked here against exactly what rank 0's intake would drop unread (the
  frame is decoded as the intake decodes it), so a bad one is a :class:`RequestError` now
  rather than a request nobody answers;
* rank 0 acknowledges every submit it takes (an output with no tokens that is not the last;
  streams swallow it), and a submit still unacknowledged once rank 0 has begun
  :data:`ACK_ITERATIONS` engine iterations after it was sent (at least :data:`ACK_GRACE_S`
  later) fails with :class:`EngineDeadError`: its frame was lost. Without vitals (a bare
  client) the bound is :data:`ACK_TIMEOUT_S`;
* a wait fails with :class:`EngineDeadError` once a rank process has exited, or a rank has
  shown no sign of life for :data:`GIVE_UP_S` (stopped: :mod:`tspd_engine.rank.pulse`);
* a send that rank 0 does not take within :data:`SEND_TIMEOUT_MS` (its queue full: it stopped
  reading) fails with :class:`EngineDeadError` instead of blocking the caller.

A request that is queued or computing waits as long as the engine is alive and progressing:
a long prefill round is no failure.

Threading: every public method is thread-safe; each :class:`RequestStream` is meant to be
consumed by one thread or one asyncio task (:meth:`RequestStream.next_output_async` waits
without a thread of its own).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress

import zmq

from tspd_core.procname import name_this_thread
from tspd_engine.errors import EngineDeadError
from tspd_engine.frames import (
    MAX_FRAME_BYTES,
    Abort,
    FinishReason,
    Output,
    PdTarget,
    Query,
    RequestMode,
    RoomAbort,
    SamplingParams,
    Shutdown,
    Stats,
    Submit,
)
from tspd_engine.frames import decode as decode_frame
from tspd_engine.frames import encode as encode_frame
from tspd_engine.rank.pulse import Vitals
from tspd_serving.errors import RequestError
from tspd_serving.tokenizer import MAX_TOKEN_ID

_POLL_S = 0.2
#: Engine iterations rank 0 must have begun after a submit before its silence means the frame
#: was lost: each iteration starts by draining the intake, so the second one has read it.
ACK_ITERATIONS = 2
#: ... and seconds since the send at least (a frame in flight on a loaded machine).
ACK_GRACE_S = 2.0
#: The acknowledgement bound of a client without vitals (no iterations to count).
ACK_TIMEOUT_S = 60.0
#: A replica with a rank that has not run for this long (stopped) fails the waits on it.
GIVE_UP_S = 60.0
#: How long a send may wait for room in the queue towards rank 0 (ZMQ's high-water mark).
SEND_TIMEOUT_MS = 2000
log = logging.getLogger(__name__)


class RequestStream:
    """Outputs of one request, in order; iterating yields each chunk of new tokens."""

    def __init__(self, rid: str, client: EngineClient, iteration: int) -> None:
        self.rid = rid
        self._client = client
        self._queue: queue.SimpleQueue[Output] = queue.SimpleQueue()
        self._sent = (time.monotonic(), iteration)  # when, and rank 0's iterations by then
        self._wake: Callable[[], None] | None = None  # an async waiter's (next_output_async)
        self.acknowledged = False  #: rank 0 has taken the submit
        self.tokens: list[int] = []
        self.final: Output | None = None

    def _put(self, out: Output) -> None:
        """An output from the receiver thread (an empty non-final one: the acknowledgement)."""
        self.acknowledged = True
        if out.tokens or out.finished:
            self._queue.put(out)
        wake = self._wake
        if wake is not None:
            wake()

    def _take(self, timeout: float = 0.0) -> Output | None:
        """The next output, waiting up to ``timeout`` s for it, or None."""
        try:
            out = self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
        except queue.Empty:
            return None
        self.tokens.extend(out.tokens)
        if out.finished:
            self.final = out
            self._client._forget(self.rid)
        return out

    def _check(self) -> None:
        """Raise :class:`EngineDeadError` if this request can no longer be answered."""
        vitals = self._client.check_alive()
        if self.acknowledged:
            return
        sent_at, iteration = self._sent
        waited = time.monotonic() - sent_at
        if vitals is None:
            lost = waited > ACK_TIMEOUT_S
            why = f"no acknowledgement in {ACK_TIMEOUT_S:g} s"
        else:
            lost = waited > ACK_GRACE_S and vitals.iterations >= iteration + ACK_ITERATIONS
            why = f"rank 0 began {ACK_ITERATIONS} rounds after it was sent without acknowledging it"
        if lost:
            self._client._forget(self.rid)
            raise EngineDeadError(
                f"request {self.rid}: the engine never took it: {why} (its frame was lost)"
            )

    def next_output(self, timeout: float | None = None) -> Output:
        """The next output; :class:`EngineDeadError` if the engine died, stopped or lost the
        request meanwhile, :class:`TimeoutError` after ``timeout`` seconds without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (out := self._take(_POLL_S)) is None:
            self._check()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"request {self.rid}: no output in {timeout} s")
        return out

    async def next_output_async(self) -> Output:
        """:meth:`next_output` for an asyncio task: no thread waits (the receiver thread
        wakes the task); cancelling the task ends the wait."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            with suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(ready.set)

        self._wake = wake
        try:
            while True:
                ready.clear()
                out = self._take()
                if out is not None:
                    return out
                self._check()
                with suppress(TimeoutError):
                    await asyncio.wait_for(ready.wait(), _POLL_S)
        finally:
            self._wake = None

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
        return self._whole(self.final)

    async def result_async(self) -> Output:
        """:meth:`result` for an asyncio task (see :meth:`next_output_async`)."""
        while self.final is None:
            await self.next_output_async()
        return self._whole(self.final)

    def _whole(self, f: Output) -> Output:
        return Output(
            f.rid, tuple(self.tokens), f.finish, f.error, f.prompt_tokens, f.cached_tokens
        )


class EngineClient:
    """Talks to one engine replica's rank 0 at ``intake_address`` (``tcp://host:port``).

    ``token`` is the replica's intake token (:attr:`RankAddresses.token`); ``vitals``
    (optional) reads the replica's signs of life (:meth:`EngineHandle.vitals`): waits consult
    it so that a dead or stopped engine, or a lost submit, fails requests with
    :class:`EngineDeadError` instead of hanging (see the module docstring).
    """

    def __init__(
        self, intake_address: str, token: str, vitals: Callable[[], Vitals] | None = None
    ) -> None:
        self._ctx = zmq.Context()
        self._token = token.encode()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._push.connect(intake_address)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.bind("tcp://127.0.0.1:0")
        self.reply_address = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._vitals = vitals
        self._lock = threading.Lock()  # the tables below
        self._sending = threading.Lock()  # the PUSH socket (a ZMQ socket is one thread's)
        self._streams: dict[str, RequestStream] = {}
        self._queries: dict[int, queue.Queue[Stats]] = {}
        self._ids = itertools.count()
        self._prefix = f"c{os.getpid()}-{id(self):x}-"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="engine-client", daemon=True)
        self._thread.start()

    def vitals(self) -> Vitals | None:
        """The replica's signs of life now (None: this client has no view of them)."""
        return self._vitals() if self._vitals is not None else None

    def check_alive(self) -> Vitals | None:
        """Raise :class:`EngineDeadError` if a rank process exited or a rank has not run for
        :data:`GIVE_UP_S`; else the vitals read (None without a view of them)."""
        vitals = self.vitals()
        if vitals is None:
            return None
        if vitals.dead:
            raise EngineDeadError(f"the engine's rank processes have exited ({vitals.dead})")
        if vitals.silent_s > GIVE_UP_S:
            raise EngineDeadError(
                f"the engine has stopped: rank {vitals.silent_rank} has not run for "
                f"{vitals.silent_s:.0f} s"
            )
        return vitals

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        mode: RequestMode = RequestMode.GENERATE,
        pd: PdTarget | None = None,
    ) -> RequestStream:
        """Send one request; returns its stream at once. ``mode`` selects a PD half and ``pd``
        its room and P's bootstrap server (see docs/engine.md); the default prefills and
        decodes here. :class:`RequestError` for a request rank 0's intake would drop unread
        (its frame is checked as the intake checks it; the model's own limits are the
        engine's: it answers those with an ERROR output)."""
        if not prompt:
            raise RequestError("prompt must hold at least one token id")
        ids = tuple(int(t) for t in prompt)
        if not all(0 <= t <= MAX_TOKEN_ID for t in ids):
            raise RequestError(f"prompt token ids must lie in 0..{MAX_TOKEN_ID}")
        rid = rid or f"{self._prefix}{next(self._ids)}"
        frame = encode_frame(
            Submit(rid, ids, params or SamplingParams(), self.reply_address, mode, pd)
        )
        decode_frame(frame)  # the intake's own check: what it would drop is refused here
        vitals = self.vitals()
        stream = RequestStream(rid, self, vitals.iterations if vitals is not None else 0)
        with self._lock:
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in flight on this client")
            self._streams[rid] = stream
        try:
            self._send(frame)
        except BaseException:
            self._forget(rid)
            raise
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
        """Ask rank 0 to abort ``rid`` (no answer; its stream ends with ABORT if it ran).
        Never raises: an engine that does not read its intake any more fails the request's
        wait anyway."""
        try:
            self._send(encode_frame(Abort(rid)))
        except EngineDeadError as exc:
            log.warning("abort of %s not sent: %s", rid, exc)

    def abort_room(self, room: int, reason: str) -> bool:
        """Ask the replica to fail PD room ``room``, which none of its requests serves (see
        :class:`~tspd_engine.frames.RoomAbort`; no answer). :class:`RequestError` for a room
        or reason the intake would drop. Never waits: whether the frame went out (False when
        the queue towards rank 0 is full — a long round, or a dead engine — the room then
        fails at P's bootstrap timeout, as it did before; a caller on an event loop, such as
        a busy node refusing a flood, must not stall on it)."""
        frame = encode_frame(RoomAbort(room, reason))
        try:
            self._send(frame, wait=False)
        except EngineDeadError:
            return False
        return True

    def stats(self, timeout: float = 5.0) -> dict[str, float]:
        """Rank 0's counters (KV pool, queues, PD transfers), read after its current round.

        Raises :class:`EngineDeadError` if the engine is gone and :class:`TimeoutError` if it
        does not answer within ``timeout`` seconds."""
        qid = next(self._ids)
        box: queue.Queue[Stats] = queue.Queue()
        with self._lock:
            self._queries[qid] = box
        deadline = time.monotonic() + timeout
        try:
            self._send(encode_frame(Query(self.reply_address, qid)))
            while True:
                try:
                    return box.get(timeout=_POLL_S).values
                except queue.Empty:
                    self.check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the engine did not answer in {timeout} s") from None
        finally:
            with self._lock:
                self._queries.pop(qid, None)

    def shutdown_engine(self) -> None:
        """Ask the engine to stop (every rank exits after finishing its current round)."""
        self._send(encode_frame(Shutdown()))

    def _send(self, frame: bytes, wait: bool = True) -> None:
        """One message to the intake: the token, then the encoded frame;
        :class:`EngineDeadError` when rank 0 leaves no room for it within
        :data:`SEND_TIMEOUT_MS` (it stopped reading), or at once without ``wait``."""
        with self._sending:
            try:
                self._push.send_multipart([self._token, frame], 0 if wait else zmq.NOBLOCK)
            except zmq.Again:
                room = f"no room for a frame in {SEND_TIMEOUT_MS / 1000:g} s" if wait else "full"
                raise EngineDeadError(f"the engine is not reading its intake ({room})") from None

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._streams.pop(rid, None)

    def _receive(self) -> None:
        name_this_thread()
        # This thread is the only way outputs reach their requests: nothing a frame holds may
        # end it (the reply socket is reachable by any local process).
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if poller.poll(int(_POLL_S * 1000)):
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
