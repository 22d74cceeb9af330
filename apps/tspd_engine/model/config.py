"""The model's configuration (a frozen dataclass).

:class:`ModelConfig` speaks Hugging Face Llama's ``config.json`` keys, so a real small Llama
checkpoint directory loads. It validates eagerly and raises :class:`ConfigError` with the
offending value. What the serving side chooses (pages, TP, feed) is
:class:`tspd_engine.config.EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tspd_engine.errors import ConfigError
from tspd_engine.model.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Hugging Face ``rope_scaling`` (``linear`` and ``llama3`` kinds are supported)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama-style decoder: GQA, RoPE, RMSNorm, SwiGLU.

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
        if self.rope_scaling.rope_type not in _ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling type {self.rope_scaling.rope_type!r} not supported; "
                f"choose one of {list(_ROPE_TYPES)}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ConfigError(f"{name} {getattr(self, name)} outside vocab {self.vocab_size}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

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
        """The ``config.json`` a Hugging Face ``LlamaForCausalLM`` would write for this model."""
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
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], dtype: str | None = None) -> ModelConfig:
        """Read Hugging Face Llama keys; ``dtype`` overrides the checkpoint's ``torch_dtype``."""
        try:
            return _from_hf(raw, dtype)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"config.json is not a Llama config: {exc!r}") from exc

    @classmethod
    def from_json_file(cls, path: Path, dtype: str | None = None) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw, dtype)


def _from_hf(raw: dict[str, Any], dtype: str | None) -> ModelConfig:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} not supported (SwiGLU needs 'silu')")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    eos = raw.get("eos_token_id", ByteTokenizer.EOS)
    if isinstance(eos, list):  # Llama 3 lists several; the first is the end of text
        eos = eos[0]
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        dtype=dtype or _hf_dtype(raw.get("torch_dtype")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=int(raw.get("bos_token_id", ByteTokenizer.BOS)),
        eos_token_id=int(eos),
        rope_scaling=_rope_scaling(raw.get("rope_scaling")),
    )


def _hf_dtype(value: object) -> str:
    # Checkpoints are often bf16; the reference engine computes in float32 unless told.
    return value if isinstance(value, str) and value in _DTYPES else "float32"


def _rope_scaling(raw: object) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {raw!r}")
    kind = str(raw.get("rope_type", raw.get("type", "default")))
    return RopeScaling(
        rope_type=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
