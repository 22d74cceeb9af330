"""A real PD prefill peer's EPD receiver: placed like the peer, fed by a real encode node."""

from __future__ import annotations

import time

import pytest
import torch

from tspd_core.epd import (
    EmbeddingItem,
    EmbeddingReceiverConfig,
    ToyVisionTower,
    receiver_for_peer,
)
from tspd_core.epd.loopback import EncodeNode
from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, AttentionKind, PageLayout
from tspd_testing.loopback import LoopbackCluster

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _spec(rank: int) -> ArenaSpec:
    return ArenaSpec(
        layers=1,
        attention=AttentionKind.GQA,
        kv_heads=2,
        head_dim=8,
        latent_dim=16,
        rope_dim=8,
        page_size=4,
        tp_size=1,
        tp_rank=rank,
        page_layout=PageLayout.HND,
        num_pages=8,
    )


def test_prefill_peer_receiver_lands_items() -> None:
    tower = ToyVisionTower(24, 1, torch.bfloat16)
    config = EmbeddingReceiverConfig(hidden=24, dtype=torch.bfloat16, deepstack_levels=1)
    with LoopbackCluster([_spec(0)], [_spec(0)]) as pd, EncodeNode(1) as enc:
        peer = pd.p[0].peer
        receiver = receiver_for_peer(peer, config)
        try:
            assert receiver.config.host == peer.host() == "127.0.0.1"
            assert (receiver.config.tp_size, receiver.config.tp_rank) == (1, 0)
            host, port = enc.bootstrap
            items = [EmbeddingItem(Room(r), host, port, n) for r, n in ((11, 5), (12, 130))]
            receiver.stage(RequestId("img"), items, pd_room=Room(99))
            for item in items:
                enc.send(tower.chunk(item.room, item.n_tokens))
            deadline = time.monotonic() + 30
            while not (settled := receiver.settle()).admitted:
                assert not settled.failed, settled.failed
                assert time.monotonic() < deadline, "no admission within 30 s"
                receiver.wait(0.01)
            (landed,) = settled.admitted
            for item, got in zip(items, landed.items, strict=True):
                main, deep = tower(item.room, item.n_tokens)
                assert torch.equal(got.embedding, main)
                assert torch.equal(got.deepstack, deep)
            receiver.release(RequestId("img"))
            pool = receiver.stats().pool
            assert pool.free_blocks == pool.total_blocks
        finally:
            receiver.shutdown()
