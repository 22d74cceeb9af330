"""tspd's ranks in processes of their own, as the TokenSpeed host runs TokenSpeed's.

In :mod:`~tspd_testing.interop.tspd_side` every tspd rank's engine side (its peer, outbox and
the loop that drives them) lives in the test's process and shares its one thread; TokenSpeed's
ranks each get a child (:class:`~tspd_testing.interop.host.TokenSpeedHost`). To time both
systems alike — and as a tspd deployment runs, an engine process per rank — the benchmark gives
each tspd rank a child too: a :class:`TspdHost` holds one rank's peer (whose transfer worker
is that child's own child) and drives it with :func:`~.tspd_side.drive_many`, and a
:class:`HostedInstance` is the instance made of them, with the interface of
:class:`~tspd_testing.interop.pairs.TokenSpeedInstance` (``submit``, ``answered``, ``collect``).

The arenas are shared-memory tensors made in the parent, as for TokenSpeed's hosts, so the
parent tags the sources and checks the destination bytes. A P instance's bootstrap server
(tspd-bootstrap) runs in its first rank's child, where TokenSpeed's runs. A child whose parent
goes away (its pipe ends) shuts its peer down and exits.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tspd_bootstrap import BootstrapServer
from tspd_core.ids import RequestId
from tspd_core.layout import CacheContract, parse_contract
from tspd_core.pd import PdEvent, PdTunables
from tspd_testing import procstat
from tspd_testing.identity import RankView
from tspd_testing.interop.host import ChildHost
from tspd_testing.interop.tspd_side import (
    LOOPBACK,
    ErrorLog,
    Room_,
    Stamps,
    TspdInstance,
    drive_many,
    shared_arena,
    start_decode,
    start_prefill,
)

#: The worker metric of what it handed Mooncake (after staging and cutting runs).
WIRE_DESCRIPTORS = "tspd_pd_transfer_wire_descriptors_total"
#: One rank's last event per request (the child's answer to ``run``).
Final = dict[RequestId, PdEvent]


@dataclass
class _Child:
    inst: TspdInstance | None = None
    server: BootstrapServer | None = None
    errors: ErrorLog = field(default_factory=ErrorLog)


def _start(
    child: _Child,
    role: str,
    wire: bytes,
    arena: torch.Tensor,
    tp: int,
    rank: int,
    tunables: PdTunables,
    mooncake_env: dict[str, str],
    bootstrap_url: str | None,
) -> str | None:
    """This child's rank; P's first rank without ``bootstrap_url`` starts the instance's
    bootstrap server here. Returns that server's URL (P) or None (D)."""
    contract = parse_contract(wire)
    if role == "d":
        child.inst = start_decode(contract, tp, tunables, only=(rank, arena))
        return None
    if bootstrap_url is None:
        child.server = BootstrapServer(LOOPBACK, 0).start()
        bootstrap_url = child.server.url
    child.inst = start_prefill(
        contract, tp, tunables, mooncake_env, only=(rank, arena), bootstrap_url=bootstrap_url
    )
    return bootstrap_url


def _inst(child: _Child) -> TspdInstance:
    if child.inst is None:
        raise RuntimeError("this host holds no rank yet: start comes first")
    return child.inst


def _run(
    child: _Child,
    rooms: Sequence[Room_],
    bootstrap: tuple[str, int],
    timeout_s: float,
    engine_flow: bool,
) -> tuple[Final, Stamps]:
    finals, stamps = drive_many([_inst(child)], rooms, bootstrap, timeout_s=timeout_s,
                                engine_flow=engine_flow)  # fmt: skip
    return finals[0][0], stamps[0]


def _descriptors(child: _Child) -> int:
    return int(_inst(child).peers[0].metrics().total(WIRE_DESCRIPTORS))


def _close(child: _Child) -> None:
    """Shut the rank's peer and the server down (once: later calls find nothing)."""
    inst, server, child.inst, child.server = child.inst, child.server, None, None
    if inst is not None:
        inst.close()
    if server is not None:
        server.close()


def _serve(conn: Any, environ: dict[str, str]) -> None:
    os.environ.update(environ)
    child = _Child()
    logging.getLogger().addHandler(child.errors)
    handlers: dict[str, Callable[..., Any]] = {
        "start": lambda *a: _start(child, *a),
        "run": lambda *a: _run(child, *a),
        "descriptors": lambda: _descriptors(child),
        "errors": lambda: list(child.errors.lines),
    }
    try:
        while True:
            try:
                cmd, args = conn.recv()
            except (EOFError, OSError):
                return  # the parent went away
            if cmd == "exit":
                _close(child)
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", handlers[cmd](*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        _close(child)


class TspdHost(ChildHost):
    """One child process holding one tspd rank (see the module docstring)."""

    LABEL = "tspd host"
    EXIT_S = 30.0

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        # Not a daemon: its peer starts a transfer worker process of its own.
        super().__init__(_serve, environ, "tspd-host", daemon=False)


class HostedInstance:
    """A tspd P instance or D replica with a :class:`TspdHost` per rank."""

    def __init__(
        self,
        role: str,
        contract: CacheContract,
        tp: int,
        tunables: PdTunables,
        mooncake_env: dict[str, str] | None = None,
    ) -> None:
        from tspd_core.layout import encode_contract

        self.role, self.tp = role, tp
        self.arenas = [shared_arena(contract) for _ in range(tp)]
        self.views = [RankView(a.numpy(), contract, tp, r) for r, a in enumerate(self.arenas)]
        self.hosts: list[TspdHost] = []
        self.port = 0
        wire = encode_contract(contract)
        url: str | None = None
        try:
            for rank, arena in enumerate(self.arenas):
                host = TspdHost()
                self.hosts.append(host)
                got = host.call("start", role, wire, arena, tp, rank, tunables,
                                mooncake_env or {}, url)  # fmt: skip
                if role == "p" and url is None:
                    url = str(got)
                    self.port = int(url.rsplit(":", 1)[1])
        except BaseException:
            self.close()
            raise

    def submit(
        self, rooms: Sequence[Room_], p_port: int, timeout_s: float, engine_flow: bool
    ) -> None:
        """Start ``rooms`` on every rank (each child drives its rank until they ended there)."""
        for host in self.hosts:
            host.submit("run", list(rooms), (LOOPBACK, p_port), timeout_s, engine_flow)

    def answered(self) -> bool:
        return all(host.ready() for host in self.hosts)

    def collect(self, timeout_s: float) -> tuple[dict[int, Final], Stamps]:
        """Each rank's last event per request, and the rooms' stamps (one per rank)."""
        finals: dict[int, Final] = {}
        stamps: Stamps = {}
        for rank, host in enumerate(self.hosts):
            finals[rank], got = host.result(timeout_s)
            for key, values in got.items():
                stamps.setdefault(key, []).extend(values)
        return finals, stamps

    def pids(self) -> list[int]:
        """Every process of this instance: each rank's child and what it started (its transfer
        worker, and the forkserver that forked it)."""
        return [pid for host in self.hosts for pid in procstat.descendants(host.pid)]

    def descriptors(self) -> int:
        """Descriptors this instance's workers handed Mooncake so far (P: after staging)."""
        return sum(int(host.call("descriptors")) for host in self.hosts)

    def errors(self) -> list[str]:
        """ERROR lines logged in the children."""
        return [line for host in self.hosts for line in host.call("errors")]

    def close(self) -> None:
        for host in reversed(self.hosts):  # rank 0's child, with P's bootstrap server, last
            host.close()
