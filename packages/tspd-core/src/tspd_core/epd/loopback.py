"""An encode node and a prefill replica on one host: for tests, benchmarks and demos.

:class:`EncodeNode` runs in the calling process: the embedding bootstrap server (tspd-bootstrap)
and one :class:`EmbeddingSender` per encode rank, each with its own transfer worker process.
:class:`PrefillReplica` starts one process per prefill rank (:mod:`tspd_core.epd.replica_proc`),
joined in a gloo group, each with its own Mooncake engine and one receiver per config::

    test process                                         prefill rank processes (gloo group)
    ────────────                                         ──────────────────────────────────
    EncodeNode: bootstrap server, E senders ──Mooncake──► receivers (one engine per rank)
       └ encode worker processes  ◄──ZMQ item infos────   settle() MIN over gloo
    PrefillReplica.call("stage"/"settle"/...) ──pipes──► the same command to every rank
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as tmp

from tspd_bootstrap import BootstrapServer
from tspd_core.epd.config import EmbeddingReceiverConfig, EmbeddingSenderConfig
from tspd_core.epd.items import EmbeddingChunk
from tspd_core.epd.replica_proc import rank_main
from tspd_core.epd.sender import EmbeddingSender, SendOutcome
from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import PdError, PeerError
from tspd_core.pd.proc import forkserver
from tspd_core.pd.proc.handle import PRELOAD


class EncodeNode:
    """An embedding bootstrap server and ``tp_size`` encode ranks (close it, or use ``with``)."""

    def __init__(
        self,
        tp_size: int,
        tunables: PdTunables | None = None,
        buffer_bytes: int = 4 << 20,
        host: str = "127.0.0.1",
        tombstone_s: float | None = None,
    ) -> None:
        self.tp_size = tp_size
        self.tombstone_s = tombstone_s
        self.tunables = tunables or PdTunables.from_env()
        self.buffer_bytes = buffer_bytes
        self.host = host
        self.server = BootstrapServer(host, 0, embedding=True)
        self.senders: list[EmbeddingSender] = []
        self._outcomes: dict[Room, dict[int, SendOutcome]] = {}  # room -> encode rank -> it

    def __enter__(self) -> EncodeNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> EncodeNode:
        self.server.start()
        try:
            for rank in range(self.tp_size):
                config = EmbeddingSenderConfig(
                    bootstrap_url=self.server.url,
                    tp_size=self.tp_size,
                    tp_rank=rank,
                    buffer_bytes=self.buffer_bytes,
                    host=self.host,
                    tunables=self.tunables,
                    tombstone_s=self.tombstone_s,
                )
                self.senders.append(EmbeddingSender.start(config))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for sender in self.senders:
            sender.shutdown()
        self.server.close()

    @property
    def bootstrap(self) -> tuple[str, int]:
        return self.host, self.server.port

    def send(self, chunk: EmbeddingChunk, timeout_s: float = 30.0) -> None:
        """Every encode rank sends the item (TP-gathered rows), waiting for buffer space."""
        deadline = time.monotonic() + timeout_s
        for sender in self.senders:
            while sender.send(chunk) is None:
                if time.monotonic() > deadline:
                    raise PdError(f"room {chunk.room}: no send buffer space in {timeout_s:g} s")
                self.collect(0.01)

    def sync(self, timeout_s: float = 30.0) -> None:
        """Return once every encode rank's worker handled everything sent to it so far (a chunk
        sent before is parked there if its receivers have not asked yet)."""
        for sender in self.senders:
            sender.sync(timeout_s)

    def abort(self, room: Room, reason: str = "aborted by the test") -> None:
        for sender in self.senders:
            sender.abort_room(room, reason)

    def collect(self, wait_s: float = 0.0) -> None:
        """Gather the senders' outcomes (each room gets one per encode rank that sent it)."""
        if wait_s:
            self.senders[0].wait(wait_s)
        for rank, sender in enumerate(self.senders):
            for outcome in sender.poll():
                self._outcomes.setdefault(outcome.room, {})[rank] = outcome

    def outcomes_of(self, rank: int) -> list[SendOutcome]:
        """Every outcome encode rank ``rank`` reported so far."""
        return [per_rank[rank] for per_rank in self._outcomes.values() if rank in per_rank]

    def wait_for(
        self, rooms: Sequence[Room], timeout_s: float = 60.0
    ) -> dict[Room, list[SendOutcome]]:
        """Outcomes of ``rooms`` (in encode rank order) once every encode rank reported each."""
        deadline = time.monotonic() + timeout_s
        while any(len(self._outcomes.get(r, {})) < self.tp_size for r in rooms):
            if time.monotonic() > deadline:
                missing = [r for r in rooms if len(self._outcomes.get(r, {})) < self.tp_size]
                raise PdError(f"encode outcomes missing after {timeout_s:g} s for rooms {missing}")
            self.collect(0.01)
        return {r: [self._outcomes[r][e] for e in range(self.tp_size)] for r in rooms}


class PrefillReplica:
    """``tp_size`` prefill rank processes, each with one receiver per config.

    ``overrides[rank]`` replaces config fields on one rank only (to test disagreeing ranks).
    """

    def __init__(
        self,
        tp_size: int,
        configs: Sequence[EmbeddingReceiverConfig],
        overrides: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.tp_size = tp_size
        self.configs = list(configs)
        self.overrides = overrides or {}
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> PrefillReplica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = 120.0) -> PrefillReplica:
        ctx: Any = tmp.get_context("forkserver")
        # The ranks' modules, and the workers' (the same server may start their workers).
        preload = [*PRELOAD, "tspd_core.epd.replica_proc"]
        ctx.set_forkserver_preload(preload)
        server = forkserver.running(preload)  # each rank starts its workers from it
        # The gloo group meets in a file of its own (no port to pick, none to collide on).
        self._store_dir = tempfile.TemporaryDirectory(prefix="tspd-epd-replica-")
        store = os.path.join(self._store_dir.name, "store")
        for rank in range(self.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                args=(rank, self.tp_size, store, self._configs(rank), child, server),
                name=f"tspd-epd-prefill-tp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        try:
            for rank in range(self.tp_size):
                self._expect(rank, "ready", timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _configs(self, rank: int) -> list[EmbeddingReceiverConfig]:
        changes = self.overrides.get(rank, {})
        return [dataclasses.replace(c, **changes) for c in self.configs]

    def call(self, cmd: str, *args: Any, timeout_s: float = 120.0) -> list[Any]:
        """Run one command on every rank (same arguments) and return each rank's answer."""
        for conn in self._conns:
            conn.send((cmd, args))
        return [self._expect(rank, "ok", timeout_s) for rank in range(self.tp_size)]

    def close(self) -> None:
        """Shut every rank down (receivers and engines closed), then reap the processes."""
        for conn in self._conns:
            try:
                conn.send(("shutdown", ()))
            except (OSError, EOFError):
                pass
        for proc in self._procs:
            proc.join(20.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None

    def _expect(self, rank: int, kind: str, timeout_s: float) -> Any:
        conn = self._conns[rank]
        if not conn.poll(timeout_s):
            raise PeerError(f"prefill rank {rank} did not answer within {timeout_s:g} s")
        got, value = conn.recv()
        if got != kind:
            raise PeerError(f"prefill rank {rank}: {got}: {value}")
        return value
