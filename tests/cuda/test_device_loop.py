"""The engine loop's device paths: the token feed's cells, pinned host ring and events; the
fed decode loop against the synchronous one on the same device; and layerwise intervals
released by a real forward's per-layer step-counter advances (the counter on the forward's
device, read through its shared host word by a real pacer thread, as P's worker reads it).

On CUDA the launch paths must never make the host wait for the device:
``torch.cuda.set_sync_debug_mode("error")`` turns any synchronising call inside them into an
error, so "launch N+1 before reading N" is checked, not assumed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from tspd_core.feed import (
    FeedError,
    FromFeed,
    FromHost,
    HostRing,
    TorchFeedDevice,
    encode_sources,
    row_masks,
)
from tspd_core.pd.layerwise.schedule import interval_target
from tspd_core.pd.layerwise.step_counter import CounterReader, M, Pacer, StepCounter, ready
from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.loop.hooks import PdHooks, PrefillRow
from tspd_engine.model.config import ModelConfig
from tspd_engine.pdlink.layerwise import CounterStream
from tspd_serving.tokenizer import ByteTokenizer

from .conftest import DEVICES

TOK = ByteTokenizer()
PROMPTS = [
    TOK.encode("hello world"),
    TOK.encode("the quick brown fox jumps over the lazy dog"),
    TOK.encode("a"),
    TOK.encode("paged attention on the device, one layer at a time"),
]


@contextlib.contextmanager
def never_syncs(device: torch.device) -> Iterator[None]:
    """On CUDA: any call inside that synchronises the device raises (torch's sync debug
    mode). On CPU there is nothing to wait for."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _peaks(rows: int, at: torch.Tensor, vocab: int = 16) -> torch.Tensor:
    """Logits whose row ``i`` peaks at ``at[i]`` (2.0) with a runner-up at ``at[i] + 1``."""
    logits = torch.zeros(rows, vocab, device=at.device)
    logits.scatter_(1, (at + 1)[:, None], 1.0)
    return logits.scatter_(1, at[:, None], 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_fed_steps_chain_on_the_device_and_land_in_the_pinned_ring(device: str) -> None:
    dev = TorchFeedDevice(torch.device(device), max_rows=4)
    ring = HostRing(dev, depth=2)
    assert all(s.cells.is_pinned() == dev.is_cuda for s in ring.slots)
    first = _peaks(3, torch.tensor([5, 9, 2], device=device))
    with never_syncs(dev.device):
        # Step N: argmax into the cells, async copy into slot N, event N.
        slot_n = ring.acquire(3)
        ids = dev.argmax_to_cells(first, row_masks([[], [], []]))
        dev.copy_d2h_async(ids, slot_n.cells[:3])
        dev.record(slot_n.event)
        # Step N+1, launched before N is read: its inputs come from N's cells on the
        # device (rows 2 and 0) and from the host (11); row 1's best id (12) is masked.
        inputs = dev.resolve(encode_sources([FromFeed(2), FromHost(11), FromFeed(0)], 4))
        slot_n1 = ring.acquire(3)
        ids = dev.argmax_to_cells(_peaks(3, inputs + 1), row_masks([[], [12], []]))
        dev.copy_d2h_async(ids, slot_n1.cells[:3])
        dev.record(slot_n1.event)
        with pytest.raises(FeedError, match="host ring overrun: slot 0"):
            ring.acquire(1)  # a third step in flight would overwrite N's unread ids
    assert ring.read(slot_n).tolist() == [5, 9, 2]
    assert ring.read(slot_n1).tolist() == [3, 13, 6]
    assert ring.in_flight == 0
    assert dev.query(slot_n.event)
    assert dev.query(slot_n1.event)
    ring.close()


def _config(device: str, feed: bool, layers: int = 2) -> EngineConfig:
    model = ModelConfig(num_hidden_layers=layers)
    return EngineConfig(model=model, num_pages=96, page_size=4, max_running=8, device=device,
                        device_feed=feed, prefix_cache=False)  # fmt: skip


def _generate(cfg: EngineConfig, prompts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    engine = Engine(cfg)
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        out = [o.tokens for o in engine.generate(prompts, params)]
        assert engine.core.sched.free_count() == engine.core.initial_free_pages
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_the_fed_loop_gives_the_sync_loops_tokens_on_the_device(device: str) -> None:
    fed = _generate(_config(device, feed=True), PROMPTS)
    sync = _generate(_config(device, feed=False), PROMPTS)
    assert fed == sync
    assert [len(t) for t in fed] == [12] * len(PROMPTS)


@pytest.mark.parametrize("device", DEVICES)
def test_fed_decode_rounds_wait_only_on_the_event_of_the_step_they_read(device: str) -> None:
    engine = Engine(_config(device, feed=True))
    try:
        for i, p in enumerate(PROMPTS):
            engine.add(p, SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True), rid=f"r{i}")
        engine.step()  # the prefill round: its first tokens are a synchronous readback
        # Every later round launches step N+1, then reads step N through N's event (not a
        # device sync), and finishes requests on length with a step still in flight.
        with never_syncs(torch.device(device)):
            out = engine.run()
        assert {rid: len(o.tokens) for rid, o in out.items()} == {"r0": 6, "r1": 8, "r2": 10,
                                                                   "r3": 12}  # fmt: skip
        assert engine.core.sched.free_count() == engine.core.initial_free_pages
    finally:
        engine.close()


@pytest.mark.parametrize("device", DEVICES[1:])
def test_the_cuda_counter_is_page_locked_and_advances_without_a_sync(device: str) -> None:
    counter = StepCounter(device, start=M - 1)
    assert counter.host.is_pinned()  # cudaHostRegister'ed: the mirror copy is a DMA
    counter.reserve(3)
    with never_syncs(counter.device):
        counter.advance()
        counter.advance(2)
    torch.cuda.synchronize()
    assert counter.value() == 2
    counter.close()
    assert not counter.host.is_pinned()


class _Armed(PdHooks):
    """Arms every prefill forward as P's outbox does: reserve the forward's steps, register
    each interval's target with the pacer (P's worker does that on ArmChunk), then advance
    the counter after each layer's KV writes (the engine's CounterStream)."""

    def __init__(self, counter: StepCounter, layers: int, width: int) -> None:
        self.counter, self.layers, self.width = counter, layers, width
        self.reader = CounterReader(counter.host)  # what P's worker maps
        self.pacer = Pacer(self.reader, name="test-pacer")
        self.fired: list[tuple[int, int, int]] = []  # (forward, interval end, value seen)
        self.all_fired = threading.Event()  # set while every interval armed so far has fired
        self.expected = 0
        self.forwards = 0
        self._lock = threading.Lock()  # fired/expected: the pacer thread and the engine's

    def before_prefill(self, rows: Sequence[PrefillRow]) -> CounterStream:
        begin = self.counter.reserve(self.layers)
        n = self.forwards
        self.forwards += 1
        ends = [min(b + self.width, self.layers) for b in range(0, self.layers, self.width)]
        with self._lock:
            self.expected += len(ends)
            self.all_fired.clear()
        for e in ends:
            self.pacer.wait((n, e), interval_target(begin, e), self._fire(n, e))
        return CounterStream(self.counter)

    def _fire(self, n: int, e: int) -> object:
        def fire() -> None:
            with self._lock:
                self.fired.append((n, e, self.reader.value()))
                if len(self.fired) == self.expected:
                    self.all_fired.set()

        return fire


@pytest.mark.parametrize("device", DEVICES)
def test_a_real_forward_releases_each_interval_once_its_layers_ran(device: str) -> None:
    layers, width = 4, 2
    counter = StepCounter(device, start=M - 3)  # the first forward's steps cross the wrap
    engine = Engine(_config(device, feed=True, layers=layers).replace(max_prefill_tokens=16))
    hook = _Armed(counter, layers, width)
    engine.core.add_hooks(hook)
    try:
        engine.add(PROMPTS[3], SamplingParams(max_tokens=2))  # 52 tokens: 4 chunks of 16
        engine.step()  # the first chunk's forward only
        assert hook.all_fired.wait(30), f"intervals fired: {hook.fired}"
        assert [(n, e) for n, e, _ in hook.fired] == [(0, 2), (0, 4)]
        begin = M - 3
        for _, e, seen in hook.fired:
            assert ready(seen, interval_target(begin, e))  # fired after its last layer ran
        engine.run()
        assert hook.all_fired.wait(30), f"intervals fired: {hook.fired}"
        assert [(n, e) for n, e, _ in hook.fired] == [(n, e) for n in range(4) for e in (2, 4)]
        assert counter.value() == (begin + 4 * layers) % M == counter.reserved
        assert hook.pacer.waiting() == 0
    finally:
        hook.pacer.close()
        engine.close()
        counter.close()
