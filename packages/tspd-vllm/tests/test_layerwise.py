"""Layerwise sends (``layerwise_interval``) at the connector level: P's scheduler side turns
vLLM's steps into early rooms and forward rows, P's worker side arms them and advances the
step counter per ``save_kv_layer``, over vLLM's own KV tensors and real tspd peers (Mooncake
TCP, transfer workers, the bootstrap server). A chunked prefill streams layer by layer once D
bootstrapped the room (exact bytes, exact write jobs); a room D bootstraps after P's last
forward goes whole; a request preempted or aborted mid-prefill fails its room and leaves
nothing held. (Real vLLM processes: test_pd_vllm.py.)"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tspd_bootstrap import BootstrapServer
from tspd_core.ids import RequestId
from tspd_vllm.arena import build_arena
from tspd_vllm.jobs import EarlyRoom, EndJob, ForwardRow, JobBatch, RecvJob
from tspd_vllm.layerwise import stats_log
from tspd_vllm.params import Rendezvous
from tspd_vllm.scheduler import PrefillScheduler, Scheduled
from tspd_vllm.settings import Role, Settings
from tspd_vllm.worker import DecodeSide, PrefillSide, Rank, Results

pytestmark = [pytest.mark.vllm, pytest.mark.multiproc]

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 3, 6, 64, 32, 12
PROMPT = 2 * BLOCK + 9  #: three chunks of 32 tokens: [0, 32) [32, 64) [64, 73)
P_BLOCKS, D_BLOCKS = (3, 7, 5), (2, 10, 4)
ROOM = 5151
RID = "p-req"
KvFactory = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0) as srv:
        yield srv


class Pair:
    """A layerwise P (scheduler side + worker side) and a D worker side, TP 1 each."""

    def __init__(self, server: BootstrapServer, make: KvFactory) -> None:
        def settings(role: Role) -> Settings:
            return Settings(
                role=role,
                bootstrap_host="127.0.0.1",
                bootstrap_port=server.port,
                serve_bootstrap=False,
                host="127.0.0.1",
                layerwise_interval=1 if role == Role.PREFILL else 0,
            )

        def kv() -> dict[str, torch.Tensor]:
            return make(layers=LAYERS, kv_heads=HEADS, head_size=HEAD, block_size=BLOCK,
                        num_blocks=BLOCKS)  # fmt: skip

        self.p_kv, self.d_kv = kv(), kv()
        for layer, view in enumerate(self.p_kv.values()):  # a function of every index
            b, h, n, c = torch.meshgrid(*(torch.arange(s) for s in view.shape), indexing="ij")
            view.copy_(((layer * 7 + b * 13 + h * 31 + n * 3 + c) % 251).to(view.dtype))
        self.sched = PrefillScheduler(settings(Role.PREFILL))
        self.p = PrefillSide(settings(Role.PREFILL), build_arena(self.p_kv, total_kv_heads=HEADS),
                             Rank())  # fmt: skip
        self.d = DecodeSide(settings(Role.DECODE), build_arena(self.d_kv, total_kv_heads=HEADS),
                            Rank())  # fmt: skip
        self.meet = Rendezvous("127.0.0.1", server.port, ROOM)
        self.params = {"do_remote_decode": True, "bootstrap_room": ROOM}
        self.sent: list[set[str]] = []  # P's finished_sending, per poll
        self.got: list[Results] = []  # D's news, per poll

    def close(self) -> None:
        self.d.close()
        self.p.close()

    def jobs(self) -> int:
        return int(self.p.peer.counters()["jobs"])

    def step(
        self,
        scheduled: list[Scheduled],
        preempted: tuple[str, ...] = (),
        on_layer: Callable[[int], None] | None = None,
    ) -> None:
        """One vLLM step of P: the metadata, the forward's layers, the poll."""
        self.p.take(self.sched.take(scheduled, preempted, lambda rid: P_BLOCKS))
        if scheduled:
            for i, name in enumerate(self.p.arena.layers):
                self.p.layer_saved(name)
                if on_layer is not None:
                    on_layer(i)
            self.p.forward_done()
        self.poll()

    def poll(self) -> None:
        self.sent.append(self.p.results((), idle=True).sending)
        self.got.append(self.d.results((), idle=True))

    def receive(self) -> None:
        """D's receive: it looks P up and pre-allocates the room."""
        self.d.take(JobBatch(recvs=(RecvJob("d-req", self.meet, D_BLOCKS, 0, PROMPT),)))

    def until(self, what: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, "timed out"
            self.poll()

    def d_slots(self, layer: int, slots: range) -> torch.Tensor:
        view = list(self.d_kv.values())[layer]
        return torch.cat([view[D_BLOCKS[s], :, : _tokens(s)] for s in slots], dim=1)

    def p_slots(self, layer: int, slots: range) -> torch.Tensor:
        view = list(self.p_kv.values())[layer]
        return torch.cat([view[P_BLOCKS[s], :, : _tokens(s)] for s in slots], dim=1)

    def landed(self, layer: int, slots: range) -> bool:
        return torch.equal(self.d_slots(layer, slots), self.p_slots(layer, slots))

    def streamed_layer_by_layer(self, slots: range) -> Callable[[int], None]:
        """An ``on_layer`` that waits for layer i's pages on D after layer i was saved and
        checks that layer i + 1's are not there yet: each layer is its own write."""

        def check(i: int) -> None:
            self.until(lambda: self.landed(i, slots))
            if i + 1 < LAYERS:
                assert not self.d_slots(i + 1, slots).any(), f"layer {i + 1} went early"

        return check


def _tokens(slot: int) -> int:
    return min(BLOCK, PROMPT - slot * BLOCK)


@pytest.fixture
def pair(server: BootstrapServer, make_kv_caches: KvFactory) -> Iterator[Pair]:
    pair = Pair(server, make_kv_caches)
    try:
        yield pair
    finally:
        pair.close()


def test_scheduler_side_turns_steps_into_early_rooms_and_rows() -> None:
    """The bookkeeping alone: an early room as vLLM first schedules the request (not when
    vLLM only looked at it), one row per prefill step from vLLM's computed/scheduled counts
    (a prefix hit starts the first), none after the prompt, none for other requests, and
    nothing at all with layerwise off."""
    on = PrefillScheduler(Settings(role=Role.PREFILL, bootstrap_port=9, layerwise_interval=2))
    params = {"do_remote_decode": True, "bootstrap_room": 7}
    on.scheduling("a", params, 100)
    on.scheduling("local", {}, 50)
    assert on.take([], (), None) == on.take()  # looked at, not scheduled: nothing yet
    blocks = {"a": (4, 5), "local": (9,)}
    step1 = on.take([Scheduled("a", 16, 48), Scheduled("local", 0, 50)], (), blocks.__getitem__)
    meet = Rendezvous("127.0.0.1", 9, 7, 100)
    assert step1.early == (EarlyRoom("a", meet),)
    assert step1.rows == (ForwardRow("a", (4, 5), 16, 64, False),)
    step2 = on.take([Scheduled("a", 64, 36)], (), blocks.__getitem__)
    assert step2.early == ()
    assert step2.rows == (ForwardRow("a", (4, 5), 64, 100, True),)
    assert on.take([Scheduled("a", 100, 1)], (), blocks.__getitem__).rows == ()  # decoding
    on.scheduling("a", params, 100)  # vLLM asks again: still one early room
    assert on.take([Scheduled("a", 100, 1)], (), blocks.__getitem__).early == ()
    hold, answer = on.finished("a", params, prefilled=True, block_ids=(4, 5), prompt_len=100,
                               first_token=3)  # fmt: skip
    assert (hold, answer) == (True, meet.as_params())
    assert on.holding == {"a"}
    assert [s.rid for s in on.take().sends] == ["a"]
    on.reported({"a"})
    assert not on.pending()
    assert on.early == {}

    off = PrefillScheduler(Settings(role=Role.PREFILL, bootstrap_port=9))
    off.scheduling("a", params, 100)
    batch = off.take([Scheduled("a", 0, 100)], (), blocks.__getitem__)
    assert (batch.early, batch.rows, batch.ends) == ((), (), ())


def test_scheduler_side_ends_rooms_preempted_or_aborted_mid_prefill() -> None:
    s = PrefillScheduler(Settings(role=Role.PREFILL, bootstrap_port=9, layerwise_interval=1))
    params = {"do_remote_decode": True, "bootstrap_room": 8}
    for rid in ("pre", "abt"):
        s.scheduling(rid, params | {"bootstrap_room": len(rid) + ord(rid[0])}, 64)
    s.take([Scheduled("pre", 0, 32), Scheduled("abt", 0, 32)], (), lambda rid: (1, 2))
    batch = s.take([Scheduled("abt", 32, 16)], ("pre",), lambda rid: (1, 2))
    assert batch.ends == (EndJob("pre", held=False),)
    assert [r.rid for r in batch.rows] == ["abt"]
    s.scheduling("pre", params, 64)  # vLLM schedules the preempted request again: no room
    assert s.take([Scheduled("pre", 0, 32)], (), lambda rid: (1, 2)).rows == ()
    assert s.finished("pre", params, prefilled=True, block_ids=(1,), prompt_len=64,
                      first_token=1) == (False, None)  # fmt: skip
    hold, answer = s.finished("abt", params, prefilled=False, block_ids=(1, 2), prompt_len=64,
                              first_token=None)  # fmt: skip
    assert (hold, answer) == (True, None)
    assert s.holding == {"abt"}
    assert s.take().ends == (EndJob("abt", held=True),)
    s.reported({"abt"})
    assert not s.pending()
    assert (s.early, s.preempted) == ({}, set())


def _log_lines() -> tuple[list[str], logging.Handler]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.INFO)
    stats_log.addHandler(handler)
    stats_log.setLevel(logging.INFO)
    return lines, handler


def test_chunked_prefill_streams_layer_by_layer_once_d_bootstrapped(pair: Pair) -> None:
    """Chunk 1 runs in the step that registers the room (never armable); D bootstraps; chunk
    2 is armed as [0, 64) (chunk 1's page rides along) and the final chunk as [64, 73): each
    layer's pages land on D right after its save_kv_layer, before the next layer's — so
    exactly 2 chunks × 3 layers = 6 write jobs; the first token alone ends the room."""
    lines, handler = _log_lines()
    try:
        jobs = pair.jobs()
        pair.sched.scheduling(RID, pair.params, PROMPT)
        pair.step([Scheduled(RID, 0, 32)])
        assert not pair.p.peer.armable(RequestId(RID))  # D has not come yet
        pair.receive()
        pair.until(lambda: pair.p.peer.armable(RequestId(RID)))
        assert not any(v.any() for v in pair.d_kv.values())  # nothing sent before arming
        pair.step([Scheduled(RID, 32, 32)], on_layer=pair.streamed_layer_by_layer(range(2)))
        pair.step([Scheduled(RID, 64, 9)], on_layer=pair.streamed_layer_by_layer(range(2, 3)))
        assert not any("d-req" in g.recving for g in pair.got)  # Success waits for the token
        hold, _ = pair.sched.finished(RID, pair.params, prefilled=True, block_ids=P_BLOCKS,
                                      prompt_len=PROMPT, first_token=42)  # fmt: skip
        assert hold
        pair.step([])
        pair.until(lambda: any(RID in s for s in pair.sent) and any("d-req" in g.recving
                                                                    for g in pair.got))  # fmt: skip
        assert not any(g.failed for g in pair.got)
        assert sum(RID in s for s in pair.sent) == 1
        assert pair.jobs() - jobs == 2 * LAYERS
        for layer in range(LAYERS):
            assert pair.landed(layer, range(3))
        assert pair.p.early is not None
        assert pair.p.early.rooms == {}
        assert lines == [f"TspdConnector P rank 0: room {ROOM} sent, 2 chunk(s) armed; rank "
                         f"totals: jobs={jobs + 6} bytes={lines[0].rsplit('=', 1)[1]}"]  # fmt: skip
    finally:
        stats_log.removeHandler(handler)


def test_a_room_d_bootstraps_after_the_last_forward_goes_whole(pair: Pair) -> None:
    """Every chunk ran before D came: nothing armed; the whole prompt goes in one write job
    after request_finished (today's path), byte for byte."""
    jobs = pair.jobs()
    pair.sched.scheduling(RID, pair.params, PROMPT)
    for start, n in ((0, 32), (32, 32), (64, 9)):
        pair.step([Scheduled(RID, start, n)])
    pair.sched.finished(RID, pair.params, prefilled=True, block_ids=P_BLOCKS, prompt_len=PROMPT,
                        first_token=42)  # fmt: skip
    pair.step([])
    pair.receive()
    pair.until(lambda: any(RID in s for s in pair.sent) and any("d-req" in g.recving
                                                                for g in pair.got))  # fmt: skip
    assert not any(g.failed for g in pair.got)
    assert pair.jobs() - jobs == 1
    for layer in range(LAYERS):
        assert pair.landed(layer, range(3))


@pytest.mark.parametrize("how", ["preempted", "aborted"])
def test_a_request_ended_mid_prefill_fails_its_room_and_nothing_leaks(how: str, pair: Pair) -> None:
    """Chunk 2 streamed, then vLLM preempts the request (its blocks are gone: P reports
    nothing, its later finish hands nothing over) or aborts it (P holds the blocks until the
    room's final event, reported once): D's receive fails, P tracks nothing, D's untouched
    blocks stay zero."""
    pair.sched.scheduling(RID, pair.params, PROMPT)
    pair.step([Scheduled(RID, 0, 32)])
    pair.receive()
    pair.until(lambda: pair.p.peer.armable(RequestId(RID)))
    pair.step([Scheduled(RID, 32, 32)], on_layer=pair.streamed_layer_by_layer(range(2)))
    if how == "preempted":
        pair.step([], preempted=(RID,))
    else:
        hold, answer = pair.sched.finished(RID, pair.params, prefilled=False,
                                           block_ids=P_BLOCKS, prompt_len=PROMPT,
                                           first_token=None)  # fmt: skip
        assert (hold, answer) == (True, None)
        pair.step([])
    pair.until(lambda: any("d-req" in g.recving for g in pair.got))
    assert any("d-req" in g.failed for g in pair.got)
    if how == "preempted":
        pair.until(lambda: pair.p.peer.tracked_count() == 0)
        assert not any(RID in s for s in pair.sent)  # vLLM freed the blocks itself
        assert pair.sched.finished(RID, pair.params, prefilled=True, block_ids=P_BLOCKS,
                                   prompt_len=PROMPT, first_token=1) == (False, None)  # fmt: skip
    else:
        pair.until(lambda: any(RID in s for s in pair.sent))
        assert sum(RID in s for s in pair.sent) == 1
        pair.sched.reported({RID})
    assert pair.p.early is not None
    assert pair.p.early.rooms == {}
    assert pair.p.peer.tracked_count() == 0
    assert not pair.sched.pending()
    assert pair.sched.early == {}
    untouched = [b for b in range(BLOCKS) if b not in D_BLOCKS]
    for view in pair.d_kv.values():
        assert not view[untouched].any()
