"""Every decoder that reads bytes from another process, fuzzed with Hypothesis: whatever the
bytes, each raises its documented refusal type and nothing else (no RecursionError, no
OverflowError, no AttributeError from a list where an object was expected, ...).

* the engine's front-door and round frames (``tspd_engine.frames.decode``: RequestError);
* the PD control plane's ZMQ frames and the peer<->worker pipe (``tspd_core.pd.wire``:
  FrameError), EPD's ZMQ frames (FrameError), the manifests and contracts inside them
  (``tspd_core.layout.codec``: ManifestError / ContractError);
* the bootstrap server's request bodies and route queries (RegistrationError) and the
  client's readers of its answers (ValueError);
* the apps' HTTP bodies: the JSON checks every server runs (BodyError), the node's
  ``/generate`` body (RequestError) and the OpenAI bodies (ApiError).

Each strategy mixes raw bytes with valid messages that have one part replaced, so the
decoders' deeper branches are reached, not only their first check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tspd_bootstrap.errors import RegistrationError
from tspd_bootstrap.model import ServerKind
from tspd_bootstrap.wire import (
    decode_json,
    deployment_from_json,
    parallel_info_from_json,
    parse_registration,
    parse_route_query,
    rank_address_from_json,
)
from tspd_core.epd import wire as epd_wire
from tspd_core.layout.codec import parse_contract, parse_manifest
from tspd_core.layout.errors import ContractError, ManifestError
from tspd_core.pd.errors import FrameError
from tspd_core.pd.wire import frames as pd_frames
from tspd_core.pd.wire import ipc
from tspd_engine import frames as engine_frames
from tspd_engine.node.endpoint import parse_request
from tspd_engine.node.replicas import NodeInfo, NodeRole
from tspd_engine.node.sglang import parse as sglang_parse
from tspd_engine.node.target import top_level_target
from tspd_router.config import RouterConfig
from tspd_serving.errors import RequestError
from tspd_serving.http import BodyError, check_json
from tspd_serving.openai.api import parse_chat, parse_completion
from tspd_serving.openai.errors import ApiError
from tspd_serving.openai.limits import ModelLimits, check_prompts
from tspd_serving.tokenizer import ByteTokenizer

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = b"[" * 100_000
TOK = ByteTokenizer()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=16,
)  # fmt: skip


def _frames_like(valid: Sequence[Sequence[bytes]]) -> st.SearchStrategy[list[bytes]]:
    """Random frame lists, and valid messages with one frame replaced, added or dropped."""
    junk = st.binary(max_size=40) | st.sampled_from(
        [b"", b"-1", b"0", b"None", b"18446744073709551616", b"1e400", DEEP[:4096], b"\xff"]
    )
    base = st.sampled_from([list(m) for m in valid])

    def mutate(msg: list[bytes], i: int, frame: bytes, how: int) -> list[bytes]:
        i %= len(msg) + 1
        if how == 0:
            return [*msg[:i], frame, *msg[i + 1 :]]
        if how == 1:
            return [*msg[:i], frame, *msg[i:]]
        return msg[:i] + msg[i + 1 :]

    mutated = st.builds(mutate, base, st.integers(0, 20), junk, st.integers(0, 2))
    return st.lists(junk, max_size=9) | mutated


def _only(refusal: type[BaseException] | tuple[type[BaseException], ...],
          decode: Callable[..., object], *args: object) -> None:  # fmt: skip
    try:
        decode(*args)
    except refusal:
        pass


# -- the engine's frames ------------------------------------------------------------------

_ENGINE_VALID = [
    engine_frames.encode(engine_frames.Submit("r", (1, 2), reply="tcp://127.0.0.1:1")),
    engine_frames.encode(engine_frames.Output("r", (3,), engine_frames.FinishReason.EOS)),
    engine_frames.encode(engine_frames.Round((engine_frames.Abort("r"),))),
    engine_frames.encode(engine_frames.Stats(1, {"free_pages": 3.0})),
]


@FUZZ
@given(st.binary(max_size=200) | st.sampled_from(_ENGINE_VALID) | json_values.map(
    lambda v: json.dumps(v).encode()))  # fmt: skip
@example(DEEP)
@example(b'{"op":"submit","rid":"a","prompt":[2147483648],"params":[1,0,[],false],"reply":""}')
@example(b'{"op":"output","rid":"a","tokens":[],"finish":1,"error":"","prompt_tokens":1e400,'
         b'"cached_tokens":0}')  # fmt: skip
@example(b'{"op":["x"]}')
def test_engine_frames_refuse_with_request_error_only(data: bytes) -> None:
    _only(RequestError, engine_frames.decode, data)


@FUZZ
@given(st.sampled_from(_ENGINE_VALID), st.integers(0, 200), json_values)
def test_engine_frames_with_one_field_replaced_refuse_with_request_error_only(
    valid: bytes, which: int, value: Any
) -> None:
    raw = json.loads(valid)
    key = sorted(raw)[which % len(raw)]
    raw[key] = value
    _only(RequestError, engine_frames.decode, json.dumps(raw).encode())


# -- PD and EPD ZMQ frames, the worker pipe, manifests and contracts ---------------------

_SESSION = b"127.0.0.1:7000"
_PD_VALID = [
    pd_frames.encode_registration(pd_frames.Registration(
        "127.0.0.1", 7001, "127.0.0.1:7000", 4096, b'{"plan":{}}', 2, 1)),
    pd_frames.encode_pre_allocation(pd_frames.PreAllocation(5, "127.0.0.1:7000", b"{}")),
    pd_frames.encode_status(pd_frames.StatusMessage(
        5, pd_frames.TransferPoll.SUCCESS, 0, 17, (1, 2), 3, -0.5)),
    [pd_frames.STAGE_OFFER_ORDERED_TAG, _SESSION, b"0", b"\x00" * 7 + b"\x01", b"4096", b"2"],
    [pd_frames.SCATTER_TAG, b"5", b"0", b"1", b"2", b"\x00" * 8, b"\x01" + b"\x00" * 7],
    [pd_frames.SCATTERED_TAG, _SESSION, b"0", b"1", b"2", b"1"],
]  # fmt: skip


@FUZZ
@given(_frames_like(_PD_VALID))
def test_pd_frames_refuse_with_frame_error_only(frames: list[bytes]) -> None:
    _only(FrameError, pd_frames.decode_p_inbound, frames)
    _only(FrameError, pd_frames.decode_d_inbound, frames)


_EPD_VALID = [
    [b"None", b"127.0.0.1", b"7001", _SESSION, b"\x00" * 8, b"\x00" * 8],
    [b"5", b"127.0.0.1", b"7001", _SESSION, b"\x01" + b"\x00" * 7, b"\x00" * 8, b"4", b"8",
     b"torch.bfloat16", b"0", b"1", b"0", b"4"],
    [b"5", b"5", b"0"],
]  # fmt: skip


@FUZZ
@given(_frames_like(_EPD_VALID))
def test_epd_frames_refuse_with_frame_error_only(frames: list[bytes]) -> None:
    _only(FrameError, epd_wire.decode_encode_inbound, frames)
    _only(FrameError, epd_wire.decode_status, frames)


@FUZZ
@given(st.binary(max_size=120) | json_values.map(lambda v: b"\x01" + json.dumps(v).encode()))
@example(b"\x01\x00\x00\x00\x00\x00\x00\x00" + DEEP)
def test_the_worker_pipe_refuses_with_frame_error_only(data: bytes) -> None:
    _only(FrameError, ipc.decode, data)


@FUZZ
@given(json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=80))
@example(DEEP)
@example(b'{"groups":[{"blocks":[1e400]}],"prefix_len":0,"prompt_len":1}')
def test_manifests_and_contracts_refuse_with_their_errors_only(data: bytes) -> None:
    _only(ManifestError, parse_manifest, data)
    _only(ContractError, parse_contract, data)


# -- the bootstrap server and its client --------------------------------------------------


@FUZZ
@given(json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=80))
@example(DEEP)
@example(b'{"role":"Prefill","world_size":1e400}')
def test_bootstrap_bodies_refuse_with_registration_error_only(data: bytes) -> None:
    def parse(raw: bytes) -> object:
        return parse_registration(decode_json(raw), ServerKind.KV)

    _only(RegistrationError, parse, data)


@FUZZ
@given(st.dictionaries(st.sampled_from(["engine_rank", "target_dp_group", "x"]),
                       st.lists(st.text(max_size=25), max_size=3), max_size=3))  # fmt: skip
def test_bootstrap_queries_refuse_with_registration_error_only(query: dict[str, list[str]]) -> None:
    _only(RegistrationError, parse_route_query, query)


@FUZZ
@given(json_values)
def test_bootstrap_answers_refuse_with_value_error_only(body: Any) -> None:
    for read in (parallel_info_from_json, rank_address_from_json, deployment_from_json):
        _only(ValueError, read, body)


# -- the apps' HTTP bodies ------------------------------------------------------------------

_CFG = RouterConfig(colocated=("http://127.0.0.1:1",))
_LIMITS = ModelLimits(vocab_size=259, max_model_len=4096)


@FUZZ
@given(json_values, st.booleans())
@example({"model": "tspd-tiny", "prompt": [2147483648]}, False)
@example({"model": "tspd-tiny", "prompt": [[1], [259]], "echo": True}, False)
@example({"model": "tspd-tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         True)  # fmt: skip
def test_router_bodies_refuse_with_api_error_only(body: Any, chat: bool) -> None:
    def parse(value: Any) -> None:
        check_json(value)
        api = (parse_chat if chat else parse_completion)(value, "tspd-tiny", TOK, _CFG)
        check_prompts(api.prompts, _LIMITS, api.param)

    _only((ApiError, BodyError), parse, body)


#: Valid router bodies whose every field (at any depth) the test below replaces in turn.
_ROUTER_VALID: list[tuple[bool, dict[str, Any]]] = [
    (False, {"model": "tspd-tiny", "prompt": ["hi", "ho"], "max_tokens": 3, "stream": True,
             "stream_options": {"include_usage": True}, "stop": ["x"], "echo": False}),
    (True, {"model": "tspd-tiny", "max_tokens": 3, "response_format": {"type": "text"},
            "tool_choice": "none", "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
]  # fmt: skip


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    keys = value.keys() if isinstance(value, dict) else range(len(value))
    out = []
    for key in keys:
        out.append((*prefix, key))
        if isinstance(value[key], dict | list):
            out += _paths(value[key], (*prefix, key))
    return out


def _replaced(case: tuple[bool, dict[str, Any], tuple[Any, ...]], new: Any) -> tuple[Any, bool]:
    chat, body, path = case
    body = json.loads(json.dumps(body))
    inner = body
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = new
    return body, chat


_ROUTER_CASES = [(chat, body, path) for chat, body in _ROUTER_VALID for path in _paths(body)]


@FUZZ
@given(st.builds(_replaced, st.sampled_from(_ROUTER_CASES), json_values))
@example(_replaced((True, _ROUTER_VALID[1][1], ("messages", 1, "role")), ["user"]))
@example(_replaced((True, _ROUTER_VALID[1][1], ("messages", 0, "role")), {"a": 1}))
@example(_replaced((False, _ROUTER_VALID[0][1], ("stream_options", "include_usage")), [1]))
def test_router_bodies_with_one_field_replaced_refuse_with_api_error_only(
    case: tuple[Any, bool],
) -> None:
    """Issue 35.7: ``"role": ["user"]`` was a 500 (an unhashable dict key)."""
    body, chat = case

    def parse(value: Any) -> None:
        api = (parse_chat if chat else parse_completion)(value, "tspd-tiny", TOK, _CFG, _LIMITS)
        check_prompts(api.prompts, _LIMITS, api.param)

    _only(ApiError, parse, body)


@FUZZ
@given(json_values)
@example({"input_ids": [2147483648]})
@example({"text": "x", "pd": {"room": 1, "bootstrap_host": "h", "bootstrap_port": 1e400}})
def test_node_bodies_refuse_with_request_error_only(body: Any) -> None:
    _only(RequestError, parse_request, body, TOK, 259)


_NODE = NodeInfo(vocab_size=259, max_model_len=4096)
_INFOS = (_NODE, NodeInfo(role=NodeRole.PREFILL, bootstrap="h:1"), NodeInfo(role=NodeRole.DECODE))


def _sglang_only(body: Any) -> None:
    """SGLang's /generate body on a node (tspd_engine.node.sglang) and its top-level
    bootstrap fields (tspd_engine.node.target) refuse with their errors only."""
    if isinstance(body, dict):
        _only((ApiError, RequestError), sglang_parse, body, TOK, _NODE)
        for info in _INFOS:
            _only(RequestError, top_level_target, body, info, "h")


@FUZZ
@given(json_values)
@example({"text": "x", "sampling_params": {"stop": [""]}})
@example({"input_ids": [[1]], "sampling_params": None})
def test_sglang_bodies_refuse_with_api_error_only(body: Any) -> None:
    _sglang_only(body)


_SGLANG_VALID = {
    "text": "hi", "stream": True, "rid": "r", "bootstrap_host": "h", "bootstrap_port": 1,
    "bootstrap_room": 5, "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 1,
    "stop": ["x"], "stop_token_ids": [1], "ignore_eos": False, "temperature": 0, "n": 1},
}  # fmt: skip
_SGLANG_CASES = [(False, _SGLANG_VALID, path) for path in _paths(_SGLANG_VALID)]


@FUZZ
@given(st.builds(_replaced, st.sampled_from(_SGLANG_CASES), json_values))
def test_sglang_bodies_with_one_field_replaced_refuse_with_api_error_only(
    case: tuple[Any, bool],
) -> None:
    _sglang_only(case[0])


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff and more"])
def test_lone_surrogates_are_refused_by_the_body_check(text: str) -> None:
    with pytest.raises(BodyError, match="a lone surrogate, which is not Unicode text"):
        check_json({"model": "m", "messages": [{"role": "user", "content": text}]})
