"""Model and GPU specifications the cost model and the memory sizing read.

Numbers carry their sources in comments. Model shapes come from each model's published
``config.json`` on Hugging Face; GPU numbers from NVIDIA's datasheets (dense, i.e. without
2:4 sparsity). NIC bandwidth is per GPU: DGX/HGX systems pair each GPU with one NIC.

Models and GPUs beyond the built-in ones come from files (:mod:`tspd_sim.spec_files`: a Hugging
Face ``config.json`` or a short spec file); everything that takes a model or a GPU accepts
either a built-in name or a :class:`ModelSpec` / :class:`GpuSpec` object.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tspd_sim.errors import SpecError

GB = 1e9


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache is one latent per token.

    ``q_lora_rank`` 0 means no query compression (DeepSeek-V2-Lite: one query projection).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Mixture of experts: ``routed`` experts of which ``top_k`` serve each token."""

    routed: int
    top_k: int
    shared: int
    expert_intermediate: int
    #: The first ``dense_layers`` layers use a dense MLP of ``dense_intermediate``.
    dense_layers: int
    dense_intermediate: int


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: enough to count FLOPs, weight bytes and KV bytes.

    ``weight_bytes`` is the stored width of a parameter (2 for bf16, 1 for fp8 checkpoints);
    ``kv_bytes`` the width of one cached KV element. ``gated_mlp`` MLPs (and experts) have
    three matrices (gate, up, down: Llama, Mixtral, DeepSeek), plain ones two (fc1, fc2: OPT).
    ``other_params`` are parameters outside the matrices — norms, biases, learned position
    embeddings: stored (they count in the totals and the weight bytes) but too small to price.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_context: int
    weight_bytes: int = 2
    kv_bytes: int = 2
    mla: MlaSpec | None = None
    moe: MoeSpec | None = None
    gated_mlp: bool = True
    #: The LM head shares the embedding matrix (stored once).
    tied_embeddings: bool = False
    other_params: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "max_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(
                    f"model {self.name!r}: {name} must be an integer ≥ 1, got {value!r}"
                )
        if self.intermediate < 0 or self.other_params < 0:
            raise SpecError(f"model {self.name!r}: intermediate and other_params must be ≥ 0")
        if self.weight_bytes not in (1, 2, 4) or self.kv_bytes not in (1, 2, 4):
            raise SpecError(f"model {self.name!r}: weight and KV widths must be 1, 2 or 4 bytes")
        if self.moe is not None and not 1 <= self.moe.top_k <= self.moe.routed:
            raise SpecError(f"model {self.name!r}: MoE top_k must be in 1 .. experts")
        if self.moe is not None and not 0 <= self.moe.dense_layers <= self.layers:
            raise SpecError(f"model {self.name!r}: MoE dense_layers must be in 0 .. layers")

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP or expert: 3 when gated, else 2."""
        return 3 if self.gated_mlp else 2

    # ---- parameter counts --------------------------------------------------------------------

    @cached_property
    def attn_params(self) -> int:
        """Attention projection parameters of one layer."""
        h = self.hidden
        if self.mla is None:
            return 2 * h * self.heads * self.head_dim + 2 * h * self.kv_heads * self.head_dim
        m = self.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (
            h * m.q_lora_rank + m.q_lora_rank * self.heads * qk
            if m.q_lora_rank
            else h * self.heads * qk
        )
        return (
            q
            + h * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim)
            + self.heads * m.v_head_dim * h
        )

    @cached_property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return self.mlp_matrices * self.hidden * self.moe.expert_intermediate if self.moe else 0

    @cached_property
    def mlp_params_dense(self) -> int:
        """Parameters of all dense-MLP layers together."""
        if self.moe is None:
            return self.layers * self.mlp_matrices * self.hidden * self.intermediate
        return self.moe.dense_layers * self.mlp_matrices * self.hidden * self.moe.dense_intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.moe.dense_layers if self.moe else 0

    @cached_property
    def shared_params(self) -> int:
        """Parameters every token touches except the LM head: attention, dense MLPs, shared
        experts and routers."""
        p = self.layers * self.attn_params + self.mlp_params_dense
        if self.moe:
            p += self.moe_layers * (
                self.moe.shared * self.expert_params + self.hidden * self.moe.routed
            )
        return p

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @cached_property
    def total_params(self) -> int:
        """Every stored parameter (the embedding once more unless tied to the LM head)."""
        routed = self.moe_layers * self.moe.routed * self.expert_params if self.moe else 0
        embeddings = (1 if self.tied_embeddings else 2) * self.lm_head_params
        return self.shared_params + routed + embeddings + self.other_params

    @cached_property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (embedding lookup excluded)."""
        routed = self.moe_layers * self.moe.top_k * self.expert_params if self.moe else 0
        return self.shared_params + routed + self.lm_head_params

    # ---- KV cache ------------------------------------------------------------------------------

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds (replicated when TP exceeds the KV head count)."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV bytes one token occupies on one TP rank, all layers (MLA latent is replicated)."""
        if self.mla is not None:
            width = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
            return self.layers * width * self.kv_bytes
        return self.layers * 2 * self.kv_heads_per_rank(tp) * self.head_dim * self.kv_bytes

    def weight_bytes_per_gpu(self, gpus: int) -> float:
        """Weights one GPU stores when the model is sharded over ``gpus`` GPUs."""
        return self.total_params * self.weight_bytes / gpus


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator and its place in a node: peak dense matmul rates, HBM, capacity,
    interconnects (intra-node link, scale-out NIC, host link)."""

    name: str
    #: Dense bf16 tensor throughput, FLOP/s.
    bf16_flops: float
    #: Dense fp8 tensor throughput, FLOP/s (equal to bf16 where fp8 is not supported).
    fp8_flops: float
    #: HBM bandwidth, bytes/s.
    hbm_bw: float
    #: HBM capacity, bytes.
    memory: float
    #: NVLink bandwidth per GPU, one direction, bytes/s (TP all-reduce).
    nvlink_bw: float
    #: Scale-out NIC bandwidth per GPU, one direction, bytes/s (KV transfer).
    nic_bw: float
    #: Start-up latency of one transfer on the NIC (post to first byte), seconds.
    nic_latency_s: float = 30e-6
    #: Host link (PCIe) per GPU, one direction, bytes/s: KV swapped out under memory pressure.
    host_bw: float = 64 * GB
    #: GPUs behind one intra-node link (the NVLink domain): the largest TP.
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        rates = ("bf16_flops", "fp8_flops", "hbm_bw", "memory", "nvlink_bw", "nic_bw", "host_bw")
        for name in rates:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and value < float("inf")):
                raise SpecError(f"GPU {self.name!r}: {name} must be a number > 0, got {value!r}")
        if not self.nic_latency_s >= 0:
            raise SpecError(f"GPU {self.name!r}: nic_latency_s must be ≥ 0")
        if isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 1:
            raise SpecError(f"GPU {self.name!r}: gpus_per_node must be an integer ≥ 1")


def _llama(
    name: str, layers: int, hidden: int, heads: int, inter: int, vocab: int, ctx: int
) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, 8, 128, inter, vocab, ctx)


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-3.1-8B config.json (same shapes as Llama-3-8B; 128k context):
    # 32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, MLP 14336, vocab 128256.
    "llama-3-8b": _llama("llama-3-8b", 32, 4096, 32, 14336, 128256, 131072),
    # meta-llama/Llama-3.1-70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads,
    # MLP 28672, vocab 128256, 128k context.
    "llama-3-70b": _llama("llama-3-70b", 80, 8192, 64, 28672, 128256, 131072),
    # meta-llama/Llama-2-70b-hf config.json: as 70B above with vocab 32000 and 4k context.
    # Used for the fidelity check against SplitwiseSim's measurements.
    "llama-2-70b": _llama("llama-2-70b", 80, 8192, 64, 28672, 32000, 4096),
    # deepseek-ai/DeepSeek-V3 config.json: 61 layers, hidden 7168, 128 heads, MLA (q_lora 1536,
    # kv_lora 512, qk_nope 128, qk_rope 64, v 128), 256 routed experts (top 8) + 1 shared of
    # width 2048, first 3 layers dense (18432), vocab 129280, 128k context (YaRN). Weights in
    # fp8 as released; KV latent in bf16.
    "deepseek-v3": ModelSpec(
        "deepseek-v3",
        61,
        7168,
        128,
        128,
        128,
        18432,
        129280,
        131072,
        weight_bytes=1,
        kv_bytes=2,
        mla=MlaSpec(1536, 512, 128, 64, 128),
        moe=MoeSpec(
            routed=256,
            top_k=8,
            shared=1,
            expert_intermediate=2048,
            dense_layers=3,
            dense_intermediate=18432,
        ),
    ),
}

GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s
    # (both directions); DGX A100 pairs each GPU with a 200 Gb/s ConnectX-6 HDR NIC.
    # Host link: PCIe Gen4 x16, 32 GB/s per direction.
    "a100": GpuSpec("a100", 312e12, 312e12, 2039 * GB, 80 * GB, 300 * GB, 25 * GB, host_bw=32 * GB),
    # NVIDIA H100 datasheet (SXM): 989 TFLOP/s bf16 dense, 1,979 fp8 dense, 3.35 TB/s HBM3,
    # 80 GB, NVLink 900 GB/s (both directions), PCIe Gen5 128 GB/s (both directions; the
    # default host link of 64 GB/s one way); DGX H100: one 400 Gb/s ConnectX-7 per GPU.
    "h100": GpuSpec("h100", 989e12, 1979e12, 3350 * GB, 80 * GB, 450 * GB, 50 * GB),
    # NVIDIA H200 datasheet (SXM): H100 compute, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s;
    # HGX H200 systems: one 400 Gb/s NIC per GPU.
    "h200": GpuSpec("h200", 989e12, 1979e12, 4800 * GB, 141 * GB, 450 * GB, 50 * GB),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s fp8 training for 8 GPUs -> 4.5 PF fp8 and 2.25 PF
    # bf16 dense per GPU, 1,440 GB HBM3e for 8 GPUs (180 GB each) at 8 TB/s per GPU, NVLink 5
    # 1.8 TB/s (both directions), 8 x 400 Gb/s ConnectX-7.
    "b200": GpuSpec("b200", 2250e12, 4500e12, 8000 * GB, 180 * GB, 900 * GB, 50 * GB),
}


def model_spec(model: str | ModelSpec) -> ModelSpec:
    """The named built-in model (a :class:`ModelSpec` passes through), or a clear error
    listing the known ones."""
    if isinstance(model, ModelSpec):
        return model
    try:
        return MODELS[model.lower()]
    except KeyError:
        raise SpecError(
            f"unknown model {model!r}; built-in: {sorted(MODELS)} (or give a config.json or "
            "a model spec file, see 'tspd-sim list')"
        ) from None


def gpu_spec(gpu: str | GpuSpec) -> GpuSpec:
    """The named built-in GPU (a :class:`GpuSpec` passes through), or a clear error listing
    the known ones."""
    if isinstance(gpu, GpuSpec):
        return gpu
    try:
        return GPUS[gpu.lower()]
    except KeyError:
        raise SpecError(
            f"unknown GPU {gpu!r}; built-in: {sorted(GPUS)} (or describe it in a file for "
            "--gpu-spec, see 'tspd-sim list')"
        ) from None


def model_name(model: str | ModelSpec) -> str:
    return model.name if isinstance(model, ModelSpec) else model


def gpu_name(gpu: str | GpuSpec) -> str:
    return gpu.name if isinstance(gpu, GpuSpec) else gpu
