"""The engine loop on the real scheduler: greedy exactness, fed == sync, stops, page release."""

from __future__ import annotations

import pytest

from tspd_engine.frames import FinishReason, SamplingParams, Submit
from tspd_engine.loop.engine import Engine
from tspd_engine.model.dense import dense_greedy
from tspd_engine.model.weights import full_random_state

from .conftest import PROMPTS, small_config


def _run(feed: bool, params: SamplingParams, prompts=PROMPTS, **cfg: object):
    engine = Engine(small_config(device_feed=feed, **cfg))
    outs = engine.generate(prompts, params)
    return engine, outs


@pytest.mark.parametrize("feed", [False, True])
def test_batched_greedy_equals_dense_reference(feed: bool) -> None:
    engine, outs = _run(feed, SamplingParams(max_tokens=12))
    state = full_random_state(engine.core.model_cfg, 0)
    want = [tuple(dense_greedy(engine.core.model_cfg, state, p, 12)) for p in PROMPTS]
    assert [o.tokens for o in outs] == want
    assert [o.finish for o in outs] == [FinishReason.LENGTH] * 4
    assert [o.prompt_tokens for o in outs] == [len(p) for p in PROMPTS]


def test_fed_loop_equals_sync_loop_with_queueing_and_chunked_prefill() -> None:
    # 10 requests through 3 slots and a 7-token prefill budget: admission waits, long
    # prompts are chunked, and the fed loop drains before every prefill.
    prompts = PROMPTS + [p[: 3 + i] for i, p in enumerate(PROMPTS)] + PROMPTS[:2]
    params = SamplingParams(max_tokens=9)
    runs = [
        _run(feed, params, prompts, max_running=3, max_prefill_tokens=7) for feed in (False, True)
    ]
    (sync_engine, sync_outs), (fed_engine, fed_outs) = runs
    state = full_random_state(sync_engine.core.model_cfg, 0)
    want = [tuple(dense_greedy(sync_engine.core.model_cfg, state, p, 9)) for p in prompts]
    assert [o.tokens for o in sync_outs] == want  # each loop against the reference, not
    assert [o.tokens for o in fed_outs] == want  # only against the other
    assert all(len(o.tokens) == 9 for o in fed_outs)
    assert fed_engine.core.runner.fed_in_flight == 0
    assert sync_engine.core.runner.fed_in_flight == 0


def _stop_token() -> tuple[int, list[int]]:
    """A token the model emits as its 4th output for PROMPTS[1], and that full output."""
    _, outs = _run(False, SamplingParams(max_tokens=8), [PROMPTS[1]])
    tokens = list(outs[0].tokens)
    return tokens[3], tokens


@pytest.mark.parametrize("feed", [False, True])
def test_eos_stops_and_every_page_comes_back(feed: bool) -> None:
    stop, full = _stop_token()
    first = full.index(stop)
    model = small_config().model.replace(eos_token_id=stop)
    engine = Engine(small_config(model=model, device_feed=feed, prefix_cache=False))
    free = engine.core.sched.free_count()
    outs = engine.generate([PROMPTS[1], PROMPTS[0]], SamplingParams(max_tokens=8))
    assert outs[0].tokens == tuple(full[: first + 1])  # EOS is part of the output
    assert outs[0].finish == FinishReason.EOS
    assert outs[1].finish == FinishReason.LENGTH
    # The fed loop launched one step past the EOS (it cannot be foreseen, unlike max_tokens,
    # which launches nothing past the end); finishing released that step's page too.
    assert engine.core.discarded_steps == (1 if feed else 0)
    assert engine.core.sched.free_count() == free == 96
    assert engine.core.sched.rounds_in_flight() == 0


def test_stop_ids_min_tokens_and_ignore_eos() -> None:
    stop, full = _stop_token()
    first = full.index(stop)
    model = small_config().model.replace(eos_token_id=stop)
    engine = Engine(small_config(model=model))
    a = engine.add(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    b = engine.add(PROMPTS[1], SamplingParams(max_tokens=8, min_tokens=first + 1))
    c = engine.add(PROMPTS[1], SamplingParams(max_tokens=8, stop_token_ids=(full[1],)))
    out = engine.run()
    assert out[a].tokens == tuple(full)
    assert out[a].finish == FinishReason.LENGTH
    # Below min_tokens EOS is masked out of the argmax, so the output diverges at `first`.
    assert out[b].tokens[:first] == tuple(full[:first])
    assert out[b].tokens[first] != stop
    assert out[c].tokens == tuple(full[:2])
    assert out[c].finish == FinishReason.EOS


def test_refusals_are_errors_and_lose_nothing() -> None:
    engine = Engine(small_config(max_model_len=32, num_pages=4))
    bad = {
        engine.add([256, 999]): "prompt token ids must lie in 0..258",
        engine.add(list(range(40))): "leaves no room below the context limit 32",
        engine.add(list(range(20))): "needs more KV pages than the cache has",
    }
    good = engine.add(PROMPTS[0][:5], SamplingParams(max_tokens=3))
    (dup,) = engine.core.submit(Submit(good, (1, 2)))
    assert dup.finish == FinishReason.ERROR
    assert dup.error == f"request id {good!r} is already in use"
    out = engine.run()
    for rid, why in bad.items():
        assert out[rid].finish == FinishReason.ERROR
        assert why in out[rid].error
    assert out[good].finish == FinishReason.LENGTH
    assert len(out[good].tokens) == 3
    assert engine.core.sched.free_count() + engine.core.sched.stats().evictable_pages == 4


def test_abort_releases_pages_mid_decode() -> None:
    engine = Engine(small_config(prefix_cache=False))
    rid = engine.add(PROMPTS[1], SamplingParams(max_tokens=50))
    for _ in range(4):
        engine.step()
    assert engine.core.sched.free_count() < 96
    outs = engine.abort(rid)
    assert [(o.rid, o.finish) for o in outs] == [(rid, FinishReason.ABORT)]
    assert engine.core.sched.free_count() == 96
    # A fed step launched before the abort is still in flight; its output is dropped.
    assert engine.core.decoder.in_flight == 1
    before = engine.core.running.get(rid)
    assert before is None  # gone from the scheduler and the engine at once
    results = engine.run()
    assert list(results) == [rid]
    assert results[rid].finish == FinishReason.ABORT
    assert len(results[rid].tokens) == 4  # prefill's token + 3 committed fed steps, no more
    assert engine.core.decoder.in_flight == 0
    assert not engine.core.has_work
    assert engine.core.sched.free_count() == 96


@pytest.mark.parametrize("feed", [False, True])
def test_page_pressure_preempts_and_recomputes_to_the_same_tokens(feed: bool) -> None:
    prompts = [p[:12] for p in PROMPTS[1:]] + [PROMPTS[0]]  # 3 + 3 + 3 + 3 pages
    params = SamplingParams(max_tokens=30)  # each grows to 10-11 pages; 40 fit in total
    _, want = _run(False, params, prompts)
    engine = Engine(small_config(device_feed=feed, num_pages=24, prefix_cache=False))
    got = engine.generate(prompts, params)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    assert engine.core.preemptions == 2  # the newest decoding request, twice
    assert engine.core.sched.free_count() == 24


def test_state_digest_matches_for_identical_histories_only() -> None:
    a, b = Engine(small_config()), Engine(small_config())
    for engine in (a, b):
        engine.add(PROMPTS[1], SamplingParams(max_tokens=5), rid="x")
        engine.step()
    assert a.core.state_digest() == b.core.state_digest()
    b.add(PROMPTS[0], SamplingParams(max_tokens=5), rid="y")
    b.step()
    a.add(PROMPTS[2], SamplingParams(max_tokens=5), rid="y")  # same id, other prompt
    a.step()
    assert a.core.state_digest() != b.core.state_digest()
    assert 0 <= a.core.state_digest() < 1 << 63


def test_a_request_that_outgrows_the_pool_fails_alone() -> None:
    engine = Engine(small_config(num_pages=4, prefix_cache=False))
    rid = engine.add(PROMPTS[0][:5], SamplingParams(max_tokens=40))  # 2 pages, grows to 12
    out = engine.run()[rid]
    assert out.finish == FinishReason.ERROR
    assert out.error == "KV cache full: 4 pages cannot hold this request"
    assert len(out.tokens) == 16 - 5 + 1  # positions 0..15 fit in 4 pages; one more token
    assert engine.core.sched.free_count() == 4


def test_a_hook_s_news_keeps_the_loop_awake_only_while_work_is_tracked() -> None:
    """A PD link reports news after a round with events (a follow-up may come next round):
    the loop then runs without waiting — but never while idle, when no round would clear
    the flag (that spun a prefill node's ranks at ~90 % of a core)."""
    from tspd_engine.loop.hooks import PdHooks

    class News(PdHooks):  # a double beside the real links (tests/e2e/test_pd_engine.py)
        def has_news(self) -> bool:
            return True

    engine = Engine(small_config())
    engine.core.add_hooks(News())
    assert not engine.core.has_work
    assert not engine.core.busy  # idle: the loop may wait
    engine.add(PROMPTS[0], SamplingParams(max_tokens=2))
    assert engine.core.busy


def test_a_prefill_s_first_token_is_out_before_its_hand_over_hook_runs() -> None:
    """A PD prefill hands its KV to the transfer worker in ``after_round``, once the round's
    outputs are out (its first token's way to the client first): the hooks see the prefill
    done, then the round's end, each exactly once, after the round's output was made."""
    from tspd_engine.frames import RequestMode
    from tspd_engine.loop.hooks import PdHooks

    engine = Engine(small_config())
    calls: list[tuple[str, object]] = []

    class Recorder(PdHooks):  # a double beside the real links (tests/e2e/test_pd_engine.py)
        def on_prefill_done(self, rid: str, first_token: int, pages: object) -> None:
            calls.append(("prefill_done", first_token))

        def after_round(self) -> None:
            calls.append(("after_round", dict(engine._results)))

    engine.core.add_hooks(Recorder())
    rid = engine.add(PROMPTS[0], SamplingParams(max_tokens=4), mode=RequestMode.PREFILL_ONLY)
    outs = engine.step()
    assert [(o.rid, len(o.tokens), o.finish) for o in outs] == [(rid, 1, FinishReason.LENGTH)]
    first = outs[0].tokens[0]
    assert [name for name, _ in calls] == ["prefill_done", "after_round"]
    assert calls[0][1] == first
    results = calls[1][1]
    assert isinstance(results, dict)
    assert results[rid].tokens == (first,)  # the output was out already
    engine.step()  # an idle round: the hook still hears of it, nothing else
    assert [name for name, _ in calls] == ["prefill_done", "after_round", "after_round"]
    engine.close()
