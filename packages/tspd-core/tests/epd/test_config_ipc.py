"""EPD configs (environment, validation, derived sizes) and the engine/worker message codec."""

from __future__ import annotations

import pytest
import torch

from tspd_core.epd import ipc
from tspd_core.epd.config import EmbeddingReceiverConfig, EmbeddingSenderConfig, shard_from_env
from tspd_core.epd.items import ShardMode
from tspd_core.ids import Room
from tspd_core.pd.config import PdTunables
from tspd_core.pd.errors import ConfigError, FrameError
from tspd_core.pd.status import TransferPoll


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, True),
        ({"TOKENSPEED_EPD_EMBEDDING_SHARD": "0"}, False),
        ({"TOKENSPEED_EPD_EMBEDDING_SHARD": "Off"}, False),
        ({"TOKENSPEED_EPD_EMBEDDING_SHARD": "true"}, True),
        ({"TOKENSPEED_EPD_EMBEDDING_SHARD": "1", "TSPD_EPD_EMBEDDING_SHARD": "no"}, False),
    ],
)
def test_shard_flag_from_env(env: dict[str, str], want: bool) -> None:
    assert shard_from_env(env) is want


def test_bad_shard_flag_names_the_variable() -> None:
    with pytest.raises(
        ConfigError, match="TOKENSPEED_EPD_EMBEDDING_SHARD='maybe' is not a boolean"
    ):
        shard_from_env({"TOKENSPEED_EPD_EMBEDDING_SHARD": "maybe"})


def test_receiver_config_derives_mode_and_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_EPD_EMBEDDING_SHARD", "0")
    c = EmbeddingReceiverConfig(hidden=64, dtype=torch.bfloat16, deepstack_levels=3, tp_size=4)
    assert (c.shard, c.mode) == (False, ShardMode.IDENTITY)
    assert (c.row_bytes, c.deepstack_row_bytes) == (128, 384)
    sharded = EmbeddingReceiverConfig(hidden=8, dtype=torch.float32, tp_size=2, shard=True)
    assert sharded.mode is ShardMode.ROWS
    solo = EmbeddingReceiverConfig(hidden=8, dtype=torch.float32, shard=True)
    assert solo.mode is ShardMode.IDENTITY  # one rank takes every row
    t = PdTunables(bootstrap_timeout_s=7.0)
    assert (
        EmbeddingReceiverConfig(hidden=8, dtype=torch.float32, tunables=t).quarantine_seconds
        == 17.0
    )


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"tp_rank": 2, "tp_size": 2}, "tp rank 2 is outside 0..1"),
        ({"hidden": 0}, "hidden must be 1.."),
        ({"deepstack_levels": -1}, "deepstack_levels >= 0"),
        ({"dtype": torch.complex64}, "not supported"),
        ({"protocol": "udp"}, "protocol must be one of"),
        ({"quarantine_s": -1.0}, "quarantine_s must be >= 0"),
    ],
)
def test_receiver_config_refusals(kw: dict[str, object], why: str) -> None:
    base: dict[str, object] = {"hidden": 8, "dtype": torch.float32}
    base.update(kw)
    with pytest.raises((ConfigError, ValueError), match=why):
        EmbeddingReceiverConfig(**base)  # type: ignore[arg-type]


def test_sender_config_refusals() -> None:
    with pytest.raises(ConfigError, match="needs the bootstrap server"):
        EmbeddingSenderConfig(bootstrap_url="")
    with pytest.raises(ConfigError, match="start_method must be one of"):
        EmbeddingSenderConfig(bootstrap_url="h:1", start_method="fork")
    with pytest.raises(ConfigError, match="below one block"):
        EmbeddingSenderConfig(bootstrap_url="h:1", buffer_bytes=100)
    with pytest.raises(ConfigError, match=r"tombstone_s must be >= 0, got -1\.0"):
        EmbeddingSenderConfig(bootstrap_url="h:1", tombstone_s=-1.0)


def test_tombstones_last_the_bootstrap_timeout_unless_set() -> None:
    tunables = PdTunables(bootstrap_timeout_s=7.0)
    assert EmbeddingSenderConfig(bootstrap_url="h:1", tunables=tunables).tombstone_seconds == 7.0
    config = EmbeddingSenderConfig(bootstrap_url="h:1", tunables=tunables, tombstone_s=0.0)
    assert config.tombstone_seconds == 0.0


@pytest.mark.parametrize(
    "msg",
    [
        ipc.SubmitChunk(Room(2**63 - 1), 4096, 10, 8, "torch.float16", 160, 4256, 320),
        ipc.AbortRoom(Room(3), "why"),
        ipc.Shutdown(),
        ipc.WorkerReady("127.0.0.1", 5000, "127.0.0.1:16000", 1 << 40),
        ipc.WorkerFatal("no route"),
        ipc.ChunkDone(Room(4), TransferPoll.FAILED, "late", True, 2, 0),
        ipc.Sync(7),
        ipc.Synced(7),
    ],
)
def test_ipc_round_trips(msg: ipc.Message) -> None:
    assert ipc.decode(ipc.encode(msg)) == msg


@pytest.mark.parametrize(
    "buf", [b"", b"\x63{}", b"\x01{", b'\x12{"room":1,"status":9}', b'\x02{"x":1}']
)
def test_ipc_refuses_garbage(buf: bytes) -> None:
    with pytest.raises(FrameError, match="bad encode engine/worker message"):
        ipc.decode(buf)


def test_sync_messages_exact_bytes() -> None:
    assert ipc.encode(ipc.Sync(7)) == b'\x04{"token":7}'
    assert ipc.encode(ipc.Synced(7)) == b'\x13{"token":7}'
