"""How one engine replica joins PD: its role and what its ranks' transfer peers need."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tspd_core.pd import PdTunables
from tspd_serving.errors import ConfigError

PROTOCOLS = ("tcp", "rdma")


class PdRole(StrEnum):
    """The half of PD a replica serves."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class PdConfig:
    """PD settings shared by every rank of one replica (picklable: it crosses ``spawn``).

    ``bootstrap`` is the ``host:port`` of the bootstrap server a prefill replica's ranks
    register with (a decode replica learns P's address from each request). ``dp_size`` /
    ``dp_rank`` place the replica among the data-parallel replicas of its node: D picks a P
    replica by ``room % dp_size``, so a P node must dispatch each request to that replica.
    ``tunables=None`` reads them from the rank's environment (``TSPD_*`` /
    ``TOKENSPEED_DISAGGREGATION_*``, wire.md §8). ``layerwise_interval`` (a prefill replica's
    only): stream each prefill chunk's KV this many layers at a time while the forward runs
    (wire.md §7); 0 hands the KV over after the forward. ``prefill_early`` (a prefill
    replica's): admit and prefill a request at once, while D looks P up and pre-allocates;
    its KV goes out the moment the room is Bootstrapped (the forward and D's bootstrap
    overlap, as in vLLM's PD; layerwise, the worker holds the armed chunks until then and
    sends the intervals passed meanwhile together). False holds each request until
    Bootstrapped: no pages or compute for a request whose D side never shows up, at the
    price of the bootstrap round trip in TTFT.
    """

    role: PdRole
    bootstrap: str = ""
    host: str | None = None  #: advertised address of the ranks' sockets (None = auto)
    protocol: str = "tcp"
    ib_device: str = ""
    dp_size: int = 1
    dp_rank: int = 0
    tunables: PdTunables | None = None
    debug: bool = False
    layerwise_interval: int = 0
    prefill_early: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.role, PdRole):
            raise ConfigError(f"PD role must be prefill or decode, got {self.role!r}")
        if self.role is PdRole.PREFILL and not _is_host_port(self.bootstrap):
            raise ConfigError(
                f"a prefill replica needs its bootstrap server as host:port, got {self.bootstrap!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"transport must be one of {PROTOCOLS}, got {self.protocol!r}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(f"dp rank {self.dp_rank} outside DP size {self.dp_size}")
        if self.layerwise_interval < 0:
            raise ConfigError(f"layerwise interval must be >= 0, got {self.layerwise_interval}")
        if self.layerwise_interval and self.role is not PdRole.PREFILL:
            raise ConfigError("layerwise streaming is a prefill replica's setting (P sends)")


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 1 <= int(port) <= 65535
