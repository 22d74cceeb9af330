"""Parsing of untrusted bodies and query strings, and of server answers (exact reasons)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tspd_bootstrap import ParallelInfo, RankAddress, Registration, RegistrationError, Role
from tspd_bootstrap.model import ServerKind
from tspd_bootstrap.wire import (
    MAX_BODY_BYTES,
    decode_json,
    error_from_json,
    parallel_info_from_json,
    parallel_info_json,
    parse_registration,
    parse_route_query,
    rank_address_from_json,
    rank_address_json,
    registration_json,
)

KV = ServerKind.KV


def body(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "role": "Prefill",
        "world_size": 4,
        "dp_size": 2,
        "rank_ip": "10.1.2.3",
        "rank_port": 17000,
        "engine_rank": 3,
        "cache_layout": "{}",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def refused(obj: object, begins: str, kind: ServerKind = KV) -> tuple[int, str, str]:
    """Parsing ``obj`` is refused with a message that begins with ``begins``: the refusal."""
    with pytest.raises(RegistrationError, match=f"^{re.escape(begins)}") as info:
        parse_registration(obj, kind)
    return info.value.status, info.value.code, info.value.message


def test_a_tokenspeed_body_parses_and_extra_keys_are_ignored() -> None:
    got = parse_registration(body(pp_size=1, pp_layer_partition=None, future={"x": 1}), KV)
    assert got == Registration(Role.PREFILL, 4, 2, "10.1.2.3", 17000, 3, "{}")
    assert (got.dp_group, got.tp_rank, got.tp_per_dp) == (1, 1, 2)


def test_roles_are_matched_case_insensitively() -> None:
    assert parse_registration(body(role="prefill"), KV).role is Role.PREFILL
    emb = ServerKind.EMBEDDING
    assert parse_registration(body(role="Prefill", cache_layout=...), emb).role is Role.PREFILL
    assert parse_registration(body(role="ENCODE", cache_layout=...), emb).role is Role.ENCODE


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ([], (400, "bad_type", "body must be a JSON object, got array")),
        ("x", (400, "bad_type", "body must be a JSON object, got string")),
        (
            body(role=..., rank_port=..., cache_layout=...),
            (400, "missing_field", "missing field(s): role, rank_port, cache_layout"),
        ),
        (
            body(world_size=True),
            (400, "bad_type", "field 'world_size' must be an integer, got boolean"),
        ),
        (
            body(world_size=4.0),
            (400, "bad_type", "field 'world_size' must be an integer, got number"),
        ),
        (
            body(rank_port="17000"),
            (400, "bad_type", "field 'rank_port' must be an integer, got string"),
        ),
        (
            body(world_size=0),
            (400, "out_of_range", "field 'world_size' is 0; it must be in 1..65536"),
        ),
        (
            body(world_size=10**30),
            (400, "out_of_range", f"field 'world_size' is {10**30}; it must be in 1..65536"),
        ),
        (body(dp_size=5), (400, "out_of_range", "field 'dp_size' is 5; it must be in 1..4")),
        (body(dp_size=3), (400, "out_of_range", "world_size 4 is not a multiple of dp_size 3")),
        (
            body(engine_rank=4),
            (400, "out_of_range", "field 'engine_rank' is 4; it must be in 0..3"),
        ),
        (
            body(engine_rank=-1),
            (400, "out_of_range", "field 'engine_rank' is -1; it must be in 0..3"),
        ),
        (
            body(rank_port=0),
            (400, "out_of_range", "field 'rank_port' is 0; it must be in 1..65535"),
        ),
        (
            body(rank_port=65536),
            (400, "out_of_range", "field 'rank_port' is 65536; it must be in 1..65535"),
        ),
        (body(rank_ip=None), (400, "bad_type", "field 'rank_ip' must be a string, got null")),
        (
            body(cache_layout=7),
            (400, "bad_type", "field 'cache_layout' must be a string, got integer"),
        ),
        (body(role=["Prefill"]), (400, "bad_type", "field 'role' must be a string, got array")),
    ],
)
def test_bad_bodies_are_refused_with_the_reason(
    obj: object, expected: tuple[int, str, str]
) -> None:
    assert refused(obj, expected[2]) == expected


@pytest.mark.parametrize("ip", ["", "a b", "10.0.0.1/24", "h\n", "x" * 256, "ho$t"])
def test_rank_ip_must_be_a_host(ip: str) -> None:
    status, code, message = refused(body(rank_ip=ip), f"rank_ip {ip!r}"[:20])
    assert (status, code) == (400, "bad_field")
    assert message.startswith(f"rank_ip {ip!r}"[:20])


@pytest.mark.parametrize("ip", ["10.0.0.1", "fe80::1%eth0", "node-7.cluster.local", "[::1]", "::"])
def test_rank_ip_accepts_hosts_and_addresses(ip: str) -> None:
    assert parse_registration(body(rank_ip=ip), KV).rank_ip == ip


def test_roles_outside_the_server_kind_are_refused() -> None:
    assert refused(body(role="Decode"), "role 'Decode' is not accepted") == (
        400,
        "bad_role",
        "role 'Decode' is not accepted (only data-source ranks register here); use 'Prefill'",
    )
    assert refused(body(role="Encode"), "role 'Encode' is not accepted")[2] == (
        "role 'Encode' is not accepted (encode ranks register on an embedding bootstrap server, "
        "not on a KV one); use 'Prefill'"
    )
    emb = refused(
        body(role="Decode", cache_layout=...), "role 'Decode' is not accepted", ServerKind.EMBEDDING
    )
    assert emb[2].endswith("use 'Prefill' or 'Encode'")


def test_embedding_server_refuses_a_layout_and_kv_server_a_huge_one() -> None:
    status, code, _ = refused(
        body(),
        "this is an embedding bootstrap server: it takes no cache_layout (a prefill rank of a PD "
        "deployment registers on its own KV server)",
        ServerKind.EMBEDDING,
    )
    assert (status, code) == (400, "bad_field")
    # null is how an omitted key looks to some clients: accepted on an embedding server
    emb = parse_registration(body(cache_layout=None), ServerKind.EMBEDDING)
    assert emb.cache_layout is None
    assert refused(body(cache_layout="x" * 262_145), "cache_layout is 262145 bytes") == (
        400,
        "too_large",
        "cache_layout is 262145 bytes; the limit is 262144",
    )


def test_decode_json_is_strict_and_bounded() -> None:
    assert decode_json(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for raw, start in [
        (b"{", "body is not valid JSON: "),
        (b"\xff\xfe", "body is not UTF-8: invalid start byte at byte 0"),
        (b'{"a": NaN}', "body is not valid JSON: NaN is not JSON"),
        (b"[" * 200_000, "body nests too deeply"),
        (b"1" * 5000, "body is not valid JSON: Exceeds the limit"),
    ]:
        with pytest.raises(RegistrationError, match=f"^{re.escape(start)}") as info:
            decode_json(raw)
        assert (info.value.status, info.value.code) == (400, "bad_json")
        assert info.value.message.startswith(start), info.value.message
    too_big = f"body is {MAX_BODY_BYTES + 1} bytes; the limit is {MAX_BODY_BYTES}"
    with pytest.raises(RegistrationError, match=f"^{re.escape(too_big)}$") as big:
        decode_json(b" " * (MAX_BODY_BYTES + 1))
    assert (big.value.status, big.value.code) == (413, "too_large")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"engine_rank": ["-1"], "target_dp_group": ["-1"]}, (-1, -1)),
        ({"engine_rank": ["7"], "target_dp_group": ["0"], "x": ["y"]}, (7, 0)),
        ({"engine_rank": ["007"], "target_dp_group": ["1"]}, (7, 1)),
    ],
)
def test_route_query_parses(query: dict[str, list[str]], expected: tuple[int, int]) -> None:
    assert parse_route_query(query) == expected


@pytest.mark.parametrize(
    ("query", "code", "message"),
    [
        ({}, "missing_parameter", "missing query parameter 'engine_rank'"),
        ({"engine_rank": ["1"]}, "missing_parameter", "missing query parameter 'target_dp_group'"),
        ({"engine_rank": [""], "target_dp_group": ["1"]}, "missing_parameter", "missing query"),
        ({"engine_rank": ["1", "2"], "target_dp_group": ["0"]}, "bad_query", "given 2 times"),
        ({"engine_rank": ["1.0"], "target_dp_group": ["0"]}, "bad_query", "got '1.0'"),
        ({"engine_rank": [" 1"], "target_dp_group": ["0"]}, "bad_query", "got ' 1'"),
        ({"engine_rank": ["+1"], "target_dp_group": ["0"]}, "bad_query", "got '+1'"),
        ({"engine_rank": ["١"], "target_dp_group": ["0"]}, "bad_query", "decimal integer"),
        ({"engine_rank": ["9" * 13], "target_dp_group": ["0"]}, "bad_query", "decimal integer"),
    ],
)
def test_route_query_refusals(query: dict[str, list[str]], code: str, message: str) -> None:
    with pytest.raises(RegistrationError, match=re.escape(message)) as info:
        parse_route_query(query)
    assert (info.value.status, info.value.code) == (400, code)
    assert message in info.value.message


def test_parallel_info_round_trips_and_nulls_mean_none() -> None:
    info = ParallelInfo(8, 2, "{}")
    assert parallel_info_json(info, KV) == {
        "prefill_tp_size": 8,
        "prefill_dp_size": 2,
        "cache_layout": "{}",
    }
    assert parallel_info_json(None, ServerKind.EMBEDDING) == {
        "prefill_tp_size": None,
        "prefill_dp_size": None,
    }
    assert parallel_info_from_json(parallel_info_json(info, KV)) == info
    assert parallel_info_from_json(parallel_info_json(None, KV)) is None
    newer = {"prefill_tp_size": 2, "prefill_dp_size": 1, "prefill_pp_size": 1}
    assert parallel_info_from_json(newer) == ParallelInfo(2, 1, None)
    for bad, message in [
        ([], "parallel info must be a JSON object, got array"),
        ({"prefill_tp_size": 3, "prefill_dp_size": 2}, "prefill_tp_size 3 is not a multiple"),
        ({"prefill_tp_size": "2"}, "prefill_tp_size must be an integer, got string"),
        ({"prefill_tp_size": 2, "prefill_dp_size": 1, "cache_layout": 5}, "cache_layout must"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            parallel_info_from_json(bad)


def test_rank_address_answers_are_checked() -> None:
    assert rank_address_from_json({"rank_ip": "h", "rank_port": 5}) == RankAddress("h", 5)
    assert RankAddress("fe80::1", 5).endpoint == "tcp://[fe80::1]:5"
    for bad, message in [
        ({"rank_ip": "", "rank_port": 5}, "rank_ip must be a non-empty string, got string"),
        ({"rank_ip": "h", "rank_port": 70000}, "rank_port 70000 is not a TCP port"),
        ({"rank_ip": "h", "rank_port": True}, "rank_port must be an integer, got boolean"),
        (None, "rank address must be a JSON object, got null"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            rank_address_from_json(bad)


def test_error_bodies_from_both_servers() -> None:
    ours = json.dumps({"status": 409, "error": "layout_conflict", "message": "differs"})
    assert error_from_json(ours) == ("layout_conflict", "differs")
    assert error_from_json("Bootstrap info not Found") == (None, "Bootstrap info not Found")
    assert error_from_json("") == (None, "(empty body)")


def test_registration_json_matches_the_tokenspeed_body() -> None:
    reg = Registration(Role.PREFILL, 4, 2, "10.1.2.3", 17000, 3, "{}")
    assert registration_json(reg) == body()
    assert list(registration_json(reg)) == list(body())
    assert "cache_layout" not in registration_json(Registration(Role.ENCODE, 1, 1, "h", 1, 0))


def test_tspd_extensions_are_optional_and_checked() -> None:
    got = parse_registration(body(tspd_extensions=["tspd.stage/2", "tspd.stage/2", "a-b_c"]), KV)
    assert got.extensions == ("a-b_c", "tspd.stage/2")  # sorted, deduplicated
    assert parse_registration(body(), KV).extensions == ()
    for bad, message in [
        ("tspd.stage/2", "field 'tspd_extensions' must be an array, got string"),
        (["ok", 7], "field 'tspd_extensions' holds 7; names are 1..64 of a-z 0-9"),
        (["Stage"], "field 'tspd_extensions' holds 'Stage'; names are"),
        ([f"x{i}" for i in range(17)], "field 'tspd_extensions' lists 17 names; at most 16"),
    ]:
        status, code, _ = refused(body(tspd_extensions=bad), message)
        assert (status, code) == (400, "bad_field")


def test_tspd_extensions_travel_only_when_announced() -> None:
    plain = Registration(Role.PREFILL, 4, 2, "10.1.2.3", 17000, 3, "{}")
    staged = Registration(Role.PREFILL, 4, 2, "10.1.2.3", 17000, 3, "{}", ("tspd.stage/2",))
    assert registration_json(plain) == body()  # TokenSpeed's body, byte for byte
    assert registration_json(staged) == body(tspd_extensions=["tspd.stage/2"])
    assert rank_address_json(RankAddress("h", 5)) == {"rank_ip": "h", "rank_port": 5}
    assert rank_address_json(RankAddress("h", 5, ("tspd.stage/2",))) == {
        "rank_ip": "h",
        "rank_port": 5,
        "tspd_extensions": ["tspd.stage/2"],
    }
    answer = {"rank_ip": "h", "rank_port": 5, "tspd_extensions": ["tspd.stage/2"]}
    assert rank_address_from_json(answer) == RankAddress("h", 5, ("tspd.stage/2",))
    with pytest.raises(ValueError, match=r"^field 'tspd_extensions' must be an array, got null$"):
        rank_address_from_json({"rank_ip": "h", "rank_port": 5, "tspd_extensions": None})
