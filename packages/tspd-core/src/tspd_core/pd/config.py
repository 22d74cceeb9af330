"""Typed configuration of the PD peers, and the tunables read from the environment (wire.md §8).

Every ``TOKENSPEED_DISAGGREGATION_*`` variable TokenSpeed reads is honoured with the same
default, so one deployment script drives both; each also has a shorter ``TSPD_*`` alias, which
wins when both are set (it is the more specific of the two). A value that does not parse is a
:class:`ConfigError` naming the variable, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import torch

from tspd_bootstrap.auth import ClusterCredential
from tspd_core.pd.errors import ConfigError
from tspd_core.pd.layerwise.step_counter import StepCounter
from tspd_core.pd.proc.control import route_source_ip
from tspd_core.pd.transfer.mooncake import DEFAULT_MAX_BATCH, DEFAULT_WINDOW, PROTOCOLS

T = TypeVar("T", int, float)

_PREFIX = "TOKENSPEED_DISAGGREGATION_"
#: The advertised host of a rank's sockets and Mooncake engine, when the config names none.
HOST_ENV = "TSPD_HOST"
START_METHODS = ("forkserver", "spawn")


def _default_threads() -> int:
    cpus = os.cpu_count() or 1
    return min(max(4, int(0.75 * cpus) // 8), 12)


def _read(
    env: Mapping[str, str], name: str, cast: Callable[[str], T], default: T, floor: T | None
) -> T:
    alias = "TSPD_" + name
    key = alias if alias in env else _PREFIX + name
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = cast(raw.strip())
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a valid {cast.__name__}") from None
    return value if floor is None else max(value, floor)


def _credential_from_env() -> ClusterCredential | None:
    try:
        return ClusterCredential.resolve()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


class WorkerRole(StrEnum):
    """Which half of the PD protocol a peer's transfer worker serves (it picks the worker's
    metric families and names its process; each role's peer starts its own entry point)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class PdTunables:
    """Timeouts, heartbeats and transfer parallelism (wire.md §8); see :meth:`from_env`."""

    bootstrap_timeout_s: float = 120.0  #: P room still Bootstrapping this long -> Failed
    waiting_timeout_s: float = 300.0  #: D room WaitingForInput this long -> Failed
    heartbeat_interval_s: float = 5.0  #: D's GET /health period (at least 2 s)
    heartbeat_max_failure: int = 2  #: consecutive failed heartbeats before a node is dead
    failed_session_ttl_s: float = 30.0  #: P refuses a session this long after a failed write
    queue_size: int = 4  #: P transfer queues (room -> sum of session ports mod queues)
    thread_pool_size: int = field(default_factory=_default_threads)  #: >= queue_size
    max_batch: int = 0  #: descriptors per Mooncake call; 0 = 512 on tcp, 4096 on rdma
    #: Descriptors in flight per write (docs/pd.md, "Moving the bytes"): -1 = by protocol
    #: (a window of 64 on tcp, synchronous batches on rdma), 0 = synchronous batches
    #: (Mooncake's call, which busy-polls a core until the batch is done), N = a window of N.
    write_window: int = -1
    #: P: longer coalesced runs are cut into descriptors of this size (0 = never cut); over
    #: Mooncake's TCP lanes 2 MiB descriptors moved fastest here (8 MiB ones ~40 % slower).
    max_run_bytes: int = 2 << 20
    #: D: staging memory for staged transfers (tspd peers only); 0 turns staging off.
    staging_bytes: int = 64 << 20
    staging_slots: int = 8  #: D: slots the staging memory is cut into
    staging_slots_per_rank: int = 2  #: D: slots granted to each P rank (2 = double buffering)
    #: P: stage a job when its mean run is below this many bytes (0 = never stage).
    stage_below_bytes: int = 256 << 10
    #: P: ... or, for a job of at most 64 runs (a page or two: one-page rooms, a short
    #: prompt's equal-TP pages), below this many (capped by ``stage_below_bytes``). Such a job
    #: of longer runs goes direct: its few descriptors cost less than the staging round (the
    #: gather, the scatter request, D's scatter), and it can start on the control thread.
    stage_few_below_bytes: int = 16 << 10
    #: P: ... and it has at least this many runs (staging adds two message hops, ~1 ms here,
    #: and saves ~0.1-0.3 ms per run, so a handful of small runs goes direct).
    stage_min_runs: int = 16
    stage_timeout_s: float = 30.0  #: P: wait for a free slot / a scatter acknowledgement
    #: P: a staged piece writes source runs this long straight from the arena into D's slot
    #: (P's side already contiguous); shorter ones are gathered first. 0 = always gather.
    stage_direct_bytes: int = 256 << 10
    #: P: a direct job of at most this many bytes (and 64 descriptors) whose queue is idle
    #: starts on the control thread, which waits up to 2 ms for it (a one-page request saves
    #: two thread hand-offs: an 8B-class model's page is 2 MiB); 0 = always through the
    #: transfer threads.
    inline_bytes: int = 2 << 20
    #: P: a staged job of at most this many bytes (one slot of an ordered grant) whose queue
    #: is idle starts on the control thread the same way: it gathers them (a memcpy) and waits
    #: up to 2 ms for the one write into D's slot (a short prompt's re-sliced pages); 0 =
    #: always through the transfer threads.
    inline_staged_bytes: int = 1 << 20
    #: D: a scatter of at most this many bytes, of a room alone on its rank (no other room
    #: live), that finds the scatter thread idle runs on the control thread (a one-page
    #: room's or a short prompt's staged piece: the hand-off to that thread and back saved,
    #: ~0.1 ms a room on an idle host); 0 = always on the scatter thread. Only for a room
    #: alone: with many rooms live the control thread then fell behind on the other rooms'
    #: frames (-3 to -5 % requests served at 64 users here, before the rule).
    inline_scatter_bytes: int = 1 << 20
    #: TEST ONLY: probability that a P write job fails (after half its descriptors landed),
    #: as a broken link would. 0 (the default) never injects; read from
    #: ``TSPD_FAULT_WRITE_PROBABILITY``.
    fault_write_probability: float = 0.0
    #: TEST ONLY: the seed of those draws (logged, and named in each injected failure): the
    #: same seed fails the same jobs of the same rooms on the same ranks, so a run can be
    #: replayed. Read from ``TSPD_FAULT_WRITE_SEED``.
    fault_write_seed: int = 0

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ConfigError(f"queue_size must be >= 1, got {self.queue_size}")
        if self.thread_pool_size < self.queue_size:
            # wire.md §8: the pool is at least as large as the queue count.
            object.__setattr__(self, "thread_pool_size", self.queue_size)
        if self.bootstrap_timeout_s <= 0 or self.waiting_timeout_s <= 0:
            raise ConfigError("bootstrap and waiting timeouts must be > 0")
        if self.max_batch < 0:
            raise ConfigError(f"max_batch must be >= 0, got {self.max_batch}")
        if self.write_window < -1:
            raise ConfigError(f"write_window must be >= -1, got {self.write_window}")
        if self.staging_bytes and self.staging_bytes // max(self.staging_slots, 1) < 1 << 20:
            raise ConfigError("staging slots must be at least 1 MiB (staging_bytes / slots)")
        if not 1 <= self.staging_slots_per_rank <= self.staging_slots:
            raise ConfigError("staging_slots_per_rank must be 1..staging_slots")
        if not 0.0 <= self.fault_write_probability <= 1.0:
            raise ConfigError("fault_write_probability must be within 0..1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PdTunables:
        """Read every tunable from ``env`` (default ``os.environ``), with wire.md §8's floors."""
        env = os.environ if env is None else env
        return cls(
            bootstrap_timeout_s=_read(env, "BOOTSTRAP_TIMEOUT", float, 120.0, None),
            waiting_timeout_s=_read(env, "WAITING_TIMEOUT", float, 300.0, None),
            heartbeat_interval_s=_read(env, "HEARTBEAT_INTERVAL", float, 5.0, 2.0),
            heartbeat_max_failure=_read(env, "HEARTBEAT_MAX_FAILURE", int, 2, 1),
            failed_session_ttl_s=_read(env, "FAILED_SESSION_TTL", float, 30.0, None),
            queue_size=_read(env, "QUEUE_SIZE", int, 4, 1),
            thread_pool_size=_read(env, "THREAD_POOL_SIZE", int, _default_threads(), 1),
            max_batch=_read(env, "MAX_BATCH", int, 0, 0),
            write_window=_read(env, "WRITE_WINDOW", int, -1, -1),
            max_run_bytes=_read(env, "MAX_RUN_BYTES", int, 2 << 20, 0),
            staging_bytes=_read(env, "STAGING_BYTES", int, 64 << 20, 0),
            staging_slots=_read(env, "STAGING_SLOTS", int, 8, 1),
            staging_slots_per_rank=_read(env, "STAGING_SLOTS_PER_RANK", int, 2, 1),
            stage_below_bytes=_read(env, "STAGE_BELOW_BYTES", int, 256 << 10, 0),
            stage_few_below_bytes=_read(env, "STAGE_FEW_BELOW_BYTES", int, 16 << 10, 0),
            stage_min_runs=_read(env, "STAGE_MIN_RUNS", int, 16, 1),
            stage_timeout_s=_read(env, "STAGE_TIMEOUT", float, 30.0, 0.1),
            stage_direct_bytes=_read(env, "STAGE_DIRECT_BYTES", int, 256 << 10, 0),
            inline_bytes=_read(env, "INLINE_BYTES", int, 2 << 20, 0),
            inline_staged_bytes=_read(env, "INLINE_STAGED_BYTES", int, 1 << 20, 0),
            inline_scatter_bytes=_read(env, "INLINE_SCATTER_BYTES", int, 1 << 20, 0),
            fault_write_probability=_read(env, "FAULT_WRITE_PROBABILITY", float, 0.0, 0.0),
            fault_write_seed=_read(env, "FAULT_WRITE_SEED", int, 0, None),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerConfig:
    """What both roles need to start. The arena belongs to the engine process; the peer only
    shares it with its transfer worker (shared memory on CPU, CUDA IPC on GPU).

    ``contract`` is the rank's canonical cache transfer contract (JSON text, wire.md §4) describing
    ``arena``; ``tp_size``/``tp_rank`` are the attention-TP size and rank inside the DP group.
    """

    contract: str
    arena: torch.Tensor = field(compare=False, repr=False)
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    host: str | None = None  #: advertised IP; None -> $TSPD_HOST -> route source -> 127.0.0.1
    protocol: str = "tcp"  #: Mooncake protocol: "tcp" or "rdma"
    ib_device: str = ""  #: Mooncake RDMA device(s), "" = auto
    tunables: PdTunables = field(default_factory=PdTunables.from_env)
    start_method: str = "forkserver"  #: how the transfer worker process starts
    start_timeout_s: float = 120.0  #: worker start (engine init, registration) deadline
    debug: bool = False  #: DEBUG logs in the worker and Mooncake's INFO logs
    #: Environment for Mooncake in the worker, set before it is imported (``MC_*`` knobs such
    #: as ``MC_TCP_LANES_PER_PEER``); the worker's inherited environment fills the rest.
    mooncake_env: Mapping[str, str] = field(default_factory=dict)
    #: The cluster credential (docs/bootstrap.md): P seals its bootstrap registration with it
    #: and requires it on D's registrations; D seals its look-ups and registrations. Default:
    #: ``$TSPD_CLUSTER_TOKEN`` / ``$TSPD_CLUSTER_TOKEN_FILE``, else off.
    credential: ClusterCredential | None = field(
        default_factory=_credential_from_env, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.dp_rank < self.dp_size:
            raise ConfigError(
                f"rank (tp {self.tp_rank}/{self.tp_size}, dp {self.dp_rank}/{self.dp_size}) "
                "is outside its group"
            )
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"start_method must be one of {START_METHODS}")
        if self.arena.dim() != 1 or self.arena.dtype != torch.uint8:
            raise ConfigError("arena must be one contiguous 1-D uint8 tensor")
        if not self.arena.is_contiguous() or self.arena.numel() == 0:
            raise ConfigError("arena must be a non-empty contiguous tensor")
        bad = [k for k in self.mooncake_env if not k.startswith(("MC_", "GLOG_"))]
        if bad:
            raise ConfigError(f"mooncake_env takes MC_* / GLOG_* variables only, got {bad}")

    def advertised_host(self) -> str:
        """The address peers reach this rank at (see :attr:`host`)."""
        return self.host or os.environ.get(HOST_ENV) or route_source_ip("127.0.0.1")

    def max_batch(self) -> int:
        """Descriptors per Mooncake call for this protocol."""
        return self.tunables.max_batch or DEFAULT_MAX_BATCH[self.protocol]

    def write_window(self) -> int:
        """Descriptors in flight per Mooncake write (0 = synchronous batches)."""
        window = self.tunables.write_window
        return DEFAULT_WINDOW[self.protocol] if window < 0 else window

    @property
    def engine_rank(self) -> int:
        """The global rank the bootstrap server knows this rank by (TP x DP)."""
        return self.dp_rank * self.tp_size + self.tp_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillPeerConfig(PeerConfig):
    """A P rank: ``bootstrap_url`` is the bootstrap server it registers with (``host:port``).

    Layerwise streaming (wire.md §7, docs/layerwise.md) is on when ``layerwise_interval`` > 0: the
    forward advances the outbox's step counter once per producer step, and each armed chunk
    goes out that many producer steps at a time. ``draft_layers`` is how many of the
    contract's merged layers (the last ones) are draft layers; together they form one final
    producer step. ``step_counter`` lets the engine bring its own counter (e.g. made on the
    forward's device); by default one is made on the arena's device.
    """

    bootstrap_url: str
    layerwise_interval: int = 0  #: producer steps per interval; 0 = off (hand over after)
    draft_layers: int = 0
    step_counter: StepCounter | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        super(PrefillPeerConfig, self).__post_init__()
        if self.layerwise_interval < 0 or self.draft_layers < 0:
            raise ConfigError(
                f"layerwise_interval ({self.layerwise_interval}) and draft_layers "
                f"({self.draft_layers}) must be >= 0"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodePeerConfig(PeerConfig):
    """A D rank: the bootstrap address comes with each request (:class:`BootstrapInfo`)."""
