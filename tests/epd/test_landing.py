"""Items land byte-exact from encode ranks into prefill ranks, in both fan-out modes.

Real embedding bootstrap server, real encode worker processes, real prefill rank processes in a
gloo group, real ZMQ and real Mooncake over TCP. Each prefill rank runs four receivers at once
(bf16 / f16 / f32, deepstack on and off, row shards and identity broadcast) over one engine;
items span 1 row (0-row shards on most ranks) to 257 rows (ragged shards). Half of the items
are encoded before the prefill ranks ask for them (the encode rank parks them), half after.
"""

from __future__ import annotations

import pytest
import torch

from tspd_core.epd import (
    EmbeddingItem,
    EmbeddingReceiverConfig,
    ShardMode,
    ToyVisionTower,
    shard_rows,
)
from tspd_core.epd.loopback import EncodeNode, PrefillReplica
from tspd_core.epd.replica_proc import LandedBytes
from tspd_core.ids import Room
from tspd_core.pd.status import TransferPoll

#: (dtype, hidden, deepstack levels, row shards)
RECEIVERS = [
    (torch.bfloat16, 64, 0, True),
    (torch.float16, 48, 2, True),
    (torch.float32, 32, 0, False),
    (torch.bfloat16, 40, 1, False),
]
SPANS = [[1], [3, 257], [7], [13, 2, 64]]  # items per request


def _configs() -> list[EmbeddingReceiverConfig]:
    return [
        EmbeddingReceiverConfig(
            hidden=hidden,
            dtype=dtype,
            deepstack_levels=levels,
            shard=shard,
            host="127.0.0.1",
            pool_bytes=1 << 20,
        )
        for dtype, hidden, levels, shard in RECEIVERS
    ]


def _raw(t: torch.Tensor | None) -> bytes | None:
    return None if t is None else t.contiguous().view(torch.uint8).numpy().tobytes()


TOPOLOGIES = [
    pytest.param(1, 1, id="E1-P1"),
    pytest.param(1, 2, id="E1-P2"),
    pytest.param(2, 2, id="E2-P2"),
    pytest.param(2, 4, id="E2-P4"),
]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(("e_tp", "p_tp"), TOPOLOGIES)
def test_items_land_byte_exact(e_tp: int, p_tp: int) -> None:
    towers = [ToyVisionTower(h, lv, dt, seed=i) for i, (dt, h, lv, _) in enumerate(RECEIVERS)]
    with EncodeNode(e_tp) as enc, PrefillReplica(p_tp, _configs()) as rep:
        host, port = enc.bootstrap
        plan: dict[str, tuple[int, list[EmbeddingItem]]] = {}
        room = 1000 * e_tp + 100 * p_tp
        for idx in range(len(RECEIVERS)):
            for n, spans in enumerate(SPANS):
                items = []
                for span in spans:
                    room += 1
                    items.append(EmbeddingItem(Room(room), host, port, span))
                plan[f"r{idx}-{n}"] = (idx, items)
        early = {rid for rid in plan if rid.endswith(("-0", "-2"))}
        for rid in sorted(early):
            idx, items = plan[rid]
            for item in items:
                enc.send(towers[idx].chunk(item.room, item.n_tokens))
        enc.sync()  # the early chunks reached their encode workers before any item info
        for rid, (idx, items) in plan.items():
            rep.call("stage", idx, rid, items, None)
        for rid in sorted(set(plan) - early):
            idx, items = plan[rid]
            for item in items:
                enc.send(towers[idx].chunk(item.room, item.n_tokens))

        results = rep.call("settle", sorted(plan), True, True)

        for rank, out in enumerate(results):
            assert sorted(out) == sorted(plan)
            for rid, (idx, items) in plan.items():
                kind, landed = out[rid]
                assert kind == "admitted"
                _check_rank(rank, p_tp, idx, towers[idx], items, landed)
        _check_encode_side(enc, plan, e_tp, p_tp)
        stats = rep.call("sweep_until_idle", 10.0)
        for rank, rank_stats in enumerate(stats):
            for idx, s in enumerate(rank_stats):
                assert s.pool.free_blocks == s.pool.total_blocks
                assert (s.pending, s.admitted, s.failed_total) == (0, 0, 0)
                assert s.admitted_total == len(SPANS)
                rows = sum(_rows(idx, rank, p_tp, span) for spans in SPANS for span in spans)
                assert s.landed_bytes == rows * _row_bytes(idx)
        n_items = sum(len(items) for _, items in plan.values())
        n_early = sum(len(plan[rid][1]) for rid in early)
        for rank, sender in enumerate(enc.senders):
            s = sender.stats()
            assert s.buffer.free_blocks == s.buffer.total_blocks
            assert (s.in_flight, s.sent_total, s.succeeded_total, s.failed_total) == (
                0,
                n_items,
                n_items,
                0,
            )
            assert s.parked_total >= n_early
            assert s.bytes_total == sum(o.nbytes for o in enc.outcomes_of(rank))


def _row_bytes(idx: int) -> int:
    dtype, hidden, levels, _ = RECEIVERS[idx]
    return hidden * (1 + levels) * torch.empty(0, dtype=dtype).element_size()


def _rows(idx: int, rank: int, p_tp: int, span: int) -> int:
    return shard_rows(span, rank, p_tp)[1] if RECEIVERS[idx][3] else span


def _check_rank(
    rank: int,
    p_tp: int,
    idx: int,
    tower: ToyVisionTower,
    items: list[EmbeddingItem],
    landed: list[LandedBytes],
) -> None:
    mode = ShardMode.ROWS if RECEIVERS[idx][3] and p_tp > 1 else ShardMode.IDENTITY
    assert [lb.room for lb in landed] == [item.room for item in items]
    for item, lb in zip(items, landed, strict=True):
        start, n = (
            shard_rows(item.n_tokens, rank, p_tp) if mode is ShardMode.ROWS else (0, item.n_tokens)
        )
        assert (lb.span, lb.row_start, lb.n_rows) == (item.n_tokens, start, n)
        main, deep = tower(item.room, item.n_tokens)
        assert lb.embedding == _raw(main[start : start + n])
        assert lb.deepstack == (None if deep is None else _raw(deep[start : start + n]))
        assert lb.whole == _raw(main)
        assert lb.whole_deepstack == _raw(deep)


def _check_encode_side(
    enc: EncodeNode, plan: dict[str, tuple[int, list[EmbeddingItem]]], e_tp: int, p_tp: int
) -> None:
    fanout = p_tp // e_tp
    rooms = {item.room: (idx, item.n_tokens) for idx, items in plan.values() for item in items}
    outcomes = enc.wait_for(sorted(rooms))
    for room, per_rank in outcomes.items():
        idx, span = rooms[room]
        shard = RECEIVERS[idx][3] and p_tp > 1
        assert len(per_rank) == e_tp
        for outcome in per_rank:
            assert outcome.status is TransferPoll.SUCCESS, outcome.reason
            assert outcome.receivers == fanout
        if shard:  # the encode ranks together wrote each row exactly once
            assert sum(o.nbytes for o in per_rank) == span * _row_bytes(idx)
        else:  # every prefill rank got every row
            assert [o.nbytes for o in per_rank] == [fanout * span * _row_bytes(idx)] * e_tp
    early = {item.room for rid, (_, items) in plan.items() for item in items if rid[-1] in "02"}
    for room in early:
        assert all(o.parked for o in outcomes[room])
