"""A :class:`~tspd_sim.specs.ModelSpec` from a Hugging Face ``config.json``.

Supported architectures (the ``architectures`` entry, else ``model_type``):

==============================  =====================================================
Llama, Mistral, Qwen2, Qwen3    GQA attention, gated MLP (Qwen2: q/k/v biases;
                                Qwen3: per-head q/k norms)
Mixtral, Qwen3-MoE              GQA attention, top-k routed gated experts
DeepSeek-V2, DeepSeek-V3        MLA (one cached latent per token), shared + routed
                                experts after ``first_k_dense_replace`` dense layers
OPT                             MHA, plain two-matrix MLP with biases, learned
                                positions, tied embeddings
==============================  =====================================================

Anything else is refused by name. Counts follow the modules the Hugging Face implementations
build (norms, biases and position tables go to ``other_params``); the multi-token-prediction
layer DeepSeek-V3 ships besides its 61 layers is not part of the served model and not counted.

Widths: ``torch_dtype`` bfloat16/float16 checkpoints are 2 bytes a weight and float32 ones are
served in half precision too (what vLLM's ``--dtype auto`` does); an ``fp8``
``quantization_config`` makes weights 1 byte. The KV cache is 2 bytes an element. Sliding-window
attention (Mistral-7B-v0.1's ``sliding_window``) is cached in full: an upper bound of what an
engine that drops out-of-window pages holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tspd_sim.errors import SpecError
from tspd_sim.specs import MlaSpec, ModelSpec, MoeSpec

Config = Mapping[str, Any]

_WIDTHS = {"bfloat16": 2, "float16": 2, "float32": 2}
_QUANT_WIDTHS = {"fp8": 1}


class _Reader:
    """Typed access to the config's keys with errors that name the file and the key."""

    def __init__(self, cfg: Config, where: str) -> None:
        self.cfg, self.where = cfg, where

    def count(self, key: str, default: int | None = None) -> int:
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise SpecError(f"{self.where}: missing {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{self.where}: {key!r} must be an integer ≥ 0, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"{self.where}: {key!r} must be true or false, got {value!r}")
        return value

    def widths(self) -> tuple[int, int]:
        """(weight bytes, KV bytes)."""
        dtype = self.cfg.get("torch_dtype") or self.cfg.get("dtype") or "bfloat16"
        if dtype not in _WIDTHS:
            raise SpecError(f"{self.where}: torch_dtype {dtype!r}; supported: {sorted(_WIDTHS)}")
        quant = self.cfg.get("quantization_config")
        if quant is None:
            return _WIDTHS[dtype], 2
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        if method not in _QUANT_WIDTHS:
            raise SpecError(
                f"{self.where}: quantization {method!r} is not supported; supported: "
                f"{sorted(_QUANT_WIDTHS)} or none"
            )
        return _QUANT_WIDTHS[method], 2


def _attention(r: _Reader) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of GQA/MHA attention."""
    heads = r.count("num_attention_heads")
    hidden = r.count("hidden_size")
    kv = r.count("num_key_value_heads", heads)
    head_dim = r.count("head_dim", hidden // heads if heads else 0)
    return heads, kv, head_dim


def _llama_like(r: _Reader, name: str, kind: str) -> ModelSpec:
    """Llama, Mistral, Qwen2, Qwen3 (and the attention/norm part of Mixtral, Qwen3-MoE)."""
    heads, kv, head_dim = _attention(r)
    hidden, layers = r.count("hidden_size"), r.count("num_hidden_layers")
    inter = r.count("intermediate_size")
    per_layer = 2 * hidden  # input and post-attention RMSNorm
    qkv_bias = heads * head_dim + 2 * kv * head_dim
    if kind == "qwen2":
        per_layer += qkv_bias  # Qwen2 always biases q, k and v
    elif r.flag("attention_bias", False):
        per_layer += qkv_bias + hidden
    if kind in ("qwen3", "qwen3_moe"):
        per_layer += 2 * head_dim  # q_norm, k_norm
    if kind == "llama" and r.flag("mlp_bias", False):
        per_layer += 2 * inter + hidden
    weight, kv_bytes = r.widths()
    return ModelSpec(
        name, layers, hidden, heads, kv, head_dim, inter, r.count("vocab_size"),
        r.count("max_position_embeddings"), weight_bytes=weight, kv_bytes=kv_bytes,
        tied_embeddings=r.flag("tie_word_embeddings", False),
        other_params=layers * per_layer + hidden,
    )  # fmt: skip


def _with_moe(base: ModelSpec, moe: MoeSpec, router_params: int) -> ModelSpec:
    return ModelSpec(
        base.name, base.layers, base.hidden, base.heads, base.kv_heads, base.head_dim,
        base.intermediate, base.vocab, base.max_context, weight_bytes=base.weight_bytes,
        kv_bytes=base.kv_bytes, moe=moe, tied_embeddings=base.tied_embeddings,
        other_params=base.other_params + router_params,
    )  # fmt: skip


def _mixtral(r: _Reader, name: str) -> ModelSpec:
    base = _llama_like(r, name, "mixtral")
    experts = r.count("num_local_experts")
    moe = MoeSpec(experts, r.count("num_experts_per_tok"), 0, base.intermediate, 0, 0)
    return _with_moe(base, moe, 0)


def _qwen3_moe(r: _Reader, name: str) -> ModelSpec:
    base = _llama_like(r, name, "qwen3_moe")
    experts, step = r.count("num_experts"), r.count("decoder_sparse_step", 1)
    dense_only = set(r.cfg.get("mlp_only_layers") or [])
    sparse = sum(
        1
        for i in range(base.layers)
        if i not in dense_only and experts > 0 and step > 0 and (i + 1) % step == 0
    )
    moe = MoeSpec(
        experts, r.count("num_experts_per_tok"), 0, r.count("moe_intermediate_size"),
        base.layers - sparse, base.intermediate,
    )  # fmt: skip
    return _with_moe(base, moe, 0)


def _deepseek(r: _Reader, name: str, kind: str) -> ModelSpec:
    hidden, layers = r.count("hidden_size"), r.count("num_hidden_layers")
    heads = r.count("num_attention_heads")
    mla = MlaSpec(
        r.count("q_lora_rank", 0), r.count("kv_lora_rank"), r.count("qk_nope_head_dim"),
        r.count("qk_rope_head_dim"), r.count("v_head_dim"),
    )  # fmt: skip
    experts, dense = r.count("n_routed_experts"), r.count("first_k_dense_replace", 0)
    if r.count("moe_layer_freq", 1) != 1:
        raise SpecError(f"{r.where}: moe_layer_freq other than 1 is not supported")
    moe = MoeSpec(
        experts, r.count("num_experts_per_tok"), r.count("n_shared_experts", 0),
        r.count("moe_intermediate_size"), min(dense, layers), r.count("intermediate_size"),
    )  # fmt: skip
    norms = 2 * hidden + mla.kv_lora_rank + mla.q_lora_rank  # layer norms, kv_a/q_a norms
    # DeepSeek-V3's router keeps a per-expert score bias (noaux_tc balancing).
    bias = experts * (layers - moe.dense_layers) if kind == "deepseek_v3" else 0
    weight, kv_bytes = r.widths()
    return ModelSpec(
        name, layers, hidden, heads, heads, mla.v_head_dim, r.count("intermediate_size"),
        r.count("vocab_size"), r.count("max_position_embeddings"), weight_bytes=weight,
        kv_bytes=kv_bytes, mla=mla, moe=moe,
        tied_embeddings=r.flag("tie_word_embeddings", False),
        other_params=layers * norms + hidden + bias,
    )  # fmt: skip


def _opt(r: _Reader, name: str) -> ModelSpec:
    hidden, layers = r.count("hidden_size"), r.count("num_hidden_layers")
    heads, ffn = r.count("num_attention_heads"), r.count("ffn_dim")
    if r.count("word_embed_proj_dim", hidden) != hidden:
        raise SpecError(
            f"{r.where}: word_embed_proj_dim different from hidden_size is not supported"
        )
    positions = r.count("max_position_embeddings")
    bias = r.flag("enable_bias", True)
    affine = r.flag("layer_norm_elementwise_affine", True)
    norm = 2 * hidden if affine else 0
    per_layer = 2 * norm + ((4 * hidden + ffn + hidden) if bias else 0)
    final = norm if r.flag("do_layer_norm_before", True) else 0
    weight, kv_bytes = r.widths()
    return ModelSpec(
        name, layers, hidden, heads, heads, hidden // heads, ffn, r.count("vocab_size"), positions,
        weight_bytes=weight, kv_bytes=kv_bytes, gated_mlp=False,
        tied_embeddings=r.flag("tie_word_embeddings", True),
        # OPT's learned position table has two extra rows (its padding offset).
        other_params=layers * per_layer + final + (positions + 2) * hidden,
    )  # fmt: skip


_Builder = Callable[[_Reader, str], ModelSpec]

#: ``architectures`` entry -> builder; ``model_type`` is the fallback key.
ARCHITECTURES: dict[str, tuple[str, _Builder]] = {
    "LlamaForCausalLM": ("llama", lambda r, n: _llama_like(r, n, "llama")),
    "MistralForCausalLM": ("mistral", lambda r, n: _llama_like(r, n, "mistral")),
    "Qwen2ForCausalLM": ("qwen2", lambda r, n: _llama_like(r, n, "qwen2")),
    "Qwen3ForCausalLM": ("qwen3", lambda r, n: _llama_like(r, n, "qwen3")),
    "MixtralForCausalLM": ("mixtral", _mixtral),
    "Qwen3MoeForCausalLM": ("qwen3_moe", _qwen3_moe),
    "DeepseekV2ForCausalLM": ("deepseek_v2", lambda r, n: _deepseek(r, n, "deepseek_v2")),
    "DeepseekV3ForCausalLM": ("deepseek_v3", lambda r, n: _deepseek(r, n, "deepseek_v3")),
    "OPTForCausalLM": ("opt", _opt),
}
_BY_TYPE = dict(ARCHITECTURES.values())


def is_hf_config(doc: Config) -> bool:
    """Whether a JSON document looks like a Hugging Face model config."""
    return "architectures" in doc or "model_type" in doc


def model_from_hf_config(doc: Config, name: str, where: str = "config.json") -> ModelSpec:
    """The model a Hugging Face ``config.json`` describes, named ``name``.

    Raises :class:`SpecError` for an unsupported architecture (naming it and the supported
    ones), a missing or malformed key, or an unsupported dtype or quantization.
    """
    archs = doc.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    model_type = doc.get("model_type")
    if arch in ARCHITECTURES:
        build = ARCHITECTURES[arch][1]
    elif arch is None and model_type in _BY_TYPE:
        build = _BY_TYPE[model_type]
    else:
        raise SpecError(
            f"{where}: unsupported architecture {arch or model_type!r}; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return build(_Reader(doc, where), name)
