"""The same model's cache contract, built by TokenSpeed's recipe code and by tspd's recipe.

TokenSpeed's builders here run its cache pipeline as its ``CacheRecipe.setup`` does — group the
layers, pack, check, size the parents from the budget, bind — then its transfer-schema builder
and its contract type. Its config classes import transformers and GPU kernels, so the recipes
get plain attribute objects with the fields they read (the fixture's README says they accept
them); :class:`_Ordinary` dispatches MHA/MLA layers straight to the recipe's own per-layer field
functions instead of through ``isinstance`` on those config classes. Nothing else is replaced.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tspd_testing.interop import env

env.load()

import torch  # noqa: E402
from tokenspeed.runtime.layers.attention.kv_cache.recipes import (  # noqa: E402
    ordinary,
    plan,
    qwen35,
    spec,
    transfer,
)
from tokenspeed.runtime.pd.cache_protocol import CacheTransferContract  # noqa: E402

from tspd_core.layout import ArenaSpec, AttentionKind, PageLayout, StateSpec  # noqa: E402

NS = types.SimpleNamespace
_TORCH = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


@dataclass(frozen=True, slots=True)
class Model:
    """One model's cache facts, as both recipes need them."""

    name: str
    family: str  # "mha" (MHA/GQA), "mla" or "qwen_gdn"
    layers: int
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page: int = 16
    kv_lora_rank: int = 512
    rope_dim: int = 64
    state_layers: tuple[int, ...] = ()  # qwen_gdn: linear-attention layers
    key_heads: int = 16
    value_heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    conv_kernel: int = 4

    def at(self, **changes: Any) -> Model:
        return dataclasses.replace(self, **changes)


#: The models the contract tests compare, with real sizes (small layer counts keep them fast).
MODELS = [
    Model("mha-8-heads", "mha", layers=4, kv_heads=8, head_dim=128),
    Model("gqa-1-head", "mha", layers=4, kv_heads=1, head_dim=128),
    Model("gqa-2-heads", "mha", layers=4, kv_heads=2, head_dim=128),
    Model("gqa-8-heads", "mha", layers=4, kv_heads=8, head_dim=64, page=64),
    Model("mla-deepseek", "mla", layers=3, page=64),
    Model("fp8-gqa", "mha", layers=4, kv_heads=8, head_dim=128, dtype="float8_e4m3fn"),
    Model("fp8-mla", "mla", layers=3, page=64, dtype="float8_e4m3fn"),
    Model(
        "qwen3.5-gdn",
        "qwen_gdn",
        layers=8,
        kv_heads=2,
        head_dim=256,
        page=128,
        state_layers=(0, 1, 2, 4, 5, 6),
    ),
]


class _Ordinary(ordinary.OrdinaryRecipe):  # type: ignore[misc]  # TokenSpeed is untyped
    """TokenSpeed's ordinary recipe; only the config-class dispatch is done by family."""

    @cached_property
    def group_ids(self) -> tuple[str, ...]:
        return (str(spec.FULL_ATTENTION),) * int(self.num_target_layers)

    @cached_property
    def layer_types(self) -> tuple[str, ...]:
        return ()

    def fields_for_layer(self, layer_id: int, group_id: str, occurrence: int) -> Any:
        if self.family == "mla":
            return ordinary._mla_layer_fields(self.attn_config, layer_id, occurrence)
        return ordinary._mha_layer_fields(self.attn_config, layer_id, occurrence)


def _cell_bytes(m: Model, tp: int) -> int:
    width = torch.empty((), dtype=_TORCH[m.dtype]).element_size()
    if m.family == "mla":
        return (m.kv_lora_rank + m.rope_dim) * width
    return 2 * max(m.kv_heads // tp, 1) * m.head_dim * width


def _attn(m: Model, tp: int) -> Any:
    layer_types = [
        "linear_attention" if i in m.state_layers else "full_attention" for i in range(m.layers)
    ]
    return NS(
        prefix_granularity=m.page,
        num_kv_heads=m.kv_heads,
        attn_tp_size=tp,
        head_dim=m.head_dim,
        kv_cache_dtype=_TORCH[m.dtype],
        kv_cache_mxfp8=False,
        kv_cache_quant_method=None,
        kv_lora_rank=m.kv_lora_rank,
        qk_rope_head_dim=m.rope_dim,
        dtype=torch.bfloat16,
        device="cpu",
        pd_disaggregation_enabled=True,
        layer_types=layer_types,
        max_bs=8,
        context_len=1 << 17,
        cache_cell_size=lambda: _cell_bytes(m, tp),
    )


def _model_config(m: Model, tp: int) -> Any:
    conv = ((2 * m.key_heads * m.key_dim + m.value_heads * m.value_dim) // tp, m.conv_kernel - 1)
    ssm = (m.value_heads // tp, m.value_dim, m.key_dim)
    text = (
        NS(
            mamba2_cache_params=(conv, ssm, torch.bfloat16, torch.float32, list(m.state_layers)),
            linear_key_head_dim=m.key_dim,
            linear_num_key_heads=m.key_heads,
            linear_value_head_dim=m.value_dim,
            linear_num_value_heads=m.value_heads,
        )
        if m.state_layers
        else NS()
    )
    return NS(
        num_attention_layers=m.layers,
        num_key_value_heads=m.kv_heads,
        hf_config=text,
        hf_text_config=text,
    )


def tokenspeed_contract(m: Model, tp: int, budget: int) -> CacheTransferContract:
    """TokenSpeed's contract of one rank of ``m`` at TP ``tp`` with ``budget`` cache bytes."""
    kwargs = {
        "server_args": NS(max_total_tokens=None, chunked_prefill_size=8192),
        "model_config": _model_config(m, tp),
        "attn_config": _attn(m, tp),
        "draft_model_config": None,
        "draft_attn_config": None,
        "cache_budget_bytes": budget,
        "decode_input_tokens": 1,
        "overlap_schedule_depth": 0,
    }
    recipe: Any
    if m.family == "qwen_gdn":
        recipe = qwen35.QwenGDNRecipe(**kwargs)
    else:
        recipe = _Ordinary(family=m.family, **kwargs)
    # CacheRecipe.setup()'s stages, in its order (setup itself imports the config classes).
    groups = recipe.groups()
    layout = plan.pack(
        groups,
        prefix_granularity=recipe.prefix_granularity,
        cache_blocks_per_lcm_block=recipe.packing(groups),
        alignment=recipe.alignment,
        max_padding_fraction=recipe.max_padding_fraction,
    )
    recipe.check_layout(layout)
    memory_plan = layout.bind(recipe.num_lcm_blocks(layout))
    schema = transfer.build_cache_transfer_schema(memory_plan, model_config=kwargs["model_config"])
    return CacheTransferContract(
        plan=memory_plan,
        group_specs=tuple(group_spec for group_spec, _ in groups),
        transfer_schema=schema,
    )


def tspd_spec(m: Model, tp: int, budget: int, rank: int = 0) -> ArenaSpec:
    """tspd's arena spec of the same rank (its recipe builds the contract from it)."""
    state = None
    if m.state_layers:
        state = StateSpec(
            layers=m.state_layers,
            key_heads=m.key_heads,
            value_heads=m.value_heads,
            key_head_dim=m.key_dim,
            value_head_dim=m.value_dim,
            conv_width=m.conv_kernel - 1,
        )
    return ArenaSpec(
        layers=m.layers,
        attention=AttentionKind.MLA if m.family == "mla" else AttentionKind.GQA,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
        page_size=m.page,
        tp_size=tp,
        tp_rank=rank,
        page_layout=PageLayout.NHD,
        latent_dim=m.kv_lora_rank,
        rope_dim=m.rope_dim,
        state=state,
        memory_bytes=budget,
    )
