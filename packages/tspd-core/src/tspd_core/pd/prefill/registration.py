"""This P rank's entry at its bootstrap server: the first registration, then a renewal every
:data:`RENEW_S` seconds.

wire.md §3 has a P rank PUT once. A tspd P rank announces ``tspd.lease/1`` and renews, because
the bootstrap server lets no other address take a registered engine rank while its lease is
fresh (without the cluster credential; docs/bootstrap.md, "Who may move a rank"), and because
a standalone server that restarted has forgotten its ranks: the renewals register them again.

    worker start ── register() ── 200 ────────────────► renewing thread: PUT every RENEW_S
                       │ 409 rank_held + Retry-After         (failures logged once per streak;
                       │ (a previous run of this rank,        the worker goes on serving)
                       ▼  on another port, still leased)
                   wait it out (HELD_WAIT_S at most), PUT again; any other refusal: the start fails

Threading: :meth:`RankRegistration.register` runs on the caller's thread (the worker's, before
it serves); the renewals on a daemon thread of their own that touches no worker state.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from tspd_bootstrap.auth import ClusterCredential
from tspd_bootstrap.client import BootstrapClient
from tspd_bootstrap.errors import BootstrapConflict, BootstrapError
from tspd_core.procname import name_this_thread

log = logging.getLogger(__name__)

#: Seconds between renewals (the server's default lease is four of them: 20 s).
RENEW_S = 5.0
#: How long the first registration waits for a previous run's lease to lapse at most.
HELD_WAIT_S = 30.0
#: wire.md §3: a P rank's PUT times out after 5 s.
PUT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What this rank registers (``engine_rank`` is global: dp_rank * tp_size + tp_rank)."""

    engine_rank: int
    world_size: int
    dp_size: int
    rank_ip: str
    rank_port: int
    cache_layout: str
    extensions: tuple[str, ...]


class RankRegistration:
    """Registers one P rank and keeps its lease (see the module docstring)."""

    def __init__(
        self, url: str, entry: RankSpec, credential: ClusterCredential | None = None
    ) -> None:
        # wire.md §3: no retries of one PUT (a dead server is reported in 5 s, not after backoff);
        # the renewals are the retries.
        self._client = BootstrapClient(url, timeout=PUT_TIMEOUT_S, retries=0, credential=credential)
        self.entry = entry
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def register(self, wait_s: float = HELD_WAIT_S) -> None:
        """The first registration; raises the :class:`BootstrapError` that refused it.

        A 409 ``rank_held`` with a ``Retry-After`` (a previous run of this rank, at another
        address, whose lease has not lapsed yet) is waited out for ``wait_s`` at most.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._put()
                return
            except BootstrapConflict as exc:
                after = exc.retry_after
                if exc.code != "rank_held" or after is None:
                    raise
                if time.monotonic() + after > deadline:
                    raise
                log.warning("%s; waiting %g s for that lease to lapse", exc.reason, after)
                if self._stop.wait(after):
                    raise

    def start_renewing(self, every_s: float = RENEW_S) -> None:
        """Renew the registration every ``every_s`` seconds until :meth:`close`."""
        self._thread = threading.Thread(
            target=self._renew, args=(every_s,), name="tspd-lease-renew", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop renewing (a renewal in flight ends within its timeout, on its own thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0.5)
        self._client.close()

    def _put(self) -> None:
        e = self.entry
        self._client.register_rank(
            engine_rank=e.engine_rank,
            world_size=e.world_size,
            dp_size=e.dp_size,
            rank_ip=e.rank_ip,
            rank_port=e.rank_port,
            cache_layout=e.cache_layout,
            extensions=e.extensions,
        )

    def _renew(self, every_s: float) -> None:
        """On the renewing thread."""
        name_this_thread()
        while not self._stop.wait(every_s):
            try:
                self._put()
            except BootstrapError as exc:
                if not self._failing:  # once per streak: a server down for minutes says so once
                    log.warning("renewing engine_rank %d failed: %s", self.entry.engine_rank, exc)
                self._failing = True
                continue
            if self._failing:
                log.info("engine_rank %d is registered again", self.entry.engine_rank)
            self._failing = False
