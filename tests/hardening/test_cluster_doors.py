"""Every door of a real cluster (``launch_pd.py local``: router, prefill node at TP 2 with its
bootstrap server, decode node at TP 1), attacked as issue 18 found them open; after each
attack the cluster answers a known prompt with its exact text, both pools are whole, and no
role was restarted (none died).

* the router's bodies: an id past int32, lone surrogates, echo of ids outside the
  vocabulary, JSON nested 100,000 deep, a 4.5 MB prompt, a body over the size limit: each a
  4xx in OpenAI's error shape, never a 500;
* the nodes' ``/generate``: deep JSON, ids outside the vocabulary, a bootstrap server the node
  may not contact (a 400 naming it); the same on the routes SGLang's gateway uses (SGLang's
  ``/generate``, the OpenAI routes with top-level bootstrap fields), in OpenAI's error shape;
* slow clients: headers or bodies sent slowly are cut off at the time limits (2 s here) on
  the router, a node and the prefill node's bootstrap server;
* a client that goes away from a non-streamed request is counted (499, ``client_gone``);
* the router's OpenAPI document, fuzzed with schemathesis: no 5xx, documented statuses and
  content types, bodies that match the document, and invalid bodies refused with a 4xx.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from .cluster import MODEL, Cluster, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.usefixtures("exits")]
LIMIT_S = 2.0  # the cluster's --header-timeout and --body-timeout (conftest.FLAGS)


@pytest.fixture
def exits(cluster: Cluster) -> Iterator[None]:
    """Fails the test if any role exited while it ran (every attack must harm nothing)."""
    before = len(cluster.said("exited on its own"))
    yield
    assert cluster.said("exited on its own")[before:] == []


def _unharmed(cluster: Cluster) -> None:
    """The known prompt's exact text and both pools whole."""
    assert cluster.answers_known()
    wait_until(cluster.pools_whole, 30, "both pools whole")


def _post_raw(url: str, body: bytes, timeout: float = 60) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    return requests.post(url, data=body, headers=headers, timeout=timeout)


def _openai_error(resp: requests.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text[:300]
    assert resp.headers["Content-Type"].startswith("application/json")
    error = resp.json()["error"]
    assert sorted(error) == ["code", "message", "param", "type"]
    assert error["code"] == code, error
    return str(error["message"])


DEEP = b'{"model":"tspd-tiny","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def test_the_routers_attack_bodies_are_openai_4xx_and_harm_nothing(cluster: Cluster) -> None:
    url = cluster.urls["router"]
    completions, chat = url + "/v1/completions", url + "/v1/chat/completions"
    msg = _openai_error(_post_raw(completions, b'{"model":"tspd-tiny","prompt":[2147483648]}'),
                        400, "bad_request")  # fmt: skip
    assert msg == "token id 2147483648 in the prompt is outside the model's vocabulary 0..258"
    surrogate = b'{"model":"tspd-tiny","prompt":"\\ud800"}'
    msg = _openai_error(_post_raw(completions, surrogate), 400, "bad_request")
    assert msg == "a string holds '\\ud800', a lone surrogate, which is not Unicode text"
    chat_body = b'{"model":"tspd-tiny","messages":[{"role":"user","content":"hi \\udfff"}]}'
    _openai_error(_post_raw(chat, chat_body), 400, "bad_request")
    echo = json.dumps({"model": MODEL, "prompt": [104, 300], "echo": True}).encode()
    msg = _openai_error(_post_raw(completions, echo), 400, "bad_request")
    assert msg == "token id 300 in the prompt is outside the model's vocabulary 0..258"
    msg = _openai_error(_post_raw(completions, DEEP), 400, "bad_request")
    assert msg == "the body is nested more than 32 levels deep"
    huge = json.dumps({"model": MODEL, "prompt": "a" * 4_500_000}).encode()
    msg = _openai_error(_post_raw(completions, huge), 400, "context_length_exceeded")
    assert msg == (
        "the prompt has 4500000 bytes of text, so at least 4500001 tokens (one token stands "
        "for at most 1 byte), which leaves no room below the context limit 4096"
    )
    too_big = json.dumps({"model": MODEL, "prompt": "a" * (17 << 20)}).encode()
    _openai_error(_post_raw(completions, too_big), 413, "body_too_large")
    _unharmed(cluster)


def test_the_nodes_generate_refuses_deep_json_foreign_ids_and_bootstrap_servers(
    cluster: Cluster,
) -> None:
    prefill, decode = cluster.urls["prefill"], cluster.urls["decode"]
    resp = _post_raw(decode + "/generate", b'{"input_ids":' + b"[" * 100_000 + b"}")
    assert (resp.status_code, resp.json()) == (
        400,
        {"error": "the body is nested more than 32 levels deep"},
    )
    resp = requests.post(decode + "/generate", json={"input_ids": [2147483648]}, timeout=30)
    assert (resp.status_code, resp.json()) == (
        400,
        {"error": "prompt token ids must lie in 0..258"},
    )
    foreign = {"room": 7, "bootstrap_host": "10.1.2.3", "bootstrap_port": 80}
    body = {"input_ids": [104, 105], "pd": foreign}
    resp = requests.post(decode + "/generate", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"].startswith(
        "bootstrap server 10.1.2.3:80 is not one this node may contact (allowed: "
    )
    own = requests.get(prefill + "/info", timeout=10).json()["bootstrap"]
    host, _, port = own.rpartition(":")
    other = {"room": 7, "bootstrap_host": host, "bootstrap_port": int(port) + 1}
    resp = requests.post(prefill + "/generate", json=body | {"pd": other}, timeout=30)
    assert (resp.status_code, resp.json()["error"]) == (
        400,
        f"bootstrap server {host}:{int(port) + 1} is not one this node may contact "
        f"(allowed: {own}; a prefill node contacts only its own bootstrap server)",
    )
    _unharmed(cluster)


def test_the_nodes_sglang_and_openai_doors_refuse_the_same_attacks(cluster: Cluster) -> None:
    """The routes SGLang's gateway uses (SGLang's /generate, the OpenAI routes with top-level
    bootstrap fields) refuse what the node's own door refuses, in OpenAI's error shape."""
    prefill, decode = cluster.urls["prefill"], cluster.urls["decode"]
    deep = b'{"model":"tspd-tiny","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    msg = _openai_error(_post_raw(decode + "/v1/completions", deep), 400, "bad_request")
    assert msg == "the body is nested more than 32 levels deep"
    body = {"input_ids": [2147483648], "sampling_params": {"max_new_tokens": 2}}
    msg = _openai_error(requests.post(decode + "/generate", json=body, timeout=30), 400,
                        "bad_request")  # fmt: skip
    assert msg == "token id 2147483648 in the prompt is outside the model's vocabulary 0..258"
    foreign = {"model": "tspd-tiny", "prompt": "hi", "bootstrap_room": 7,
               "bootstrap_host": "10.1.2.3", "bootstrap_port": 80}  # fmt: skip
    resp = requests.post(decode + "/v1/completions", json=foreign, timeout=30)
    assert _openai_error(resp, 400, "refused").startswith(
        "bootstrap server 10.1.2.3:80 is not one this node may contact (allowed: "
    )
    own = requests.get(prefill + "/info", timeout=10).json()["bootstrap"]
    host, _, port = own.rpartition(":")
    other = {"text": "hi", "sampling_params": {}, "bootstrap_room": 7, "bootstrap_host": host,
             "bootstrap_port": int(port) + 1}  # fmt: skip
    resp = requests.post(prefill + "/generate", json=other, timeout=30)
    assert _openai_error(resp, 400, "refused") == (
        f"bootstrap server {host}:{int(port) + 1} is not one this node may contact "
        f"(allowed: {own}; a prefill node contacts only its own bootstrap server)"
    )
    _unharmed(cluster)


def _slow_headers(address: tuple[str, int], count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(address, timeout=30)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        socks.append(sock)
    return socks


def _closed_within(socks: list[socket.socket], bound: float) -> float:
    """Seconds until the server closed every socket (each read sees the end)."""
    start = time.monotonic()
    for sock in socks:
        sock.settimeout(max(0.1, bound - (time.monotonic() - start)))
        assert sock.recv(1024) == b"", "the server answered a request it never got"
        sock.close()
    return time.monotonic() - start


def test_slow_headers_and_bodies_are_cut_off_at_the_time_limits(cluster: Cluster) -> None:
    """Issue 18.6: 200 connections sending headers slowly were held for good."""
    prefill_info = requests.get(cluster.urls["prefill"] + "/info", timeout=10).json()
    boot_host, _, boot_port = prefill_info["bootstrap"].rpartition(":")
    targets = [cluster.urls["router"], cluster.urls["decode"], f"http://{boot_host}:{boot_port}"]
    held = []
    for url in targets:
        parts = urlsplit(url)
        held.append(_slow_headers((parts.hostname or "", parts.port or 0), 30))
    for socks in held:
        assert _closed_within(socks, LIMIT_S + 10) < LIMIT_S + 10
    router = urlsplit(cluster.urls["router"])
    sock = socket.create_connection((router.hostname or "", router.port or 0), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"model\":")  # fmt: skip
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"] == {
        "message": "the body did not arrive within 2 s",
        "type": "invalid_request_error",
        "param": None,
        "code": "body_timeout",
    }
    _unharmed(cluster)


def test_a_client_that_leaves_a_plain_request_is_counted(cluster: Cluster) -> None:
    """Issue 18.10: streamed disconnects were counted (499), plain ones were not."""
    gone = 'tspd_router_requests_total{endpoint="completions",status="499"}'
    before = cluster.router_metric(gone)
    body = {"model": MODEL, "prompt": "leave me", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(requests.Timeout):
        requests.post(cluster.urls["router"] + "/v1/completions", json=body, timeout=1.5)
    wait_until(lambda: cluster.router_metric(gone) == before + 1, 30, "the 499 counted")
    _unharmed(cluster)


# -- the OpenAPI document, fuzzed -----------------------------------------------------------

#: Valid bodies may ask for any max_tokens; the fuzz caps them so it stays bounded in time.
FUZZ_MAX_TOKENS = 3
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]  # fmt: skip


def _fuzz(cluster: Cluster, path: str, mode: GenerationMode, examples: int) -> None:
    url = cluster.urls["router"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operation = schema[path]["POST" if path.startswith("/v1/c") else "GET"]
    checks = [*CHECKS, negative_data_rejection] if mode is GenerationMode.NEGATIVE else CHECKS

    # derandomize: the same examples every run, so a CI run fails only on a regression (a
    # random seed found `"best_of": true` accepted once in a while; it is pinned in
    # tests/e2e/test_router_units.py now).
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict):
            for key in ("max_tokens", "max_completion_tokens"):
                if type(case.body.get(key)) is int and case.body[key] > FUZZ_MAX_TOKENS:
                    case.body[key] = FUZZ_MAX_TOKENS
        response = case.call(base_url=url, timeout=60)
        case.validate_response(response, checks=checks)

    run()


@pytest.mark.parametrize(
    ("path", "mode", "examples"),
    [("/v1/completions", GenerationMode.POSITIVE, 25),
     ("/v1/completions", GenerationMode.NEGATIVE, 25),
     ("/v1/chat/completions", GenerationMode.POSITIVE, 15),
     ("/v1/chat/completions", GenerationMode.NEGATIVE, 15),
     ("/v1/models/{model}", GenerationMode.POSITIVE, 10)],
)  # fmt: skip
def test_the_openapi_document_holds_under_schemathesis(
    cluster: Cluster, path: str, mode: GenerationMode, examples: int
) -> None:
    _fuzz(cluster, path, mode, examples)
    _unharmed(cluster)
