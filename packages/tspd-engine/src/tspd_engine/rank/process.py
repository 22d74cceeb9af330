"""The body of one rank: build the core, then serve rounds until shutdown.

Every rank runs the same loop; only rank 0 owns the intake (the client-facing sockets)::

    rank 0:  collect intake ─ broadcast Round ─ apply ─ core.step ─ send outputs ─┐
    rank k:                   receive Round  ─ apply ─ core.step ─────────────────┤ (lockstep:
             ◀───────────────────────────────────────────────────────────────────┘  collectives
                                                                                    inside step)

Rank 0 waits for intake only while the core is idle, and broadcasts a round at least every
``IDLE_POLL_S`` so the other ranks notice a shutdown (or rank 0's death: their broadcast fails
and they exit). A rank whose parent process died shuts the group down. While requests wait
on a PD peer, the wait also ends as soon as the peer's worker publishes something (its notes
descriptor, ``EngineCore.wake_fds``), so a room's events are acted on at once rather than at
the next poll.
"""

from __future__ import annotations

import gc
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from tspd_core import trace
from tspd_core.pd.proc import forkserver
from tspd_core.procname import set_process_name
from tspd_engine.config import EngineConfig
from tspd_engine.errors import EngineError
from tspd_engine.frames import Output, RoomAbort, Round, Submit
from tspd_engine.loop.core import EngineCore
from tspd_engine.model.tp import TpGroup
from tspd_engine.pdlink import attach, peer_of
from tspd_engine.pdlink.config import PdConfig
from tspd_engine.pdlink.peer_metrics import MetricsResponder
from tspd_engine.rank.intake import Intake, broadcast_round
from tspd_engine.rank.pulse import Pulse
from tspd_engine.rank.steps import StepLog

log = logging.getLogger(__name__)
#: Idle, rank 0 broadcasts an empty round this often (a shutdown or a new request ends the
#: wait at once; a dead launcher is noticed within it): each empty round is a gloo broadcast
#: on every rank, so an idle node's CPU scales with this rate (docs/measurements/idle.md).
IDLE_POLL_S = 1.0
#: Intake wait while requests are tracked but none can compute (waiting on a PD peer).
HELD_POLL_S = 0.002
#: Rounds between cross-rank checks of the scheduler state (and at shutdown).
VERIFY_EVERY = 16


#: What a rank binds its ZMQ sockets to: a loopback port the OS picks as it binds.
ANY_PORT = "tcp://127.0.0.1:*"


@dataclass(frozen=True, slots=True)
class RankAddresses:
    """Where a replica's ranks meet: the gloo rendezvous and rank 0's intake socket.

    The launcher hands the ranks the addresses to bind (:data:`ANY_PORT`: the OS picks the
    port) and keeps the ones they report once bound (:class:`RankReport`)."""

    store: str  # host:port of the torch.distributed TCPStore (the launcher serves it)
    intake: str  # tcp://host:port rank 0 binds for clients
    #: tcp://host:port per rank where its PD peer's metrics are scraped (empty without PD)
    metrics: tuple[str, ...] = ()
    #: The secret every intake message carries (drawn by the launcher; never on a command line)
    token: str = ""


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a rank tells its launcher once its sockets are bound (rank 0: once every rank
    is built, which makes rank 0's report the replica's readiness)."""

    rank: int
    intake: str  # rank 0's bound intake address; "" on the other ranks
    metrics: str  # this rank's bound peer metrics address; "" without a PD peer


class QueueLike(Protocol):
    """A ``multiprocessing`` queue (what ``rank_main`` reports on)."""

    def put(self, obj: RankReport) -> None: ...


def apply_round(core: EngineCore, rnd: Round) -> list[Output]:
    """Apply a round's intake events to the core in order; the refusals come back."""
    outputs: list[Output] = []
    for event in rnd.events:
        if isinstance(event, Submit):
            outputs += core.submit(event)  # fails a request it cannot take alone
            continue
        if isinstance(event, RoomAbort):
            core.abort_room(event.room, event.reason)  # never raises: logs what went wrong
            continue
        try:
            outputs += core.abort(event.rid)
        except Exception:  # the same on every rank: each logs it and goes on
            log.exception("abort of %s failed; the request goes on", event.rid)
    return outputs


def verify_ranks(core: EngineCore, tp: TpGroup) -> None:
    """Raise on every rank if any rank's scheduler state differs (one MIN all-reduce of the
    digest and its negation). Block ids must agree: PD transfers address pages by id."""
    mine = core.state_digest()
    both = tp.all_reduce_min(torch.tensor([mine, -mine], dtype=torch.int64))
    if int(both[0]) != -int(both[1]):
        raise EngineError(
            f"rank {tp.rank}: scheduler state diverged across the TP group (digest {mine:x}); "
            "every rank must apply the same intake in the same order"
        )


def launcher_alive() -> Callable[[], bool]:
    """Whether the process that started this one still runs, as a cheap check.

    A rank started from a forkserver is the server's child, so ``os.getppid`` says nothing
    about the launcher; ``multiprocessing`` keeps the launcher's end of the start pipe open
    for as long as it lives (spawn and forkserver alike), and the child's end reads EOF once it
    is gone. In a process ``multiprocessing`` did not start (an in-thread engine in its
    launcher), the parent is whatever started the process, watched through ``os.getppid``.
    """
    parent = multiprocessing.parent_process()
    if parent is not None:
        return parent.is_alive
    first = os.getppid()
    return lambda: os.getppid() == first


def serve(
    core: EngineCore,
    tp: TpGroup,
    intake: Intake | None,
    stop: threading.Event | None = None,
    steps: StepLog | None = None,
    pulse: Pulse | None = None,
) -> None:
    """Run rounds until a shutdown round; rank 0 passes its intake (and its step log: the
    rounds' timings, :mod:`.steps`), the others ``None``. ``pulse``: where each iteration's
    start is noted for the launcher (:mod:`.pulse`)."""
    launcher = launcher_alive()
    for rounds in itertools.count(1):
        if pulse is not None:
            pulse.loop_began()
        rnd: Round | None = None
        if intake is not None:
            rnd = intake.collect(_wait_s(core), core.wake_fds())
            orphaned = not launcher() or (stop is not None and stop.is_set())
            if orphaned and not rnd.shutdown:
                rnd = Round(rnd.events, shutdown=True)
        started = time.perf_counter()  # the wait for intake is not the round's
        rnd = broadcast_round(tp, rnd)
        outputs = apply_round(core, rnd)
        if tp.size > 1 and (rnd.shutdown or rounds % VERIFY_EVERY == 0):
            verify_ranks(core, tp)
        if rnd.shutdown:
            outputs += core.abort_all("engine shutting down")
        elif core.has_work:
            outputs += core.step()
        if intake is not None and outputs:
            intake.send(outputs)
        core.after_round()  # after the outputs: a PD prefill's hand-overs (see PdHooks)
        shape = core.runner.take_shape()
        if steps is not None:
            steps.record(shape, time.perf_counter() - started)
        if intake is not None and intake.queries:
            intake.answer(core.stats() | (steps.stats() if steps is not None else {}))
        if rnd.shutdown:
            return
        if not core.has_work:
            core.on_idle()  # every rank: what its hooks deferred goes before the idle wait


def _wait_s(core: EngineCore) -> float:
    # Compute waits for nobody; requests parked on a peer (PD) poll often; idle ranks doze.
    if core.busy:
        return 0.0
    return HELD_POLL_S if core.has_work else IDLE_POLL_S


def build_core(cfg: EngineConfig, tp: TpGroup, pd: PdConfig | None) -> EngineCore:
    """This rank's core, joined to its PD peer when the replica serves a PD role (the peer's
    worker starts here: a prefill rank is registered with its bootstrap server on return)."""
    core = EngineCore.build(cfg, tp)
    if pd is not None:
        # A rank process is daemonic to its parent (it dies with the launcher), but it starts
        # its transfer worker itself, which multiprocessing refuses to daemonic processes.
        # The worker is daemonic to the rank and also stops when the rank's pipe closes.
        multiprocessing.current_process().daemon = False
        try:
            attach(core, pd)
        except BaseException:
            core.close()
            raise
    return core


def rank_main(
    cfg: EngineConfig,
    rank: int,
    addrs: RankAddresses,
    report: QueueLike | None = None,
    pd: PdConfig | None = None,
    env: Mapping[str, str] | None = None,
    server: forkserver.Server | None = None,
    pulse: Pulse | None = None,
) -> None:
    """Entry point of a rank process (``torch.multiprocessing`` forkserver or spawn target).

    ``addrs`` says what to bind (and where the rendezvous is). Each rank puts its
    :class:`RankReport` on ``report`` once its sockets are bound; rank 0 only once every rank
    has built its model and arena (and started its PD peer, with ``pd``) and the intake is
    bound. Exits after a shutdown round, or with an error if the group breaks. ``env``: the
    launcher's environment, installed first (a forkserver's child has the server's).
    ``server``: the forkserver that started this rank, which starts its workers too.
    ``pulse``: the slots this rank's signs of life go to (:mod:`.pulse`), beaten from the
    first moment on.
    """
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    forkserver.adopt(server)
    beating = pulse.start_beating() if pulse is not None else None
    # The launching process decides when ranks stop (launch.sigint_ignored says why); its
    # transfer worker, started below, ignores SIGINT too (its engine decides when it stops).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    trace.label(f"{pd.role.value if pd is not None else 'colocated'}-rank{rank}")
    set_process_name(f"tspd-{pd.role.value[0] + '-' if pd is not None else ''}rank{rank}")
    level = os.environ.get("TSPD_LOG_LEVEL", "INFO").upper()  # set by the launcher's --log-level
    logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(name)s %(message)s")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.batch_sched and torch.device(cfg.device).type == "cpu":
        batch_sched()
    tp = TpGroup.init_gloo(rank, cfg.tp, addrs.store, cfg.group_timeout_s)
    intake = None
    core = None
    responder = None
    steps = None
    try:
        steps = StepLog(cfg.tp, cfg.step_log) if rank == 0 else None
        core = build_core(cfg, tp, pd)
        responder = serve_peer_metrics(core, addrs, rank)
        intake = Intake(addrs.intake, addrs.token) if rank == 0 else None
        metrics = responder.address if responder is not None else ""
        if report is not None and rank != 0:
            report.put(RankReport(rank, "", metrics))
        tp.barrier()  # every rank has its model, arena and peer before rank 0 takes requests
        if report is not None and intake is not None:
            report.put(RankReport(rank, intake.address, metrics))
        serve(core, tp, intake, steps=steps, pulse=pulse)
    finally:
        if beating is not None:
            beating.set()
        if steps is not None:
            steps.close()
        if responder is not None:
            responder.close()  # before the peer it asks goes
        if core is not None:
            core.close()
        if intake is not None:
            intake.close()
        tp.destroy()
        skip_exit_collection()


def batch_sched() -> bool:
    """Move the calling thread, and the threads it starts from now on, to Linux's SCHED_BATCH
    (no privilege needed). The kernel then treats it as throughput work: a thread that wakes
    on its core (the rank's transfer worker, Mooncake's lanes, D's scatter) preempts it at once
    instead of waiting out its slice. False, logged, where the platform has no such policy."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None:
        log.info("no SCHED_BATCH on this platform: the rank keeps the normal policy")
        return False
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.info("SCHED_BATCH refused (%s): the rank keeps the normal policy", exc)
        return False
    return True


def skip_exit_collection() -> None:
    """Let the interpreter exit without its final garbage collection.

    Everything that needs closing is closed; what is left is the model, the arena and the
    imports (torch's, a GGUF's vocabulary: ~200,000 tracked objects), which the process's exit
    returns anyway. Python's last collection walks them all first: 1-9 s measured on the
    loaded 2-core machine, enough to push a TP 3 node's stop past its supervisor's bound.
    ``gc.freeze`` moves them to the permanent generation, which that collection skips.
    Call it only where the process ends next (a rank process, a node's main).
    """
    gc.freeze()


def serve_peer_metrics(
    core: EngineCore, addrs: RankAddresses, rank: int
) -> MetricsResponder | None:
    """Answer scrapes of this rank's PD peer metrics at ``addrs.metrics[rank]`` (bound here;
    the responder's ``address`` is the bound one) from a thread of its own (the engine loop
    never waits on them); ``None`` without a PD peer."""
    peer = peer_of(core)
    if peer is None or not addrs.metrics:
        return None
    return MetricsResponder(addrs.metrics[rank], peer.metrics).start()
