"""One prefill rank of a :class:`~tspd_core.epd.loopback.PrefillReplica`, in its own process.

The parent sends every rank the same commands in the same order (as a replicated scheduler
would see the same requests); the rank runs them against real receivers over one Mooncake
engine, settling over a real gloo group, and answers with plain values. The pipe to the parent
carries pickled harness commands only: nothing here is a wire format.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from tspd_core.epd.assemble import assemble
from tspd_core.epd.config import EmbeddingReceiverConfig
from tspd_core.epd.items import LandedItem, LandedRequest
from tspd_core.epd.receiver import EmbeddingReceiver, embedding_receiver
from tspd_core.ids import RequestId, Room
from tspd_core.pd.peer.agreement import GlooMesh, ReplicaGroup, SoloMesh
from tspd_core.pd.proc import forkserver
from tspd_core.pd.transfer.mooncake import MooncakeEngine, quiet_mooncake_logs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LandedBytes:
    """What one item left on one rank, as bytes the parent can compare."""

    room: Room
    span: int
    row_start: int
    n_rows: int
    embedding: bytes
    deepstack: bytes | None
    whole: bytes | None = None  #: after :func:`assemble`
    whole_deepstack: bytes | None = None


@dataclass
class Recorder:
    """A :class:`RoomAborter` test double: remembers the PD rooms it was asked to abort."""

    calls: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def abort_room(self, room: Room, reason: str) -> None:
        self.calls.append((int(room), reason))


def _bytes(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()


def _landed(item: LandedItem) -> LandedBytes:
    emb = _bytes(item.embedding)
    assert emb is not None
    return LandedBytes(
        item.room, item.span, item.row_start, item.n_rows, emb, _bytes(item.deepstack)
    )


class Rank:
    """The receivers of one rank and the commands it understands."""

    def __init__(self, rank: int, size: int, configs: list[EmbeddingReceiverConfig]) -> None:
        self.rank, self.size = rank, size
        self.group: ReplicaGroup = (
            GlooMesh([dist.group.WORLD]).replica_group(0)
            if size > 1
            else SoloMesh().replica_group(0)
        )
        host = configs[0].host or "127.0.0.1"
        self.engine = MooncakeEngine(host, configs[0].protocol)
        self.aborter = Recorder()
        self.receivers: list[EmbeddingReceiver] = [
            embedding_receiver(
                self.engine, dataclasses.replace(c, tp_size=size, tp_rank=rank), self.aborter
            )
            for c in configs
        ]

    def stage(self, idx: int, rid: str, items: list[Any], pd_room: int | None) -> None:
        self.receivers[idx].stage(RequestId(rid), items, None if pd_room is None else Room(pd_room))

    def settle(
        self, rids: list[str], whole: bool, release: bool, timeout_s: float = 90.0
    ) -> dict[str, Any]:
        """Settle every receiver each round until all ``rids`` concluded (agreed, so every rank
        leaves the loop in the same round). Past ``timeout_s`` the rest are reported stuck."""
        want: set[str] = set(rids)
        out: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        while not want <= out.keys():
            if time.monotonic() > deadline:
                out.update((rid, ("stuck",)) for rid in want - out.keys())
                break
            busy = False
            for r in self.receivers:
                s = r.settle(self.group)
                for landed in s.admitted:
                    out[landed.rid] = ("admitted", self._capture(r, landed, whole))
                    if release:
                        r.release(landed.rid)
                for failed in s.failed:
                    out[failed.rid] = ("failed", failed.reason, failed.pd_room)
                busy |= bool(s.admitted or s.failed)
            if not busy:
                time.sleep(0.003)
        return out

    def _capture(self, r: EmbeddingReceiver, landed: LandedRequest, whole: bool) -> Any:
        items = [_landed(i) for i in landed.items]
        if whole:
            full = assemble(landed, self.size)
            items = [
                dataclasses.replace(i, whole=_bytes(m), whole_deepstack=_bytes(d))
                for i, (m, d) in zip(items, full, strict=True)
            ]
        return items

    def sweep_until_idle(self, timeout_s: float) -> list[Any]:
        """Sweep until every pool is whole again (quarantines lifted) or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for r in self.receivers:
                r.sweep()
            if all(
                r.stats().pool.free_blocks == r.stats().pool.total_blocks for r in self.receivers
            ):
                break
            time.sleep(0.01)
        return [r.stats() for r in self.receivers]

    def run(self, cmd: str, args: tuple[Any, ...]) -> Any:
        if cmd == "stage":
            return self.stage(*args)
        if cmd == "settle":
            return self.settle(*args)
        if cmd == "release":
            return self.receivers[args[0]].release(RequestId(args[1]))
        if cmd == "abort":
            return self.receivers[args[0]].abort(RequestId(args[1]), args[2])
        if cmd == "stats":
            return [r.stats() for r in self.receivers]
        if cmd == "sweep_until_idle":
            return self.sweep_until_idle(*args)
        if cmd == "aborts":
            return list(self.aborter.calls)
        if cmd == "ports":
            return [r.port for r in self.receivers]
        raise ValueError(f"unknown command {cmd!r}")

    def close(self) -> None:
        for r in self.receivers:
            r.shutdown()
        self.engine.close()


def rank_main(
    rank: int,
    size: int,
    store: str,
    configs: list[EmbeddingReceiverConfig],
    conn: Connection,
    server: forkserver.Server | None = None,
) -> None:
    """Entry point of one prefill rank process (``store``: the gloo group's file store);
    its workers come from ``server``."""
    forkserver.adopt(server)
    logging.basicConfig(level=logging.WARNING)
    quiet_mooncake_logs(debug=False)
    if size > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=60),  # a broken test fails, it does not hang for 30 min
        )
    node = Rank(rank, size, configs)
    conn.send(("ready", None))
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "shutdown":
                break
            try:
                conn.send(("ok", node.run(cmd, args)))
            except Exception as exc:
                log.exception("prefill rank %d: %s failed", rank, cmd)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        node.close()
        if size > 1:
            dist.destroy_process_group()
        conn.send(("closed", None))
