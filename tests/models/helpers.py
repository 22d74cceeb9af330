"""Shared pieces of the real-model tests: the paged model run step by step, and the
transformers reference over the same weights."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tspd_engine.model.attention import build_meta, pack_tables
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.llama import LlamaModel
from tspd_engine.model.tp import ShardPlan, TpGroup
from tspd_engine.model.weights import TensorSource, global_shapes, shard_weights

CPU = torch.device("cpu")
PAGE = 16


def paged_model(cfg: ModelConfig, source: TensorSource) -> LlamaModel:
    plan = ShardPlan.build(cfg, 0, 1)
    return LlamaModel(cfg, plan, shard_weights(cfg, plan, source), TpGroup(), CPU)


def full_state(cfg: ModelConfig, source: TensorSource) -> dict[str, torch.Tensor]:
    """Every global tensor of the model in Hugging Face names (float32)."""
    return {name: source(name, None, None) for name in global_shapes(cfg)}


def state_source(state: Mapping[str, torch.Tensor]) -> TensorSource:
    """A :data:`TensorSource` over tensors already in memory (read once, used twice)."""

    def get(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        t = state[name]
        t = t if rows is None else t[rows]
        return t if cols is None else t[:, cols]

    return get


class Pages:
    """Per-layer page tensors ``[pages, kv_heads, P, D]``, NaN where nothing was written."""

    def __init__(self, cfg: ModelConfig, count: int) -> None:
        shape = (cfg.num_hidden_layers, count, cfg.num_key_value_heads, PAGE, cfg.head_dim)
        self.k = torch.full(shape, float("nan"))
        self.v = torch.full(shape, float("nan"))
        self.k[:, 0] = 0.0
        self.v[:, 0] = 0.0

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


def paged_greedy(
    model: LlamaModel, prompts: Sequence[Sequence[int]], steps: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill every prompt in one ragged forward, then ``steps - 1`` batched decode steps:
    the float32 logits ``[rows, steps, vocab]`` of each step and the greedy tokens."""
    cfg = model.cfg
    per_row = -(-(max(map(len, prompts)) + steps) // PAGE)
    pages = Pages(cfg, 1 + per_row * len(prompts))
    tables = [np.arange(1 + r * per_row, 1 + (r + 1) * per_row) for r in range(len(prompts))]
    context = np.zeros(len(prompts), dtype=np.int64)
    feed = [list(p) for p in prompts]
    logits, tokens = [], [[] for _ in prompts]
    for _ in range(steps):
        new = np.array([len(f) for f in feed], dtype=np.int64)
        meta = build_meta(context, new, *pack_tables(tables), PAGE, CPU)
        ids = torch.tensor([t for f in feed for t in f])
        out = model.forward(model.embed(ids), meta, pages)
        logits.append(out)
        picked = out.argmax(-1).tolist()
        context = context + new
        feed = [[t] for t in picked]
        for row, t in zip(tokens, picked, strict=True):
            row.append(t)
    return torch.stack(logits, dim=1), tokens


def hf_llama(cfg: ModelConfig, state: Mapping[str, torch.Tensor], arch: str = "llama") -> Any:
    """transformers' own implementation of ``cfg`` holding ``state`` (float32, eval mode)."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = kinds[arch]
    config = config_cls(**hf_config_kwargs(cfg))
    with torch.device("meta"):
        model = model_cls(config)
    model.load_state_dict(dict(state), strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"transformers' model lacks weights for {missing[:3]}"
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # off meta
    return model.float().eval()


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": cfg.rope_scaling.rope_type}
    if cfg.rope_scaling.rope_type == "llama3":
        rs = cfg.rope_scaling
        rope |= {
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }


@torch.inference_mode()
def hf_greedy(
    model: Any, prompts: Sequence[Sequence[int]], steps: int, pad: int = 0
) -> tuple[torch.Tensor, list[list[int]]]:
    """transformers' forward with its KV cache over the left-padded batch (explicit positions
    and attention mask): the logits ``[rows, steps, vocab]`` and the greedy tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    logits = [out.logits[:, -1].float()]
    last = positions[:, -1]
    # transformers 5 renames the cache argument (past_key_values -> cache).
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    for _ in range(steps - 1):
        picked = logits[-1].argmax(-1)
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        last = last + 1
        cache = getattr(out, "cache", None) or out.past_key_values
        out = model(
            input_ids=picked[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            use_cache=True,
            **{key: cache},
        )
        logits.append(out.logits[:, -1].float())
    stacked = torch.stack(logits, dim=1)
    return stacked, stacked.argmax(-1).tolist()
