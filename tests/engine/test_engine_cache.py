"""Prefix cache hits, copy-on-write after a fork, and the PD hooks (in one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.ids import RequestId
from tspd_engine.frames import FinishReason, RequestMode, SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.loop.hooks import PdHooks

from .conftest import PROMPTS, TOK, small_config

PARAMS = SamplingParams(max_tokens=6)


@pytest.mark.parametrize("feed", [False, True])
def test_prefix_hit_gives_identical_tokens_and_computes_fewer(feed: bool) -> None:
    first, second = PROMPTS[1], PROMPTS[1] + TOK.encode(" again", add_bos=False)
    assert (len(first), len(second)) == (44, 50)
    # 6 tokens = prefill's + 5 decode steps; the fed loop launches no step past max_tokens.
    steps = 5
    cold = Engine(small_config(prefix_cache=False, device_feed=feed))
    (want,) = cold.generate([second], PARAMS)
    warm = Engine(small_config(device_feed=feed))
    warm.generate([first], PARAMS)
    before = warm.core.runner.forward_tokens
    (got,) = warm.generate([second], PARAMS)
    assert got.tokens == want.tokens
    assert got.cached_tokens == 44  # the 11 full prompt pages of `first`
    assert warm.core.runner.forward_tokens - before == (50 - 44) + steps
    assert cold.core.runner.forward_tokens == 50 + steps
    assert warm.core.sched.stats().prefix_hit_tokens == 44


def test_fork_copies_the_shared_page_on_write() -> None:
    prompt = PROMPTS[1][:42]  # 10 full pages + 2 tokens on the last page
    (want,) = Engine(small_config()).generate([prompt], SamplingParams(max_tokens=8))
    for feed in (False, True):
        engine = Engine(small_config(device_feed=feed, prefix_cache=False))
        rid = engine.add(prompt, SamplingParams(max_tokens=8))
        engine.step()  # prefill + the first decode step: positions 0..42 are written
        engine.core.fork(rid, "twin")  # (the fed loop commits its step in flight first)
        shared = engine.core.page_table(rid).copy()
        assert shared.tolist() == list(range(1, 12))
        assert np.array_equal(engine.core.page_table("twin"), shared)
        assert engine.core.sched.pool.refcount(11) == 2
        engine.step()  # both write position 43 into logical page 10, shared page 11
        # The parent (first in the round) writes a private copy, page 12; the twin is then
        # the page's only holder and writes it in place.
        assert engine.core.page_table(rid).tolist() == [*range(1, 11), 12]
        assert engine.core.page_table("twin").tolist() == list(range(1, 12))
        assert engine.core.sched.stats().cow_copies == 1
        out = engine.run()
        # The parent reads positions 40..42 from its copy: without the copy it would differ.
        assert out[rid].tokens == want.tokens
        assert out["twin"].tokens == want.tokens
        assert engine.core.sched.free_count() == 96


class _Recorder(PdHooks):
    def __init__(self) -> None:
        self.done: dict[str, tuple[int, np.ndarray]] = {}
        self.admitted: dict[str, object] = {}
        self.seeds: list[tuple[str, int]] = []
        self.rounds = 0

    def on_round(self, core) -> None:  # type: ignore[no-untyped-def]
        self.rounds += 1
        while self.seeds:
            core.start_remote_decode(*self.seeds.pop())

    def on_prefill_done(self, rid, first_token, pages) -> None:  # type: ignore[no-untyped-def]
        self.done[rid] = (first_token, pages.copy())

    def on_remote_admitted(self, rid, admission) -> None:  # type: ignore[no-untyped-def]
        self.admitted[rid] = admission


def _copy_kv(src: Engine, src_pages, dst: Engine, dst_pages) -> None:
    for layer in range(src.core.model_cfg.num_hidden_layers):
        for s_view, d_view in zip(
            src.core.arena.pages(layer), dst.core.arena.pages(layer), strict=False
        ):
            d_view[torch.from_numpy(dst_pages.astype(np.int64))] = s_view[
                torch.from_numpy(src_pages.astype(np.int64))
            ]


def test_pd_hooks_prefill_only_then_remote_decode_equal_colocated() -> None:
    prompt = PROMPTS[3]
    (want,) = Engine(small_config()).generate([prompt], PARAMS)
    p_engine, d_engine = Engine(small_config()), Engine(small_config())
    p_hooks, d_hooks = _Recorder(), _Recorder()
    p_engine.core.add_hooks(p_hooks)
    d_engine.core.add_hooks(d_hooks)

    rid = p_engine.add(prompt, PARAMS, rid="r1", mode=RequestMode.PREFILL_ONLY)
    p_out = p_engine.run(max_rounds=3)[rid]
    first, p_pages = p_hooks.done[rid]
    assert p_out.tokens == (first,) == want.tokens[:1]
    assert p_out.finish == FinishReason.LENGTH
    assert np.array_equal(p_engine.core.page_table(rid), p_pages)  # held until released

    d_engine.add(prompt, PARAMS, rid="r1", mode=RequestMode.REMOTE_DECODE)
    d_engine.step()
    adm = d_hooks.admitted[rid]
    assert d_engine.core.sched.state(RequestId(rid)).name == "AWAITING_KV"
    assert np.array_equal(adm.new_pages, adm.pages)  # nothing cached on D
    d_engine.core.zero_pages(adm.new_pages)
    _copy_kv(p_engine, p_pages, d_engine, adm.pages)  # what the PD transfer writes
    d_hooks.seeds.append((rid, first))
    d_out = d_engine.run()[rid]
    assert d_out.tokens == want.tokens
    assert d_out.finish == FinishReason.LENGTH

    p_engine.core.release_prefill(rid)
    sched = p_engine.core.sched
    assert sched.free_count() + sched.stats().evictable_pages == 96
    assert not p_engine.core.has_work
