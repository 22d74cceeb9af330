"""What ``tspd-sim list`` prints: the built-in models and GPUs, and how to bring your own."""

from __future__ import annotations

import textwrap

from tspd_sim.cluster import PREEMPTION
from tspd_sim.hf_config import ARCHITECTURES
from tspd_sim.network import NET_PROFILES
from tspd_sim.sim.router import POLICIES
from tspd_sim.spec_files import GPU_FORMAT, MODEL_FORMAT
from tspd_sim.specs import GPUS, MODELS, GpuSpec, ModelSpec


def model_line(m: ModelSpec) -> str:
    """One line: shapes, KV bytes per token at TP 1, parameters, context."""
    if m.mla is not None:
        attn = f"MLA {m.heads}q latent {m.mla.kv_lora_rank}+{m.mla.qk_rope_head_dim}"
    else:
        attn = f"{'MHA' if m.kv_heads == m.heads else 'GQA'} {m.heads}q/{m.kv_heads}kv"
    params = f"{m.total_params / 1e9:.1f} B"
    if m.moe is not None:
        params += (
            f" ({m.active_params / 1e9:.1f} B active, {m.moe.routed} experts top {m.moe.top_k})"
        )
    kv = m.kv_bytes_per_token(1) / 1024
    return (
        f"  {m.name:<14} {m.layers:>3} layers  {attn:<26} KV {kv:6.1f} KiB/token  "
        f"{params}  {m.max_context:,} context"
    )


def gpu_line(g: GpuSpec) -> str:
    return (
        f"  {g.name:<6} {g.bf16_flops / 1e12:6.0f} TFLOP/s bf16 {g.fp8_flops / 1e12:6.0f} fp8  "
        f"{g.memory / 1e9:4.0f} GB at {g.hbm_bw / 1e12:4.2f} TB/s  "
        f"NVLink {g.nvlink_bw / 1e9:4.0f} GB/s x{g.gpus_per_node}  "
        f"NIC {g.nic_bw * 8 / 1e9:4.0f} Gb/s  host {g.host_bw / 1e9:3.0f} GB/s"
    )


def listing(traces: list[str]) -> str:
    """Everything ``tspd-sim list`` prints; ``traces`` are the bundled traces' lines."""
    archs = textwrap.wrap(", ".join(sorted(ARCHITECTURES)), 88)
    lines = [
        "built-in models (--model NAME):",
        *(model_line(m) for _, m in sorted(MODELS.items())),
        "built-in GPUs (@NAME in a group spec):",
        *(gpu_line(g) for _, g in sorted(GPUS.items())),
        "network profiles: " + ", ".join(sorted(NET_PROFILES)),
        "routing policies: " + ", ".join(POLICIES),
        "preemption policies (with --no-reserve-output): " + ", ".join(PREEMPTION),
        *traces,
        "",
        "Your own model: --model PATH, PATH a Hugging Face config.json (or its folder) of a",
        "supported architecture:",
        *(f"  {line}" for line in archs),
        "or a model spec file:",
        MODEL_FORMAT,
        "",
        "Your own GPU: --gpu-spec FILE (repeatable), then @NAME in group specs:",
        GPU_FORMAT,
    ]
    return "\n".join(lines)
