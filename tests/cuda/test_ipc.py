"""The arena and the step-counter word, shared with a worker process the way a transfer worker
gets them (``ProcessHandle.spawn``: forkserver, torch's reductions — shared memory on CPU, a
CUDA IPC handle on GPU): bytes the worker writes are the engine's, bytes the engine writes are
the worker's, and the counter the engine advances (on the device, mirrored into page-locked
host memory on CUDA) is the value the worker reads, across the counter's wrap.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tspd_core.pd.layerwise.step_counter import M, StepCounter, ready
from tspd_core.pd.proc.handle import ProcessHandle
from tspd_testing import ipc_probe
from tspd_testing.ipc_probe import ProbeCounter, ProbeDigest, ProbeFill, ProbeSpec

from .conftest import DEVICES

pytestmark = pytest.mark.multiproc

ARENA = 1 << 20


@dataclass
class Shared:
    arena: torch.Tensor
    counter: StepCounter
    probe: ProcessHandle[Any, Any]


@pytest.fixture(scope="module", params=DEVICES)
def shared(request: pytest.FixtureRequest) -> Iterator[Shared]:
    """An arena and a counter (near the wrap) on the device, and a probe worker mapping both
    (one per device for the module: each test touches its own bytes, only one the counter)."""
    arena = torch.zeros(ARENA, dtype=torch.uint8, device=request.param)
    counter = StepCounter(request.param, start=M - 2)
    probe = ipc_probe.start(arena, ProbeSpec(counter.host))
    try:
        yield Shared(arena, counter, probe)
    finally:
        probe.close()
        counter.close()


def test_the_worker_maps_the_engines_arena(shared: Shared) -> None:
    arena, probe = shared.arena, shared.probe
    assert probe.ready == ipc_probe.ProbeReady(str(arena.device), ARENA)


def test_worker_writes_reach_the_engine_and_back(shared: Shared) -> None:
    arena, probe = shared.arena, shared.probe
    # Worker -> engine: the probe fills 8 KiB at 4 KiB; the engine sees exactly those bytes.
    assert ipc_probe.ask(probe, ProbeFill(4096, 8192, seed=7)) == "filled"
    host = arena.cpu().numpy()
    assert np.array_equal(host[4096:12288], ipc_probe.pattern(8192, 7))
    assert not host[:4096].any()
    assert not host[12288:65536].any()
    # Engine -> worker: the engine writes 4 KiB at 64 KiB; the worker's bytes hash the same,
    # for the region and for the whole arena.
    arena[65536:69632] = torch.from_numpy(ipc_probe.pattern(4096, 9)).to(arena.device)
    if arena.is_cuda:
        torch.cuda.synchronize()
    want = ipc_probe.digest(torch.from_numpy(ipc_probe.pattern(4096, 9)))
    assert ipc_probe.ask(probe, ProbeDigest(65536, 4096)) == want
    assert ipc_probe.ask(probe, ProbeDigest(0, ARENA)) == ipc_probe.digest(arena)


def test_the_worker_reads_the_counter_across_the_wrap(shared: Shared) -> None:
    counter, probe = shared.counter, shared.probe
    assert ipc_probe.ask(probe, ProbeCounter()) == str(M - 2)
    begin = counter.reserve(4)
    assert begin == M - 2
    seen = []
    for _ in range(4):
        counter.advance()  # CUDA: an add and an async copy to the host word, on the stream
        if counter.device.type == "cuda":
            torch.cuda.synchronize()
        seen.append(int(ipc_probe.ask(probe, ProbeCounter())))
    assert seen == [M - 1, 0, 1, 2]
    assert counter.value() == 2 == counter.reserved == counter.issued
    # Wrap-safe: 2 has passed every step of the forward, M - 2 .. 1, and not itself.
    assert [ready(2, t) for t in (M - 2, M - 1, 0, 1, 2)] == [True, True, True, True, False]
