"""The bootstrap server's data: what a rank registers, what a peer looks up.

Pure values (frozen, slotted dataclasses); JSON encoding lives in :mod:`tspd_bootstrap.wire`,
the rules that combine them in :mod:`tspd_bootstrap.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

#: What a rank that renews its registration announces (``tspd_extensions``): the bootstrap
#: server then lets another address take its engine rank once the lease lapses.
LEASE_EXTENSION = "tspd.lease/1"


class ServerKind(StrEnum):
    """Which rendezvous a server is (wire.md §3).

    ``KV``: one per prefill instance; prefill ranks register with their ``cache_layout`` and the
    parallel info carries it. ``EMBEDDING``: one per encode instance (EPD); encode ranks register
    without a layout and the parallel info has no ``cache_layout`` key.
    """

    KV = "kv"
    EMBEDDING = "embedding"


class Role(StrEnum):
    """The role a stored rank registered with (the ``role`` key of ``PUT /route``)."""

    PREFILL = "Prefill"
    ENCODE = "Encode"


@dataclass(frozen=True, slots=True)
class RankAddress:
    """Where a data-source rank listens: its ZMQ PULL socket (``rank_ip:rank_port``).

    ``extensions`` are the tspd-only protocol extensions the rank announced when it
    registered (e.g. ``tspd.stage/2``); empty for a TokenSpeed rank or a TokenSpeed server,
    which never carry them, so a peer offers an extension only to ranks that asked for it.
    """

    rank_ip: str
    rank_port: int
    extensions: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        """The ZMQ endpoint, ``tcp://ip:port`` (IPv6 addresses in brackets)."""
        host = f"[{self.rank_ip}]" if ":" in self.rank_ip else self.rank_ip
        return f"tcp://{host}:{self.rank_port}"


@dataclass(frozen=True, slots=True)
class Registration:
    """One validated ``PUT /route``.

    ``world_size`` is TP x DP of the registering instance and ``engine_rank`` its global rank;
    the rank is stored at ``[engine_rank // tp_per_dp][engine_rank % tp_per_dp]``. On a KV server
    ``cache_layout`` is the *canonical* layout text (the server canonicalises before the registry
    sees it); on an embedding server it is ``None``.
    """

    role: Role
    world_size: int
    dp_size: int
    rank_ip: str
    rank_port: int
    engine_rank: int
    cache_layout: str | None = None
    extensions: tuple[str, ...] = ()  #: tspd extensions the rank speaks (``tspd_extensions``)

    @property
    def tp_per_dp(self) -> int:
        return self.world_size // self.dp_size

    @property
    def dp_group(self) -> int:
        return self.engine_rank // self.tp_per_dp

    @property
    def tp_rank(self) -> int:
        return self.engine_rank % self.tp_per_dp


@dataclass(frozen=True, slots=True)
class RankEntry:
    """A stored rank, as the operator listing shows it.

    ``registrations`` counts every accepted PUT for this engine rank since it was first stored
    (a restarted rank re-registers); the two times are Unix seconds.
    """

    engine_rank: int
    dp_group: int
    tp_rank: int
    role: Role
    rank_ip: str
    rank_port: int
    registrations: int
    first_registered: float
    last_registered: float
    extensions: tuple[str, ...] = ()

    @property
    def address(self) -> RankAddress:
        return RankAddress(self.rank_ip, self.rank_port, self.extensions)

    @property
    def leased(self) -> bool:
        """Whether the rank renews its registration (it announced :data:`LEASE_EXTENSION`)."""
        return LEASE_EXTENSION in self.extensions


@dataclass(frozen=True, slots=True)
class ParallelInfo:
    """The answer to ``GET /route?engine_rank=-1&target_dp_group=-1``.

    The names follow the wire: ``prefill_tp_size`` is the instance's *world size* (TP x DP), not
    its TP; a decode peer's TP per DP group is :attr:`tp_per_dp`. ``cache_layout`` is the
    canonical layout on a KV server and ``None`` on an embedding server.
    """

    prefill_tp_size: int
    prefill_dp_size: int
    cache_layout: str | None = None

    @property
    def tp_per_dp(self) -> int:
        return self.prefill_tp_size // self.prefill_dp_size


@dataclass(frozen=True, slots=True)
class DeploymentView:
    """A consistent snapshot of the registry for operators (``GET /ranks``).

    ``missing`` lists the engine ranks not registered yet; ``complete`` is true once every rank
    of ``world_size`` is present (a rank look-up answers once its own DP group is). The layout
    is summarised by its size and SHA-256; ``GET /route`` parallel info returns it in full.
    """

    kind: ServerKind
    world_size: int | None
    dp_size: int | None
    layout_bytes: int | None
    layout_sha256: str | None
    ranks: tuple[RankEntry, ...]
    missing: tuple[int, ...]

    @property
    def complete(self) -> bool:
        return self.world_size is not None and not self.missing
