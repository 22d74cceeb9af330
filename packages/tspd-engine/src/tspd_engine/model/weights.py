"""Model weights: Llama tensor names, seeded random initialisation, and TP sharding.

Every rank builds its shard from the same *global* tensors (random ones generated from the
seed, or ones read from a checkpoint), so a TP 2 model is exactly the TP 1 model cut in two.
Sharded tensors are fused per layer (q|k|v, gate|up) so each projection is one matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tspd_engine.model.config import ModelConfig
from tspd_engine.model.tp import ShardPlan
from tspd_serving.errors import CheckpointError

#: A source of global tensors: ``get(name, rows, cols)`` returns the ``[rows, cols]`` slice of
#: the named global tensor (``None`` = whole axis); the checkpoint reader and the seeded
#: generator both implement it, so sharding is one code path.
TensorSource = Callable[[str, slice | None, slice | None], torch.Tensor]


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype the model computes in (``cfg.dtype``, a name :class:`ModelConfig`
    checked)."""
    dtype: torch.dtype = getattr(torch, cfg.dtype)
    return dtype


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's local shard (fused projections, engine dtype)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(q_local + 2 kv_local) * head_dim, hidden]
    o: torch.Tensor  # [hidden, q_local * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * inter_local, hidden]
    down: torch.Tensor  # [hidden, inter_local]
    qkv_bias: torch.Tensor | None = None  # [(q_local + 2 kv_local) * head_dim] (Qwen2)


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """One rank's weights; the embedding, final norm and LM head are replicated."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]


def global_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint for ``cfg``, in Hugging Face names and shapes."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            **_bias_shapes(cfg, p),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _bias_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    if not cfg.qkv_bias:
        return {}
    sizes = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    return {f"{prefix}self_attn.{x}_proj.bias": (n,) for x, n in sizes.items()}


def random_tensor(cfg: ModelConfig, seed: int, name: str) -> torch.Tensor:
    """The global tensor ``name`` of the seeded random model (float32, deterministic).

    Each tensor has its own generator seeded from (seed, position in the name list), so any rank
    can make any tensor without making the others. Norms start at 1; projections are
    N(0, 1/fan_in) so activations keep unit scale through the layers.
    """
    shapes = global_shapes(cfg)
    if name not in shapes:
        raise CheckpointError(f"no tensor {name!r} in a model with this config")
    shape = shapes[name]
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 100_003 + list(shapes).index(name))
    std = 1.0 if name == "model.embed_tokens.weight" else shape[-1] ** -0.5
    if name.endswith(".bias"):
        std = 0.1
    return torch.randn(shape, generator=gen) * std


def random_source(cfg: ModelConfig, seed: int) -> TensorSource:
    """A :data:`TensorSource` over the seeded random model."""

    def get(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        t = random_tensor(cfg, seed, name)
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t

    return get


def shard_weights(cfg: ModelConfig, plan: ShardPlan, get: TensorSource) -> ModelWeights:
    """Build one rank's :class:`ModelWeights` from global tensors, cast to ``cfg.dtype``."""
    dt, d = torch_dtype(cfg), cfg.head_dim
    q_rows = slice(plan.q_head_start * d, (plan.q_head_start + plan.q_heads) * d)
    kv_rows = slice(plan.kv_head_start * d, (plan.kv_head_start + plan.kv_heads) * d)
    ff = slice(plan.intermediate_start, plan.intermediate_start + plan.intermediate)
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = [get(p + f"self_attn.{x}_proj.weight", r, None) for x, r in _qkv(q_rows, kv_rows)]
        bias = None
        if cfg.qkv_bias:
            parts = [get(p + f"self_attn.{x}_proj.bias", r, None) for x, r in _qkv(q_rows, kv_rows)]
            bias = torch.cat(parts).to(dt).contiguous()
        mlp = [get(p + f"mlp.{x}_proj.weight", ff, None) for x in ("gate", "up")]
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight", None, None).to(dt),
                qkv=torch.cat(attn).to(dt).contiguous(),
                o=get(p + "self_attn.o_proj.weight", None, q_rows).to(dt).contiguous(),
                post_norm=get(p + "post_attention_layernorm.weight", None, None).to(dt),
                gate_up=torch.cat(mlp).to(dt).contiguous(),
                down=get(p + "mlp.down_proj.weight", None, ff).to(dt).contiguous(),
                qkv_bias=bias,
            )
        )
    embed = get("model.embed_tokens.weight", None, None).to(dt).contiguous()
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = embed if cfg.tie_word_embeddings else get(head_name, None, None).to(dt).contiguous()
    norm = get("model.norm.weight", None, None).to(dt)
    return ModelWeights(embed=embed, layers=tuple(layers), norm=norm, lm_head=head)


def _qkv(q_rows: slice, kv_rows: slice) -> Iterator[tuple[str, slice]]:
    yield "q", q_rows
    yield "k", kv_rows
    yield "v", kv_rows


def full_random_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The whole seeded random model as a Hugging Face state dict (for checkpoints, tests)."""
    return {name: random_tensor(cfg, seed, name) for name in global_shapes(cfg)}


def weights_to(w: ModelWeights, device: torch.device) -> ModelWeights:
    """The same weights on ``device`` (a no-op on CPU); tied heads stay tied."""
    if device.type == "cpu":
        return w
    embed = w.embed.to(device)
    layers = tuple(
        LayerWeights(
            **{f: _to(getattr(layer, f), device) for f in LayerWeights.__slots__}  # type: ignore[arg-type]
        )
        for layer in w.layers
    )
    head = embed if w.lm_head is w.embed else w.lm_head.to(device)
    return ModelWeights(embed, layers, w.norm.to(device), head)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
