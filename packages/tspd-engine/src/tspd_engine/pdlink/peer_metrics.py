"""A node's ``/metrics`` from its ranks' transfer peers, scraped off the engine loop.

Each rank with a PD peer runs a :class:`MetricsResponder`: a thread with a ZMQ REP socket that
answers a scrape with ``TransferPeer.metrics()``. That call may come from any thread; the round
trip to the transfer worker it costs happens on the responder's thread, never on the engine
loop. The node's ``/metrics`` handler scrapes every rank of every replica at once
(:class:`PeerScraper`) and merges the snapshots into one exposition, each sample labelled
with its replica and rank (:func:`merge`)::

    node process (HTTP handler)               rank process (replica i, TP rank r)
    ───────────────────────────               ────────────────────────────────────
    PeerScraper.scrape ── REQ ──────────────► MetricsResponder thread ─ peer.metrics() ─► worker
                       ◄── families (JSON) ── (engine loop untouched)
    merge: + replica="i", rank="r"; render once (one HELP/TYPE per family)

A scrape is one ZMQ frame, ``metrics``. The REP socket answers every request, whatever it
holds (several frames, other bytes, an oversized message ZMQ drops unread), with one frame:
a snapshot or ``{"error": ...}``; nothing a local process sends ends the responder's thread.

Threading: a responder owns its socket and thread; ``close`` may be called from any other
thread. Any number of threads may scrape through one :class:`PeerScraper` at once (each call
makes its own sockets on the shared context); ``close`` it once no call runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from tspd_core.pd import MetricsSnapshot, PdError
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

#: What a responder gives the worker to answer (a dead worker gives the peer's own metrics).
PEER_TIMEOUT_S = 2.0
#: What a scrape waits for the slowest rank (a bit more than a responder waits for its worker).
SCRAPE_TIMEOUT_S = 3.0
_POLL_MS = 100
_REQUEST = b"metrics"
_MAX_ANSWER = 8 << 20  # a snapshot is a few KiB; anything this large is not one
_MAX_REQUEST = 1024  # a scrape is 7 bytes; ZMQ drops (and disconnects) anything larger

Source = Callable[[float], MetricsSnapshot]


class MetricsResponder:
    """Answers scrapes of one rank's peer metrics at ``address`` (``tcp://host:port``; a
    ``*`` port lets the OS pick one as it binds).

    Binds in :meth:`start` (in the caller, so a taken port fails there; ``address`` is then
    the bound one) and serves on its own daemon thread until :meth:`close`.
    """

    def __init__(self, address: str, source: Source, timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.address = address
        self._source = source
        self._timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tspd-peer-metrics", daemon=True)

    def start(self) -> MetricsResponder:
        self._sock.bind(self.address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop answering; idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * PEER_TIMEOUT_S)
        if not self._thread.is_alive():
            self._sock.close(linger=0)
            self._ctx.term()

    def _run(self) -> None:
        name_this_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(_POLL_MS):
                    # REP pairs one answer with one whole request: read all of its frames.
                    self._sock.send(self._answer(self._sock.recv_multipart(zmq.NOBLOCK)))
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("peer metrics responder: %s", exc)
            except Exception:
                log.exception("peer metrics responder: a scrape failed; answering the next")

    def _answer(self, request: list[bytes]) -> bytes:
        if request != [_REQUEST]:
            frames = f"{len(request)} frame(s)"
            return json.dumps({"error": f"not a metrics scrape ({frames})"}).encode()
        try:
            snapshot = self._source(self._timeout_s)
        except PdError as exc:  # e.g. the peer was shut down under us
            return json.dumps({"error": str(exc)}).encode()
        return json.dumps({"families": snapshot.families}).encode()


class PeerScraper:
    """Scrapes :class:`MetricsResponder` s (see the module docstring)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()

    def scrape(
        self, addresses: Sequence[str], timeout_s: float = SCRAPE_TIMEOUT_S
    ) -> list[MetricsSnapshot | None]:
        """Every address's snapshot, asked all at once; ``None`` for a rank that did not
        answer in ``timeout_s`` or answered an error (both are logged)."""
        socks = []
        for address in addresses:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, _MAX_ANSWER)
            sock.connect(address)
            sock.send(_REQUEST)
            socks.append(sock)
        try:
            return self._collect(addresses, socks, timeout_s)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def close(self) -> None:
        self._ctx.term()

    @staticmethod
    def _collect(
        addresses: Sequence[str], socks: list[zmq.Socket[bytes]], timeout_s: float
    ) -> list[MetricsSnapshot | None]:
        out: list[MetricsSnapshot | None] = [None] * len(socks)
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        waiting = set(range(len(socks)))
        deadline = time.monotonic() + timeout_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            for i in [i for i in waiting if socks[i] in ready]:
                waiting.discard(i)
                out[i] = _parse(addresses[i], socks[i].recv())
        for i in sorted(waiting):
            log.warning("peer metrics at %s: no answer in %g s", addresses[i], timeout_s)
        return out


def _parse(address: str, raw: bytes) -> MetricsSnapshot | None:
    try:
        body = json.loads(raw)
        families = body["families"] if isinstance(body, dict) and "error" not in body else None
    except (ValueError, KeyError, RecursionError):
        families = None
        body = {"error": "not a metrics answer"}
    if not isinstance(body, dict):
        body = {"error": "not a metrics answer"}
    if not isinstance(families, dict):
        log.warning("peer metrics at %s: %s", address, body.get("error", "no families"))
        return None
    return MetricsSnapshot(families)


def merge(snapshots: Sequence[tuple[Mapping[str, str], MetricsSnapshot]]) -> MetricsSnapshot:
    """One snapshot holding every sample of ``snapshots``, each row with its labels first.

    Families are matched by name (every peer declares a family the same way); a row keeps its
    own labels after the given ones, so ``replica``/``rank`` tell the ranks apart.
    """
    merged: dict[str, dict[str, Any]] = {}
    for labels, snapshot in snapshots:
        head = [[k, str(v)] for k, v in labels.items()]
        for name, fam in snapshot.families.items():
            into = merged.setdefault(name, {**fam, "rows": []})
            into["rows"].extend([head + list(at), value] for at, value in fam["rows"])
    return MetricsSnapshot(merged)
