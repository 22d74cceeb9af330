"""D's heartbeat on the bootstrap servers it uses (wire.md §3).

Every ``max(interval, 2)`` seconds the D worker probes ``GET /health`` on each bootstrap
address it reached (a cached P instance, or a tracked room's whose look-up succeeded). A
non-200 answer or an error counts one failure, a 200 resets the count; at ``max(limit, 1)``
consecutive failures the P instance is declared dead and the worker drops what it cached about
it (parallel info, rank addresses, registrations, staging grants) and fails its rooms that are
not Success.

Threading: :meth:`Heartbeat.tick` and the result callbacks run on the worker's control thread;
probes run on the heartbeat's own threads (an HTTP wait never stalls the control thread) and
``post`` their results back. Bound: an instance that stops answering at time t is declared dead
by ``t + limit * (interval + 5 s)`` (:func:`bound_for`; a probe waits wire.md §3's 2 s to connect
and 3 s to read at most; a refused connection fails at once, giving ``t + limit * interval``),
plus one loop tick: 20 s with the defaults (interval 5, limit 2), 7 s with interval 2, limit 1.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from tspd_bootstrap.client import HEALTH_TIMEOUT, BootstrapClient
from tspd_bootstrap.errors import BootstrapError
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 2.0
#: Per probe, (connect, read) seconds: wire.md §3's 2 s + 3 s, as TokenSpeed's D probes.
PROBE_TIMEOUT: tuple[float, float] = HEALTH_TIMEOUT
#: The longest one probe can take (a connect that just makes it, then a silent read).
PROBE_BOUND_S = sum(PROBE_TIMEOUT)
PROBE_THREADS = 4

Post = Callable[[Callable[[], None]], None]
#: ``on_result(address, ok)`` for every probe; ``on_dead(address, reason)`` at the limit.
OnResult = Callable[[str, bool], None]
OnDead = Callable[[str, str], None]


def bound_for(interval_s: float, limit: int) -> float:
    """Longest time from a server's death to the verdict (plus one loop tick), floors applied:
    ``max(limit, 1) * (max(interval, 2) + 5 s)``."""
    return max(limit, 1) * (max(interval_s, MIN_INTERVAL_S) + PROBE_BOUND_S)


class Heartbeat:
    """Failure counts per bootstrap address and the probes (see the module docstring)."""

    def __init__(
        self, interval_s: float, limit: int, post: Post, on_result: OnResult, on_dead: OnDead
    ) -> None:
        self.interval_s = max(interval_s, MIN_INTERVAL_S)
        self.limit = max(limit, 1)
        self._post = post
        self._on_result = on_result
        self._on_dead = on_dead
        self._failures: dict[str, int] = {}
        self._inflight: set[str] = set()
        self._next = 0.0
        self._pool = ThreadPoolExecutor(
            PROBE_THREADS, thread_name_prefix="tspd-heartbeat", initializer=name_this_thread
        )
        self._clients: dict[str, BootstrapClient] = {}
        self._lock = threading.Lock()  # the client cache (probe threads)

    @property
    def bound_s(self) -> float:
        """Longest time from a server's death to the verdict (plus one loop tick)."""
        return bound_for(self.interval_s, self.limit)

    def due(self, now: float) -> bool:
        """Whether a round of probes is due (so callers gather addresses only then)."""
        return now >= self._next

    def tick(self, now: float, addresses: Iterable[str]) -> None:
        """Start a probe of every address not being probed, once per interval."""
        if not self.due(now):
            return
        self._next = now + self.interval_s
        for address in sorted(set(addresses) - self._inflight):
            self._inflight.add(address)
            self._pool.submit(self._probe, address)

    def failures(self, address: str) -> int:
        return self._failures.get(address, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _probe(self, address: str) -> None:
        """On a probe thread."""
        try:
            self._client(address).health(PROBE_TIMEOUT)
            ok, why = True, ""
        except (BootstrapError, ValueError) as exc:
            ok, why = False, str(exc)
        self._post(lambda: self._done(address, ok, why))

    def _done(self, address: str, ok: bool, why: str) -> None:
        self._inflight.discard(address)
        self._on_result(address, ok)
        if ok:
            self._failures.pop(address, None)
            return
        count = self._failures.get(address, 0) + 1
        log.warning("heartbeat %d/%d of bootstrap %s failed: %s", count, self.limit, address, why)
        if count < self.limit:
            self._failures[address] = count
            return
        self._failures.pop(address, None)
        with self._lock:
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()
        self._on_dead(address, f"{count} heartbeats failed ({why})")

    def _client(self, address: str) -> BootstrapClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = BootstrapClient(address, retries=0)
            return client
