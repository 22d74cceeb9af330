"""Rank processes: TP 1 == TP 2 greedy tokens, the client front door, clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from tspd_engine.errors import EngineDeadError
from tspd_engine.frames import FinishReason, SamplingParams
from tspd_engine.model.dense import dense_greedy
from tspd_engine.model.weights import full_random_state
from tspd_engine.rank.client import EngineClient
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_engine.rank.process import batch_sched
from tspd_serving.errors import RequestError

from .conftest import PROMPTS, TOK, listening, small_config

PARAMS = SamplingParams(max_tokens=24)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _generate(handle: EngineHandle) -> list[tuple[int, ...]]:
    streams = [handle.client.submit(p, PARAMS) for p in PROMPTS]
    return [s.result(timeout=120).tokens for s in streams]


@pytest.mark.multiproc
@pytest.mark.slow
def test_tp1_and_tp2_ranks_give_the_same_greedy_tokens() -> None:
    cfg = small_config(model=small_config().model.replace(num_hidden_layers=3), seed=11)
    state = full_random_state(cfg.model, 11)
    want = [tuple(dense_greedy(cfg.model, state, p, 24)) for p in PROMPTS]
    pids = []
    for tp, feed, batch in [(1, True, True), (2, True, True), (2, False, False)]:
        with launch(cfg.replace(tp=tp, device_feed=feed, batch_sched=batch)) as handle:
            pids += handle.pids
            assert len(handle.pids) == tp
            assert _generate(handle) == want, f"tp={tp} feed={feed}"
            # Forked from a forkserver (its command line), each rank names itself.
            assert [_comm(pid) for pid in handle.pids] == [f"tspd-rank{r}" for r in range(tp)]
            # CPU ranks run under SCHED_BATCH unless told not to.
            policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
            assert [os.sched_getscheduler(pid) for pid in handle.pids] == [policy] * tp
            _assert_loopback_only(handle)
    assert all(_gone(pid) for pid in pids)  # every rank exited and was reaped


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _assert_loopback_only(handle: EngineHandle) -> None:
    """Issue 18.7: a replica's rendezvous (served by this process), its gloo pairs and its
    ZMQ sockets listen on 127.0.0.1 and nowhere else (its ranks share this host)."""
    store_port = int(handle.addrs.store.rpartition(":")[2])
    assert ("127.0.0.1", store_port) in listening(os.getpid())
    assert not {sock for sock in listening(os.getpid()) if sock[1] == store_port} - {
        ("127.0.0.1", store_port)
    }
    for pid in handle.pids:
        bound = listening(pid)
        assert bound, f"rank pid {pid} listens on nothing"  # its intake or gloo sockets
        assert {host for host, _ in bound} == {"127.0.0.1"}, (pid, bound)


@pytest.mark.multiproc
def test_client_streams_aborts_and_rejects_in_process() -> None:
    cfg = small_config()
    state = full_random_state(cfg.model, cfg.seed)
    with launch(cfg, in_process=True) as handle:
        client = handle.client
        streamed = list(client.stream(PROMPTS[0], max_tokens=10))
        assert streamed == dense_greedy(cfg.model, state, PROMPTS[0], 10)
        assert client.generate(PROMPTS[0], max_tokens=10) == streamed
        assert len(streamed) == 10
        with pytest.raises(RequestError, match=r"prompt token ids must lie in 0\.\.258"):
            client.generate([256, 4096])
        with pytest.raises(RequestError, match="prompt must hold at least one token id"):
            client.submit([])
        # Garbage on the intake socket is dropped; the engine keeps serving.
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(handle.addrs.intake)
        raw.send(b"\x00not json")
        raw.send(b'{"op":"submit","rid":7}')
        raw.send(b'{"op":"submit","rid":"x","prompt":[1],"params":[2,0,[],false],"reply":"nope"}')
        # Two clients, one request id: the second is refused, the first is not disturbed.
        other = EngineClient(handle.addrs.intake, handle.addrs.token)
        mine = client.submit(PROMPTS[2], SamplingParams(max_tokens=1000), rid="shared-id")
        mine.next_output(timeout=30)  # in flight now
        clash = other.submit(PROMPTS[0], SamplingParams(max_tokens=2), rid="shared-id")
        refused = clash.result(timeout=30)
        assert refused.finish == FinishReason.ERROR
        assert refused.error == "request id 'shared-id' is already in use"
        client.abort("shared-id")
        assert mine.result(timeout=30).finish == FinishReason.ABORT  # only ever one owner
        other.close()
        long = client.submit(PROMPTS[1], SamplingParams(max_tokens=10_000))
        first = long.next_output(timeout=30)
        client.abort(long.rid)
        final = long.result(timeout=30)
        raw.close(linger=0)
        assert final.finish == FinishReason.ABORT
        assert 1 <= len(final.tokens) < 10_000
        assert final.tokens[: len(first.tokens)] == first.tokens
        # Still serving after all that, with the reference's tokens.
        ok = TOK.encode("ok")
        assert client.generate(ok, max_tokens=3) == dense_greedy(cfg.model, state, ok, 3)
    assert not handle.alive()


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_killed_rank_fails_requests_and_leaves_no_orphans() -> None:
    handle = launch(small_config(tp=2, group_timeout_s=20))
    try:
        stream = handle.client.submit(PROMPTS[1], SamplingParams(max_tokens=1000))
        stream.next_output(timeout=60)
        os.kill(handle.pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank processes have exited"):
            stream.result(timeout=60)
        deadline = time.monotonic() + 60
        while not all(
            _gone(p) or not proc.is_alive()
            for p, proc in zip(handle.pids, handle.procs, strict=False)
        ):
            assert time.monotonic() < deadline, "rank 0 outlived its peer"
            time.sleep(0.2)
    finally:
        handle.shutdown(timeout=10)
    assert all(_gone(pid) for pid in handle.pids)


EXIT_PROBE = """
import gc
from tspd_engine.rank.process import skip_exit_collection

class Cycle:
    def __init__(self):
        self.me = self
    def __del__(self):
        print("collected", flush=True)

gc.disable()  # only the interpreter's last collection may find the cycle
Cycle()
if {skip}:
    skip_exit_collection()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("skip", [False, True])
def test_a_rank_process_exits_without_the_last_collection(skip: bool) -> None:
    # What a rank process (and the launcher) does once everything is closed: leave what is
    # left to the process's exit instead of a last collection over all of it, which took
    # seconds of a loaded machine's stop bound. The cycle stands for those objects.
    code = EXIT_PROBE.format(skip=skip)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.splitlines() == (["exiting"] if skip else ["exiting", "collected"])


def test_batch_sched_moves_the_calling_thread_and_the_threads_it_starts() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = os.sched_getscheduler(0)

    def rank() -> None:
        seen["before"] = os.sched_getscheduler(0)
        seen["moved"] = batch_sched()
        seen["after"] = os.sched_getscheduler(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=rank)
    t.start()
    t.join()
    assert seen == {
        "before": os.SCHED_OTHER,
        "moved": True,
        "after": os.SCHED_BATCH,
        "child": os.SCHED_BATCH,
    }
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread was not touched
