"""The transfer benchmark's TokenSpeed pairs (``tspd_testing.interop.pairs``) move the exact bytes.

One NHD P TP 2 -> D TP 1 shape (GQA, 8 KV heads: each P rank holds half of every token row of
D's pages), both systems' instances, and the four pairs the benchmark times: TokenSpeed ->
TokenSpeed (a process per TokenSpeed rank), tspd -> tspd, and the two mixed ones, with tspd's
ranks in this process and then hosted a process each. Each moves a scrambled 32-token room
into a D arena filled with one byte value: every destination page must hold its room's
identity and no other D byte may change; then a one-page room. TokenSpeed's P
and tspd's P writing to TokenSpeed's D put one descriptor per token row per field on the wire
(what the benchmark reports as the unequal-TP raw path); tspd -> tspd stages, so fewer.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)

from tspd_testing.interop import pairs
from tspd_testing.interop.contracts import Model
from tspd_testing.interop.tspd_side import ErrorLog

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

GQA = Model("gqa-8", "mha", layers=2, kv_heads=8, head_dim=16, page=4)
TOKENS = 32
#: Per P rank: 8 pages x 4 token rows x 4 fields (K and V of 2 layers), one descriptor each.
RAW = 2 * (TOKENS // 4) * 4 * 4


@pytest.fixture(scope="module", params=[False, True], ids=["tspd-here", "tspd-hosted"])
def shape(request: pytest.FixtureRequest) -> Iterator[pairs.Instances]:
    """tspd's ranks in this process, then each in a child process (as the benchmark runs them)."""
    inst = pairs.Instances.start(GQA, 2, 1, pages=64, hosted=request.param)
    try:
        yield inst
    finally:
        inst.close()


@pytest.mark.parametrize(("p_sys", "d_sys"), [(p, d) for p in pairs.SYSTEMS for d in pairs.SYSTEMS])
def test_each_pair_moves_its_rooms_byte_exact(
    shape: pairs.Instances, error_log: ErrorLog, p_sys: str, d_sys: str
) -> None:
    p, d = shape.p[p_sys], shape.d[d_sys]
    p_count, d_count = (c.group(pairs.GID).page_count for c in shape.contracts())
    rng = np.random.default_rng(len(p_sys) * 10 + len(d_sys))
    src = rng.permutation(np.arange(1, p_count))[: TOKENS // 4]
    dst = rng.permutation(np.arange(1, d_count))[: TOKENS // 4]
    salt = 1000 * len(p_sys) + len(d_sys)
    big = pairs.room(salt, TOKENS, src, dst)
    pairs.tag(p, [big])
    timed = pairs.run(p, d, [big], snapshots=pairs.fill(d, salt))
    assert 0 < timed.transfer_s <= timed.latency_s
    if (p_sys, d_sys) == ("tspd", "tspd"):
        assert 0 < timed.descriptors < RAW  # staged: pieces, not token rows
    else:
        assert timed.descriptors == RAW
    one = pairs.room(salt + 1, 4, src[:1], dst[:1])
    pairs.tag(p, [one])
    assert pairs.run(p, d, [one], snapshots=pairs.fill(d, salt + 1)).latency_s > 0
    assert shape.errors() == []
    assert error_log.lines == []


def test_a_room_that_lands_wrong_is_reported(shape: pairs.Instances) -> None:
    """The check can fail: sources left untagged leave D's pages without the room's identity."""
    p, d = shape.p["tspd"], shape.d["tspd"]
    room = pairs.room(77, 8, np.array([5, 6]), np.array([7, 8]))
    for view in p.views:
        view.arena[:] = 0
    with pytest.raises(pairs.PairError, match="problem"):
        pairs.run(p, d, [room], snapshots=pairs.fill(d, 3))
