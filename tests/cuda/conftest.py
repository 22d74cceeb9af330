"""The device tests: each runs once on CPU (in the normal suite) and once on CUDA.

The ``cuda`` parameter carries the ``cuda`` marker and skips, with its reason in one line,
where torch sees no GPU; ``scripts/gpu-check`` runs exactly those parameters on a GPU machine
(``-m cuda``). The same test body runs both, so the GPU minutes go to GPU questions only.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tspd_testing.loopback import assert_nothing_left_behind

NO_GPU = "needs a CUDA GPU (torch sees none here); scripts/gpu-check runs it on a GPU machine"
HAS_GPU = torch.cuda.is_available()

#: ``@pytest.mark.parametrize("device", DEVICES)``: the CPU form and the CUDA form of a test.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_GPU, reason=NO_GPU)]
    ),
]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # OpenMP workers spinning on a shared 2-core machine make tiny matmuls 100x slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    yield
    assert_nothing_left_behind()
