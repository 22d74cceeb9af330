"""``EmbeddingSender.sync`` against a scripted worker: it returns once the worker answered the
sync, keeps the verdicts that came with it for the next poll, and fails loudly otherwise."""

from __future__ import annotations

import pytest
import torch

from tspd_core.epd import ToyVisionTower, ipc
from tspd_core.epd.config import EmbeddingSenderConfig
from tspd_core.epd.pool import BufferPool
from tspd_core.epd.sender import EmbeddingSender, SendOutcome
from tspd_core.ids import Room
from tspd_core.pd.errors import PeerError
from tspd_core.pd.status import TransferPoll

TOWER = ToyVisionTower(16, 0, torch.float32)  # 64-byte rows


class ScriptedWorker:
    """Stands in for the worker process: records commands; answers a Sync with the verdicts
    queued so far, then the Synced note (the order a real worker's notes pipe keeps)."""

    def __init__(self, answer: bool = True, dies: bool = False) -> None:
        self.commands: list[ipc.Message] = []
        self.queued: list[ipc.Message] = []
        self.notes: list[ipc.Message] = []
        self.answer, self.dies = answer, dies

    def send(self, msg: ipc.Message) -> None:
        self.commands.append(msg)
        if isinstance(msg, ipc.Sync) and self.answer:
            self.notes += [*self.queued, ipc.Synced(msg.token)]
            self.queued = []

    def drain(self) -> list[ipc.Message]:
        if self.dies:
            raise PeerError("encode worker 4242 died: pipe closed")
        out, self.notes = self.notes, []
        return out

    def wait(self, timeout_s: float) -> bool:
        return bool(self.notes) or self.dies


def _sender(worker: ScriptedWorker) -> EmbeddingSender:
    config = EmbeddingSenderConfig(bootstrap_url="127.0.0.1:1", buffer_bytes=1 << 16)
    return EmbeddingSender(config, worker, BufferPool(1 << 16), None)  # type: ignore[arg-type]


def test_sync_returns_after_the_answer_and_keeps_the_verdicts_for_poll() -> None:
    worker = ScriptedWorker()
    sender = _sender(worker)
    assert sender.send(TOWER.chunk(Room(5), 3)) == 3 * 64
    worker.queued.append(ipc.ChunkDone(Room(5), TransferPoll.SUCCESS, "", True, 1, 192))
    sender.sync()
    assert [type(m) for m in worker.commands] == [ipc.SubmitChunk, ipc.Sync]
    assert worker.commands[1] == ipc.Sync(1)
    assert sender.in_flight() == 0  # taken during the sync: its buffer space is free
    want = SendOutcome(Room(5), TransferPoll.SUCCESS, "", True, 1, 192)
    assert sender.poll() == [want]
    assert sender.poll() == []
    sender.sync()
    assert worker.commands[-1] == ipc.Sync(2)  # each sync waits for its own answer
    stats = sender.stats()
    assert (stats.sent_total, stats.succeeded_total, stats.parked_total) == (1, 1, 1)


def test_sync_without_an_answer_fails_loudly() -> None:
    sender = _sender(ScriptedWorker(answer=False))
    with pytest.raises(
        PeerError, match=r"^encode rank 0: the worker did not answer a sync within 0\.05 s$"
    ):
        sender.sync(timeout_s=0.05)


def test_sync_with_a_dead_worker_fails_and_poll_reports_what_was_in_flight() -> None:
    worker = ScriptedWorker()
    sender = _sender(worker)
    assert sender.send(TOWER.chunk(Room(6), 1)) == 64
    worker.dies = True
    with pytest.raises(
        PeerError, match=r"^encode rank 0 is down: encode worker 4242 died: pipe closed$"
    ):
        sender.sync()
    why = "encode worker lost: encode worker 4242 died: pipe closed"
    assert sender.poll() == [SendOutcome(Room(6), TransferPoll.FAILED, why)]
