"""The router's pure parts, exactly: text assembly, stop strings, the chat template, request
parsing and refusals, node picking, and the metrics exposition."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tspd_launch.cli import PACKAGED
from tspd_launch.cli import _parser as launcher_parser
from tspd_launch.local import child_argv
from tspd_router.cli import add_router_args, router_config
from tspd_router.config import Policy, RouterConfig
from tspd_router.errors import BadRequest, Unavailable, UnknownModel
from tspd_router.metrics import RouterMetrics
from tspd_router.nodes import NodePool, Role
from tspd_serving import cliargs
from tspd_serving.openai.api import GenParams, parse_chat, parse_completion
from tspd_serving.openai.chat import render
from tspd_serving.openai.text import Detokenizer, StopMatcher
from tspd_serving.tokenizer import ByteTokenizer, ContentSpecials

TOK = ByteTokenizer()
PD = RouterConfig(prefill=("http://p:1",), decode=("http://d:2",))


def test_detokenizer_holds_a_split_character_and_drops_specials() -> None:
    snow = list("é☃".encode())  # 2 + 3 bytes
    d = Detokenizer()
    assert d.feed([256, snow[0]]) == ""
    assert d.feed(snow[1:3]) == "é"
    assert d.feed([snow[3], 257]) == ""
    assert d.feed(snow[4:]) == "☃"
    assert d.feed([0xFF]) + d.flush() == "\ufffd"


def test_stop_matcher_cuts_before_the_first_stop_across_chunks() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert [m.feed(t) for t in ["abc E", "N", "x E", "ND tail"]] == ["abc ", "", "ENx ", ""]
    assert m.stopped
    assert m.flush() == ""
    m = StopMatcher(["END"])
    assert m.feed("xxEN") == "xx"
    assert m.flush() == "EN"  # held back, but the stream ended without the stop
    assert StopMatcher([]).feed("END") == "END"


def test_chat_template_is_exact() -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": "Yes?"},
        {"role": "developer", "content": "again"},
    ]  # fmt: skip
    assert render(messages) == (
        "<|system|>Be terse.\n<|user|>Hi !\n<|assistant|>Yes?\n<|system|>again\n<|assistant|>"
    )
    with pytest.raises(BadRequest, match=r"messages\[0\].role must be one of"):
        render([{"role": "tool", "content": "x"}])
    with pytest.raises(BadRequest, match="only text parts"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(BadRequest, match="non-empty list"):
        render([])


def test_completion_requests_parse_to_exact_prompts_and_params() -> None:
    body = {"model": "m", "prompt": ["ab", "c"], "max_tokens": 5, "stop": "x", "seed": 3,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    api = parse_completion(body, "m", TOK, PD)
    assert api.prompts == ((256, 97, 98), (256, 99))
    assert api.params == GenParams(5, 0, False, ("x",))
    assert (api.stream, api.include_usage, api.chat) == (True, True, False)
    ids = parse_completion({"model": "m", "prompt": [5, 6]}, "m", TOK, PD)
    assert (ids.prompts, ids.params.max_tokens) == (((5, 6),), 16)
    chat = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "max_completion_tokens": 7, "min_tokens": 2, "ignore_eos": True}, "m", TOK, PD,
    )  # fmt: skip
    assert chat.prompts == (tuple(TOK.encode("<|user|>hi\n<|assistant|>")),)
    assert chat.params == GenParams(7, 2, True, ())
    default = parse_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "m", TOK, PD
    )
    assert default.params.max_tokens == PD.chat_max_tokens


@pytest.mark.parametrize(
    ("body", "param", "why"),
    [
        ({"prompt": "a"}, "model", "'model' is required"),
        ({"model": "m", "prompt": "a", "temperature": 0.7}, "temperature", "decodes greedily"),
        ({"model": "m", "prompt": "a", "top_p": 0.5}, "temperature", "decodes greedily"),
        ({"model": "m", "prompt": "a", "temperature": 3}, "temperature", r"in \[0, 2\]"),
        ({"model": "m", "prompt": "a", "n": 2}, "n", "'n' > 1 is not supported"),
        ({"model": "m", "prompt": "a", "n": True}, "n", "'n' must be an integer >= 1"),
        ({"model": "m", "prompt": "a", "best_of": 2}, "best_of", "'best_of' > 1 is not supp"),
        # JSON true is not the number 1 (Python's bool is an int: found by schemathesis).
        ({"model": "m", "prompt": "a", "best_of": True}, "best_of", "'best_of' must be an int"),
        ({"model": "m", "prompt": "a", "repetition_penalty": True}, "repetition_penalty", "not"),
        ({"model": "m", "prompt": "a", "presence_penalty": False}, "presence_penalty", "not"),
        ({"model": "m", "prompt": "a", "logprobs": 2}, "logprobs", "not supported"),
        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens", "integer >= 1"),
        ({"model": "m", "prompt": "a", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "exceed"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt", "'prompt' must be"),
        ({"model": "m", "prompt": []}, "prompt", "'prompt' must be"),
        ({"model": "m", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"model": "m", "prompt": "a", "stop": [""]}, "stop", "non-empty string"),
        ({"model": "m", "prompt": "a", "stream_options": {}}, "stream_options", "only allowed"),
        ({"model": "m", "prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not supp"),
        ({"model": "m", "prompt": "a", "echo": "yes"}, "echo", "true or false"),
        (
            {"model": "m", "prompt": "a", "stream": True, "stream_options": {"include_usage": [1]}},
            "include_usage",
            "'include_usage' must be true or false",
        ),
    ],
)
def test_bad_requests_are_refused_with_the_parameter_and_reason(
    body: dict[str, object], param: str, why: str
) -> None:
    with pytest.raises(BadRequest, match=why) as info:
        parse_completion(body, "m", TOK, PD)
    assert info.value.param == param
    assert info.value.status == 400
    assert info.value.body()["error"]["param"] == param


def test_sampling_can_be_accepted_as_greedy_and_unknown_models_are_404() -> None:
    lenient = RouterConfig(colocated=("http://n:1",), accept_sampling=True)
    api = parse_completion({"model": "m", "prompt": "a", "temperature": 0.9}, "m", TOK, lenient)
    assert api.params.max_tokens == 16
    with pytest.raises(UnknownModel, match=r"^the model 'gpt-4' does not exist here; the served "
                       r"model is 'm'$") as info:  # fmt: skip
        parse_completion({"model": "gpt-4", "prompt": "a"}, "m", TOK, PD)
    assert info.value.status == 404
    assert info.value.body()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("role", [["user"], {"a": 1}, 1, None, True, "tool"])
def test_a_role_of_any_other_value_or_type_is_a_400(role: object) -> None:
    """Issue 35.7: an unhashable role (a list, an object) was a 500."""
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": role}]}
    with pytest.raises(BadRequest) as info:
        parse_chat(body, "m", TOK, PD)
    assert (info.value.status, info.value.param, info.value.message) == (
        400,
        "messages",
        "messages[1].role must be one of ['assistant', 'developer', 'system', 'user'], "
        f"got {role!r}",
    )


def test_the_router_flags_reach_its_config() -> None:
    parser = argparse.ArgumentParser()
    cliargs.add_http_args(parser)
    add_router_args(parser)
    opts = parser.parse_args(["--colocated", "http://c:1"])
    cfg = router_config(opts)
    assert (cfg.chat_content_special_tokens, cfg.tokenizer_threads) == (ContentSpecials.PARSE, 2)
    argv = ["--colocated", "http://c:1", "--chat-content-special-tokens", "text",
            "--tokenizer-threads", "3"]  # fmt: skip
    cfg = router_config(parser.parse_args(argv))
    assert (cfg.chat_content_special_tokens, cfg.tokenizer_threads) == (ContentSpecials.TEXT, 3)


def test_local_passes_the_chat_content_flag_to_its_router() -> None:
    parser, _ = launcher_parser()
    ready = {"prefill": "http://127.0.0.1:1", "decode": "http://127.0.0.1:2"}
    for given, passed in (([], "parse"), (["--chat-content-special-tokens", "text"], "text")):
        argv = child_argv(parser.parse_args(["local", *given]), PACKAGED.command, "router", ready)
        at = argv.index("--chat-content-special-tokens")
        assert argv[at + 1] == passed


def test_config_refuses_mixed_or_missing_nodes() -> None:
    with pytest.raises(ValueError, match="not both"):
        RouterConfig(prefill=("http://p:1",), decode=("http://d:1",), colocated=("http://c:1",))
    with pytest.raises(ValueError, match="at least one prefill node and one decode node"):
        RouterConfig(prefill=("http://p:1",))
    with pytest.raises(ValueError, match="must look like"):
        RouterConfig(colocated=("p:1",))


def _pool(policy: Policy) -> NodePool:
    cfg = RouterConfig(decode=("http://d0:1", "http://d1:1", "http://d2:1"),
                       prefill=("http://p:1",), policy=policy)  # fmt: skip
    pool = NodePool(cfg, session=None)  # type: ignore[arg-type]  # picking needs no session
    for node in pool.all():
        node.healthy = True
    return pool


def test_round_robin_goes_in_turn_over_healthy_nodes() -> None:
    pool = _pool(Policy.ROUND_ROBIN)
    assert [pool.pick(Role.DECODE).url[7:9] for _ in range(4)] == ["d0", "d1", "d2", "d0"]
    pool.nodes[Role.DECODE][1].healthy = False
    assert [pool.pick(Role.DECODE).url[7:9] for _ in range(3)] == ["d0", "d2", "d0"]


def test_least_load_picks_the_emptiest_node_and_breaks_ties_in_turn() -> None:
    pool = _pool(Policy.LEAST_LOAD)
    d0, d1, d2 = pool.nodes[Role.DECODE]
    d0.in_flight, d1.in_flight, d2.in_flight = 3, 1, 2
    assert [pool.pick(Role.DECODE) for _ in range(2)] == [d1, d1]
    d1.in_flight = 3
    with d2.track():
        assert d2.in_flight == 3  # every node at 3 now: ties go round
        assert [pool.pick(Role.DECODE) for _ in range(3)] == [d2, d0, d1]  # picks 3, 4, 5
    assert d2.in_flight == 2


def test_no_healthy_node_is_a_503_naming_each_nodes_problem() -> None:
    pool = _pool(Policy.ROUND_ROBIN)
    pool.nodes[Role.PREFILL][0].healthy = False
    pool.nodes[Role.PREFILL][0].last_error = "connection refused"
    with pytest.raises(
        Unavailable, match=r"^no healthy prefill node \(http://p:1: connection refused\)$"
    ) as info:
        pool.pick(Role.PREFILL)
    assert (info.value.status, info.value.cause) == (503, "no_prefill_node")


def test_a_node_is_taken_out_after_the_configured_failures_and_its_waiters_told() -> None:
    async def scenario() -> None:
        pool = _pool(Policy.ROUND_ROBIN)
        node = pool.nodes[Role.PREFILL][0]
        pool._failed(node, "timeout")
        assert (node.healthy, node.down.is_set()) == (True, False)
        pool._failed(node, "timeout")
        assert (node.healthy, node.down.is_set(), node.last_error) == (False, True, "timeout")

    asyncio.run(scenario())


def test_metrics_render_exact_families() -> None:
    m = RouterMetrics()
    m.answered("completions", 200)
    m.answered("completions", 502)
    m.failed("transfer_failed")
    m.completed(5, 3, (10.0, 10.25, 10.5))  # TTFT 0.25, TPOT 0.125, E2E 0.5
    pool = _pool(Policy.ROUND_ROBIN)
    d1 = pool.nodes[Role.DECODE][1]
    for _ in range(2):
        with d1.track():
            pass
    text = m.render(pool)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert 'tspd_router_requests_total{endpoint="completions",status="502"} 1' in lines
    assert 'tspd_router_errors_total{cause="transfer_failed"} 1' in lines
    assert 'tspd_router_ttft_seconds_bucket{le="0.1"} 0' in lines
    assert 'tspd_router_ttft_seconds_bucket{le="0.25"} 1' in lines
    assert 'tspd_router_tpot_seconds_bucket{le="0.1"} 0' in lines
    assert 'tspd_router_tpot_seconds_bucket{le="0.25"} 1' in lines
    assert 'tspd_router_e2e_seconds_bucket{le="0.25"} 0' in lines
    assert 'tspd_router_e2e_seconds_bucket{le="0.5"} 1' in lines
    assert "tspd_router_tpot_seconds_sum 0.125000" in lines
    assert "tspd_router_prompt_tokens_total 5" in lines
    assert "tspd_router_completion_tokens_total 3" in lines
    assert 'tspd_router_in_flight{node="http://d1:1",role="decode"} 0' in lines
    assert 'tspd_router_node_requests_total{node="http://d1:1",role="decode"} 2' in lines
    assert 'tspd_router_node_requests_total{node="http://d0:1",role="decode"} 0' in lines
    assert 'tspd_router_node_healthy{node="http://p:1",role="prefill"} 1' in lines
