"""The model's configuration (a frozen dataclass).

:class:`ModelConfig` describes a Llama-family decoder (Llama, Mistral, Qwen2: GQA, RoPE,
RMSNorm, SwiGLU, optional q/k/v biases). It validates eagerly and raises
:class:`ConfigError` with the offending value. It is read from a Hugging Face ``config.json``
(:mod:`.hf_config`) or a GGUF file's metadata (:mod:`.gguf_model`) and written back as a
``config.json`` (:meth:`ModelConfig.to_hf_dict`). What the serving side chooses (pages, TP,
feed) is :class:`tspd_engine.config.EngineConfig`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tspd_serving.errors import ConfigError
from tspd_serving.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

# Plain data, no torch: the launcher's flags build configs while a node role parses its
# command line (the torch dtype of ``dtype`` is tspd_engine.model.weights.torch_dtype).
_DTYPES = ("float32", "bfloat16", "float16")
ROPE_TYPES = ("default", "linear", "llama3", "factors")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Hugging Face ``rope_scaling`` (kinds ``linear`` and ``llama3``), or the per-pair
    divisors a GGUF file stores as ``rope_freqs.weight`` (kind ``factors``: llama.cpp writes
    Llama 3.1's scaling that way)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    #: ``factors``: each rotation pair's frequency is divided by its factor (head_dim / 2 of them).
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-style decoder: GQA, RoPE, RMSNorm, SwiGLU (q/k/v biases with ``qkv_bias``).

    Defaults describe the tiny seeded model the tests and the benchmark run: a byte-level
    vocabulary (256 bytes + BOS, EOS, PAD) and float32, so that TP splits agree with TP 1 to
    within summation order (see docs/engine.md).
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    tie_word_embeddings: bool = False
    bos_token_id: int = ByteTokenizer.BOS
    eos_token_id: int = ByteTokenizer.EOS
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    #: q/k/v projections carry biases (Qwen2).
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        for name in (*positive, "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not supported; choose one of {list(_DTYPES)}")
        rope = self.rope_scaling
        if rope.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling type {rope.rope_type!r} not supported; "
                f"choose one of {list(ROPE_TYPES[:3])}"
            )
        if (rope.rope_type == "factors") != bool(rope.freq_factors) or (
            rope.freq_factors and len(rope.freq_factors) != self.head_dim // 2
        ):
            raise ConfigError(
                f"rope frequency factors: {len(rope.freq_factors)} given for rope type "
                f"{rope.rope_type!r}; 'factors' needs head_dim / 2 = {self.head_dim // 2}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name} {getattr(self, name)} outside vocab {self.vocab_size}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ---------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` a Hugging Face ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with
        q/k/v biases) would write for this model. Frequency factors have no such key."""
        if self.rope_scaling.rope_type == "factors":
            raise ConfigError(
                "rope frequency factors (a GGUF's rope_freqs) have no config.json form"
            )
        rope = self.rope_scaling
        scaling: dict[str, Any] | None = None
        if rope.rope_type != "default":
            scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
            if rope.rope_type == "llama3":
                scaling |= {
                    "low_freq_factor": rope.low_freq_factor,
                    "high_freq_factor": rope.high_freq_factor,
                    "original_max_position_embeddings": rope.original_max_position_embeddings,
                }
        arch, kind = (
            ("Qwen2ForCausalLM", "qwen2") if self.qkv_bias else ("LlamaForCausalLM", "llama")
        )
        return {
            "architectures": [arch],
            "model_type": kind,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "rope_scaling": scaling,
        }
