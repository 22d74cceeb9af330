"""Typed configuration of the EPD sender (encode rank) and receiver (prefill rank).

Timeouts and transfer parallelism come from PD's :class:`~tspd_core.pd.config.PdTunables`
(wire.md §8 names them for both planes): ``bootstrap_timeout_s`` (120 s) bounds how long an encode
rank parks a chunk for its receivers, ``waiting_timeout_s`` (300 s) how long a prefill request
waits for its embeddings. Row sharding follows ``TOKENSPEED_EPD_EMBEDDING_SHARD`` (default on;
alias ``TSPD_EPD_EMBEDDING_SHARD``), which must agree on every rank of a prefill replica.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tspd_core.epd.items import MAX_WIDTH, ShardMode, dtype_name
from tspd_core.pd.config import HOST_ENV, START_METHODS, PdTunables
from tspd_core.pd.errors import ConfigError
from tspd_core.pd.proc.control import route_source_ip
from tspd_core.pd.transfer.mooncake import DEFAULT_MAX_BATCH, PROTOCOLS

SHARD_ENV = "TOKENSPEED_EPD_EMBEDDING_SHARD"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
#: A quarantined receive extent outlives the encode side's park timeout by this much.
QUARANTINE_SLACK_S = 10.0


def shard_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``TOKENSPEED_EPD_EMBEDDING_SHARD`` (or ``TSPD_EPD_EMBEDDING_SHARD``), default true."""
    env = os.environ if env is None else env
    alias = "TSPD_EPD_EMBEDDING_SHARD"
    key = alias if alias in env else SHARD_ENV
    raw = env.get(key, "").strip().lower()
    if not raw:
        return True
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ConfigError(f"{key}={env[key]!r} is not a boolean (use 1/0, true/false, on/off)")


def _check_common(tp_size: int, tp_rank: int, protocol: str, start_method: str | None) -> None:
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp rank {tp_rank} is outside 0..{tp_size - 1}")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if start_method is not None and start_method not in START_METHODS:
        raise ConfigError(f"start_method must be one of {START_METHODS}, got {start_method!r}")


def _advertised(host: str | None) -> str:
    return host or os.environ.get(HOST_ENV) or route_source_ip("127.0.0.1")


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingSenderConfig:
    """An encode rank. ``bootstrap_url`` is the encode node's embedding bootstrap server
    (``host:port``) this rank registers with; rank 0 also serves it when ``serve_bootstrap``
    names the address to bind (the port is the URL's; port 0 lets the system pick one, for an
    encode node of one rank: ``EmbeddingSender.bootstrap_server.port`` tells which)."""

    bootstrap_url: str
    tp_size: int = 1
    tp_rank: int = 0
    buffer_bytes: int = 256 << 20  #: the registered send buffer (items wait here until sent)
    block_bytes: int = 4096
    host: str | None = None  #: advertised IP; None -> $TSPD_HOST -> route source -> 127.0.0.1
    protocol: str = "tcp"
    ib_device: str = ""
    tunables: PdTunables = field(default_factory=PdTunables.from_env)
    serve_bootstrap: str | None = None
    start_method: str = "forkserver"
    start_timeout_s: float = 120.0  #: includes the bootstrap registration (60 x 0.5 s retries)
    #: How long a concluded room is remembered, so a late item info or chunk for it is told
    #: Failed instead of opening the room again; None -> bootstrap_timeout_s.
    tombstone_s: float | None = None
    debug: bool = False

    def __post_init__(self) -> None:
        _check_common(self.tp_size, self.tp_rank, self.protocol, self.start_method)
        if not self.bootstrap_url:
            raise ConfigError("an encode rank needs the bootstrap server it registers with")
        if self.tombstone_s is not None and self.tombstone_s < 0:
            raise ConfigError(f"tombstone_s must be >= 0, got {self.tombstone_s}")
        if self.buffer_bytes < self.block_bytes:
            raise ConfigError(f"buffer_bytes {self.buffer_bytes} is below one block")

    def advertised_host(self) -> str:
        return _advertised(self.host)

    def max_batch(self) -> int:
        return self.tunables.max_batch or DEFAULT_MAX_BATCH[self.protocol]

    @property
    def tombstone_seconds(self) -> float:
        if self.tombstone_s is not None:
            return self.tombstone_s
        return self.tunables.bootstrap_timeout_s


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingReceiverConfig:
    """A prefill rank's receiver: what one embedding row looks like and where rows land.

    ``hidden``, ``dtype`` and ``deepstack_levels`` describe the model's vision output (a row is
    ``hidden`` values, plus ``hidden * deepstack_levels`` deepstack values); ``tp_size`` and
    ``tp_rank`` place this rank in its prefill replica (attention TP).
    """

    hidden: int
    dtype: torch.dtype
    deepstack_levels: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    shard: bool | None = None  #: row sharding at TP > 1; None -> $TOKENSPEED_EPD_EMBEDDING_SHARD
    pool_bytes: int = 256 << 20  #: the registered receive pool
    block_bytes: int = 4096
    device: str = "cpu"
    host: str | None = None  #: advertised IP; None -> $TSPD_HOST -> route source -> 127.0.0.1
    protocol: str = "tcp"  #: for an engine the receiver opens itself
    ib_device: str = ""
    tunables: PdTunables = field(default_factory=PdTunables.from_env)
    quarantine_s: float | None = None  #: None -> bootstrap_timeout_s + 10 s
    lookup_timeout_s: float = 5.0  #: each bootstrap HTTP call

    def __post_init__(self) -> None:
        _check_common(self.tp_size, self.tp_rank, self.protocol, None)
        dtype_name(self.dtype)
        if not 1 <= self.hidden <= MAX_WIDTH or self.deepstack_levels < 0:
            raise ConfigError(
                f"hidden must be 1..{MAX_WIDTH} and deepstack_levels >= 0, "
                f"got {self.hidden} and {self.deepstack_levels}"
            )
        if self.quarantine_s is not None and self.quarantine_s < 0:
            raise ConfigError(f"quarantine_s must be >= 0, got {self.quarantine_s}")
        if self.lookup_timeout_s <= 0:
            raise ConfigError("lookup_timeout_s must be > 0")
        if self.shard is None:
            object.__setattr__(self, "shard", shard_from_env())

    @property
    def mode(self) -> ShardMode:
        """Row shards at TP > 1 with sharding on; otherwise every rank takes every row."""
        return ShardMode.ROWS if self.shard and self.tp_size > 1 else ShardMode.IDENTITY

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return self.hidden * self.element_size

    @property
    def deepstack_row_bytes(self) -> int:
        return self.hidden * self.deepstack_levels * self.element_size

    @property
    def quarantine_seconds(self) -> float:
        if self.quarantine_s is not None:
            return self.quarantine_s
        return self.tunables.bootstrap_timeout_s + QUARANTINE_SLACK_S

    def advertised_host(self) -> str:
        return _advertised(self.host)

    def max_batch(self) -> int:
        return self.tunables.max_batch or DEFAULT_MAX_BATCH[self.protocol]
