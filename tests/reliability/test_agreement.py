"""Replica agreement across real processes: a P replica of TP 4 and a D replica of TP 2.

Four P engine processes (a gloo group of 4) and two D engine processes (a gloo group of 2), each
with its own transfer worker, a real bootstrap server, real ZMQ and Mooncake. With 2 KV heads,
P ranks 1 and 3 serve no D rank (dummies: D rank 0 rendezvouses with them, they write nothing
and succeed after their "forward"). Every member of a replica must log exactly the same
(round, event, request) list; every page arrives byte-exact; both sides' pools end whole.
"""

from __future__ import annotations

import numpy as np
import pytest

from tspd_bootstrap.server import BootstrapServer
from tspd_core.layout import ArenaSpec, build_contract, canonical_contract
from tspd_core.pd import PdTunables
from tspd_testing.replica_rank import ReplicaScript, RoomScript
from tspd_testing.replicas import Replica, run_replicas

ROOMS = 48
PAGE = 4
SPEC = ArenaSpec(layers=2, kv_heads=2, head_dim=16, page_size=PAGE, num_pages=ROOMS * 11)


def _rooms(bootstrap: tuple[str, int]) -> list[RoomScript]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(ROOMS):
        prompt = int(rng.integers(1, 41))
        full = (prompt - 1) // PAGE
        prefix = PAGE * int(rng.integers(0, full + 1)) if full and i % 3 == 0 else 0
        room = int(rng.integers(0, 2**63 - 1))
        # Waves of 6 every 4 rounds: rooms overlap in every state.
        out.append(RoomScript(f"r{i}", room, prompt, prefix, 100 + i, 1 + 4 * (i // 6), bootstrap))
    return out


def _canonical(text: str) -> str:
    return canonical_contract(text.encode()).decode()


@pytest.mark.multiproc
@pytest.mark.slow
def test_every_member_of_a_replica_logs_the_same_rounds_and_events() -> None:
    with BootstrapServer("127.0.0.1", 0, layout_canonicalizer=_canonical) as server:
        boot = ("127.0.0.1", server.port)
        rooms = tuple(_rooms(boot))
        tun = PdTunables(stage_min_runs=1)  # staged and direct both occur (see the bytes check)
        p = Replica("p", ReplicaScript("p", _tp(4), rooms, tun, p_bootstrap=server.url))
        d = Replica("d", ReplicaScript("d", _tp(2), rooms, tun))
        out = run_replicas([p, d], timeout_s=240)
    p_out, d_out = out["p"], out["d"]
    for side in (p_out, d_out):
        assert all(r.log == side[0].log for r in side), "members of a replica disagree"
        assert [r.rounds for r in side] == [side[0].rounds] * len(side)
        assert all((r.free_end, r.tracked_end) == (r.free_start, 0) for r in side)
    rids = [r.rid for r in rooms]
    assert _events_by_rid(p_out[0].log) == {rid: ["Bootstrapped", "Succeeded"] for rid in rids}
    assert _events_by_rid(d_out[0].log) == {rid: ["Bootstrapped", "RemotePrefill"] for rid in rids}
    assert d_out[0].outcome == {r.rid: ("RemotePrefill", str(r.token)) for r in rooms}
    assert [r.problems for r in d_out] == [[], []]
    # Exact bytes: P ranks 0 and 2 each send one head of every transferred page; the dummy
    # ranks 1 and 3 send nothing and still succeed every room.
    page_bytes = sum(f.payload_bytes for f in build_contract(_tp(4)).plan.fields)
    pages = sum(-(-r.prompt_len // PAGE) - r.prefix_len // PAGE for r in rooms)
    sent = [_metric(r.metrics, "tspd_pd_transfer_bytes_total") for r in p_out]
    assert sent == [pages * page_bytes, 0, pages * page_bytes, 0]
    succeeded = [_metric(r.metrics, "tspd_pd_rooms_succeeded_total") for r in [*p_out, *d_out]]
    assert succeeded == [ROOMS] * 6


def _tp(size: int) -> ArenaSpec:
    from dataclasses import replace

    return replace(SPEC, tp_size=size)


def _events_by_rid(log: list[tuple[int, str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for _, event, rid in log:
        out.setdefault(rid, []).append(event)
    return out


def _metric(families: dict, name: str) -> float:  # type: ignore[type-arg]
    from tspd_core.pd.metrics.registry import MetricsSnapshot

    return MetricsSnapshot(families).total(name)
