"""The pure registry: placement, completeness, re-registration, conflicts, redeploys."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

from tspd_bootstrap import (
    LEASE_EXTENSION,
    Outcome,
    ParallelInfo,
    RankAddress,
    Registration,
    RegistrationError,
    Registry,
    Role,
    ServerKind,
)
from tspd_bootstrap.registry import first_difference

LAYOUT = '{"plan":{},"group_specs":[],"transfer_schema":{"fields":[]}}'
OTHER = '{"plan":{"x":1},"group_specs":[],"transfer_schema":{"fields":[]}}'


def reg(
    rank: int, world: int = 4, dp: int = 2, port: int = 0, layout: str | None = LAYOUT
) -> Registration:
    return Registration(Role.PREFILL, world, dp, "10.0.0.7", port or 7000 + rank, rank, layout)


def test_ranks_land_at_dp_group_and_tp_rank() -> None:
    registry = Registry(ServerKind.KV)
    for rank in range(6):
        registry.register(reg(rank, world=6, dp=3), now=float(rank))
    view = registry.snapshot()
    assert [(e.engine_rank, e.dp_group, e.tp_rank, e.rank_port) for e in view.ranks] == [
        (0, 0, 0, 7000),
        (1, 0, 1, 7001),
        (2, 1, 0, 7002),
        (3, 1, 1, 7003),
        (4, 2, 0, 7004),
        (5, 2, 1, 7005),
    ]
    assert registry.lookup(1, 2) == RankAddress("10.0.0.7", 7005)
    assert registry.lookup(0, 1) == RankAddress("10.0.0.7", 7002)
    assert registry.parallel_info() == ParallelInfo(6, 3, LAYOUT)


def test_lookups_wait_for_the_asked_for_dp_group() -> None:
    """World 4, DP 2: group 0 is engine ranks 0-1, group 1 ranks 2-3. A decode rank needs
    exactly its group, so a look-up answers once that group is complete."""
    registry = Registry(ServerKind.KV)
    assert registry.parallel_info() is None
    assert registry.lookup(0, 0) is None
    registry.register(reg(0), now=1.0)
    assert registry.lookup(0, 0) is None  # rank 1 of group 0 is missing: not yet
    assert registry.group_missing(0) == (1,)
    for rank in (1, 3):
        registry.register(reg(rank), now=1.0)
    assert registry.lookup(1, 0) == RankAddress("10.0.0.7", 7001)  # group 1 still waits
    assert registry.lookup(1, 1) is None  # rank 2 is not there
    assert (registry.group_missing(1), registry.snapshot().missing) == ((2,), (2,))
    assert not registry.complete
    registry.register(reg(2), now=2.0)
    assert registry.complete
    assert registry.lookup(0, 1) == RankAddress("10.0.0.7", 7002)
    assert registry.snapshot().missing == ()


def test_extensions_ride_with_the_rank() -> None:
    registry = Registry(ServerKind.KV)
    registry.register(dataclasses.replace(reg(0, world=1, dp=1), extensions=("tspd.stage/2",)), 1.0)
    assert registry.lookup(0, 0) == RankAddress("10.0.0.7", 7000, ("tspd.stage/2",))
    assert registry.snapshot().ranks[0].extensions == ("tspd.stage/2",)
    registry.register(reg(0, world=1, dp=1), now=2.0)  # re-registered without: gone
    assert registry.lookup(0, 0) == RankAddress("10.0.0.7", 7000)


BEYOND = "out of range: the deployment has 2 DP group(s) of 2 TP rank(s)"
NEGATIVE = "must both be >= 0 (or both -1 for the parallel info)"


@pytest.mark.parametrize(
    ("tp", "dp", "why"),
    [
        (2, 0, f"engine_rank 2 / target_dp_group 0 {BEYOND}"),
        (0, 2, f"engine_rank 0 / target_dp_group 2 {BEYOND}"),
        (5, 5, f"engine_rank 5 / target_dp_group 5 {BEYOND}"),
        (-1, 0, f"engine_rank -1 and target_dp_group 0 {NEGATIVE}"),
        (0, -1, f"engine_rank 0 and target_dp_group -1 {NEGATIVE}"),
        (-1, -1, f"engine_rank -1 and target_dp_group -1 {NEGATIVE}"),
    ],
)
def test_out_of_range_lookups_are_400(tp: int, dp: int, why: str) -> None:
    registry = Registry(ServerKind.KV)
    for rank in range(4):
        registry.register(reg(rank), now=0.0)
    with pytest.raises(RegistrationError, match=f"^{re.escape(why)}$") as info:
        registry.lookup(tp, dp)
    assert (info.value.status, info.value.code) == (400, "out_of_range")


def test_a_rank_moves_to_another_address_only_when_its_holder_is_gone() -> None:
    leased = dataclasses.replace(reg(2), extensions=(LEASE_EXTENSION,))
    registry = Registry(ServerKind.KV, lease_s=20.0)
    for rank in range(4):
        assert registry.register(leased if rank == 2 else reg(rank), now=1.0) is Outcome.NEW
    moved = dataclasses.replace(leased, rank_port=9999)
    before = registry.snapshot()
    with pytest.raises(RegistrationError, match=r"^engine_rank 2 is registered at 10\.0\.0\.7:"):
        registry.register(moved, now=20.9)  # 19.9 s after the last registration: held
    assert registry.snapshot() == before
    assert registry.register(leased, now=5.0) is Outcome.REREGISTERED  # renewed at 5 s
    assert registry.lease_left(registry.snapshot().ranks[2], now=12.0) == 13.0
    assert registry.holder(moved, now=24.9) == registry.snapshot().ranks[2]
    assert registry.register(moved, now=25.0) is Outcome.REPLACED  # lapsed at 5 + 20 s
    entry = registry.snapshot().ranks[2]
    assert (entry.rank_port, entry.registrations) == (9999, 3)
    assert (entry.first_registered, entry.last_registered) == (1.0, 25.0)
    assert registry.lookup(0, 1) == RankAddress("10.0.0.7", 9999, (LEASE_EXTENSION,))
    # Without a lease a rank never lapses; a trusted (sealed) registration moves it at once.
    with pytest.raises(RegistrationError, match="registered without a lease") as info:
        registry.register(reg(0, port=9000), now=1e9)
    assert (info.value.status, info.value.code) == (409, "rank_held")
    assert registry.lease_left(registry.snapshot().ranks[0], now=1.0) is None
    assert registry.register(reg(0, port=9000), now=2.0, trusted=True) is Outcome.REPLACED
    assert registry.lookup(0, 0) == RankAddress("10.0.0.7", 9000)
    assert registry.registered == 4


LAYOUT_DIFFERS = "registered (first difference at byte 9: this rank has "


@pytest.mark.parametrize(
    ("offered", "code", "begins"),
    [
        (
            reg(1, layout=OTHER),
            "layout_conflict",
            f"cache_layout of engine_rank 1 differs from the one engine_rank 0 {LAYOUT_DIFFERS}",
        ),
        (
            reg(1, world=8, dp=2),
            "deployment_conflict",
            "engine_rank 1 registers world_size 8, dp_size 2, but engine_rank 0 registered "
            "world_size 4, dp_size 2; ",
        ),
        (
            reg(1, world=4, dp=1),
            "deployment_conflict",
            "engine_rank 1 registers world_size 4, dp_size 1, but engine_rank 0 registered "
            "world_size 4, dp_size 2; ",
        ),
        (  # a new rank, too
            reg(3, layout=OTHER),
            "layout_conflict",
            f"cache_layout of engine_rank 3 differs from the one engine_rank 0, 1 {LAYOUT_DIFFERS}",
        ),
    ],
)
def test_conflicts_are_409_and_change_nothing(
    offered: Registration, code: str, begins: str
) -> None:
    registry = Registry(ServerKind.KV)
    registry.register(reg(0), now=1.0)
    registry.register(reg(1), now=1.0)
    before = registry.snapshot()
    with pytest.raises(RegistrationError, match=f"^{re.escape(begins)}") as info:
        registry.register(offered, now=2.0)
    assert (info.value.status, info.value.code) == (409, code)
    assert "engine_rank 0" in info.value.message
    assert registry.snapshot() == before
    assert registry.parallel_info() == ParallelInfo(4, 2, LAYOUT)


def test_a_lone_rank_may_redefine_the_deployment() -> None:
    registry = Registry(ServerKind.KV)
    registry.register(reg(0), now=1.0)
    assert registry.register(reg(0, world=2, dp=1, layout=OTHER), now=2.0) is Outcome.REDEPLOYED
    assert registry.parallel_info() == ParallelInfo(2, 1, OTHER)
    assert registry.register(reg(0, world=2, dp=1, layout=OTHER), now=3.0) is Outcome.REREGISTERED
    assert registry.snapshot().ranks[0].registrations == 3


def test_reset_and_deregister_allow_a_full_redeploy() -> None:
    registry = Registry(ServerKind.KV)
    for rank in range(4):
        registry.register(reg(rank), now=1.0)
    assert registry.deregister(3) is not None
    assert registry.deregister(3) is None
    assert registry.snapshot().missing == (3,)
    assert registry.lookup(0, 1) is None  # group 1 is incomplete again
    assert registry.reset() == 3
    assert registry.parallel_info() is None
    assert registry.register(reg(0, world=1, dp=1, layout=OTHER), now=2.0) is Outcome.NEW
    assert registry.parallel_info() == ParallelInfo(1, 1, OTHER)
    assert registry.lookup(0, 0) == RankAddress("10.0.0.7", 7000)


def test_deregistering_the_last_rank_forgets_the_deployment() -> None:
    registry = Registry(ServerKind.KV)
    registry.register(reg(0), now=1.0)
    registry.register(reg(1), now=1.0)
    registry.deregister(0)
    assert registry.parallel_info() == ParallelInfo(4, 2, LAYOUT)
    registry.deregister(1)
    assert registry.parallel_info() is None
    assert registry.expected == 0


def test_embedding_registry_takes_no_layout() -> None:
    registry = Registry(ServerKind.EMBEDDING)
    registry.register(Registration(Role.ENCODE, 2, 1, "e0", 6000, 0), now=0.0)
    registry.register(Registration(Role.PREFILL, 2, 1, "e1", 6001, 1), now=0.0)
    assert registry.parallel_info() == ParallelInfo(2, 1, None)
    assert registry.lookup(1, 0) == RankAddress("e1", 6001)
    assert [e.role for e in registry.snapshot().ranks] == [Role.ENCODE, Role.PREFILL]
    with pytest.raises(
        RegistrationError, match=r"^a embedding server takes cache_layout iff it is a KV server$"
    ):
        registry.register(reg(0, world=2, dp=1), now=0.0)
    with pytest.raises(
        RegistrationError, match=r"^a kv server takes cache_layout iff it is a KV server$"
    ):
        Registry(ServerKind.KV).register(reg(0, layout=None), now=0.0)


def test_snapshot_summarises_the_layout() -> None:
    registry = Registry(ServerKind.KV)
    registry.register(reg(0), now=0.0)
    view = registry.snapshot()
    assert view.layout_bytes == len(LAYOUT)
    assert view.layout_sha256 == hashlib.sha256(LAYOUT.encode()).hexdigest()
    assert (view.world_size, view.dp_size, view.missing) == (4, 2, (1, 2, 3))


def test_first_difference_points_at_the_byte() -> None:
    assert first_difference("abcXef", "abcYef", context=2) == (
        "first difference at byte 3: this rank has 'bcXe', the deployment has 'bcYe'"
    )
    assert first_difference("abc", "abcd", context=1) == (
        "first difference at byte 3: this rank has 'c', the deployment has 'cd'"
    )
