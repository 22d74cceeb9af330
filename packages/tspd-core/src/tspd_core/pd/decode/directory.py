"""Where a room's P ranks are: D's per-address cache of what bootstrap servers say.

:class:`PrefillDirectory` caches, per bootstrap address, what the bootstrap server says about a
P instance (parallel sizes, contract, the route to this D rank, rank addresses). Look-ups run on
helper threads (HTTP must never stall the control thread), so the directory has its own lock.

A cached rank address is not trusted forever: when a room fails, the worker drops the addresses
of the P ranks it contacted (:meth:`PrefillDirectory.drop`), so the next room of that DP group
asks the bootstrap server again — a rank that moved (restarted on another port, or a wrong
address an operator has since removed) is found without restarting D. With the cluster
credential, every look-up is sealed (:class:`~tspd_bootstrap.auth.ClusterCredential`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from tspd_bootstrap.auth import AUTH_EXTENSION, ClusterCredential
from tspd_bootstrap.client import BootstrapClient
from tspd_bootstrap.errors import BootstrapError
from tspd_core.ids import Rank, Room
from tspd_core.layout import CacheContract, parse_contract
from tspd_core.layout.routes import RoutePlan, plan_routes, prefill_dp_group
from tspd_core.pd.errors import PdError
from tspd_core.pd.wire.frames import STAGE_EXTENSION


class BootstrapLookupError(PdError, RuntimeError):
    """The bootstrap server could not tell where a room's P ranks are."""


@dataclass(frozen=True, slots=True)
class PrefillInstance:
    """One P instance as its bootstrap server describes it, routed to this D rank."""

    address: str
    p_tp: int
    dp_size: int
    route: RoutePlan


@dataclass(frozen=True, slots=True)
class Lookup:
    """Where one room's P ranks are: the instance, its DP group and each contacted rank.

    ``staging`` holds the contacted ranks that announced ``tspd.stage/2`` when they
    registered (a tspd P rank behind a tspd bootstrap server): only they get staging offers.
    ``sealed`` those that announced ``tspd.auth/1``: they take only sealed registrations.
    """

    instance: PrefillInstance
    dp_group: int
    endpoints: dict[Rank, tuple[str, int]]
    staging: frozenset[Rank] = frozenset()
    sealed: frozenset[Rank] = frozenset()


class PrefillDirectory:
    """Per-address cache of P instances and rank addresses (thread-safe)."""

    def __init__(
        self,
        contract: CacheContract,
        tp_size: int,
        tp_rank: int,
        credential: ClusterCredential | None = None,
    ) -> None:
        self._contract = contract
        self._tp_size = tp_size
        self._tp_rank = tp_rank
        self._credential = credential
        self._lock = threading.Lock()
        self._instances: dict[str, PrefillInstance] = {}
        self._endpoints: dict[tuple[str, int, int], tuple[str, int]] = {}
        # (address, group, P rank) -> the tspd extensions the rank announced
        self._extensions: dict[tuple[str, int, int], tuple[str, ...]] = {}
        self._clients: dict[str, BootstrapClient] = {}

    def lookup(self, address: str, room: Room) -> Lookup:
        """Resolve ``room``'s P ranks at ``address`` (HTTP on a miss; call from helper threads)."""
        try:
            client = self._client(address)
            instance = self._instance(address, client)
            group = prefill_dp_group(room, instance.dp_size)
            endpoints = {
                p: self._endpoint(address, group, p, client)
                for p in instance.route.contacts(self._tp_rank)
            }
        except (BootstrapError, ValueError) as exc:
            raise BootstrapLookupError(f"bootstrap {address}: {exc}") from exc
        with self._lock:
            return self._found(instance, address, group, endpoints)

    def cached(self, address: str, room: Room) -> Lookup | None:
        """The look-up if everything it needs is cached already (no HTTP; any thread)."""
        with self._lock:
            instance = self._instances.get(address)
            if instance is None:
                return None
            group = prefill_dp_group(room, instance.dp_size)
            endpoints = {}
            for p in instance.route.contacts(self._tp_rank):
                endpoint = self._endpoints.get((address, group, p))
                if endpoint is None:
                    return None
                endpoints[p] = endpoint
            return self._found(instance, address, group, endpoints)

    def _found(
        self,
        instance: PrefillInstance,
        address: str,
        group: int,
        endpoints: dict[Rank, tuple[str, int]],
    ) -> Lookup:
        """(Under the lock.)"""
        announced = {p: self._extensions.get((address, group, p), ()) for p in endpoints}
        staging = frozenset(p for p, ext in announced.items() if STAGE_EXTENSION in ext)
        sealed = frozenset(p for p, ext in announced.items() if AUTH_EXTENSION in ext)
        return Lookup(instance, group, endpoints, staging, sealed)

    def drop(self, address: str, group: int, ranks: Iterable[Rank]) -> list[tuple[str, int]]:
        """Forget the addresses of P ``ranks`` of DP ``group`` at ``address`` (a room of theirs
        failed): the next room looks them up again. Returns the endpoints dropped."""
        dropped = []
        with self._lock:
            for p in ranks:
                endpoint = self._endpoints.pop((address, group, p), None)
                self._extensions.pop((address, group, p), None)
                if endpoint is not None:
                    dropped.append(endpoint)
        return dropped

    def forget(self, address: str) -> list[tuple[str, int]]:
        """Drop what is cached about ``address`` (its P instance restarted or died); returns
        the rank endpoints it knew there."""
        with self._lock:
            self._instances.pop(address, None)
            dropped = [self._endpoints.pop(k) for k in list(self._endpoints) if k[0] == address]
            self._extensions = {k: v for k, v in self._extensions.items() if k[0] != address}
            client = self._clients.pop(address, None)
        if client is not None:
            client.close()
        return dropped

    def addresses(self) -> set[str]:
        """Bootstrap addresses with a cached P instance."""
        with self._lock:
            return set(self._instances)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def _client(self, address: str) -> BootstrapClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                # wire.md §3: rank look-ups time out after 5 s; one retry rides out a reset.
                client = self._clients[address] = BootstrapClient(
                    address, timeout=5.0, retries=1, credential=self._credential
                )
            return client

    def _instance(self, address: str, client: BootstrapClient) -> PrefillInstance:
        with self._lock:
            known = self._instances.get(address)
        if known is not None:
            return known
        info = client.parallel_info()
        if info is None or info.cache_layout is None:
            raise BootstrapLookupError(
                f"bootstrap {address}: no P rank has registered a cache layout yet"
            )
        p_contract = parse_contract(info.cache_layout.encode())
        p_tp = info.tp_per_dp
        route = plan_routes(p_contract, p_tp, self._contract, self._tp_size)
        instance = PrefillInstance(address, p_tp, info.prefill_dp_size, route)
        with self._lock:
            return self._instances.setdefault(address, instance)

    def _endpoint(
        self, address: str, group: int, p_rank: int, client: BootstrapClient
    ) -> tuple[str, int]:
        key = (address, group, p_rank)
        with self._lock:
            known = self._endpoints.get(key)
        if known is not None:
            return known
        rank = client.rank_address(p_rank, group)
        endpoint = (str(rank.rank_ip), int(rank.rank_port))
        with self._lock:
            known = self._endpoints.setdefault(key, endpoint)
            if known == endpoint:
                self._extensions[key] = rank.extensions
            return known
