"""A dense, cache-free, single-process reference of the same model, for checking the engine.

Written independently of the paged path (explicit softmax, KV heads repeated, the rotation
spelled out per pair) so that agreement between the two means something. Slow on purpose:
it recomputes the whole sequence for every generated token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tspd_engine.model.config import ModelConfig
from tspd_engine.model.rope import inverse_frequencies


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    # x: [T, heads, D]; pair i is (x[i], x[i + D/2]) rotated by position * freq[i]
    half = cfg.head_dim // 2
    pos = torch.arange(x.shape[0], dtype=torch.float32)
    angle = pos[:, None] * inverse_frequencies(cfg)[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _project(h: torch.Tensor, w: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    out = h @ w[name + ".weight"].T
    bias = w.get(name + ".bias")
    return out if bias is None else out + bias


@torch.inference_mode()
def dense_logits(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], ids: Sequence[int]
) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of every position of ``ids`` (no KV cache)."""
    w = {k: v.float() for k, v in state.items()}
    t, d, eps = len(ids), cfg.head_dim, cfg.rms_norm_eps
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    x = w["model.embed_tokens.weight"][torch.tensor(list(ids))]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (_project(h, w, p + f"self_attn.{x}_proj").view(t, -1, d) for x in "qkv")
        q, k = _rotate(q, cfg), _rotate(k, cfg)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return x @ head.T


def dense_greedy(
    cfg: ModelConfig, state: Mapping[str, torch.Tensor], prompt: Sequence[int], max_tokens: int
) -> list[int]:
    """Greedy continuation of ``prompt`` (stops after EOS or ``max_tokens`` tokens)."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(dense_logits(cfg, state, ids)[-1].argmax())
        out.append(token)
        ids.append(token)
        if token == cfg.eos_token_id:
            break
    return out
