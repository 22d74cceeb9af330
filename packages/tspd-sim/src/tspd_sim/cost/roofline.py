"""The default step-time model: a roofline over one engine step's FLOPs and bytes.

One step of an engine (one DP group of ``tp`` GPUs) runs every layer once for the whole batch.
Per step, per GPU:

::

    t = max(linear FLOPs / (peak·mfu),    weight bytes / (HBM·mbu))       GEMMs
      + max(attention FLOPs / (peak·attn_mfu), KV bytes / (HBM·mbu))      attention
      + 2·layers · all-reduce(tokens·hidden·2 bytes)                      TP (ring, NVLink)
      + step_overhead + layers·layer_overhead + sequences·seq_overhead     host and launch

The two rooflines are taken separately because GEMMs and attention run one after the other in
every layer, so neither hides the other's bound. FLOPs and bytes are split evenly over TP ranks
(KV heads are replicated when TP exceeds them; an MLA latent is replicated on every rank).
MoE layers read only the experts the batch routes to: with b·k routed picks among E experts,
the expected number of distinct experts is E·(1 − (1 − 1/E)^(b·k)).

The efficiency knobs are deliberately few; calibrate them (or replace the whole model with
fitted coefficients, see :mod:`tspd_sim.cost.fitted`) from measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_sim.errors import SpecError
from tspd_sim.specs import GpuSpec, ModelSpec

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class RooflineKnobs:
    """Efficiency knobs of the roofline (defaults: a modern engine on Hopper-class GPUs).

    Chosen so the defaults land within 2x of SplitwiseSim's measured Llama-2-70B / H100 / TP 8
    step times (see docs/simulator.md, "Fidelity"), not fitted to them.
    """

    #: Fraction of the peak tensor rate reached by GEMMs (prefill is compute-bound).
    mfu: float = 0.45
    #: Fraction of the peak tensor rate reached by attention kernels.
    attn_mfu: float = 0.35
    #: Fraction of HBM bandwidth reached by weight and KV reads (decode is memory-bound).
    mbu: float = 0.6
    #: Fixed host cost per engine step: scheduling, sampling, launch of the graph.
    step_overhead_s: float = 2e-3
    #: Per-layer cost beyond the roofline: kernel launches and small ops (norms, rotary).
    layer_overhead_s: float = 40e-6
    #: Per running sequence per step: host bookkeeping, sampling, detokenisation.
    seq_overhead_s: float = 0.15e-3
    #: Latency of one TP all-reduce (NCCL ring start-up).
    allreduce_latency_s: float = 15e-6
    #: Fraction of NVLink bandwidth an all-reduce reaches.
    nvlink_eff: float = 0.7

    def __post_init__(self) -> None:
        for name in ("mfu", "attn_mfu", "mbu", "nvlink_eff"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SpecError(f"roofline knob {name}={value}: must be in (0, 1]")
        for name in (
            "step_overhead_s",
            "layer_overhead_s",
            "seq_overhead_s",
            "allreduce_latency_s",
        ):
            if getattr(self, name) < 0:
                raise SpecError(f"roofline knob {name}={getattr(self, name)}: must be ≥ 0")


class RooflineCost:
    """Step times of one engine (``tp`` GPUs of one kind running one model) by roofline.

    Stateless after construction and safe to share; every method is pure.
    """

    def __init__(
        self, model: ModelSpec, gpu: GpuSpec, tp: int, knobs: RooflineKnobs | None = None
    ) -> None:
        if tp < 1:
            raise SpecError(f"TP must be ≥ 1, got {tp}")
        self.model, self.gpu, self.tp = model, gpu, tp
        self.knobs = k = knobs or RooflineKnobs()
        peak = gpu.fp8_flops if model.weight_bytes == 1 else gpu.bf16_flops
        self._lin_rate = peak * k.mfu
        self._attn_rate = gpu.bf16_flops * k.attn_mfu
        self._mem_rate = gpu.hbm_bw * k.mbu
        self._kv_tok = float(model.kv_bytes_per_token(tp))
        # FLOPs of attention per (query token x context token), all layers, one rank.
        self._attn_pair = _attn_flops_per_pair(model) / tp
        self._fixed = k.step_overhead_s + model.layers * k.layer_overhead_s
        self._ar_count = 2 * model.layers if tp > 1 else 0
        self._ar_per_token = (
            (2 * (tp - 1) / tp * model.hidden * 2 / (gpu.nvlink_bw * k.nvlink_eff))
            if tp > 1
            else 0.0
        )

    # ---- the pieces ------------------------------------------------------------------------------

    def _weights(self, routed_tokens: float) -> float:
        """Weight bytes one rank reads in a step whose MoE layers see ``routed_tokens`` tokens."""
        m = self.model
        params = m.shared_params + m.lm_head_params
        if m.moe is not None:
            e = m.moe.routed
            distinct = e * (1.0 - (1.0 - 1.0 / e) ** (routed_tokens * m.moe.top_k))
            params += m.moe_layers * distinct * m.expert_params
        return params * m.weight_bytes / self.tp

    def _gemm(self, tokens: float, logits: float) -> float:
        """GEMM roofline for ``tokens`` tokens of which ``logits`` need the LM head."""
        m = self.model
        per_token = m.active_params - m.lm_head_params
        flops = 2.0 * (tokens * per_token + logits * m.lm_head_params) / self.tp
        return max(flops / self._lin_rate, self._weights(tokens) / self._mem_rate)

    def _comm(self, tokens: float) -> float:
        return self._ar_count * (self.knobs.allreduce_latency_s + tokens * self._ar_per_token)

    # ---- the step model --------------------------------------------------------------------------

    def prefill_time(self, new_tokens: I64, context: I64) -> float:
        """Seconds for one prefill step over chunks of ``new_tokens[i]`` tokens appended to
        ``context[i]`` tokens already cached (prefix hits or earlier chunks)."""
        n = new_tokens.astype(np.float64)
        c = context.astype(np.float64)
        tokens = float(n.sum())
        # Causal attention: query j of a chunk sees c + j + 1 keys -> n·c + n(n+1)/2 pairs.
        pairs = float(np.dot(n, c) + np.dot(n, n + 1) / 2)
        kv_bytes = float((c.sum() + tokens) * self._kv_tok)
        attn = max(pairs * self._attn_pair / self._attn_rate, kv_bytes / self._mem_rate)
        gemm = self._gemm(tokens, float(len(n)))
        overhead = self._fixed + len(n) * self.knobs.seq_overhead_s
        return gemm + attn + self._comm(tokens) + overhead

    def decode_times(self, batch: int, ctx_sum: int, steps: int) -> F64:
        """Seconds of ``steps`` consecutive decode steps of ``batch`` sequences whose contexts
        sum to ``ctx_sum`` at the first step (each step adds ``batch`` context tokens)."""
        ctx = ctx_sum + batch * np.arange(steps, dtype=np.float64)
        attn = np.maximum(
            ctx * self._attn_pair / self._attn_rate, ctx * self._kv_tok / self._mem_rate
        )
        fixed = (
            self._gemm(batch, batch)
            + self._comm(batch)
            + self._fixed
            + batch * self.knobs.seq_overhead_s
        )
        return attn + fixed

    def decode_time(self, batch: int, ctx_sum: int) -> float:
        """One decode step (see :meth:`decode_times`)."""
        return float(self.decode_times(batch, ctx_sum, 1)[0])


def _attn_flops_per_pair(model: ModelSpec) -> float:
    """FLOPs of one query token attending to one key token, all layers, whole model.

    MHA/GQA: QKᵀ and PV, 2·head_dim each, per head. MLA: prefill runs the expanded form
    (QK over nope+rope dims, PV over v dims); decode runs the absorbed form over the latent
    (kv_lora + rope, then kv_lora). Both are close; the expanded count is used for both.
    """
    if model.mla is None:
        return 4.0 * model.heads * model.head_dim * model.layers
    m = model.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return 2.0 * model.heads * (qk + m.v_head_dim) * model.layers
