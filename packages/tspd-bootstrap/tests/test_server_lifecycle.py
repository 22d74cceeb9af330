"""Embedded lifecycle: bind errors, port 0, idempotent and bounded close, no restart."""

from __future__ import annotations

import errno
import re
import socket
import threading

import pytest
import requests

from tspd_bootstrap import (
    BindError,
    BootstrapClient,
    BootstrapServer,
    BootstrapUnavailable,
    ShutdownError,
)


def test_port_zero_is_resolved_and_served() -> None:
    server = BootstrapServer("127.0.0.1", 0)
    assert (server.port, server.running) == (0, False)
    server.start()
    try:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.running
        assert server.start() is server  # already serving: no-op
        assert BootstrapClient(server.url).is_healthy()
    finally:
        server.close()
    assert not server.running


def test_bind_failure_on_a_taken_port_is_clear() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = BootstrapServer("127.0.0.1", port)
        with pytest.raises(
            BindError, match=f"^{re.escape(f'address already in use: 127.0.0.1:{port}')}$"
        ) as info:
            server.start()
    assert str(info.value) == f"address already in use: 127.0.0.1:{port}"
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.EADDRINUSE
    assert not server.running
    server.close()  # closing a server that never bound is fine
    with pytest.raises(ShutdownError, match="closed; create a new one"):
        server.start()


def test_two_servers_cannot_share_a_port() -> None:
    with BootstrapServer("127.0.0.1", 0) as first:
        with pytest.raises(
            BindError, match=f"^{re.escape(f'address already in use: 127.0.0.1:{first.port}')}$"
        ):
            BootstrapServer("127.0.0.1", first.port).start()
        assert BootstrapClient(first.url).is_healthy()  # the first one is unharmed


def test_close_is_idempotent_and_frees_the_port() -> None:
    server = BootstrapServer("127.0.0.1", 0).start()
    port = server.port
    server.close()
    server.close()
    with pytest.raises(
        ShutdownError, match=r"^this bootstrap server was closed; create a new one$"
    ):
        server.start()
    with pytest.raises(ShutdownError, match="not running"):
        server.snapshot()
    with pytest.raises(BootstrapUnavailable, match="connection refused"):
        BootstrapClient(f"127.0.0.1:{port}", retries=0).health()
    with socket.socket() as again:  # the port can be bound again right away
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
    BootstrapServer("127.0.0.1", 0).close()  # never started: nothing to do


def test_close_is_bounded_with_stuck_and_idle_connections() -> None:
    server = BootstrapServer("127.0.0.1", 0, close_timeout=3.0).start()
    keepalive = requests.Session()
    assert keepalive.get(f"{server.url}/health", timeout=5).text == "OK"  # idle keep-alive
    stuck = socket.create_connection(("127.0.0.1", server.port))
    stuck.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # never ends
    try:
        server.close()  # raises ShutdownError if the thread outlives close_timeout
        assert not server.running
    finally:
        stuck.close()
        keepalive.close()


def test_close_from_several_threads_at_once() -> None:
    server = BootstrapServer("127.0.0.1", 0).start()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            server.close()
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=close) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    assert not server.running


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match="port 70000 is not a TCP port"):
        BootstrapServer("127.0.0.1", 70000)


def test_wildcard_host_maps_to_loopback_url() -> None:
    with BootstrapServer("0.0.0.0", 0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert BootstrapClient(server.url).is_healthy()
        assert repr(server) == f"BootstrapServer(kv, 0.0.0.0:{server.port}, running)"
