"""Start an engine replica (TP ranks as processes, or one rank in a thread) and stop it cleanly.

``launch(cfg)`` spawns ``cfg.tp`` rank processes with ``torch.multiprocessing`` (spawn
context, gloo on CPU), waits until they are ready and returns an :class:`EngineHandle` holding
an :class:`~tspd_engine.client.EngineClient`. ``launch(cfg, in_process=True)`` runs a TP 1
rank in a daemon thread of the calling process instead, behind the same client.

Shutdown asks rank 0 to stop (it broadcasts the shutdown round), joins every process, then
terminates and finally kills any that did not exit in time, so no rank is left behind.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.multiprocessing as mp

from tspd_core.layout.errors import ContractError
from tspd_core.layout.recipe import build_contract
from tspd_engine.arena import arena_spec
from tspd_engine.build import resolve_model
from tspd_engine.client import EngineClient
from tspd_engine.config import EngineConfig
from tspd_engine.errors import ConfigError, EngineDeadError
from tspd_engine.intake import Intake
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.tp import ShardPlan, TpGroup
from tspd_engine.worker import RankAddresses, build_core, rank_main, serve, serve_peer_metrics

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def bind_socket(host: str, port: int, hint: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) for a server to adopt (aiohttp's
    ``SockSite`` listens on it). Binding first lets a role refuse a taken or foreign address
    before it starts anything; :class:`ConfigError` names the address, the reason and
    ``hint`` (what to change)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"cannot listen on {host}:{port}: {why} ({hint})") from exc
    return sock


class EngineHandle:
    """A running replica: its ranks (processes or one thread) and a client bound to rank 0."""

    def __init__(
        self,
        cfg: EngineConfig,
        addrs: RankAddresses,
        procs: list[Any],
        thread: threading.Thread | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        self.addrs = addrs
        self.procs = procs
        self._thread = thread
        self._stop = stop
        self.client = EngineClient(addrs.intake, alive=self.alive)

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def alive(self) -> bool:
        """Whether every rank still runs (a dead rank means the replica is dead)."""
        if self._thread is not None:
            return self._thread.is_alive()
        return all(p.is_alive() for p in self.procs)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every rank; after ``timeout`` terminate, then kill, stragglers. Idempotent."""
        if self.alive():
            self.client.shutdown_engine()
        if self._stop is not None:
            self._stop.set()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                log.warning("rank pid %s did not exit in %.0f s; terminating", proc.pid, timeout)
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.client.close()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_config(cfg: EngineConfig) -> None:
    """Fail fast, in the caller, on what every rank would refuse (:class:`ConfigError`):
    the device, the model's split over ``cfg.tp`` ranks and every rank's arena layout."""
    _check_device(cfg.device)
    model = resolve_model(cfg)
    for rank in range(cfg.tp):
        ShardPlan.build(model, rank, cfg.tp)
        try:
            build_contract(arena_spec(model, cfg, rank))
        except ContractError as exc:
            raise ConfigError(f"rank {rank}: arena layout refused: {exc}") from exc


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT while rank processes start, so that they start with it ignored (an
    ignored signal stays ignored across exec, and their transfer workers inherit it).

    A terminal's Ctrl-C reaches every process of its foreground group; how ranks stop is for
    the process that launched them to decide (a shutdown round, or the ranks' orphan check),
    not for a KeyboardInterrupt in the middle of a round. Only the main thread may change a
    handler: elsewhere this does nothing, and ``rank_main`` ignores SIGINT as it starts.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"device {device!r} is not available: {why} (use --device cpu)")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} does not exist: {torch.cuda.device_count()} GPU(s)")


def launch(
    cfg: EngineConfig,
    in_process: bool = False,
    ready_timeout_s: float = 300.0,
    pd: PdConfig | None = None,
) -> EngineHandle:
    """Start a replica for ``cfg`` and return once it takes requests.

    With ``pd`` every rank also starts its PD transfer peer (docs/engine.md, PD wiring).
    Raises :class:`EngineDeadError` (with every started rank stopped) if a rank exits or the
    replica is not ready within ``ready_timeout_s``.
    """
    check_config(cfg)
    metrics = tuple(f"tcp://127.0.0.1:{free_port()}" for _ in range(cfg.tp if pd else 0))
    addrs = RankAddresses(f"127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", metrics)
    if in_process:
        return _launch_thread(cfg, addrs, ready_timeout_s, pd)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    procs = [
        ctx.Process(
            target=rank_main, args=(cfg, r, addrs, ready, pd), daemon=True, name=f"tspd-rank{r}"
        )
        for r in range(cfg.tp)
    ]
    with sigint_ignored():
        for proc in procs:
            proc.start()
    deadline = time.monotonic() + ready_timeout_s
    while not ready.wait(0.1):
        dead = [p for p in procs if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            EngineHandle(cfg, addrs, procs).shutdown(timeout=5)
            what = f"rank process exited with code {dead[0].exitcode}" if dead else "timed out"
            raise EngineDeadError(f"engine failed to start ({what}); see the ranks' logs")
    return EngineHandle(cfg, addrs, procs)


def _launch_thread(
    cfg: EngineConfig, addrs: RankAddresses, timeout: float, pd: PdConfig | None
) -> EngineHandle:
    if cfg.tp != 1:
        raise ConfigError(f"an in-process engine runs one rank; got tp={cfg.tp}")
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def body() -> None:
        tp = TpGroup()
        try:
            core = build_core(cfg, tp, pd)
            responder = serve_peer_metrics(core, addrs, 0)
            intake = Intake(addrs.intake)
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            raise
        ready.set()
        try:
            serve(core, tp, intake, stop)
        finally:
            intake.close()
            if responder is not None:
                responder.close()
            core.close()

    thread = threading.Thread(target=body, name="tspd-engine", daemon=True)
    thread.start()
    ready.wait(timeout)
    if failure or not ready.is_set():
        stop.set()
        raise EngineDeadError(f"in-process engine failed to start: {failure[:1]}")
    return EngineHandle(cfg, addrs, [], thread, stop)
