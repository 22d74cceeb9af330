"""Replica agreement over a real gloo group: every member gets the element-wise MIN."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import numpy as np
import pytest

from tspd_core.pd.peer.agreement import GlooMesh, pack
from tspd_core.pd.status import TransferPoll as S

VECTORS = [
    [S.SUCCESS, S.BOOTSTRAPPED, S.FAILED, S.SUCCESS],
    [S.BOOTSTRAPPED, S.SUCCESS, S.SUCCESS, S.SUCCESS],
]


def _member(rank: int, path: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    store = dist.FileStore(path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        group = GlooMesh([dist.group.WORLD]).replica_group(0)
        out.put((rank, group.min_reduce(pack(VECTORS[rank])).tolist()))
        out.put((rank, group.min_reduce(pack([])).tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_two_members_agree_on_the_minimum() -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_member, args=(r, path, out)) for r in range(2)]
        for p in procs:
            p.start()
        got = sorted(out.get(timeout=120) for _ in range(4))
        for p in procs:
            p.join(30)
    want = np.minimum(*[pack(v) for v in VECTORS]).tolist()
    assert want == [2, 2, 0, 5]
    assert got == [(0, []), (0, want), (1, []), (1, want)]
    assert [p.exitcode for p in procs] == [0, 0]
