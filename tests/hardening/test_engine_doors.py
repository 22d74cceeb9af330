"""The engine's own doors, attacked as issues 18 and 35 found them open: rank 0's intake, a
client's reply socket and waits, and the core's submit. A real engine (its rank in a thread of
this process, over real ZMQ sockets; a rank process where it must be stopped) takes every
attack and then still answers a known prompt with the dense reference's exact tokens, its KV
pool whole.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import zmq

from tspd_engine.config import EngineConfig
from tspd_engine.errors import EngineDeadError
from tspd_engine.frames import FinishReason, Query, SamplingParams, Shutdown, Stats, Submit, encode
from tspd_engine.loop.engine import Engine
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.dense import dense_greedy
from tspd_engine.model.weights import full_random_state
from tspd_engine.rank import client as client_module
from tspd_engine.rank.client import ACK_GRACE_S, EngineClient
from tspd_engine.rank.intake import MAX_REPLY_SOCKETS, Intake
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_engine.rank.process import ANY_PORT, IDLE_POLL_S
from tspd_engine.rank.pulse import STALL_S
from tspd_serving.errors import RequestError
from tspd_serving.tokenizer import MAX_TOKEN_ID, ByteTokenizer

TOK = ByteTokenizer()
KNOWN = TOK.encode("still serving?")
DEEP = b"[" * 100_000


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> None:
    torch.set_num_threads(1)  # the CPU is shared: OpenMP spinning slows tiny matmuls 100x


def _cfg() -> EngineConfig:
    return EngineConfig(model=ModelConfig(), num_pages=96, page_size=4, max_running=8)


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineHandle]:
    with launch(_cfg(), in_process=True) as handle:
        yield handle


def _whole_and_exact(handle: EngineHandle) -> None:
    """The known prompt's exact tokens, and every page back in the pool (free, or cached
    prefixes nobody holds)."""
    cfg = _cfg()
    want = dense_greedy(cfg.model, full_random_state(cfg.model, cfg.seed), KNOWN, 6)
    assert handle.client.generate(KNOWN, max_tokens=6, timeout=60) == want
    stats = handle.client.stats(timeout=30)
    assert (stats["reclaimable_pages"], stats["running"], stats["waiting"]) == (
        stats["initial_free_pages"],
        0,
        0,
    )


def _push(address: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return sock


@contextmanager
def _answer_box(client: EngineClient) -> Iterator[tuple[int, queue.Queue[Stats]]]:
    """A query id whose Stats frame ``client`` puts in the yielded queue (as its own
    ``stats()`` registers one)."""
    qid = next(client._ids)
    box: queue.Queue[Stats] = queue.Queue()
    with client._lock:
        client._queries[qid] = box
    try:
        yield qid, box
    finally:
        with client._lock:
            client._queries.pop(qid, None)


def _intake_read(engine: EngineHandle, sock: zmq.Socket[bytes]) -> None:
    """Wait until rank 0 read everything ``sock`` sent so far: one socket's messages arrive
    in order, so a query sent behind them (with the token) is answered after them, and only
    by a rank 0 they left serving. The answer goes to the client's own reply socket."""
    with _answer_box(engine.client) as (qid, box):
        query = Query(engine.client.reply_address, qid)
        sock.send_multipart([engine.addrs.token.encode(), encode(query)])
        box.get(timeout=30)


def _client_read(engine: EngineHandle, sock: zmq.Socket[bytes]) -> None:
    """Wait until the client's receiver read everything ``sock`` sent it so far (a Stats
    frame behind them, routed to a query of ours: it still routes)."""
    with _answer_box(engine.client) as (qid, box):
        sock.send(encode(Stats(qid, {})))
        box.get(timeout=30)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_deeply_nested_frames_neither_stop_rank_0_nor_the_clients_receiver(
    engine: EngineHandle,
) -> None:
    """Issue 18.3: ``b"[" * 100000`` killed rank 0 on its intake and a node's receiver thread
    on its reply socket (the node then answered 503 forever)."""
    token = engine.addrs.token.encode()
    raw = _push(engine.addrs.intake)
    raw.send_multipart([token, DEEP])  # with the token: decoded, refused, dropped
    raw.send(DEEP)  # without it: dropped unread
    to_client = _push(engine.client.reply_address)
    to_client.send(DEEP)
    to_client.send(b'{"op":"output","rid":"x","tokens":[1e400],"finish":1,"error":"",'
                   b'"prompt_tokens":1,"cached_tokens":0}')  # fmt: skip
    _intake_read(engine, raw)
    _client_read(engine, to_client)
    raw.close()
    to_client.close()
    _whole_and_exact(engine)
    assert engine.alive()


def test_control_frames_without_the_token_do_not_stop_the_replica(engine: EngineHandle) -> None:
    """Issue 18.9: any local process could stop every rank with ``{"op":"shutdown"}``."""
    raw = _push(engine.addrs.intake)
    raw.send(encode(Shutdown()))
    raw.send_multipart([b"not-the-token", encode(Shutdown())])
    raw.send_multipart([engine.addrs.token.encode(), encode(Shutdown()), b"extra"])
    _intake_read(engine, raw)  # answered: none of them stopped rank 0
    raw.close()
    _whole_and_exact(engine)
    assert engine.alive()


def test_thousands_of_reply_addresses_without_the_token_cost_rank_0_no_sockets(
    engine: EngineHandle,
) -> None:
    """Issue 18.9: 3,000 distinct reply addresses grew rank 0 to 1,072 fds for good."""
    _whole_and_exact(engine)  # everything this test's engine opens is open now
    before = _open_fds()
    raw = _push(engine.addrs.intake)
    for i in range(3000):
        frame = Submit(f"spray-{i}", (1, 2), SamplingParams(2), f"tcp://127.0.0.1:{1024 + i}")
        raw.send(encode(frame))
    _intake_read(engine, raw)  # the intake drained all 3,000
    raw.close()
    _whole_and_exact(engine)
    assert _open_fds() - before < 10


def test_rank_0_keeps_a_bounded_number_of_idle_reply_sockets() -> None:
    """With the token (a misbehaving client of this replica), answered queries leave at most
    MAX_REPLY_SOCKETS sockets open, however many addresses they named."""
    intake = Intake(ANY_PORT, "secret")
    raw = _push(intake.address)
    try:
        for qid in range(3 * MAX_REPLY_SOCKETS):
            query = Query(f"tcp://127.0.0.1:{20000 + qid}", qid)
            raw.send_multipart([b"secret", encode(query)])
        raw.close()
        got: list[Query] = []
        while len(got) < 3 * MAX_REPLY_SOCKETS:
            intake.collect(1.0)
            got += intake.queries
            intake.answer({"free_pages": 1.0})
        assert [q.qid for q in got] == list(range(3 * MAX_REPLY_SOCKETS))
        assert intake.reply_sockets == MAX_REPLY_SOCKETS
        assert intake.dropped == 0
    finally:
        intake.close()


def test_an_id_past_int32_is_refused_alone_by_the_client_and_by_the_core(
    engine: EngineHandle,
) -> None:
    """Issue 18.1: ``[2147483648]`` raised OverflowError in every rank (np.asarray int32
    before the vocabulary check) and the cluster answered 503 until restarted."""
    with pytest.raises(RequestError, match=rf"prompt token ids must lie in 0\.\.{MAX_TOKEN_ID}"):
        engine.client.submit([2147483648])
    core = Engine(_cfg())
    try:
        outs = core.add([2147483648]), core.add([2**64]), core.add(KNOWN)
        results = core.run()
    finally:
        core.close()
    past_vocab, past_int64, known = (results[rid] for rid in outs)
    assert (past_vocab.finish, past_vocab.error) == (
        FinishReason.ERROR,
        "prompt token ids must lie in 0..258",
    )
    assert past_int64.finish == FinishReason.ERROR
    assert past_int64.error.startswith("the engine could not take this request: OverflowError")
    cfg = _cfg()
    want = dense_greedy(cfg.model, full_random_state(cfg.model, cfg.seed), KNOWN, 16)
    assert list(known.tokens) == want
    _whole_and_exact(engine)


def test_a_frame_rank_0_would_drop_is_refused_by_its_client(engine: EngineHandle) -> None:
    """Issue 35.3: rank 0's intake drops a submit whose id is past 256 characters unread, and
    its request waited for ever. The client checks each frame as the intake does."""
    with pytest.raises(RequestError, match=r"^request id must be a string of 1\.\.256 chars$"):
        engine.client.submit(KNOWN, SamplingParams(2), rid="r" * 257)
    assert engine.client.submit(KNOWN, SamplingParams(2), rid="r" * 256).result(60).finish == (
        FinishReason.LENGTH
    )
    _whole_and_exact(engine)


def test_a_submit_rank_0_never_takes_fails_once_rank_0_has_moved_on(
    engine: EngineHandle,
) -> None:
    """Issue 35.3: a submit rank 0 never acknowledges (here: a client with the wrong token,
    whose every frame the intake drops) fails once rank 0 has begun two more rounds, sync and
    async, instead of waiting for ever; the client forgets it."""
    lost = EngineClient(engine.addrs.intake, "not-the-token", vitals=engine.vitals)
    why = (r"^request (\w+): the engine never took it: rank 0 began 2 rounds after it was sent "
           r"without acknowledging it \(its frame was lost\)$")  # fmt: skip
    try:
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=why):
            lost.submit(KNOWN, SamplingParams(2), rid="sync").result()
        # Two idle rounds (a second each) and the grace period: never more than a few seconds.
        assert time.monotonic() - started < ACK_GRACE_S + 2 * IDLE_POLL_S + 5
        stream = lost.submit(KNOWN, SamplingParams(2), rid="async")
        with pytest.raises(EngineDeadError, match=why):
            asyncio.run(asyncio.wait_for(stream.result_async(), 60))
        assert not stream.acknowledged
        assert lost.submit(KNOWN, SamplingParams(2), rid="sync").rid == "sync"  # forgotten
    finally:
        lost.close()
    _whole_and_exact(engine)


def test_a_stopped_rank_is_not_alive_and_fails_the_waits_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Liveness from the ranks' pulses: a SIGSTOPped rank process is reported within
    STALL_S and fails the requests waiting on it after GIVE_UP_S (shortened here); resumed,
    it serves again."""
    monkeypatch.setattr(client_module, "GIVE_UP_S", STALL_S + 1)
    with launch(_cfg()) as handle:
        assert handle.vitals().problem() == ""
        stream = handle.client.submit(KNOWN, SamplingParams(10_000, ignore_eos=True))
        stream.next_output(timeout=60)
        os.kill(handle.pids[0], signal.SIGSTOP)
        try:
            with pytest.raises(EngineDeadError, match=r"^the engine has stopped: rank 0 has "
                               r"not run for \d+ s$"):  # fmt: skip
                stream.result(timeout=60)
            assert re.fullmatch(r"rank 0 has not run for [\d.]+ s \(stopped\?\)",
                                handle.vitals().problem())  # fmt: skip
        finally:
            os.kill(handle.pids[0], signal.SIGCONT)
        handle.client.abort(stream.rid)  # as a node does with a request it gave up on
        deadline = time.monotonic() + 30
        while handle.vitals().problem():
            assert time.monotonic() < deadline, "the resumed rank never beat again"
            time.sleep(0.1)
        _whole_and_exact(handle)
