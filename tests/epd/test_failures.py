"""Timeouts, aborts and refusals fail the request on every prefill rank and release everything.

Real processes throughout: an encode node (one rank, its worker process) and a prefill replica
of TP 2 (two processes, gloo). Every case checks the agreed outcome on both ranks, the PD room
handed to the aborter, and that each receive pool and the send buffer return to their initial
free count. The late-write case proves the quarantine: an aborted item's buffer is not handed to
the next request until the encode rank's write into it has landed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tspd_core.epd import EmbeddingItem, EmbeddingReceiverConfig, ToyVisionTower
from tspd_core.epd.loopback import EncodeNode, PrefillReplica
from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.status import TransferPoll

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

HIDDEN = 64  # bf16: 128 bytes a row, 32 rows a 4 KiB block
NORMAL, QUICK, SMALL = 0, 1, 2


def _config(**kw: object) -> EmbeddingReceiverConfig:
    base: dict[str, object] = {
        "hidden": HIDDEN,
        "dtype": torch.bfloat16,
        "shard": False,
        "host": "127.0.0.1",
        "pool_bytes": 1 << 20,
        "quarantine_s": 60.0,
    }
    base.update(kw)
    return EmbeddingReceiverConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[EncodeNode, PrefillReplica]]:
    configs = [
        _config(),  # NORMAL
        _config(  # QUICK: gives up on embeddings after 1 s, quarantines for 3 s
            tunables=PdTunables(waiting_timeout_s=1.0), quarantine_s=3.0
        ),
        _config(pool_bytes=2 * 4096),  # SMALL: room for exactly two 32-row items
    ]
    with (
        EncodeNode(1, PdTunables(bootstrap_timeout_s=60.0)) as enc,
        PrefillReplica(2, configs) as rep,
    ):
        yield enc, rep


TOWER = ToyVisionTower(HIDDEN, 0, torch.bfloat16)


def _item(enc: EncodeNode, room: int, n: int) -> EmbeddingItem:
    host, port = enc.bootstrap
    return EmbeddingItem(Room(room), host, port, n)


ELSEWHERE = "failed on another rank of the prefill replica"


def _failed_everywhere(
    out: list[dict[str, object]], rid: str, reason: str, pd_room: int | None
) -> list[str]:
    """Every rank failed ``rid``; the ranks that saw the failure themselves say why, the others
    (whose status push was still on its way in that round) say another rank failed it."""
    reasons = []
    for rank_out in out:
        assert list(rank_out) == [rid]
        kind, why, room = rank_out[rid]  # type: ignore[misc]
        assert (kind, room) == ("failed", pd_room)
        assert why in (reason, ELSEWHERE)
        reasons.append(why)
    assert reason in reasons
    return reasons


def _new_aborts(rep: PrefillReplica, before: list[list[tuple[int, str]]]) -> list[object]:
    """The PD room aborts each rank recorded since ``before`` (the replica is shared by the
    module's tests: only this test's own aborts are its to check)."""
    after = rep.call("aborts")
    assert [calls[: len(old)] for calls, old in zip(after, before, strict=True)] == before
    return [calls[len(old) :] for calls, old in zip(after, before, strict=True)]


def _pools_whole(rep: PrefillReplica) -> None:
    for rank_stats in rep.call("sweep_until_idle", 15.0):
        for s in rank_stats:
            assert s.pool.free_blocks == s.pool.total_blocks, s
            assert (s.pending, s.admitted) == (0, 0)


def test_waiting_timeout_fails_every_rank_and_aborts_the_pd_room(
    cluster: tuple[EncodeNode, PrefillReplica],
) -> None:
    enc, rep = cluster
    item = _item(enc, 501, 10)
    before = rep.call("aborts")
    rep.call("stage", QUICK, "late", [item], 9001)
    out = rep.call("settle", ["late"], False, True)
    reason = "timed out: embeddings did not all arrive within 1 s"
    reasons = _failed_everywhere(out, "late", reason, 9001)
    assert _new_aborts(rep, before) == [[(9001, f"EPD embeddings: {why}")] for why in reasons]
    for rank_stats, why in zip(rep.call("stats"), reasons, strict=True):
        s = rank_stats[QUICK]
        assert (s.timed_out_total, s.failed_total) == (int(why == reason), 1)
        # advertised, no word from the encode rank yet: the block waits out its quarantine
        assert (s.pool.quarantined_extents, s.pool.quarantined_blocks) == (1, 1)
    _pools_whole(rep)
    enc.abort(item.room)


def test_encode_abort_fails_the_request_and_frees_at_once(
    cluster: tuple[EncodeNode, PrefillReplica],
) -> None:
    enc, rep = cluster
    item = _item(enc, 502, 40)  # 40 rows of 128 bytes: two 4 KiB blocks on each rank
    before = rep.call("aborts")
    rep.call("stage", NORMAL, "gone", [item], 9002)
    enc.abort(item.room, "vision tower crashed")
    out = rep.call("settle", ["gone"], False, True)
    reasons = _failed_everywhere(
        out, "gone", "item of room 502: encode rank 0 failed the item", 9002
    )
    assert _new_aborts(rep, before) == [[(9002, f"EPD embeddings: {why}")] for why in reasons]
    # Which rank heard the encode rank's Failed before the agreeing round is timing; what each
    # rank's pool holds follows from it exactly: a receiver takes the encode rank's notes only
    # when it settles or sweeps, and nothing has swept since the round that failed the request.
    for rank_stats, why in zip(rep.call("stats"), reasons, strict=True):
        pool = rank_stats[NORMAL].pool
        if why != ELSEWHERE:  # this rank heard the encode rank's Failed: nothing to quarantine
            assert pool.free_blocks == pool.total_blocks
            assert (pool.quarantined_extents, pool.quarantined_blocks) == (0, 0)
        else:  # its Failed push had not been taken: the item's two blocks wait for it
            assert (pool.quarantined_extents, pool.quarantined_blocks) == (1, 2)
            assert (pool.used_blocks, pool.free_blocks) == (0, pool.total_blocks - 2)
    _pools_whole(rep)
    enc.send(TOWER.chunk(item.room, 40))  # too late: the room is a tombstone
    (outcome,) = enc.wait_for([item.room])[item.room]
    assert (outcome.status, outcome.reason) == (
        TransferPoll.FAILED,
        "the room was aborted or failed",
    )


@pytest.mark.parametrize(
    ("hidden", "rows", "why"),
    [
        (32, 16, "expects [*, 64] torch.bfloat16; the encoded item is [*, 32] torch.bfloat16"),
        (64, 17, "expects 16 rows; the encoded item has 17"),
    ],
)
def test_mismatched_item_is_refused_by_the_encode_rank(
    cluster: tuple[EncodeNode, PrefillReplica], hidden: int, rows: int, why: str
) -> None:
    enc, rep = cluster
    room = 503 + hidden + rows
    item = _item(enc, room, 16)
    rid = f"bad-{room}"
    rep.call("stage", NORMAL, rid, [item], None)
    enc.send(ToyVisionTower(hidden, 0, torch.bfloat16).chunk(Room(room), rows))
    out = rep.call("settle", [rid], False, True)
    # The encode rank pushes Failed to both ranks; the one whose push was still on its way in
    # the agreeing round says another rank failed it (seen in CI under load).
    _failed_everywhere(out, rid, f"item of room {room}: encode rank 0 failed the item", None)
    (outcome,) = enc.wait_for([item.room])[item.room]
    assert outcome.status is TransferPoll.FAILED
    assert outcome.reason.endswith(why)
    assert (outcome.receivers, outcome.nbytes) == (2, 0)
    _pools_whole(rep)


def test_late_write_never_lands_in_another_requests_buffer(
    cluster: tuple[EncodeNode, PrefillReplica],
) -> None:
    enc, rep = cluster
    warm = _item(enc, 600, 32)  # caches the encode rank's address: A's info goes out at once
    rep.call("stage", SMALL, "warm", [warm], None)
    enc.send(TOWER.chunk(warm.room, 32))
    assert rep.call("settle", ["warm"], False, True)[0]["warm"][0] == "admitted"
    a, b = _item(enc, 601, 32), _item(enc, 602, 64)  # one block, then both blocks
    rep.call("stage", SMALL, "A", [a], 9003)
    assert rep.call("abort", SMALL, "A", "client went away") == [True, True]
    assert (
        rep.call("settle", ["A"], False, True) == [{"A": ("failed", "client went away", 9003)}] * 2
    )
    rep.call("stage", SMALL, "B", [b], None)
    for rank_stats in rep.call("stats"):  # A's block is held; B cannot have both blocks
        pool = rank_stats[SMALL].pool
        assert (pool.quarantined_blocks, pool.free_blocks, pool.used_blocks) == (1, 1, 0)
    enc.send(TOWER.chunk(a.room, 32))  # the slow encode rank finally writes A's rows...
    enc.send(TOWER.chunk(b.room, 64))
    (outcome,) = enc.wait_for([a.room])[a.room]
    assert outcome.status is TransferPoll.SUCCESS  # ...into the quarantined block
    out = rep.call("settle", ["B"], False, False)
    main, _ = TOWER(b.room, 64)
    for rank_out in out:
        kind, (landed,) = rank_out["B"]
        assert kind == "admitted"
        assert landed.embedding == main.view(torch.uint8).numpy().tobytes()
    rep.call("release", SMALL, "B")
    _pools_whole(rep)
    assert enc.wait_for([b.room])[b.room][0].status is TransferPoll.SUCCESS
    for sender in enc.senders:
        assert sender.stats().buffer.free_blocks == sender.stats().buffer.total_blocks


def test_oversized_item_fails_without_touching_the_pool(
    cluster: tuple[EncodeNode, PrefillReplica],
) -> None:
    enc, rep = cluster
    rep.call("stage", SMALL, "huge", [_item(enc, 701, 65)], None)
    out = rep.call("settle", ["huge"], False, True)
    why = "item of room 701: needs 8320 bytes; the receive pool holds 8192 (raise pool_bytes)"
    assert out == [{"huge": ("failed", why, None)}] * 2
    _pools_whole(rep)


def test_ranks_disagreeing_on_row_sharding_fail_loudly_instead_of_corrupting() -> None:
    configs = [_config(shard=True)]
    with EncodeNode(1) as enc, PrefillReplica(2, configs, overrides={1: {"shard": False}}) as rep:
        item = _item(enc, 801, 8)
        rep.call("stage", 0, "torn", [item], 9004)
        enc.send(TOWER.chunk(item.room, 8))
        why = "TOKENSPEED_EPD_EMBEDDING_SHARD differs across the prefill replica; set it alike"
        assert rep.call("settle", ["torn"], False, True) == [{"torn": ("failed", why, 9004)}] * 2
        # a rank whose item info went out holds its block until the encode rank answers; the
        # encode rank may park for its 120 s, so end the room there to see every pool whole
        enc.abort(item.room)
        _pools_whole(rep)
