"""TokenSpeed's PD managers in a process of their own, driven from the test.

TokenSpeed's managers start threads that never end (its bootstrap and status threads are not
daemons) and have no close, so they live in one child process for the whole test module; the
test talks to it over a pipe and ends it with ``os._exit``. The child runs TokenSpeed's code as
it is: its bootstrap server, ``MooncakeKVManagerPrefill`` / ``MooncakeKVManagerDecode``,
``MooncakeKVSender`` / ``MooncakeKVReceiver`` and its manifest builder. The harness plays only
what TokenSpeed's executors do around them (create a sender or receiver per room, publish the
manifest once bootstrapped, hand the source manifest and first token to the sender, poll).

Three machine adaptations (the fixture's README): Mooncake over ``tcp`` instead of ``rdma``,
the bootstrap server bound to 127.0.0.1, and the loopback address for the local-IP look-up
(:mod:`tspd_testing.interop.env`). The arenas are torch tensors in shared memory, made by the
test, so the test writes the source identities and checks the destination bytes itself. Every log
record of ERROR or above in the child is kept and handed back on request.

A child may hold a whole instance (the tests) or some of its ranks (the benchmark: a child per
rank, as TokenSpeed runs a process per rank; the first P rank's child hosts the bootstrap
server). The stand-in executor polls when TokenSpeed's managers change a room's status (a hook
after their ``update_status`` wakes it) or every ``POLL_S``, so a timed room is not charged
for a poll interval, and it stamps each room's steps (``marks``: perf_counter seconds, the
system-wide monotonic clock on Linux, comparable with the parent's).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.multiprocessing as tmp

LOOPBACK = "127.0.0.1"
POLL_S = 0.002  # the stand-in executor's longest wait between two polls


@dataclass
class _Instance:
    role: str
    tp: int
    ranks: list[int]  # the instance's TP ranks this child holds, managers[i] is ranks[i]
    managers: list[Any]
    contract: Any  # CacheTransferContract (every rank of one instance has the same one)
    arenas: list[Any]  # the shared tensors: kept, or their mapping (and the pointers) goes
    port: int = 0  # P: its bootstrap server's port


_SENT = ("descriptors", "bytes", "calls")


@dataclass
class _State:
    instances: dict[str, _Instance] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    servers: list[Any] = field(default_factory=list)
    news: threading.Event = field(default_factory=threading.Event)  # a status changed
    #: (room, step) -> each held rank's perf_counter stamp of that step: "registered" (sender
    #: or receiver made), "handed" (P: send; D: its manifest published), "done" (final).
    marks: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    #: Descriptors and bytes the P managers handed to Mooncake so far, and their calls.
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SENT, 0))


class _Errors(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def tcp_mooncake() -> None:
    """TokenSpeed's managers ask Mooncake for ``rdma``; this machine has ``tcp`` only."""
    import mooncake.engine

    class TcpTransferEngine(mooncake.engine.TransferEngine):  # type: ignore[misc]
        def initialize(self, hostname: str, metadata: str, protocol: str, device: str) -> int:
            return int(super().initialize(hostname, metadata, "tcp", device))

    mooncake.engine.TransferEngine = TcpTransferEngine


def loopback_bootstrap() -> None:
    """TokenSpeed's bootstrap servers bind every interface; here they bind 127.0.0.1."""
    import aiohttp.web
    from tokenspeed.runtime.pd.base import bootstrap

    class LoopbackWeb:
        """aiohttp.web, with sites bound to the loopback address."""

        def __getattr__(self, name: str) -> Any:
            return getattr(aiohttp.web, name)

        @staticmethod
        def TCPSite(runner: Any, host: str | None = None, **kwargs: Any) -> Any:
            return aiohttp.web.TCPSite(runner, host=host or LOOPBACK, **kwargs)

    bootstrap.web = LoopbackWeb()


def bound_port(server: Any) -> int:
    """The port a TokenSpeed bootstrap server created with port 0 is listening on."""
    assert server._runner is not None, "the server returns from its constructor once bound"
    return int(server._runner.addresses[0][1])


def _serve(conn: Any, environ: dict[str, str]) -> None:
    os.environ.update(environ)  # before Mooncake reads its MC_* knobs
    from tspd_testing.interop import env

    env.load()
    state = _State()
    logging.getLogger().addHandler(_Errors(state.errors))
    logging.getLogger().setLevel(logging.INFO)
    tcp_mooncake()
    loopback_bootstrap()
    handlers: dict[str, Callable[..., Any]] = {
        "start_prefill": lambda *a: _start_prefill(state, *a),
        "start_decode": lambda *a: _start_decode(state, *a),
        "run_prefill": lambda *a: _run_prefill(state, *a),
        "run_decode": lambda *a: _run_decode(state, *a),
        "errors": lambda: list(state.errors),
        "marks": lambda: _take_marks(state),
        "sent": lambda: dict(state.sent),
    }
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            conn.send(("ok", None))
            os._exit(0)  # TokenSpeed's manager threads never end: leave without joining them
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _topology(tp: int, rank: int) -> Any:
    from tokenspeed.runtime.pd.topology import PDParallelTopology

    return PDParallelTopology(
        tp_size=tp, tp_rank=rank, cp_size=1, cp_rank=0, dp_size=1, dp_rank=0, world_size=tp,
        global_rank=rank,
    )  # fmt: skip


def _args(port: int, tp: int, rank: int) -> Any:
    from tokenspeed.runtime.pd.mooncake.entities import KVManagerArgs

    return KVManagerArgs(
        bootstrap_port=port,
        dist_init_addr=f"{LOOPBACK}:0",
        topology=_topology(tp, rank),
        enable_metrics=False,
        enable_dp_attention=False,
        served_model_name="interop",
        app_key="",
        metrics_reporters="",
    )


def _kv_args(contract: Any, arena: Any, rank: int) -> Any:
    from tokenspeed.runtime.pd.mooncake.entities import KVArgs

    return KVArgs(
        engine_rank=rank, kv_data_ptr=arena.data_ptr(), ib_device=None, gpu_id=0,
        cache_layout=contract,
    )  # fmt: skip


def _watch(state: _State, manager: Any) -> Any:
    """Wake the stand-in executor after each status change of ``manager`` and count what it
    hands Mooncake (TokenSpeed's own methods run first, unchanged)."""
    update, write = manager.update_status, manager.engine.batch_transfer_sync

    def update_status(room: int, status: int) -> None:
        update(room, status)
        state.news.set()

    def batch_transfer_sync(session: str, src: list[int], dst: list[int], n: list[int]) -> int:
        ret = int(write(session, src, dst, n))
        state.sent["descriptors"] += len(n)
        state.sent["bytes"] += sum(n)
        state.sent["calls"] += 1
        return ret

    manager.update_status = update_status
    manager.engine.batch_transfer_sync = batch_transfer_sync
    return manager


def _start_prefill(
    state: _State,
    name: str,
    contract_wire: bytes,
    arenas: list[Any],
    tp: int = 0,
    first_rank: int = 0,
    port: int = 0,
) -> int:
    """P ranks ``first_rank ..`` (one per arena) of an instance of ``tp`` ranks (default: all,
    one per arena), and TokenSpeed's bootstrap server unless ``port`` names the instance's."""
    from tokenspeed.runtime.pd.cache_protocol import CacheTransferContract
    from tokenspeed.runtime.pd.mooncake.conn import MooncakeKVBootstrapServer
    from tokenspeed.runtime.pd.mooncake.prefill import MooncakeKVManagerPrefill

    contract = CacheTransferContract.from_wire_bytes(contract_wire)
    if not port:
        server = MooncakeKVBootstrapServer(0)
        state.servers.append(server)
        port = bound_port(server)
    tp = tp or len(arenas)
    ranks = list(range(first_rank, first_rank + len(arenas)))
    managers = [
        _watch(state, MooncakeKVManagerPrefill(_args(port, tp, r), _kv_args(contract, arena, r)))
        for r, arena in zip(ranks, arenas, strict=True)
    ]
    state.instances[name] = _Instance("p", tp, ranks, managers, contract, arenas, port)
    return port


def _start_decode(
    state: _State,
    name: str,
    contract_wire: bytes,
    arenas: list[Any],
    tp: int = 0,
    first_rank: int = 0,
) -> None:
    """D ranks ``first_rank ..`` (one per arena) of a replica of ``tp`` ranks (default: all)."""
    from tokenspeed.runtime.pd.cache_protocol import CacheTransferContract
    from tokenspeed.runtime.pd.mooncake.decode import MooncakeKVManagerDecode

    contract = CacheTransferContract.from_wire_bytes(contract_wire)
    tp = tp or len(arenas)
    ranks = list(range(first_rank, first_rank + len(arenas)))
    managers = [
        _watch(state, MooncakeKVManagerDecode(_args(0, tp, r), _kv_args(contract, arena, r)))
        for r, arena in zip(ranks, arenas, strict=True)
    ]
    state.instances[name] = _Instance("d", tp, ranks, managers, contract, arenas)


def _stamp(state: _State, room: int, step: str, count: int, index: int) -> None:
    state.marks.setdefault((room, step), [0.0] * count)[index] = time.perf_counter()


def _take_marks(state: _State) -> dict[tuple[int, str], list[float]]:
    marks, state.marks = state.marks, {}
    return marks


def _wait_for_news(state: _State) -> None:
    state.news.wait(POLL_S)
    state.news.clear()


class _Tables:
    """A forward batch of one request, as ``build_cache_block_manifest`` reads it."""

    def __init__(self, tables: dict[str, list[int]]) -> None:
        self.tables = tables

    def block_tables_arrays(self) -> dict[str, Any]:
        return {g: np.asarray([row], dtype=np.int64) for g, row in self.tables.items()}


def _run_prefill(
    state: _State, name: str, rooms: list[tuple[int, dict[str, list[int]], int]], timeout_s: float
) -> dict[int, list[str]]:
    """Each room through every P rank: a sender at once, the source manifest and first token
    once bootstrapped (as TokenSpeed's prefill executor does), until Success or Failed.
    Returns each rank's final state per room ("success" or "failed: <reason>")."""
    from tokenspeed.runtime.pd.cache_protocol import build_cache_block_manifest
    from tokenspeed.runtime.pd.mooncake.sender import MooncakeKVSender

    inst = state.instances[name]
    address = f"{LOOPBACK}:{inst.port}"
    held = len(inst.managers)
    senders = {}
    for room, _, _ in rooms:
        for r, mgr in enumerate(inst.managers):
            _stamp(state, room, "registered", held, r)
            senders[(room, r)] = MooncakeKVSender(mgr, address, room)
    plans = {room: (table, token) for room, table, token in rooms}

    def bootstrapped(room: int, r: int, sender: Any) -> None:
        infos = inst.managers[r].transfer_infos.get(room, {})
        real = [i for i in infos.values() if not i.is_dummy]
        table, token = plans[room]
        manifest = None
        if real:  # a dummy rank sends a final no-op: it only turns Success locally
            window = real[0].block_manifest
            manifest = build_cache_block_manifest(
                _Tables(table),
                layout=inst.contract,
                request_row=0,
                prefix_len=window.prefix_len,
                prompt_len=window.prompt_len,
            )
        sender.send(True, bootstrap_token=token, block_manifest=manifest)

    final = _poll_rooms(state, inst, senders, bootstrapped, lambda room, r: "success", timeout_s)
    return _by_room(rooms, held, final)


def _run_decode(
    state: _State,
    name: str,
    address: str,
    rooms: list[tuple[int, dict[str, list[int]], int, int]],
    timeout_s: float,
) -> dict[int, list[str]]:
    """Each room through every D rank: a receiver (TokenSpeed's look-up and registration),
    the destination manifest once bootstrapped, until Success (``"token <t>"``) or Failed."""
    from tokenspeed.runtime.pd.cache_protocol import build_cache_block_manifest
    from tokenspeed.runtime.pd.mooncake.receiver import MooncakeKVReceiver

    inst = state.instances[name]
    held = len(inst.managers)
    receivers = {}
    for room, _, _, _ in rooms:
        for r, mgr in enumerate(inst.managers):
            _stamp(state, room, "registered", held, r)
            receivers[(room, r)] = MooncakeKVReceiver(mgr, address, room)
    plans = {room: (table, prefix, prompt) for room, table, prefix, prompt in rooms}

    def bootstrapped(room: int, r: int, receiver: Any) -> None:
        table, prefix, prompt = plans[room]
        manifest = build_cache_block_manifest(
            _Tables(table),
            layout=inst.contract,
            request_row=0,
            prefix_len=prefix,
            prompt_len=prompt,
        )
        receiver.prefill(block_manifest=manifest)

    def succeeded(room: int, r: int) -> str:
        token, _ = inst.managers[r].pop_prefill_metadata(room)
        return f"token {token}"

    final = _poll_rooms(state, inst, receivers, bootstrapped, succeeded, timeout_s)
    return _by_room([(room, {}, 0) for room, _, _, _ in rooms], held, final)


def _poll_rooms(
    state: _State,
    inst: Any,
    handles: dict[tuple[int, int], Any],
    bootstrapped: Callable[[int, int, Any], None],
    succeeded: Callable[[int, int], str],
    timeout_s: float,
) -> dict[tuple[int, int], str]:
    """Poll every (room, rank) handle — TokenSpeed's sender or receiver — until each reached
    Success (``succeeded``'s text) or Failed, or the deadline; ``bootstrapped`` runs once per
    handle as it first polls Bootstrapped. Returns the final state of each that ended."""
    from tokenspeed.runtime.pd.base.status import TransferPoll

    held = len(inst.managers)
    acted: set[tuple[int, int]] = set()
    final: dict[tuple[int, int], str] = {}
    deadline = time.monotonic() + timeout_s
    while len(final) < len(handles) and time.monotonic() < deadline:
        for (room, r), handle in handles.items():
            if (room, r) in final:
                continue
            status = handle.poll()
            if status == TransferPoll.Bootstrapped and (room, r) not in acted:
                acted.add((room, r))
                bootstrapped(room, r, handle)
                _stamp(state, room, "handed", held, r)
            elif status == TransferPoll.Success:
                final[(room, r)] = succeeded(room, r)
                _stamp(state, room, "done", held, r)
            elif status == TransferPoll.Failed:
                final[(room, r)] = f"failed: {inst.managers[r].failure_records.get(room)}"
                _stamp(state, room, "done", held, r)
        _wait_for_news(state)
    return final


def _by_room(
    rooms: list[tuple[int, Any, int]], held: int, final: dict[tuple[int, int], str]
) -> dict[int, list[str]]:
    """Each room's final state on each rank this child holds, in rank order."""
    return {room: [final.get((room, r), "timed out") for r in range(held)] for room, _, _ in rooms}


class ChildHost:
    """A child process driven over one pipe: ``submit`` sends a command and returns at once;
    ``result`` waits for its answer (one command in flight at a time), raising the child's
    traceback as :class:`RuntimeError`. ``target(conn, environ)`` serves the child's end;
    ``environ`` is added to the child's environment first."""

    LABEL = "child host"
    EXIT_S = 10.0  #: how long ``close`` waits for the child to leave before killing it

    def __init__(
        self,
        target: Callable[[Any, dict[str, str]], None],
        environ: dict[str, str] | None,
        name: str,
        daemon: bool,
    ) -> None:
        ctx = tmp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=target, args=(theirs, environ or {}), name=name,
                                 daemon=daemon)  # fmt: skip
        self._proc.start()
        theirs.close()

    @property
    def pid(self) -> int:
        assert self._proc.pid is not None, "started in the constructor"
        return int(self._proc.pid)

    def submit(self, cmd: str, *args: Any) -> None:
        self._conn.send((cmd, args))

    def ready(self) -> bool:
        return bool(self._conn.poll())

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def result(self, timeout_s: float = 120.0) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.LABEL} gave no answer in {timeout_s:g} s")
        kind, value = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.LABEL} failed:\n{value}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> Any:
        self.submit(cmd, *args)
        return self.result(timeout_s)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self.call("exit", timeout_s=self.EXIT_S)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                self._proc.kill()
        self._proc.join(self.EXIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()


class TokenSpeedHost(ChildHost):
    """The child process (see the module docstring); ``environ``: ``MC_*`` knobs for its
    Mooncake engines."""

    LABEL = "TokenSpeed host"

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        super().__init__(_serve, environ, "tokenspeed-host", daemon=True)
