"""The engine <-> worker message codec, the agreement rules and the tunables."""

from __future__ import annotations

import numpy as np
import pytest

from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import ConfigError, FrameError
from tspd_core.pd.peer.agreement import SOLO, Verdict, decide, pack, pack_rows, row
from tspd_core.pd.status import TransferPoll as S
from tspd_core.pd.wire import ipc

MESSAGES: list[ipc.Message] = [
    ipc.TrackRoom(Room(7), "10.1.2.3", 8998),
    ipc.PublishManifest(Room(2**63 - 1), '{"groups":[]}'),
    ipc.ReleaseRoom(Room(3), "client went away"),
    ipc.Shutdown(),
    ipc.WorkerReady("127.0.0.1", 40000, "127.0.0.1:16000", 0x7F0000001000),
    ipc.WorkerFatal("no RDMA device"),
    ipc.RoomUpdate(Room(5), S.SUCCESS, 42, (1, 2, 3), 16, -0.5, ""),
    ipc.RoomUpdate(Room(5), S.FAILED, reason="write to 127.0.0.1:1 failed"),
    ipc.RoomUpdate(Room(5), S.FAILED, reason="P aborted", quiet=True, settled=True, cause="remote"),
    ipc.ReleaseRoom(Room(4), "failed on another rank of the replica", failed=True),
    ipc.AbortRoom(Room(6), "client went away", "abort"),
    ipc.StatsRequest(3),
    ipc.WorkerCounters({"bytes": 4096.0}, 3),
    ipc.MetricsRequest(4),
    ipc.WorkerMetrics({"x": {"kind": "counter", "help": "h", "buckets": [], "rows": []}}, 4),
    ipc.ReleaseArena(5),
    ipc.RestoreArena(6),
    ipc.Reply(6, False, "rooms [1] are still tracked", "127.0.0.1:16001"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: ipc.Message) -> None:
    assert ipc.decode(ipc.encode(msg)) == msg


def test_submit_chunk_carries_block_tables_as_raw_int64() -> None:
    tables = (np.arange(256, dtype=np.int64) * 3, np.array([], dtype=np.int64), np.array([9]))
    msg = ipc.SubmitChunk(Room(1), 0, 4096, True, tables, 17, (4, 5), 0, None)
    buf = ipc.encode(msg)
    back = ipc.decode(buf)
    assert isinstance(back, ipc.SubmitChunk)
    assert [a.tolist() for a in back.block_ids] == [t.tolist() for t in tables]
    assert (back.room, back.start, back.end, back.final, back.token) == (1, 0, 4096, True, 17)
    assert back.spec_ids == (4, 5)
    assert len(buf) < 8 * 257 + 200  # the table travels as raw bytes, not JSON text


@pytest.mark.parametrize(
    "buf",
    [b"", b"\x63\0\0\0\0\0\0\0\0", ipc.encode(ipc.Shutdown()) + b"x", ipc.encode(MESSAGES[0])[:-2]],
)
def test_garbage_is_a_frame_error(buf: bytes) -> None:
    with pytest.raises(FrameError, match="bad engine/worker message"):
        ipc.decode(buf)


def test_agreement_rules_wire_section_1_and_a_jump_past_2() -> None:
    got = {(s, v): decide(s, v) for s in (S.BOOTSTRAPPING, S.BOOTSTRAPPED) for v in range(6)}
    n, b, ok, f = Verdict.NONE, Verdict.BOOTSTRAPPED, Verdict.SUCCEEDED, Verdict.FAILING
    assert got == {
        (S.BOOTSTRAPPING, 0): f,
        (S.BOOTSTRAPPING, 1): n,
        (S.BOOTSTRAPPING, 2): b,
        # A D rank whose manifest went out with its registration may be past 2 before its
        # engine acted on Bootstrapped: Bootstrapped now, the final event next round (wire.md
        # §1's exact match would never fire again: states only move forward).
        (S.BOOTSTRAPPING, 3): b,
        (S.BOOTSTRAPPING, 4): b,
        (S.BOOTSTRAPPING, 5): b,
        (S.BOOTSTRAPPED, 0): f,
        (S.BOOTSTRAPPED, 1): n,
        (S.BOOTSTRAPPED, 2): n,
        (S.BOOTSTRAPPED, 3): n,
        (S.BOOTSTRAPPED, 4): n,
        (S.BOOTSTRAPPED, 5): ok,
    }


def test_failing_phase_waits_for_every_rank_quiet_or_one_settled() -> None:
    # While failing, a row is [quiet, not settled]: MIN says "all quiet" or "someone settled".
    assert row(S.BOOTSTRAPPED, S.WAITING_FOR_INPUT, True, False) == (3, 1)
    assert row(S.FAILED, S.FAILED, False, False) == (0, 1)
    assert row(S.FAILED, S.SUCCESS, True, False) == (1, 1)
    assert row(S.FAILED, S.FAILED, False, True) == (0, 0)
    got = {(q, st): decide(S.FAILED, q, st) for q in (0, 1) for st in (0, 1)}
    assert got == {
        (0, 1): Verdict.NONE,  # some rank may still be writing
        (1, 1): Verdict.FAILED,  # every rank quiet
        (0, 0): Verdict.FAILED,  # a P rank pushed Failed: its whole replica drained
        (1, 0): Verdict.FAILED,
    }
    rows = [row(S.FAILED, S.FAILED, False, False), row(S.BOOTSTRAPPING, S.BOOTSTRAPPED, 0, 0)]
    assert pack_rows(rows).tolist() == [0, 1, 2, 1]


def test_solo_replica_reduces_to_itself_in_insertion_order() -> None:
    vec = pack([S.SUCCESS, S.BOOTSTRAPPING, S.FAILED])
    assert vec.dtype == np.uint8
    assert SOLO.replica_group(0).min_reduce(vec).tolist() == [5, 1, 0]


def test_tunables_from_env_with_aliases_floors_and_errors() -> None:
    env = {
        "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "30",
        "TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5",
        "TOKENSPEED_DISAGGREGATION_QUEUE_SIZE": "2",
        "TSPD_QUEUE_SIZE": "3",
        "TOKENSPEED_DISAGGREGATION_THREAD_POOL_SIZE": "1",
    }
    t = PdTunables.from_env(env)
    assert (t.bootstrap_timeout_s, t.heartbeat_interval_s, t.queue_size) == (30.0, 2.0, 3)
    assert t.thread_pool_size == 3  # raised to the queue count
    assert PdTunables.from_env({}).waiting_timeout_s == 300.0
    faults = PdTunables.from_env(
        {"TSPD_FAULT_WRITE_PROBABILITY": "0.25", "TOKENSPEED_DISAGGREGATION_FAULT_WRITE_SEED": "17"}
    )
    assert (faults.fault_write_probability, faults.fault_write_seed) == (0.25, 17)
    assert PdTunables.from_env({}).fault_write_seed == 0  # a fixed default: runs replay
    with pytest.raises(ConfigError, match="TSPD_WAITING_TIMEOUT='soon' is not a valid float"):
        PdTunables.from_env({"TSPD_WAITING_TIMEOUT": "soon"})
