"""The peers' client: retries with backoff and jitter, timeouts, and errors that say what failed.

Most tests talk to the real server; a few use a stdlib HTTP server scripted to misbehave (a
foreign or broken bootstrap server), beside the real thing.
"""

from __future__ import annotations

import random
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tspd_bootstrap import (
    HEALTH_TIMEOUT,
    BootstrapClient,
    BootstrapConflict,
    BootstrapError,
    BootstrapNotFound,
    BootstrapProtocolError,
    BootstrapRejected,
    BootstrapServer,
    BootstrapUnavailable,
    RankAddress,
)
from tspd_bootstrap.client import normalize_url


@contextmanager
def refused_port() -> Iterator[int]:
    """A port held for the block where connecting is refused: bound, never listening. Bound
    with SO_REUSEADDR, so a server (which binds with it too) may still take the port."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def _ends(text: str) -> str:
    """A ``match`` pattern for an error message ending in exactly ``text``."""
    return f"{re.escape(text)}$"


class Scripted(ThreadingHTTPServer):
    """Answers every request with the (status, body) scripted for its path; counts requests."""

    def __init__(self, script: dict[str, tuple[int, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script = script
        self.seen: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: Scripted

    def do_GET(self) -> None:
        self.server.seen.append(f"{self.command} {self.path}")
        status, body = self.server.script.get(self.path.split("?")[0], (404, b"no"))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_PUT = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    server = Scripted({})
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_register_retries_until_a_late_server_binds(layout: str) -> None:
    refused, served = threading.Event(), threading.Event()
    naps: list[float] = []
    errors: list[BaseException] = []

    def nap(seconds: float) -> None:  # the client's backoff: held until the server serves
        naps.append(seconds)
        refused.set()
        assert served.wait(30), "the server never started"

    with refused_port() as port:
        client = BootstrapClient(f"127.0.0.1:{port}", retries=3, backoff=0.05, sleep=nap)

        def register() -> None:
            try:
                client.register_rank(
                    engine_rank=0,
                    world_size=1,
                    dp_size=1,
                    rank_ip="h",
                    rank_port=9,
                    cache_layout=layout,
                )
            except BaseException as exc:  # asserted below
                errors.append(exc)

        thread = threading.Thread(target=register)
        thread.start()
        assert refused.wait(30)  # the first attempt met the closed port
        with BootstrapServer("127.0.0.1", port) as server:
            served.set()
            thread.join(30)
            assert not thread.is_alive()
            assert errors == []
            assert client.rank_address(0, 0) == RankAddress("h", 9)
            assert server.snapshot().ranks[0].registrations == 1
    assert len(naps) == 1  # one refused attempt, then the one that registered


def test_unreachable_server_backs_off_with_jitter_then_names_what_failed() -> None:
    slept: list[float] = []
    with refused_port() as port:
        client = BootstrapClient(
            f"http://127.0.0.1:{port}/",
            retries=4,
            backoff=0.1,
            max_backoff=0.3,
            rng=random.Random(7),
            sleep=slept.append,
        )
        with pytest.raises(
            BootstrapUnavailable,
            match=_ends("GET /route parallel info failed: connection refused (after 5 attempts)"),
        ) as info:
            client.parallel_info()
    twin = random.Random(7)
    ceilings = [0.1, 0.2, 0.3, 0.3]  # backoff * 2**n, capped at max_backoff
    assert slept == [c / 2 + twin.uniform(0, c / 2) for c in ceilings]
    assert str(info.value) == (
        f"bootstrap server http://127.0.0.1:{port}: GET /route parallel info failed: "
        "connection refused (after 5 attempts)"
    )
    assert isinstance(info.value, ConnectionError)
    assert (info.value.status, info.value.code) == (None, None)


def test_a_silent_server_times_out() -> None:
    with socket.socket() as silent:  # the kernel completes the handshake; nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        client = BootstrapClient(f"127.0.0.1:{port}", timeout=0.2, retries=1, sleep=lambda _s: None)
        with pytest.raises(
            BootstrapUnavailable, match=_ends("read timed out after 0.2 s (after 2 attempts)")
        ) as info:
            client.rank_address(0, 0)
    assert info.value.reason == "read timed out after 0.2 s (after 2 attempts)"
    assert not client.is_healthy(timeout=0.1)


@contextmanager
def silent_port() -> Iterator[int]:
    """A port where connecting succeeds (the kernel completes the handshake) and nobody answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        yield silent.getsockname()[1]


@contextmanager
def full_backlog_port() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops further SYNs, so a connect times out
    (instead of being refused)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        fillers = [socket.socket() for _ in range(4)]
        try:
            for sock in fillers:
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
            yield port
        finally:
            for sock in fillers:
                sock.close()


def test_health_takes_a_connect_and_a_read_timeout() -> None:
    # The client's own timeout (30 s) applies to neither: health names its own bounds.
    with silent_port() as port:
        client = BootstrapClient(f"127.0.0.1:{port}", timeout=30.0, retries=3)
        with pytest.raises(
            BootstrapUnavailable, match=_ends("read timed out after 0.2 s (after 1 attempt)")
        ) as info:
            client.health((30.0, 0.2))
        assert info.value.reason == "read timed out after 0.2 s (after 1 attempt)"
    with full_backlog_port() as port:
        client = BootstrapClient(f"127.0.0.1:{port}", timeout=30.0, retries=3)
        with pytest.raises(
            BootstrapUnavailable, match=_ends("connect timed out after 0.2 s (after 1 attempt)")
        ) as info:
            client.health((0.2, 30.0))
        assert info.value.reason == "connect timed out after 0.2 s (after 1 attempt)"
        assert not client.is_healthy((0.1, 30.0))


def test_health_defaults_to_the_wire_heartbeat_bounds() -> None:
    assert HEALTH_TIMEOUT == (2.0, 3.0)  # wire.md §3: 2 s connect, 3 s read
    with silent_port() as port:
        client = BootstrapClient(f"127.0.0.1:{port}", timeout=0.2, retries=0)
        with pytest.raises(
            BootstrapUnavailable, match=_ends("read timed out after 3 s (after 1 attempt)")
        ) as info:
            client.health()
        assert info.value.reason == "read timed out after 3 s (after 1 attempt)"
        with pytest.raises(
            BootstrapUnavailable, match=_ends("read timed out after 0.2 s (after 1 attempt)")
        ) as info:
            client.parallel_info()  # the other calls keep the client's timeout
        assert info.value.reason == "read timed out after 0.2 s (after 1 attempt)"
    with full_backlog_port() as port:
        client = BootstrapClient(f"127.0.0.1:{port}", retries=0)
        with pytest.raises(
            BootstrapUnavailable, match=_ends("connect timed out after 2 s (after 1 attempt)")
        ) as info:
            client.health()
        assert info.value.reason == "connect timed out after 2 s (after 1 attempt)"


@pytest.mark.parametrize("timeout", [0, -1.0, (1.0, 0), (0, 1.0), (1.0,), (1.0, 2.0, 3.0), True])
def test_bad_health_timeouts_are_refused(server: BootstrapServer, timeout: object) -> None:
    client = BootstrapClient(server.url)
    want = r"timeout must be seconds > 0 or a \(connect, read\) pair of them"
    with pytest.raises(ValueError, match=want):
        client.health(timeout)  # type: ignore[arg-type]
    client.health((0.5, 0.5))  # a good pair reaches the real server


def test_answers_are_never_retried(scripted: Scripted) -> None:
    scripted.script["/route"] = (400, b"Missing inputs for bootstrap server.")
    client = BootstrapClient(f"127.0.0.1:{scripted.server_port}", retries=3)
    with pytest.raises(
        BootstrapRejected, match=_ends("failed: 400: Missing inputs for bootstrap server.")
    ) as info:
        client.rank_address(1, 0)
    assert scripted.seen == ["GET /route?engine_rank=1&target_dp_group=0"]
    assert info.value.reason == "Missing inputs for bootstrap server."
    assert str(info.value).endswith("failed: 400: Missing inputs for bootstrap server.")


def test_proxy_errors_are_retried(scripted: Scripted) -> None:
    scripted.script["/route"] = (503, b"")
    client = BootstrapClient(f"127.0.0.1:{scripted.server_port}", retries=2, sleep=lambda _s: None)
    with pytest.raises(
        BootstrapUnavailable, match=r"503 Service Unavailable from a proxy \(after 3"
    ):
        client.parallel_info()
    assert len(scripted.seen) == 3


def test_a_tokenspeed_server_500_is_not_found(scripted: Scripted) -> None:
    scripted.script["/route"] = (500, b"500 Internal Server Error\n\nServer got itself in trouble")
    client = BootstrapClient(f"127.0.0.1:{scripted.server_port}")
    with pytest.raises(
        BootstrapNotFound,
        match=re.escape("target_dp_group=1 failed: 500: 500 Internal Server Error"),
    ) as info:
        client.rank_address(3, 1)
    assert isinstance(info.value, LookupError)
    assert info.value.status == 500
    assert info.value.reason.startswith("500 Internal Server Error")


@pytest.mark.parametrize(
    ("path", "body", "call", "reason"),
    [
        ("/route", b"not json", "parallel_info", "unusable answer: Expecting value"),
        ("/route", b'{"rank_ip": 5, "rank_port": 1}', "rank", "unusable answer: rank_ip must be"),
        ("/ranks", b'{"ranks": 1}', "list_ranks", "unusable answer: rank listing needs"),
    ],
)
def test_unusable_answers_are_protocol_errors(
    scripted: Scripted, path: str, body: bytes, call: str, reason: str
) -> None:
    scripted.script[path] = (200, body)
    client = BootstrapClient(f"127.0.0.1:{scripted.server_port}")
    calls = {
        "parallel_info": BootstrapClient.parallel_info,
        "rank": lambda c: c.rank_address(0, 0),
        "list_ranks": BootstrapClient.list_ranks,
    }
    with pytest.raises(BootstrapProtocolError, match=re.escape(f"failed: 200: {reason}")) as info:
        calls[call](client)
    assert info.value.reason.startswith(reason)
    assert isinstance(info.value, RuntimeError)


def test_typed_errors_from_the_real_server(client: BootstrapClient, layout: str) -> None:
    client.register_rank(
        engine_rank=0, world_size=2, dp_size=1, rank_ip="h", rank_port=1, cache_layout=layout
    )
    with pytest.raises(
        BootstrapConflict,
        match=re.escape("409 deployment_conflict: engine_rank 1 registers world_size 4"),
    ) as conflict:
        client.register_rank(
            engine_rank=1, world_size=4, dp_size=1, rank_ip="h", rank_port=2, cache_layout=layout
        )
    assert isinstance(conflict.value, ValueError)
    assert str(conflict.value).startswith(
        f"bootstrap server {client.base_url}: PUT /route (engine_rank 1) failed: "
        "409 deployment_conflict: engine_rank 1 registers world_size 4, dp_size 1, "
        "but engine_rank 0 registered world_size 2, dp_size 1"
    )
    with pytest.raises(
        BootstrapRejected,
        match=_ends(
            "PUT /route (engine_rank 0) failed: 400 missing_field: missing field(s): cache_layout"
        ),
    ) as rejected:
        client.register_rank(engine_rank=0, world_size=2, dp_size=1, rank_ip="h", rank_port=1)
    assert (rejected.value.status, rejected.value.code) == (400, "missing_field")
    with pytest.raises(
        BootstrapNotFound,
        match=re.escape(
            "failed: 500 not_ready: engine_rank 0 of target_dp_group 0: DP group 0 is "
            "incomplete (missing engine_rank 1)"
        ),
    ) as missing:
        client.rank_address(0, 0)
    assert missing.value.code == "not_ready"
    for err in (conflict.value, rejected.value, missing.value):
        assert isinstance(err, BootstrapError)


def test_one_client_many_threads(client: BootstrapClient, layout: str) -> None:
    client.register_rank(
        engine_rank=0, world_size=1, dp_size=1, rank_ip="h", rank_port=1, cache_layout=layout
    )
    answers: list[RankAddress] = []
    threads = [
        threading.Thread(target=lambda: answers.extend(client.rank_address(0, 0) for _ in range(5)))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert answers == [RankAddress("h", 1)] * 40
    client.close()
    assert client.rank_address(0, 0) == RankAddress("h", 1)  # usable after close


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        ("127.0.0.1:8998", "http://127.0.0.1:8998"),
        ("http://node-3:8998/", "http://node-3:8998"),
        ("https://[::1]:8998", "https://[::1]:8998"),
        (" host ", "http://host"),
    ],
)
def test_normalize_url(given: str, normal: str) -> None:
    assert normalize_url(given) == normal


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("ftp://h:1", "is not http://host:port"),
        ("http://", "is not http://host:port"),
        ("h:1/route", "must not carry a path or query"),
        ("h:99999", "Port out of range"),
        ("h:1", None),
    ],
)
def test_bad_urls_and_arguments(given: str, message: str | None) -> None:
    if message is None:
        with pytest.raises(ValueError, match="timeout must be > 0"):
            BootstrapClient(given, timeout=0)
        return
    with pytest.raises(ValueError, match=message):
        normalize_url(given)
