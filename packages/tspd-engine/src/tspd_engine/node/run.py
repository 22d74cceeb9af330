"""Run a node: its engine replicas (DP × TP rank processes, each rank with its PD transfer
peer) behind the node HTTP endpoint, from start to a clean stop.

``run_node(spec)`` blocks: it starts every replica (a prefill replica's ranks register with
the bootstrap server as they start), serves HTTP, calls ``ready(url, info)`` once both are up,
and on SIGINT or SIGTERM stops the endpoint first (requests in flight end), then every replica
(ranks joined, stragglers terminated, transfer workers stopped with their ranks), then the
node's bootstrap server.

A node whose rank process dies is no node any more (its replica cannot take a round), so it
does not linger answering 503: a watchdog notices the death within :data:`WATCH_INTERVAL_S`,
the requests in flight on the dead replica fail (a stream ends with a ``failed`` line, a
plain request gets a 503), the node stops as above — the dead replica's surviving ranks are
terminated at once — and ``run_node`` returns :data:`EXIT_RANK_DIED`, so that systemd,
Kubernetes or ``tspd-launch local`` restart it.

A prefill node hosts its P instance's bootstrap server in this process by default (wire.md §3:
the server lives in P's frontend), so it dies with the node: a decode node's heartbeat on it
then fails the rooms that wait for this node's KV within the heartbeat bound, instead of
after D's waiting timeout. ``NodeSpec.bootstrap`` names an external server instead (the
launcher's ``bootstrap`` role)::

    prefill node process ─────────────────────────────────────┐
      BootstrapServer (own thread, strict contract check) ◄───┼── PUT /route (each P rank)
      node HTTP endpoint (asyncio, main thread)               │◄─ GET /route, GET /health (D)
      replicas: rank processes ─ transfer workers             │
    ──────────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import FrameType

from aiohttp import web

from tspd_bootstrap import BindError, BootstrapServer, ClusterCredential
from tspd_core import trace
from tspd_core.pd import PdTunables
from tspd_core.pd.config import HOST_ENV
from tspd_core.pd.proc.control import route_source_ip
from tspd_engine.config import EngineConfig
from tspd_engine.errors import EngineDeadError
from tspd_engine.model.build import resolve_model
from tspd_engine.node.allow import OWN_ONLY, BootstrapAllowlist, parse_entry
from tspd_engine.node.endpoint import make_app
from tspd_engine.node.replicas import HELD_PER_RUNNING, Node, NodeInfo, NodeRole
from tspd_engine.pdlink.config import PdConfig, PdRole
from tspd_engine.pdlink.contract import canonical_layout
from tspd_engine.rank.launch import EngineHandle, launch
from tspd_engine.rank.steps import replica_log
from tspd_serving.errors import ConfigError
from tspd_serving.hf_tokenizer import load_tokenizer
from tspd_serving.http import HttpLimits, bind_socket
from tspd_serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
#: Seconds requests in flight get to finish when the node stops (then they are cancelled).
SHUTDOWN_GRACE_S = 5.0
#: wire.md §3 / §8: ``--disaggregation-bootstrap-port``.
BOOTSTRAP_PORT = 8998
_WILDCARDS = ("", "0.0.0.0", "::")
#: How often the node checks that every rank process still runs.
WATCH_INTERVAL_S = 0.25
#: How long the surviving ranks of a replica that lost one get to exit before they are killed.
BROKEN_REPLICA_STOP_S = 2.0
#: ``run_node``'s exit code when a rank process died under the node (it should be restarted).
EXIT_RANK_DIED = 3


def pd_tunables(overrides: Mapping[str, float]) -> PdTunables | None:
    """The PD tunables from the environment (wire.md §8) with ``overrides`` (PdTunables field
    -> value: :func:`tspd_engine.node.cliargs.tunable_overrides`); None when there are none
    (each rank then reads its environment)."""
    if not overrides:
        return None
    return replace(PdTunables.from_env(), **overrides)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    """Everything a node needs; ``role`` decides whether its ranks join PD."""

    role: NodeRole
    engine: EngineConfig
    dp: int = 1
    host: str = "127.0.0.1"  #: HTTP bind address
    port: int = 8100
    #: prefill: an external bootstrap server (host:port) the ranks register with; "" = the
    #: node hosts its own on ``bootstrap_port`` (bound to ``host``)
    bootstrap: str = ""
    bootstrap_port: int = BOOTSTRAP_PORT  #: the node's own bootstrap server (0 = any free port)
    #: Serve the operator ``DELETE /ranks`` endpoints on the node's own bootstrap server. Off
    #: by default: that server listens on the node's ``host`` (often a wildcard), and a stray
    #: DELETE would make every decode node's look-up of this P instance fail until it restarts.
    bootstrap_admin: bool = False
    #: The bootstrap address decode nodes are told (``/info``); "" = ``bootstrap``.
    bootstrap_advertised: str = ""
    #: The address the ranks' sockets bind and other nodes reach them at (ZMQ control, the
    #: Mooncake session name); None: :meth:`ranks_host` picks one.
    advertise: str | None = None
    protocol: str = "tcp"
    ib_device: str = ""
    tunables: PdTunables | None = None
    #: prefill: stream each chunk's KV this many layers at a time during its forward (0: off)
    layerwise_interval: int = 0
    #: prefill: admit and prefill a request before its room is Bootstrapped (PdConfig)
    prefill_early: bool = True
    model_name: str = "tspd-tiny"
    #: Bootstrap servers a decode node may contact besides its own hosts' (``HOST:PORT``,
    #: ``HOST:*``, ``*``; :mod:`tspd_engine.node.allow`). Empty: its own hosts only.
    allow_bootstrap: tuple[str, ...] = ()
    http: HttpLimits = field(default_factory=HttpLimits)
    #: Requests the node holds at most, running and queued (one more gets a 503 ``busy``);
    #: 0: :data:`HELD_PER_RUNNING` × ``max_running`` × ``dp``.
    max_queued_requests: int = 0

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ConfigError(f"a node runs at least one replica, got dp={self.dp}")
        if self.layerwise_interval and self.role is not NodeRole.PREFILL:
            raise ConfigError("layerwise streaming is a prefill node's setting (P sends the KV)")
        if self.max_queued_requests < 0:
            raise ConfigError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.layerwise_interval < 0:
            raise ConfigError(f"layerwise interval must be >= 0, got {self.layerwise_interval}")
        external = self.bootstrap and not self.bootstrap_advertised  # hosted: both set
        if self.bootstrap_admin and (self.role is not NodeRole.PREFILL or external):
            raise ConfigError(
                "bootstrap_admin applies to the bootstrap server a prefill node hosts "
                "(an external server has its own --admin)"
            )
        if self.allow_bootstrap and self.role is not NodeRole.DECODE:
            raise ConfigError(
                "--allow-bootstrap is a decode node's flag (a prefill node contacts only its "
                "own bootstrap server)"
            )
        for entry in self.allow_bootstrap:
            try:
                parse_entry(entry)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    def allowlist(self) -> BootstrapAllowlist | None:
        """The bootstrap servers this node's requests may name (:mod:`tspd_engine.node.allow`);
        call it on the spec :func:`host_bootstrap` returns (a prefill node's own address)."""
        if self.role is NodeRole.PREFILL:
            own = {a for a in (self.bootstrap, self.bootstrap_advertised) if a}
            return BootstrapAllowlist.of(sorted(own), OWN_ONLY)
        if self.role is NodeRole.DECODE:
            if self.allow_bootstrap:
                return BootstrapAllowlist.of(self.allow_bootstrap)
            hosts = [self.host, self.advertise]
            if any(h in _WILDCARDS for h in hosts if h is not None) or self.advertise is None:
                hosts.append(_auto_host())  # what the ranks pick without a host
            return BootstrapAllowlist.own_hosts(*hosts)
        return None

    def ranks_host(self) -> str:
        """Where the ranks' sockets bind and peers reach them: ``advertise``, else
        ``$TSPD_HOST``, else ``host`` when it names one address, else the default route's
        source address (a wildcard ``host`` names none)."""
        if self.advertise:
            return self.advertise
        if os.environ.get(HOST_ENV) or self.host in _WILDCARDS:
            return _auto_host()
        return self.host

    def replica_engine(self, dp_rank: int) -> EngineConfig:
        """The engine config of replica ``dp_rank``: its own step log file (if any)."""
        if self.engine.step_log is None:
            return self.engine
        return self.engine.replace(step_log=replica_log(self.engine.step_log, dp_rank, self.dp))

    def pd(self, dp_rank: int) -> PdConfig | None:
        if self.role is NodeRole.COLOCATED:
            return None
        return PdConfig(
            role=PdRole(self.role.value),
            bootstrap=self.bootstrap,
            host=self.ranks_host(),
            protocol=self.protocol,
            ib_device=self.ib_device,
            dp_size=self.dp,
            dp_rank=dp_rank,
            tunables=self.tunables,
            layerwise_interval=self.layerwise_interval,
            prefill_early=self.prefill_early,
        )

    def info(self) -> NodeInfo:
        cfg = self.engine
        model = resolve_model(cfg)  # a checkpoint's own vocabulary and positions
        return NodeInfo(
            role=self.role,
            model=self.model_name,
            tp=cfg.tp,
            dp=self.dp,
            bootstrap=self.bootstrap_advertised or self.bootstrap or None,
            bootstrap_hosted=bool(self.bootstrap_advertised),
            page_size=cfg.page_size,
            num_pages=cfg.num_pages,
            max_model_len=cfg.max_model_len or model.max_position_embeddings,
            vocab_size=model.vocab_size,
            max_queued_requests=self.capacity(),
        )

    def capacity(self) -> int:
        """The requests the node holds at most (``max_queued_requests`` or its default)."""
        return self.max_queued_requests or HELD_PER_RUNNING * self.engine.max_running * self.dp


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


Ready = Callable[[str, NodeInfo], None]


def run_node(spec: NodeSpec, ready: Ready | None = None) -> int:
    """Start, serve until SIGINT/SIGTERM, stop; 0 after a clean stop, :data:`EXIT_RANK_DIED`
    when a rank process died under the node (raises on a failed start, with whatever started
    stopped: :class:`ConfigError` when the HTTP address or the node's bootstrap server cannot
    be bound, before any rank starts)."""
    # The HTTP address is bound first: a taken port is refused in a second, not after every
    # replica has started (and then been stopped again).
    sock = bind_socket(spec.host, spec.port, "choose another --port")
    trace.label(f"{spec.role.value}-node")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a stop during start-up, too
    handles: list[EngineHandle] = []
    server: BootstrapServer | None = None
    code = 0
    try:
        tokenizer = load_tokenizer(spec.engine.checkpoint)  # a bad tokenizer fails before ranks
        spec, server = host_bootstrap(spec)
        for rank in range(spec.dp):  # one by one: an interrupt leaves the started ones here
            handles.append(launch(spec.replica_engine(rank), pd=spec.pd(rank)))  # noqa: PERF401
        signal.signal(signal.SIGTERM, previous)  # serving: the event loop's handler takes over
        metrics = [h.addrs.metrics for h in handles]
        node = Node([h.client for h in handles], spec.info(), metrics, spec.allowlist())
        try:
            url = f"http://{_url_host(spec.host)}:{sock.getsockname()[1]}"
            code = asyncio.run(_serve(node, tokenizer, sock, url, ready, spec.http))
        finally:
            node.close()
    except KeyboardInterrupt:
        log.info("interrupted; stopping the node")
    finally:
        signal.signal(signal.SIGTERM, previous)  # also after a failed start (an embedder's)
        sock.close()
        for handle in handles:
            # A replica that lost a rank cannot take a shutdown round: end it at once.
            handle.shutdown(STOP_TIMEOUT_S if handle.alive() else BROKEN_REPLICA_STOP_S)
        if server is not None:
            server.close()  # after the ranks: D's heartbeats see P whole until it is gone
    return code


def host_bootstrap(spec: NodeSpec) -> tuple[NodeSpec, BootstrapServer | None]:
    """Start a prefill node's own bootstrap server unless ``spec`` names an external one.

    Returns the spec the replicas start with (their ranks register at the server's local
    URL; decode nodes are told the advertised address) and the server, which the caller
    closes after the replicas. Its operator ``DELETE /ranks`` endpoints answer 403 unless
    ``spec.bootstrap_admin``.
    """
    if spec.role is not NodeRole.PREFILL or spec.bootstrap:
        return spec, None
    server = BootstrapServer(
        spec.host,
        spec.bootstrap_port,
        layout_canonicalizer=canonical_layout,
        allow_admin=spec.bootstrap_admin,
        header_timeout=spec.http.header_timeout_s,
        credential=ClusterCredential.resolve(),  # $TSPD_CLUSTER_TOKEN[_FILE], as the ranks'
    )
    try:
        server.start()
    except BindError as exc:
        raise ConfigError(
            f"cannot host the bootstrap server: {exc} (choose another --bootstrap-port, or "
            "--bootstrap HOST:PORT to use an external one)"
        ) from exc
    # Decode nodes reach the server where it listens: --host, unless that is a wildcard
    # (then where they reach the ranks).
    host = spec.ranks_host() if spec.host in _WILDCARDS else spec.host
    local = server.url.removeprefix("http://")
    return replace(spec, bootstrap=local, bootstrap_advertised=f"{host}:{server.port}"), server


def _auto_host() -> str:
    """The address a rank advertises when given none: ``$TSPD_HOST``, else the default
    route's source address."""
    return os.environ.get(HOST_ENV) or route_source_ip("127.0.0.1")


async def _serve(
    node: Node,
    tokenizer: Tokenizer,
    sock: socket.socket,
    url: str,
    ready: Ready | None,
    limits: HttpLimits,
) -> int:
    """Serve until a signal (0) or a rank's death (:data:`EXIT_RANK_DIED`)."""
    runner = web.AppRunner(
        make_app(node, tokenizer, limits),
        access_log=None,
        handler_cancellation=True,  # a caller that goes away aborts its request
        shutdown_timeout=SHUTDOWN_GRACE_S,
        **limits.runner_kwargs(),
    )
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready(url, node.info)
        watch = asyncio.create_task(_watch_ranks(node), name="tspd-node-watch")
        signalled = asyncio.create_task(stop.wait())
        await asyncio.wait({watch, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if not watch.done():
            watch.cancel()
            return 0
        log.error("%s; stopping the node (exit code %d)", watch.result(), EXIT_RANK_DIED)
        return EXIT_RANK_DIED
    finally:
        await runner.cleanup()


async def _watch_ranks(node: Node) -> str:
    """Return what died once a rank process of any replica is gone."""
    while True:
        try:
            node.check_alive()
        except EngineDeadError as exc:
            return str(exc)
        await asyncio.sleep(WATCH_INTERVAL_S)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
