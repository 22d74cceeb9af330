"""Arena descriptions of well-known models, for the simulator, benchmarks and the engine.

Each function returns an :class:`ArenaSpec` for one rank; keyword overrides replace any field
(``page_layout``, ``arrangement``, ``page_size``, ``draft_layers`` ...). Capacity must be given
as ``num_pages`` or ``memory_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tspd_core.layout.recipe import ArenaSpec, AttentionKind


def _spec(base: ArenaSpec, overrides: dict[str, Any]) -> ArenaSpec:
    return dataclasses.replace(base, **overrides)


def llama3_8b(tp_size: int = 1, tp_rank: int = 0, **overrides: Any) -> ArenaSpec:
    """Llama-3-8B: 32 layers, GQA with 8 KV heads of dim 128, bf16, 16-token pages."""
    base = ArenaSpec(
        layers=32,
        attention=AttentionKind.GQA,
        kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=16,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_pages=overrides.pop("num_pages", None),
        memory_bytes=overrides.pop("memory_bytes", None),
    )
    return _spec(base, overrides)


def llama3_70b(tp_size: int = 1, tp_rank: int = 0, **overrides: Any) -> ArenaSpec:
    """Llama-3-70B: 80 layers, GQA with 8 KV heads of dim 128, bf16, 16-token pages."""
    return _spec(llama3_8b(tp_size, tp_rank, layers=80), overrides)


def deepseek_v3(tp_size: int = 1, tp_rank: int = 0, **overrides: Any) -> ArenaSpec:
    """DeepSeek-V3: 61 MLA layers, latent 512 + rope 64 (replicated on every rank), bf16,
    64-token pages (FlashMLA's page size). ``draft_layers=1`` adds the MTP layer."""
    base = ArenaSpec(
        layers=61,
        attention=AttentionKind.MLA,
        latent_dim=512,
        rope_dim=64,
        dtype="bfloat16",
        page_size=64,
        tp_size=tp_size,
        tp_rank=tp_rank,
        num_pages=overrides.pop("num_pages", None),
        memory_bytes=overrides.pop("memory_bytes", None),
    )
    return _spec(base, overrides)
