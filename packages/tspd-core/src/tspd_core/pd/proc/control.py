"""The ZMQ control plane of one rank: one PULL socket, cached PUSH sockets per peer endpoint.

A PUSH connection whose bytes stay unacknowledged for :data:`UNACKED_TIMEOUT_MS` (a cut
link) is given up and made anew, so a healed link carries frames again within a connection
attempt (:data:`CONNECT_TIMEOUT_MS`) instead of at TCP's next backed-off retransmission.

Ownership and threading: the PULL socket belongs to the worker's control thread (only it calls
:meth:`ControlPlane.recv` or polls :attr:`ControlPlane.pull`). :meth:`ControlPlane.send` may be
called from any thread: each cached PUSH socket has its own lock, so sends to different peers
run in parallel and sends to one peer keep their order. :meth:`ControlPlane.close` runs last.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

import zmq

from tspd_core.pd.errors import PeerError
from tspd_core.pd.wire.frames import MAX_FRAME_BYTES

log = logging.getLogger(__name__)

#: How long a send may wait on a peer whose queue is full before the send fails.
SEND_TIMEOUT_MS = 2000
#: How long sent bytes may stay unacknowledged before the connection is given up and made
#: anew (TCP_USER_TIMEOUT, through ZMQ_TCP_MAXRT). Without it a peer link cut for a while
#: comes back only at TCP's next retransmission, and those back off exponentially (0.2 s,
#: doubling, up to 2 min): a pre-allocation sent into a 26 s cut reached P 24 s after the
#: cable was back, and the room it served timed out. The frames in flight when a connection
#: is given up are lost: a link silent this long has cost those rooms already (D's heartbeat,
#: the router's health checks); the frames still queued in ZMQ go out on the new connection.
UNACKED_TIMEOUT_MS = 5000
#: How long one connection attempt may take: a SYN sent into a cut is retransmitted with the
#: same back-off, so each attempt is cut short and the next one starts (ZMQ_CONNECT_TIMEOUT).
CONNECT_TIMEOUT_MS = 2000


def route_source_ip(fallback: str = "127.0.0.1") -> str:
    """The source address of the route to the Internet (wire.md §2), else ``fallback``.

    Connecting a UDP socket sends nothing; it only asks the kernel which address it would use.
    On a host with loopback only there is no route, and the fallback is what peers can reach.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("8.8.8.8", 80))
            address = str(probe.getsockname()[0])
        except OSError:
            return fallback
    return address if address and not address.startswith("0.") else fallback


class _Push:
    __slots__ = ("lock", "sock")

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.lock = threading.Lock()


class ControlPlane:
    """A bound PULL socket on ``tcp://host:<OS-chosen port>`` and a PUSH socket per peer."""

    def __init__(self, host: str, context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.host = host
        self._ctx = context or zmq.Context.instance()
        self.pull: zmq.Socket[bytes] = self._ctx.socket(zmq.PULL)
        # Oversized frames are dropped by ZMQ itself (the sender is disconnected).
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.pull.setsockopt(zmq.LINGER, 0)
        try:
            self.port = self.pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self.pull.close()
            raise PeerError(f"cannot bind the control socket on {host}: {exc}") from exc
        self._pushes: dict[str, _Push] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def recv(self, timeout_ms: int) -> list[bytes] | None:
        """One whole multipart message, or None when nothing arrived within ``timeout_ms``."""
        if not self.pull.poll(timeout_ms):
            return None
        return self.pull.recv_multipart()

    def send(self, ip: str, port: int, frames: Sequence[bytes]) -> None:
        """Push ``frames`` to the peer at ``ip:port``; raises :class:`PeerError` if it is stuck."""
        push = self._push(f"tcp://{ip}:{port}")
        with push.lock:
            try:
                push.sock.send_multipart(list(frames))
            except zmq.ZMQError as exc:
                raise PeerError(f"cannot send to tcp://{ip}:{port}: {exc}") from exc

    def forget(self, ip: str, port: int) -> None:
        """Close the cached socket of a peer found dead, so queued frames do not pile up."""
        with self._lock:
            push = self._pushes.pop(f"tcp://{ip}:{port}", None)
        if push is not None:
            with push.lock:
                push.sock.close(linger=0)

    def close(self) -> None:
        """Close every socket, dropping unsent frames (no linger: shutdown never hangs)."""
        with self._lock:
            self._closed = True
            pushes, self._pushes = list(self._pushes.values()), {}
        for push in pushes:
            with push.lock:
                push.sock.close(linger=0)
        self.pull.close(linger=0)

    def _push(self, address: str) -> _Push:
        with self._lock:
            if self._closed:
                raise PeerError("the control plane is closed")
            push = self._pushes.get(address)
            if push is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.TCP_MAXRT, UNACKED_TIMEOUT_MS)
                sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
                sock.connect(address)
                push = self._pushes[address] = _Push(sock)
            return push
