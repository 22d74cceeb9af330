"""The Llama-style decoder over a paged KV arena, tensor parallel across ranks.

One :class:`LlamaModel` per rank holds that rank's weight shard and reads/writes that rank's
arena. ``forward`` is a pure function of (weights, arena, batch): it writes the batch's new K/V
into the pages named by the metadata and returns the logits of each row's last token. The two
row-parallel projections (o, down) end in an all-reduce over the TP group; everything else is
rank-local. Not thread-safe: one engine thread per rank calls it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tspd_engine.model.attention import AttnMeta, paged_attention, write_kv
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.rope import RotaryTable
from tspd_engine.model.tp import ShardPlan, TpGroup
from tspd_engine.model.weights import LayerWeights, ModelWeights

#: ``pages(layer)`` → that layer's (K, V) page views ``[pages, kv_heads_local, P, head_dim]``.
PageViews = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
#: What the forward calls after each layer's KV writes, with the layer's index.
AfterLayer = Callable[[int], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in float32, scale in the model dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """One rank's shard of the decoder (see the module docstring for ownership)."""

    def __init__(
        self,
        cfg: ModelConfig,
        plan: ShardPlan,
        weights: ModelWeights,
        tp: TpGroup,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.plan = plan
        self.weights = weights
        self.tp = tp
        self.device = device
        self.rope = RotaryTable(cfg, device)
        d = cfg.head_dim
        q_end, k_end = plan.q_heads * d, (plan.q_heads + plan.kv_heads) * d
        self._split = ((0, q_end), (q_end, k_end), (k_end, k_end + plan.kv_heads * d))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the token ids ``[T]`` (a device gather)."""
        return F.embedding(input_ids, self.weights.embed)

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        meta: AttnMeta,
        pages: PageViews,
        after_layer: AfterLayer | None = None,
    ) -> torch.Tensor:
        """Run every layer over ``hidden`` ``[T, hidden]``; return float32 logits ``[B, vocab]``.

        Writes the K/V of every packed token into the arena before attending, so rows may share
        nothing but pages the scheduler already filled (prefix hits, copy-on-write copies).
        ``after_layer(i)`` runs right after layer ``i``'s KV writes (a PD prefill streams that
        layer then); None costs nothing.
        """
        for index, layer in enumerate(self.weights.layers):
            hidden = self._layer(index, layer, hidden, meta, pages, after_layer)
        last = hidden[meta.last_token]
        last = rms_norm(last, self.weights.norm, self.cfg.rms_norm_eps)
        return F.linear(last, self.weights.lm_head).float()

    def _layer(
        self,
        index: int,
        w: LayerWeights,
        hidden: torch.Tensor,
        meta: AttnMeta,
        pages: PageViews,
        after_layer: AfterLayer | None,
    ) -> torch.Tensor:
        cfg, plan, tokens = self.cfg, self.plan, hidden.shape[0]
        x = rms_norm(hidden, w.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias)
        q, k, v = (qkv[:, a:b] for a, b in self._split)
        q = self.rope.apply(q.view(tokens, plan.q_heads, cfg.head_dim), meta.positions)
        k = self.rope.apply(k.view(tokens, plan.kv_heads, cfg.head_dim), meta.positions)
        v = v.view(tokens, plan.kv_heads, cfg.head_dim)
        k_pages, v_pages = pages(index)
        write_kv(k_pages, v_pages, k, v, meta)
        if after_layer is not None:
            after_layer(index)
        attn = paged_attention(q, k_pages, v_pages, meta).reshape(tokens, -1)
        hidden = hidden + self.tp.all_reduce(F.linear(attn, w.o))
        x = rms_norm(hidden, w.post_norm, cfg.rms_norm_eps)
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
        return hidden + self.tp.all_reduce(F.linear(F.silu(gate) * up, w.down))
