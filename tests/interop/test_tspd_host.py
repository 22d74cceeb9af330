"""tspd's ranks hosted a process each (``tspd_testing.interop.tspd_host``), as the benchmark
runs them beside TokenSpeed's: the pairs move the exact bytes, and a host fails plainly.

No TokenSpeed peer runs here: a hosted tspd P instance (TP 2, its bootstrap server in rank 0's
child) against a hosted tspd D replica and against one in this process, NHD GQA re-slicing
(each P rank holds half of every token row of D's pages), scrambled block tables, D's arena
filled with one byte value: every destination page must hold its room's identity and no other
D byte may change. The shared harness (``pairs``, ``contracts``) loads TokenSpeed's runtime on
import, so this module skips without it, as the others here do.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)

from tspd_core.layout import build_contract
from tspd_core.pd import PdTunables
from tspd_testing.interop import pairs
from tspd_testing.interop.contracts import Model, tspd_spec
from tspd_testing.interop.tspd_host import HostedInstance, TspdHost
from tspd_testing.interop.tspd_side import TspdInstance, start_decode

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GQA = Model("gqa-8", "mha", layers=2, kv_heads=8, head_dim=16, page=4)
TOKENS = 32


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, HostedInstance | TspdInstance]]:
    out: dict[str, HostedInstance | TspdInstance] = {}
    try:
        for role, tp in (("p", 2), ("d", 1)):
            budget = pairs.budget_for(GQA, tp, 64)
            contract = build_contract(tspd_spec(GQA, tp, budget))
            out[role] = HostedInstance(role, contract, tp, PdTunables())
            if role == "d":
                out["d_here"] = start_decode(contract, tp, PdTunables())
        yield out
    finally:
        for inst in out.values():
            inst.close()


@pytest.mark.parametrize("d_kind", ["d", "d_here"])
def test_hosted_ranks_move_a_room_byte_exact(
    world: dict[str, HostedInstance | TspdInstance], d_kind: str
) -> None:
    p, d = world["p"], world[d_kind]
    p_count = p.views[0].contract.group(pairs.GID).page_count
    d_count = d.views[0].contract.group(pairs.GID).page_count
    rng = np.random.default_rng(len(d_kind))
    src = rng.permutation(np.arange(1, p_count))[: TOKENS // 4]
    dst = rng.permutation(np.arange(1, d_count))[: TOKENS // 4]
    salt = 500 + len(d_kind)
    big = pairs.room(salt, TOKENS, src, dst)
    pairs.tag(p, [big])
    timed = pairs.run(p, d, [big], snapshots=pairs.fill(d, salt))
    assert 0 < timed.transfer_s <= timed.latency_s
    # Staged: each P rank's half rows go as pieces, not one descriptor per token row per field
    # (8 pages x 4 rows x 4 fields = 128 a rank).
    assert 0 < timed.descriptors < 2 * 128
    for engine_flow in (False, True):
        one = pairs.room(salt + 10 + engine_flow, 4, src[:1], dst[:1])
        pairs.tag(p, [one])
        snaps = pairs.fill(d, salt + 1)
        assert pairs.run(p, d, [one], snapshots=snaps, engine_flow=engine_flow).latency_s > 0
    assert isinstance(p, HostedInstance)
    assert p.errors() == []


def test_a_room_that_lands_wrong_is_reported_from_hosted_ranks(
    world: dict[str, HostedInstance | TspdInstance],
) -> None:
    """The check can fail: sources left untagged leave D's pages without the room's identity."""
    p, d = world["p"], world["d"]
    for view in p.views:
        view.arena[:] = 0
    room = pairs.room(77, 8, np.array([5, 6]), np.array([7, 8]))
    with pytest.raises(pairs.PairError, match="problem"):
        pairs.run(p, d, [room], snapshots=pairs.fill(d, 3))


def test_a_host_asked_to_run_before_it_started_says_so() -> None:
    host = TspdHost()
    try:
        with pytest.raises(RuntimeError, match="start comes first"):
            host.call("run", [], ("127.0.0.1", 1), 1.0, False)
        with pytest.raises(RuntimeError, match="KeyError: 'nonsense'"):
            host.call("nonsense")
    finally:
        host.close()


def test_a_host_whose_parent_goes_away_exits() -> None:
    host = TspdHost()
    proc = host._proc
    host._conn.close()  # what the parent's death does to the child's end of the pipe
    proc.join(60)
    assert proc.exitcode == 0
