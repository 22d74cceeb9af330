"""Every module of these tests must leave no transfer worker and no server thread behind.

``unused_ports`` hands out loopback ports nobody serves, held for the module so no two tests
(and no other process) share one: ``refused()`` is bound but never listens (connecting is
refused), ``silent()`` listens but never accepts (connecting succeeds, nothing ever answers).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tspd_testing.loopback import assert_nothing_left_behind


class UnusedPorts:
    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def refused(self) -> int:
        return self._bind(listen=False)

    def silent(self) -> int:
        return self._bind(listen=True)

    def _bind(self, listen: bool) -> int:
        sock = socket.socket()
        self._held.append(sock)
        sock.bind(("127.0.0.1", 0))
        if listen:
            sock.listen(16)
        return int(sock.getsockname()[1])

    def close(self) -> None:
        for sock in self._held:
            sock.close()


@pytest.fixture(scope="module")
def unused_ports() -> Iterator[UnusedPorts]:
    ports = UnusedPorts()
    yield ports
    ports.close()


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    assert_nothing_left_behind()
