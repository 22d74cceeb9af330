"""A Hugging Face ``config.json`` (Llama, Mistral, Qwen2) as a :class:`ModelConfig`.

Reads both spellings transformers has written over time: ``torch_dtype`` or ``dtype``;
``rope_theta`` + ``rope_scaling`` or (transformers 5) ``rope_parameters``. Refused with a
:class:`ConfigError` naming the key: another architecture, an activation other than SiLU,
Llama's ``attention_bias`` / ``mlp_bias`` (o and MLP biases, which the engine does not carry).

A sliding window (Mistral v0.1, Qwen2 with ``use_sliding_window``) caps the context at the
window: below it, windowed attention is full attention, so the engine computes exactly what the
model would (vLLM made the same choice before it supported windows).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tspd_engine.model.config import ModelConfig, RopeScaling
from tspd_serving.errors import ConfigError

log = logging.getLogger(__name__)

#: ``architectures`` names served, and the ``model_type`` each has.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_DTYPES = ("float32", "bfloat16", "float16")


def config_from_hf(
    raw: dict[str, Any], dtype: str | None = None, generation: dict[str, Any] | None = None
) -> ModelConfig:
    """The :class:`ModelConfig` of a ``config.json`` object; ``dtype`` overrides the file's
    (the compute dtype); ``generation`` (``generation_config.json``) supplies BOS/EOS ids the
    config lacks."""
    try:
        return _from_hf(raw, dtype, generation or {})
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"config.json is not a Llama-family config: {exc!r}") from exc


def config_from_json_file(path: Path, dtype: str | None = None) -> ModelConfig:
    """Read ``path`` (a ``config.json``) and, beside it, ``generation_config.json`` if any."""
    raw = _json_object(path)
    gen_path = path.parent / "generation_config.json"
    generation = _json_object(gen_path) if gen_path.is_file() else {}
    return config_from_hf(raw, dtype, generation)


def _json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return raw


def _from_hf(raw: dict[str, Any], dtype: str | None, generation: dict[str, Any]) -> ModelConfig:
    kind = _model_type(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} not supported (SwiGLU needs 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if kind != "qwen2" and raw.get(key):
            raise ConfigError(f"{key}: true is not supported (the engine has no o/MLP biases)")
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = _rope(raw)
    eos = _token_id(raw, generation, "eos_token_id")
    if eos is None:
        raise ConfigError("no eos_token_id in config.json or generation_config.json")
    bos = _token_id(raw, generation, "bos_token_id")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_positions(raw, kind),
        dtype=dtype or _hf_dtype(raw.get("torch_dtype", raw.get("dtype"))),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=eos if bos is None else bos,
        eos_token_id=eos,
        rope_scaling=scaling,
        qkv_bias=kind == "qwen2",
    )


def _model_type(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"'architectures' must be a list, got {archs!r}")
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    kind = raw.get("model_type")
    if not archs and kind in ARCHITECTURES.values():
        return str(kind)
    if not archs and kind is None:  # a hand-written config that names neither: Llama
        return "llama"
    named = archs[0] if archs else kind
    raise ConfigError(
        f"architecture {named!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )


def _token_id(raw: dict[str, Any], generation: dict[str, Any], key: str) -> int | None:
    """The first id under ``key`` (Llama 3 lists several EOS ids; the rest are the
    tokenizer's business: :mod:`.hf_tokenizer` stops on all of them)."""
    for source in (raw, generation):
        value = source.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5: theta and scaling in one object
        return float(params.get("rope_theta", 10000.0)), _rope_scaling(params)
    return float(raw.get("rope_theta", 10000.0)), _rope_scaling(raw.get("rope_scaling"))


def _rope_scaling(raw: object) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, dict):
        raise ConfigError(f"rope_scaling must be an object or null, got {raw!r}")
    kind = str(raw.get("rope_type", raw.get("type", "default")))
    if kind == "factors":  # our name for GGUF frequency factors, not a config.json kind
        raise ConfigError("rope_scaling type 'factors' not supported in config.json")
    return RopeScaling(
        rope_type=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _positions(raw: dict[str, Any], kind: str) -> int:
    positions = int(raw.get("max_position_embeddings", 2048))
    raw_window = raw.get("sliding_window")
    if raw_window is None or not (kind == "mistral" or raw.get("use_sliding_window")):
        return positions
    window = int(raw_window)
    if window < positions:
        log.info(
            "sliding window %d: context capped at %d of %d positions", window, window, positions
        )
        return window
    return positions


def _hf_dtype(value: object) -> str:
    # Checkpoints are often bf16; the reference engine computes in float32 unless told.
    return value if isinstance(value, str) and value in _DTYPES else "float32"
