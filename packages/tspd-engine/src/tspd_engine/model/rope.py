"""Rotary position embedding (Hugging Face Llama convention: rotate the two halves).

The cos/sin table is computed once in float32 for every position up to
``max_position_embeddings``; ``linear`` and ``llama3`` frequency scaling follow the published
Llama 3 recipe so real checkpoints reproduce their reference outputs.
"""

from __future__ import annotations

import math

import torch

from tspd_engine.model.config import ModelConfig, RopeScaling
from tspd_engine.model.weights import torch_dtype


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies ``[head_dim // 2]`` (float32), scaled as configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs.rope_type == "llama3":
        inv = _llama3(inv, rs)
    elif rs.rope_type == "factors":
        inv = inv / torch.tensor(rs.freq_factors, dtype=torch.float64)
    return inv.to(torch.float32)


def _llama3(inv: torch.Tensor, rs: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin of every position; immutable after construction, shared by all layers."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inverse_frequencies(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=torch_dtype(cfg))
        self.sin = emb.sin().to(device=device, dtype=torch_dtype(cfg))
        self.max_positions = cfg.max_position_embeddings

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` by each token's position ``[T]``."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
