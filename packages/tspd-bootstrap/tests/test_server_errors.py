"""Every refusal over real HTTP: exact status and reason, and the registry left untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests
from bootstrap_testkit import wire_layout

from tspd_bootstrap import BootstrapClient, BootstrapServer
from tspd_bootstrap.wire import MAX_BODY_BYTES


def good(layout: str, **changes: Any) -> bytes:
    body = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "127.0.0.1",
        "rank_port": 5000,
        "engine_rank": 0,
        "cache_layout": layout,
    }
    body.update(changes)
    return json.dumps(body).encode()


def state(server: BootstrapServer) -> tuple[object, object]:
    info = requests.get(f"{server.url}/route?engine_rank=-1&target_dp_group=-1", timeout=5)
    return server.snapshot(), info.json()


CASES: list[tuple[str, str, str, Any, int, str]] = [
    # (name, method, path, body (bytes, or a callable of the layout), status, reason)
    ("post", "POST", "/route", b"", 405, "method_not_allowed"),
    ("delete-route", "DELETE", "/route", b"", 405, "method_not_allowed"),
    ("not-json", "PUT", "/route", b"not json", 400, "bad_json"),
    ("empty", "PUT", "/route", b"", 400, "bad_json"),
    ("array", "PUT", "/route", b"[1]", 400, "bad_type"),
    ("bool", "PUT", "/route", lambda lay: good(lay, engine_rank=False), 400, "bad_type"),
    ("huge", "PUT", "/route", lambda lay: good(lay, rank_port=2**70), 400, "out_of_range"),
    ("rank", "PUT", "/route", lambda lay: good(lay, engine_rank=2), 400, "out_of_range"),
    ("role", "PUT", "/route", lambda lay: good(lay, role="Decode"), 400, "bad_role"),
    ("layout", "PUT", "/route", lambda lay: good(lay, cache_layout="{}"), 400, "bad_layout"),
    (
        "conflict",
        "PUT",
        "/route",
        lambda lay: good(wire_layout(5)),
        409,
        "layout_conflict",
    ),
    ("sizes", "PUT", "/route", lambda lay: good(lay, world_size=4), 409, "deployment_conflict"),
    ("too-big", "PUT", "/route", b"[" + b" " * MAX_BODY_BYTES + b"]", 413, "too_large"),
    ("no-params", "GET", "/route", b"", 400, "missing_parameter"),
    ("one-param", "GET", "/route?engine_rank=0", b"", 400, "missing_parameter"),
    ("garbage", "GET", "/route?engine_rank=%FF%00&target_dp_group=0", b"", 400, "bad_query"),
    ("negative", "GET", "/route?engine_rank=-2&target_dp_group=-1", b"", 400, "out_of_range"),
    ("beyond", "GET", "/route?engine_rank=2&target_dp_group=0", b"", 400, "out_of_range"),
    ("no-group", "GET", "/route?engine_rank=0&target_dp_group=1", b"", 400, "out_of_range"),
    ("route", "GET", "/nowhere", b"", 404, "no_such_route"),
    ("health-put", "PUT", "/health", b"", 405, "method_not_allowed"),
    ("bad-rank-path", "DELETE", "/ranks/x1", b"", 400, "bad_query"),
    ("absent-rank", "DELETE", "/ranks/7", b"", 404, "not_registered"),
]


@pytest.mark.parametrize(
    ("method", "path", "payload", "status", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_refusals_are_exact_and_change_nothing(
    server: BootstrapServer,
    layout: str,
    method: str,
    path: str,
    payload: Any,
    status: int,
    reason: str,
) -> None:
    client = BootstrapClient(server.url)
    client.register_rank(
        engine_rank=1,
        world_size=2,
        dp_size=1,
        rank_ip="127.0.0.1",
        rank_port=5001,
        cache_layout=layout,
    )
    if path.startswith("/route?engine_rank=2") or "target_dp_group=1" in path:
        client.register_rank(
            engine_rank=0,
            world_size=2,
            dp_size=1,
            rank_ip="127.0.0.1",
            rank_port=5000,
            cache_layout=layout,
        )
    before = state(server)
    data = payload(layout) if callable(payload) else payload
    resp = requests.request(method, server.url + path, data=data, timeout=10)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"] == reason
    assert resp.json()["status"] == status
    assert resp.json()["message"]
    if status == 405:
        assert resp.headers["Allow"]
    assert state(server) == before
    metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    assert f'tspd_bootstrap_errors_total{{status="{status}",reason="{reason}"}} 1\n' in metrics


def test_lookups_before_completion_are_wires_500(server: BootstrapServer, layout: str) -> None:
    url = f"{server.url}/route?engine_rank=0&target_dp_group=0"
    empty = requests.get(url, timeout=5)
    assert (empty.status_code, empty.json()["error"]) == (500, "not_ready")
    assert empty.json()["message"] == (
        "engine_rank 0 of target_dp_group 0: no rank has registered yet; retry later"
    )
    requests.put(f"{server.url}/route", data=good(layout), timeout=5)
    partial = requests.get(url, timeout=5)
    assert partial.status_code == 500
    assert partial.json()["message"] == (
        "engine_rank 0 of target_dp_group 0: DP group 0 is incomplete (missing engine_rank 1); "
        "retry later"
    )


def test_admin_endpoints_are_off_by_default(layout: str) -> None:
    with BootstrapServer("127.0.0.1", 0) as server:
        requests.put(f"{server.url}/route", data=good(layout), timeout=5)
        for path in ("/ranks", "/ranks/0"):
            resp = requests.delete(server.url + path, timeout=5)
            assert (resp.status_code, resp.json()["error"]) == (403, "admin_disabled")
        assert len(server.snapshot().ranks) == 1


def test_a_broken_canonicalizer_is_a_400_not_a_crash(layout: str) -> None:
    def broken(text: str) -> str:
        raise KeyError("plan")

    with BootstrapServer("127.0.0.1", 0, layout_canonicalizer=broken) as server:
        resp = requests.put(f"{server.url}/route", data=good(layout), timeout=5)
        assert (resp.status_code, resp.json()["message"]) == (400, "cache_layout rejected: 'plan'")
        assert BootstrapClient(server.url).is_healthy()


def test_a_chunked_body_over_the_limit_is_413(server: BootstrapServer) -> None:
    chunks = (b" " * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 2))  # no Content-Length
    resp = requests.put(f"{server.url}/route", data=chunks, timeout=10)
    assert resp.status_code == 413
    assert resp.json() == {
        "status": 413,
        "error": "too_large",
        "message": f"PUT /route: body is over the limit of {MAX_BODY_BYTES} bytes",
    }
    assert server.snapshot().ranks == ()
