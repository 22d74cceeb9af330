"""Peer configuration: bad values are refused before any process starts."""

from __future__ import annotations

import pytest
import torch

from tspd_core.layout import ArenaSpec, build_contract, encode_contract
from tspd_core.pd import ConfigError, DecodePeer, DecodePeerConfig, PdTunables, PrefillPeerConfig

CONTRACT = build_contract(ArenaSpec(layers=1, kv_heads=2, head_dim=8, page_size=4, num_pages=4))
TEXT = encode_contract(CONTRACT).decode()


def _arena(nbytes: int = CONTRACT.plan.arena_bytes) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"tp_size": 2, "tp_rank": 2}, "is outside its group"),
        ({"protocol": "udp"}, "protocol must be one of"),
        ({"start_method": "fork"}, "start_method must be one of"),
        ({"arena": torch.zeros(4, 4, dtype=torch.uint8)}, "1-D uint8"),
        ({"arena": torch.zeros(8, dtype=torch.float32)}, "1-D uint8"),
        ({"mooncake_env": {"PATH": "/tmp"}}, "MC_"),
    ],
)
def test_bad_config_fields(kwargs: dict[str, object], why: str) -> None:
    base: dict[str, object] = {"contract": TEXT, "arena": _arena(), "bootstrap_url": "h:1"}
    with pytest.raises(ConfigError, match=why):
        PrefillPeerConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_arena_must_match_the_contract_before_a_worker_starts() -> None:
    config = DecodePeerConfig(contract=TEXT, arena=_arena(CONTRACT.plan.arena_bytes - 1))
    with pytest.raises(ConfigError, match=r"allocate exactly contract\.plan\.arena_bytes"):
        DecodePeer.start(config)


def test_garbage_contract_is_a_config_error() -> None:
    config = DecodePeerConfig(contract='{"plan": 1}', arena=_arena())
    with pytest.raises(ConfigError, match="cache contract is invalid"):
        DecodePeer.start(config)


def test_tunable_limits() -> None:
    with pytest.raises(ConfigError, match="queue_size"):
        PdTunables(queue_size=0)
    with pytest.raises(ConfigError, match="at least 1 MiB"):
        PdTunables(staging_bytes=4 << 20, staging_slots=8)
    with pytest.raises(ConfigError, match="staging_slots_per_rank"):
        PdTunables(staging_slots_per_rank=9)


def test_advertised_host_prefers_config_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    config = DecodePeerConfig(contract=TEXT, arena=_arena(), host="10.9.8.7")
    assert config.advertised_host() == "10.9.8.7"
    monkeypatch.setenv("TSPD_HOST", "10.1.1.1")
    assert DecodePeerConfig(contract=TEXT, arena=_arena()).advertised_host() == "10.1.1.1"


def test_write_window_by_protocol_unless_set() -> None:
    def window(protocol: str, tunables: PdTunables) -> int:
        return DecodePeerConfig(
            contract=TEXT, arena=_arena(), protocol=protocol, tunables=tunables
        ).write_window()

    assert (window("tcp", PdTunables()), window("rdma", PdTunables())) == (64, 0)
    assert window("tcp", PdTunables.from_env({"TSPD_WRITE_WINDOW": "0"})) == 0
    assert window("rdma", PdTunables.from_env({"TSPD_WRITE_WINDOW": "16"})) == 16
    with pytest.raises(ConfigError, match="write_window must be >= -1"):
        PdTunables(write_window=-2)
