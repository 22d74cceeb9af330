"""The engine's side of layerwise PD streaming, in one process: which rows a prefill forward
announces (``PdHooks.before_prefill``), that ``after_layer(i)`` runs exactly after layer
``i``'s KV writes, that a stream is closed even when its forward raises, that an aborted
prefill whose chunks streamed keeps its pages until released, and the counter stream over a
real :class:`~tspd_core.pd.layerwise.step_counter.StepCounter`. The real peers stream in tests/e2e
(test_pd_engine: layerwise PD == colocated, chunked, exact bytes and intervals).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tspd_core.ids import RequestId
from tspd_core.pd.layerwise.step_counter import StepCounter
from tspd_engine.frames import FinishReason, RequestMode, SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.loop.hooks import PdHooks, PrefillRow
from tspd_engine.pdlink.layerwise import CounterStream

from .conftest import TOK, small_config

PARAMS = SamplingParams(max_tokens=5)
PROMPT = TOK.encode("layer by layer, chunk by chunk")  # 31 tokens: 8 pages of 4


class _Stream:
    """Records what the model had written when each ``after_layer`` ran."""

    def __init__(self, hook: _Streaming, rows: Sequence[PrefillRow]) -> None:
        self.hook = hook
        self.rows = rows

    def after_layer(self, layer: int) -> None:
        if layer == self.hook.fail_at:
            raise RuntimeError(f"layer {layer} broke")
        self.hook.log.append(("layer", layer, *self.hook.written(self.rows, layer)))

    def close(self) -> None:
        self.hook.log.append(("close",))


class _Streaming(PdHooks):
    """A hook that follows every prefill forward and holds aborted streamed requests."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.log: list[tuple[object, ...]] = []
        self.streamed: set[str] = set()
        self.tables: list[np.ndarray] = []
        self.fail_at = -1

    def before_prefill(self, rows: Sequence[PrefillRow]) -> _Stream:
        self.log.append(("forward", [(r.rid, r.start, r.end, r.final) for r in rows]))
        self.streamed.update(r.rid for r in rows)
        self.tables += [r.pages.copy() for r in rows]
        return _Stream(self, rows)

    def on_abort(self, rid: str) -> bool:
        return rid in self.streamed

    def written(self, rows: Sequence[PrefillRow], layer: int) -> tuple[bool, bool]:
        """Whether the rows' last chunk page holds KV in ``layer`` and in the next layer."""
        arena = self.engine.core.arena
        last = [int(r.pages[(r.end - 1) // 4]) for r in rows]
        nonzero = [bool(arena.pages(i)[0][last].abs().sum() > 0) for i in (layer, layer + 1)
                   if i < self.engine.core.model_cfg.num_hidden_layers]  # fmt: skip
        return nonzero[0], nonzero[1] if len(nonzero) > 1 else False


def _engine(**changes: object) -> tuple[Engine, _Streaming]:
    engine = Engine(small_config(**changes))
    hook = _Streaming(engine)
    engine.core.add_hooks(hook)
    return engine, hook


def test_each_layer_is_announced_right_after_its_kv_writes() -> None:
    engine, hook = _engine()
    engine.add(PROMPT, PARAMS, rid="a")
    engine.step()  # the prefill round (and its first token)
    assert hook.log == [
        ("forward", [("a", 0, 31, True)]),
        ("layer", 0, True, False),  # layer 0 written, layer 1 not yet
        ("layer", 1, True, False),  # (the model has 2 layers)
        ("close",),
    ]
    (table,) = hook.tables  # the request's page table: 8 pages for 31 tokens
    assert np.array_equal(table[:8], engine.core.page_table("a")[:8])


def test_chunked_prefill_announces_each_chunk_and_the_tokens_stay_the_same() -> None:
    (want,) = Engine(small_config()).generate([PROMPT], PARAMS)
    engine, hook = _engine(max_prefill_tokens=12)
    rid = engine.add(PROMPT, PARAMS, rid="c")
    assert engine.run()[rid].tokens == want.tokens
    forwards = [entry[1] for entry in hook.log if entry[0] == "forward"]
    assert forwards == [[("c", 0, 12, False)], [("c", 12, 24, False)], [("c", 24, 31, True)]]
    layers = [entry[1] for entry in hook.log if entry[0] == "layer"]
    assert layers == [0, 1] * 3
    assert hook.log.count(("close",)) == 3  # decode forwards announce nothing


def test_a_stream_is_closed_when_its_forward_raises() -> None:
    engine, hook = _engine()
    hook.fail_at = 1
    engine.add(PROMPT, PARAMS, rid="x")
    with pytest.raises(RuntimeError, match=r"^layer 1 broke$"):
        engine.step()
    assert hook.log == [("forward", [("x", 0, 31, True)]), ("layer", 0, True, False), ("close",)]


def test_an_aborted_prefill_whose_chunks_streamed_holds_its_pages_until_released() -> None:
    engine, hook = _engine(max_prefill_tokens=8)
    core = engine.core
    rid = engine.add(PROMPT, PARAMS, rid="p", mode=RequestMode.PREFILL_ONLY)
    engine.step()  # chunk [0, 8): a transfer may now read its pages
    assert core.sched.state(RequestId(rid)).name == "PREFILL"
    (out,) = engine.abort(rid)
    assert (out.finish, out.tokens) == (FinishReason.ABORT, ())
    assert list(core.held) == [rid]  # answered, but its 8 pages stay
    assert core.sched.free_count() == core.initial_free_pages - 8
    assert not core.busy  # a held request computes nothing more
    engine.step()
    assert hook.log.count(("close",)) == 1  # no further chunk ran
    core.release_held(rid)
    assert core.sched.free_count() == core.initial_free_pages
    assert not core.has_work


def test_an_aborted_prefill_nothing_streamed_from_frees_its_pages_at_once() -> None:
    engine, _ = _engine(max_prefill_tokens=8)
    engine.add(PROMPT, PARAMS, rid="q", mode=RequestMode.PREFILL_ONLY)
    (out,) = engine.abort("q")  # still queued: no forward saw it
    assert out.finish == FinishReason.ABORT
    assert not engine.core.held
    assert engine.core.sched.free_count() == engine.core.initial_free_pages


@pytest.mark.parametrize("ran", [0, 1, 2])
def test_the_counter_stream_advances_what_the_forward_reserved(ran: int) -> None:
    counter = StepCounter("cpu", start=(1 << 62) - 1)  # across the wrap
    begin = counter.reserve(2)  # an armed forward of 2 layers
    stream = CounterStream(counter)
    for layer in range(ran):
        stream.after_layer(layer)
    assert counter.value() == (begin + ran) % (1 << 62)
    stream.close()  # the forward ended: the layers it never ran are made up for
    assert counter.value() == counter.reserved == (begin + 2) % (1 << 62)
    assert counter.reserve(2) == counter.issued  # the next forward lines up
