"""Real KV transfers between TokenSpeed's PD managers and tspd's peers over Mooncake TCP.

TokenSpeed P → tspd D and tspd P → TokenSpeed D, at TP 1→1, 2→1, 1→2, 4→2 (GQA, 8 KV heads,
token-major pages) and 2→1 (MLA: a replicated latent, P rank 1 a dummy). Each side runs its
own code end to end: its recipe's contract, its bootstrap server (a P instance hosts it), its
registration, pre-allocation and status frames, its route planner and its Mooncake writes.
Source pages carry identity tags; every destination byte must be its room's and no other byte
of a destination arena may change. Neither side may log an ERROR (tspd's D keeps staging on
and must not offer it to TokenSpeed's P; TokenSpeed logged such offers as malformed).

TokenSpeed's managers live in one child process for the module (they cannot be closed); each
instance is started once and serves every case that needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)

from tspd_core.layout import CacheContract, PageLayout, build_contract, parse_contract
from tspd_core.pd import Failed, PdTunables
from tspd_testing.identity import RankView
from tspd_testing.interop.contracts import Model, tokenspeed_contract
from tspd_testing.interop.host import TokenSpeedHost
from tspd_testing.interop.tspd_side import (
    LOOPBACK,
    ErrorLog,
    TspdInstance,
    drive,
    expect_d,
    expect_p,
    failed,
    noise,
    plan_rooms,
    shared_arena,
    start_decode,
    start_prefill,
    tag_sources,
    verify,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GQA = Model("gqa-8", "mha", layers=2, kv_heads=8, head_dim=16, page=4)
MLA = Model("mla", "mla", layers=2, page=4, kv_lora_rank=48, rope_dim=16)
BUDGET = 1 << 20  # cache bytes per rank: a few hundred 4-token pages at these sizes
ROOMS = 6
CASES = [
    pytest.param(GQA, 1, 1, id="gqa-1to1"),
    pytest.param(GQA, 2, 1, id="gqa-2to1"),
    pytest.param(GQA, 1, 2, id="gqa-1to2"),
    pytest.param(GQA, 4, 2, id="gqa-4to2"),
    pytest.param(MLA, 2, 1, id="mla-2to1"),
]


@dataclass
class _TsInstance:
    name: str
    contract: CacheContract  # TokenSpeed's contract, parsed by tspd (for the identity oracle)
    views: list[RankView]
    port: int = 0


@dataclass
class World:
    """Instances on both sides, started on first use and shared by the cases."""

    host: TokenSpeedHost
    ts: dict[tuple[str, str, int], _TsInstance] = field(default_factory=dict)
    tspd: dict[tuple[str, str, int], TspdInstance] = field(default_factory=dict)

    def ts_instance(self, role: str, model: Model, tp: int) -> _TsInstance:
        key = (role, model.name, tp)
        if key not in self.ts:
            wire = tokenspeed_contract(model, tp, BUDGET).to_wire_bytes()
            contract = parse_contract(wire)
            arenas = [shared_arena(contract) for _ in range(tp)]
            name = f"{role}-{model.name}-{tp}"
            inst = _TsInstance(
                name, contract, [_view(a, contract, tp, r) for r, a in enumerate(arenas)]
            )
            cmd = "start_prefill" if role == "p" else "start_decode"
            inst.port = int(self.host.call(cmd, name, wire, arenas) or 0)
            self.ts[key] = inst
        return self.ts[key]

    def tspd_instance(self, role: str, model: Model, tp: int) -> TspdInstance:
        from tspd_testing.interop.contracts import tspd_spec

        key = (role, model.name, tp)
        if key not in self.tspd:
            contract = build_contract(tspd_spec(model, tp, BUDGET))
            start = start_prefill if role == "p" else start_decode
            self.tspd[key] = start(contract, tp, PdTunables())
        return self.tspd[key]


def _view(arena: Any, contract: CacheContract, tp: int, rank: int) -> RankView:
    return RankView(arena.numpy(), contract, tp, rank)


@pytest.fixture(scope="module")
def world(error_log: ErrorLog) -> Iterator[World]:
    host = TokenSpeedHost()
    w = World(host)
    try:
        yield w
    finally:
        host.close()  # first: its heartbeats must not outlive the tspd servers they probe
        for inst in w.tspd.values():
            inst.close()


@pytest.mark.parametrize(("model", "p_tp", "d_tp"), CASES)
def test_tokenspeed_prefill_to_tspd_decode(
    world: World, error_log: ErrorLog, model: Model, p_tp: int, d_tp: int
) -> None:
    p = world.ts_instance("p", model, p_tp)
    d = world.tspd_instance("d", model, d_tp)
    rooms = plan_rooms(p.contract, d.views[0].contract, ROOMS, seed=10 * p_tp + d_tp)
    tag_sources(p.views, rooms)
    snapshots = noise(d.views, seed=p_tp + d_tp)
    plans = [(r.room, {g: ids.tolist() for g, ids in r.p_table.items()}, r.token) for r in rooms]
    world.host.submit("run_prefill", p.name, plans, 60.0)
    final = drive(d, rooms, (LOOPBACK, p.port), world.host.ready)
    assert world.host.result() == {r.room: ["success"] * p_tp for r in rooms}
    assert failed(final) == []
    assert final == {i: expect_d(rooms) for i in range(d_tp)}
    assert verify(d.views, rooms, snapshots) == []
    assert world.host.call("errors") == []
    assert error_log.lines == []


@pytest.mark.parametrize(("model", "p_tp", "d_tp"), CASES)
def test_tspd_prefill_to_tokenspeed_decode(
    world: World, error_log: ErrorLog, model: Model, p_tp: int, d_tp: int
) -> None:
    p = world.tspd_instance("p", model, p_tp)
    d = world.ts_instance("d", model, d_tp)
    assert p.server is not None
    rooms = plan_rooms(p.views[0].contract, d.contract, ROOMS, seed=20 * p_tp + d_tp)
    tag_sources(p.views, rooms)
    snapshots = noise(d.views, seed=3 * p_tp + d_tp)
    plans = [
        (r.room, {g: ids.tolist() for g, ids in r.d_table.items()}, r.prefix_len, r.prompt_len)
        for r in rooms
    ]
    address = f"{LOOPBACK}:{p.server.port}"
    world.host.submit("run_decode", d.name, address, plans, 60.0)
    final = drive(p, rooms, (LOOPBACK, p.server.port), world.host.ready)
    assert world.host.result() == {r.room: [f"token {r.token}"] * d_tp for r in rooms}
    assert failed(final) == []
    assert final == {i: expect_p(rooms) for i in range(p_tp)}
    assert verify(d.views, rooms, snapshots) == []
    assert world.host.call("errors") == []
    assert error_log.lines == []


def test_a_head_major_tspd_node_says_which_flag_pairs_it(world: World, error_log: ErrorLog) -> None:
    """A tspd D started with --page-layout hnd meets a TokenSpeed P: the room fails on D at
    once, in one line naming the flag; TokenSpeed's P is never contacted."""
    p = world.ts_instance("p", GQA, 1)
    key = ("d-hnd", GQA.name, 1)
    if key not in world.tspd:
        from tspd_testing.interop.contracts import tspd_spec

        spec = dataclasses.replace(tspd_spec(GQA, 1, BUDGET), page_layout=PageLayout.HND)
        world.tspd[key] = start_decode(build_contract(spec), 1, PdTunables())
    d = world.tspd[key]
    rooms = plan_rooms(p.contract, d.views[0].contract, 1, seed=99)
    final = drive(d, rooms, (LOOPBACK, p.port), lambda: True)
    [event] = final[0].values()
    assert isinstance(event, Failed)
    assert "\n" not in event.reason
    assert event.reason.endswith(
        "the K/V page orders differ (token-major (NHD) vs head-major (HND)): start the tspd "
        "node with --page-layout nhd (token-major, the only order TokenSpeed has, and tspd's "
        "default) or both with --page-layout hnd"
    )
    assert world.host.call("errors") == []
    assert error_log.lines == []
