"""Shared fixtures for the engine tests: one torch thread (the CPU is shared), small configs."""

from __future__ import annotations

import pytest
import torch

from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPTS = [
    TOK.encode("hello world"),
    TOK.encode("the quick brown fox jumps over the lazy dog"),
    TOK.encode("a"),
    TOK.encode("hello world, hello again: paged attention"),
]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> None:
    # OpenMP workers spinning on a shared 2-core machine make tiny matmuls 100x slower.
    torch.set_num_threads(1)


def small_config(**changes: object) -> EngineConfig:
    """A tiny engine: 4-token pages so prompts span several pages and decode crosses pages."""
    base = EngineConfig(model=ModelConfig(), num_pages=96, page_size=4, max_running=8)
    return base.replace(**changes)
