"""An encode rank's life: hosting the embedding bootstrap server, and losing its worker."""

from __future__ import annotations

import re
import time

import pytest
import torch

from tspd_bootstrap import BootstrapClient, BootstrapServer
from tspd_core.epd import (
    EmbeddingItem,
    EmbeddingReceiverConfig,
    EmbeddingSender,
    EmbeddingSenderConfig,
    SendOutcome,
    ToyVisionTower,
    open_embedding_receiver,
)
from tspd_core.ids import RequestId, Room
from tspd_core.pd.errors import ConfigError, PeerError
from tspd_core.pd.status import TransferPoll

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TOWER = ToyVisionTower(8, 0, torch.float32)


def test_rank_zero_hosts_the_embedding_bootstrap_server() -> None:
    # Port 0: the server binds a port the system picks, and the rank registers with that one.
    config = EmbeddingSenderConfig(
        bootstrap_url="127.0.0.1:0", host="127.0.0.1", serve_bootstrap="127.0.0.1"
    )
    receiver = open_embedding_receiver(
        EmbeddingReceiverConfig(hidden=8, dtype=torch.float32, host="127.0.0.1", pool_bytes=1 << 16)
    )
    with EmbeddingSender.start(config) as sender:
        server = sender.bootstrap_server
        assert server is not None
        port = server.port
        assert server.running
        assert port != 0
        assert server.url == f"http://127.0.0.1:{port}"
        with BootstrapClient(server.url) as client:
            info = client.parallel_info()
            assert info is not None
            assert (info.prefill_tp_size, info.prefill_dp_size, info.cache_layout) == (1, 1, None)
            assert client.rank_address(0, 0).rank_port == sender.port
        receiver.stage(RequestId("r"), [EmbeddingItem(Room(1), "127.0.0.1", port, 3)])
        sender.send(TOWER.chunk(Room(1), 3))
        deadline = time.monotonic() + 20
        while not (settled := receiver.settle()).admitted:
            assert time.monotonic() < deadline
            receiver.wait(0.01)
        assert torch.equal(settled.admitted[0].items[0].embedding, TOWER(1, 3)[0])
        receiver.release(RequestId("r"))
    assert not server.running  # closed with the sender
    receiver.shutdown()
    with pytest.raises(
        ConfigError, match=re.escape("serving the bootstrap needs a fixed port in '127.0.0.1'")
    ):
        EmbeddingSender.start(
            EmbeddingSenderConfig(bootstrap_url="127.0.0.1", serve_bootstrap="127.0.0.1")
        )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "serving the bootstrap on port 0 ('127.0.0.1:0') needs an encode node of one rank, "
            "not 2: the other ranks could not learn the port"
        ),
    ):
        EmbeddingSender.start(
            EmbeddingSenderConfig(
                bootstrap_url="127.0.0.1:0", tp_size=2, serve_bootstrap="127.0.0.1"
            )
        )


def test_a_dead_worker_fails_what_was_in_flight() -> None:
    with BootstrapServer("127.0.0.1", 0, embedding=True) as server:
        sender = EmbeddingSender.start(
            EmbeddingSenderConfig(bootstrap_url=server.url, host="127.0.0.1", buffer_bytes=1 << 16)
        )
        try:
            assert sender.send(TOWER.chunk(Room(5), 4)) == 128  # parked: nobody asked for it
            sender._worker._proc.kill()  # the worker dies (OOM killer, segfault...)
            sender._worker._proc.join(10)
            deadline = time.monotonic() + 10
            outcomes: list[SendOutcome] = []
            while not outcomes:
                assert time.monotonic() < deadline
                outcomes = sender.poll()
            (outcome,) = outcomes
            assert (outcome.room, outcome.status) == (5, TransferPoll.FAILED)
            assert outcome.reason.startswith("encode worker lost: encode worker ")
            assert sender.in_flight() == 0
            assert sender.stats().buffer.free_blocks == sender.stats().buffer.total_blocks
            with pytest.raises(PeerError, match="encode rank 0 is down"):
                sender.send(TOWER.chunk(Room(6), 4))
        finally:
            sender.shutdown()
