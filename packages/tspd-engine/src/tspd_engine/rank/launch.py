"""Start an engine replica (TP ranks as processes, or one rank in a thread) and stop it cleanly.

``launch(cfg)`` starts ``cfg.tp`` rank processes with ``torch.multiprocessing`` (gloo on CPU),
waits until they are ready and returns an :class:`EngineHandle` holding an
:class:`~tspd_engine.rank.client.EngineClient`. ``launch(cfg, in_process=True)`` runs a TP 1
rank in a daemon thread of the calling process instead, behind the same client.

No port is chosen before it is bound: the gloo rendezvous is a ``TCPStore`` this process
listens on (port 0, the OS picks), and each rank binds its ZMQ sockets (rank 0's intake, every
rank's peer metrics) to port 0 itself and reports the bound addresses back on a queue; the
last report, rank 0's, comes once every rank is built (it is the readiness signal).

Everything here listens on loopback only: a replica's ranks all run on this host, so its
rendezvous, its gloo pairs (:meth:`~tspd_engine.model.tp.TpGroup.init_gloo`) and its ZMQ
sockets have no business on an address other hosts reach. ``TCPStore`` given a host name
still listens on every address, so the store gets a socket this module bound to
``127.0.0.1`` (``master_listen_fd``).

Ranks start from a ``forkserver`` that imports torch, numpy, zmq and tspd's modules once
(:data:`RANK_PRELOAD`, a superset of what PD's transfer workers preload): a rank is a fork
of that clean, single-threaded server, not a fresh interpreter importing torch again (~1.7 s
of CPU a rank on this project's 2-core machine), and it never inherits the launcher's threads
or a CUDA context. Two things a fresh interpreter had for free are passed on explicitly: the
launcher's environment as it is at ``launch`` (the server's is the one it started with;
``rank_main`` installs the one it is given before anything reads it), and the launcher's
liveness (a rank's parent is the server, so the orphan check watches the launcher's end of
the start pipe, ``multiprocessing.parent_process``, not ``os.getppid``). A PD rank's
transfer worker comes from the same server (:mod:`tspd_core.pd.proc.forkserver`): the rank
is handed the server's address instead of starting a server of its own (~2 s of CPU a rank).

Shutdown asks rank 0 to stop (it broadcasts the shutdown round), joins every process, then
terminates and finally kills any that did not exit in time, so no rank is left behind.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported

from tspd_core.layout.errors import ContractError
from tspd_core.layout.recipe import build_contract
from tspd_core.pd.proc import forkserver
from tspd_core.pd.proc.handle import PRELOAD
from tspd_core.procname import name_this_thread
from tspd_engine.config import EngineConfig
from tspd_engine.errors import EngineDeadError
from tspd_engine.model.build import resolve_model
from tspd_engine.model.kv_arena import arena_spec
from tspd_engine.model.tp import ShardPlan, TpGroup
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.rank.client import EngineClient
from tspd_engine.rank.intake import Intake
from tspd_engine.rank.process import (
    ANY_PORT,
    RankAddresses,
    RankReport,
    build_core,
    rank_main,
    serve,
    serve_peer_metrics,
)
from tspd_engine.rank.pulse import Pulse, Vitals, vitals
from tspd_engine.rank.steps import StepLog, check_writable
from tspd_serving.errors import ConfigError

log = logging.getLogger(__name__)

#: What the ranks' forkserver imports before it forks a rank: the heavy imports every rank
#: makes, and nothing that reads the environment at import (each rank installs the
#: launcher's first). PD's transfer workers' list and the rank's own module, so whichever
#: starts this process's server first, ranks and workers find their modules loaded.
RANK_PRELOAD = [*PRELOAD, "tspd_engine.rank.process"]


class EngineHandle:
    """A running replica: its ranks (processes or one thread), their pulses (rank order,
    :mod:`.pulse`) and a client bound to rank 0 that watches them."""

    def __init__(
        self,
        cfg: EngineConfig,
        addrs: RankAddresses,
        procs: list[Any],
        thread: threading.Thread | None = None,
        stop: threading.Event | None = None,
        store: TCPStore | None = None,
        pulses: list[Pulse] | None = None,
    ) -> None:
        self.cfg = cfg
        self.addrs = addrs
        self.procs = procs
        self.pulses = pulses or []
        self._thread = thread
        self._stop = stop
        self._store = store  # the ranks' rendezvous, served by this process while they run
        self.client = EngineClient(addrs.intake, addrs.token, vitals=self.vitals)

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.procs]

    def alive(self) -> bool:
        """Whether every rank still runs (a dead rank means the replica is dead)."""
        if self._thread is not None:
            return self._thread.is_alive()
        return all(p.is_alive() for p in self.procs)

    def vitals(self) -> Vitals:
        """The replica's signs of life now (dead ranks, silent ranks, rank 0's iterations),
        read without asking the engine loop; cheap enough to call per request wait."""
        if self._thread is not None:
            dead = "" if self._thread.is_alive() else "the engine thread has exited"
        else:
            gone = [(r, p) for r, p in enumerate(self.procs) if not p.is_alive()]
            dead = ", ".join(f"rank {r} (pid {p.pid}) exited" for r, p in gone)
        return vitals(self.pulses, dead)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every rank; after ``timeout`` terminate, then kill, stragglers. Idempotent."""
        if self.alive():
            with suppress(EngineDeadError):  # a rank 0 that reads nothing: stopped below
                self.client.shutdown_engine()
        if self._stop is not None:
            self._stop.set()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        _join_or_kill(self.procs, deadline, timeout)
        self.client.close()
        self._store = None

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _join_or_kill(procs: list[Any], deadline: float, timeout: float) -> None:
    """Join ``procs`` until ``deadline``; terminate, then kill, the ones still running."""
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            log.warning("rank pid %s did not exit in %.0f s; terminating", proc.pid, timeout)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def check_config(cfg: EngineConfig) -> None:
    """Fail fast, in the caller, on what every rank would refuse (:class:`ConfigError`):
    the device, the step log's path, the model's split over ``cfg.tp`` ranks and every rank's
    arena layout."""
    _check_device(cfg.device)
    if cfg.step_log is not None:
        check_writable(cfg.step_log)
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
    ignored signal stays ignored across exec: a forkserver started here ignores it, and so
    do the ranks it forks; a transfer worker ignores it whoever forks it, ``proc/handle.py``).

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
    # The intake token: a fresh secret per replica, known to this process and its ranks only.
    binds = RankAddresses("", ANY_PORT, (ANY_PORT,) * (cfg.tp if pd else 0), secrets.token_hex(16))
    if in_process:
        return _launch_thread(cfg, binds, ready_timeout_s, pd)
    store = _loopback_store(datetime.timedelta(seconds=cfg.group_timeout_s))
    binds = RankAddresses(f"127.0.0.1:{store.port}", binds.intake, binds.metrics, binds.token)
    ctx: Any = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # no effect once this process's server runs
    reports = ctx.Queue()
    env = dict(os.environ)
    pulses = [Pulse(ctx) for _ in range(cfg.tp)]
    with sigint_ignored():
        server = forkserver.running(RANK_PRELOAD)  # the ranks start their workers from it too
        procs = [
            ctx.Process(
                target=rank_main,
                args=(cfg, r, binds, reports, pd, env, server, pulses[r]),
                daemon=True,
                name=f"tspd-rank{r}",
            )
            for r in range(cfg.tp)
        ]
        for proc in procs:
            proc.start()
    got: dict[int, RankReport] = {}
    deadline = time.monotonic() + ready_timeout_s
    while len(got) < cfg.tp:
        try:
            report: RankReport = reports.get(timeout=0.1)
            got[report.rank] = report
            continue
        except queue.Empty:
            pass
        dead = [p for p in procs if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            for proc in procs:  # nobody to send a shutdown round to before rank 0 reported
                proc.terminate()
            _join_or_kill(procs, time.monotonic() + 5, 5)
            reports.close()
            what = f"rank process exited with code {dead[0].exitcode}" if dead else "timed out"
            raise EngineDeadError(f"engine failed to start ({what}); see the ranks' logs")
    reports.close()
    metrics = tuple(got[r].metrics for r in range(cfg.tp)) if pd else ()
    addrs = RankAddresses(binds.store, got[0].intake, metrics, binds.token)
    return EngineHandle(cfg, addrs, procs, store=store, pulses=pulses)


def _loopback_store(timeout: datetime.timedelta) -> TCPStore:
    """The ranks' rendezvous, listening on ``127.0.0.1`` and nowhere else (a ``TCPStore``
    that binds its own socket listens on the wildcard address whatever host it is given)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = TCPStore(
            "127.0.0.1", port, None, True, timeout,
            wait_for_workers=False, master_listen_fd=sock.fileno(),
        )  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it with the store
    return store


def _launch_thread(
    cfg: EngineConfig, binds: RankAddresses, timeout: float, pd: PdConfig | None
) -> EngineHandle:
    if cfg.tp != 1:
        raise ConfigError(f"an in-process engine runs one rank; got tp={cfg.tp}")
    ready, stop = threading.Event(), threading.Event()
    failure: list[BaseException] = []
    bound: list[RankAddresses] = []
    pulse = Pulse()
    beating = pulse.start_beating()

    def body() -> None:
        name_this_thread()
        tp = TpGroup()
        steps = None
        try:
            steps = StepLog(cfg.tp, cfg.step_log)
            core = build_core(cfg, tp, pd)
            responder = serve_peer_metrics(core, binds, 0)
            intake = Intake(binds.intake, binds.token)
        except BaseException as exc:
            if steps is not None:
                steps.close()
            failure.append(exc)
            ready.set()
            raise
        metrics = (responder.address,) if responder is not None else ()
        bound.append(RankAddresses("", intake.address, metrics, binds.token))
        ready.set()
        try:
            serve(core, tp, intake, stop, steps, pulse)
        finally:
            beating.set()
            steps.close()
            intake.close()
            if responder is not None:
                responder.close()
            core.close()

    thread = threading.Thread(target=body, name="tspd-engine", daemon=True)
    thread.start()
    ready.wait(timeout)
    if failure or not ready.is_set():
        stop.set()
        beating.set()
        raise EngineDeadError(f"in-process engine failed to start: {failure[:1]}")
    return EngineHandle(cfg, bound[0], [], thread, stop, pulses=[pulse])
