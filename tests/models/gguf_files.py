"""GGUF files written for the tests, the way llama.cpp's converter writes a Llama: its tensor
names, q/k rows permuted within each head, tensors quantized by ``gguf.quants``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tspd_engine.model.config import ModelConfig

Q = GGMLQuantizationType
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass
class Vocab:
    """``tokenizer.ggml.*`` contents."""

    model: str = "gpt2"
    tokens: list[str] = field(default_factory=list)
    types: list[int] = field(default_factory=list)
    merges: list[str] | None = None
    scores: list[float] | None = None
    pre: str | None = "default"
    bos: int | None = None
    eos: int = 0
    extra: dict[str, object] = field(default_factory=dict)  # other tokenizer keys


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}." + _LAYER[".".join(parts[3:])]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: interleave each head's two rotary halves."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def stored(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """What a tensor reads back as after ``qtype`` (norms stay float32, as llama.cpp keeps them)."""
    if w.ndim == 1:
        return w
    return dequantize(quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(
    path: Path,
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    vocab: Vocab,
    qtype: GGMLQuantizationType = Q.F32,
    arch: str = "llama",
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    chat_template: str | None = None,
) -> dict[str, np.ndarray]:
    """Write ``state`` (Hugging Face names) as a llama GGUF; returns, by Hugging Face name,
    what each tensor reads back as (quantization applied, permutation undone)."""
    w = GGUFWriter(path, arch)
    a = arch
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    _vocab(w, vocab)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    readback: dict[str, np.ndarray] = {}
    for hf, tensor in state.items():
        data = tensor.float().numpy()
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
            data = permute(data, heads)
        kind = Q.F32 if data.ndim == 1 else qtype
        if kind in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(hf), data.astype(np.float32 if kind == Q.F32 else np.float16))
        else:
            w.add_tensor(gguf_name(hf), quantize(data, kind), raw_dtype=kind)
        readback[hf] = stored(tensor.float().numpy(), kind)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return readback


def _vocab(w: GGUFWriter, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    if v.pre is not None:
        w.add_tokenizer_pre(v.pre)
    if v.tokens:
        w.add_token_list(v.tokens)
        w.add_token_types(v.types or [1] * len(v.tokens))
    if v.merges is not None:
        w.add_token_merges(v.merges)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.bos is not None:
        w.add_bos_token_id(v.bos)
    w.add_eos_token_id(v.eos)
    for key, value in v.extra.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, str(value))


def byte_vocab(size: int) -> Vocab:
    """A byte-level vocabulary of ``size`` tokens (the 256 byte symbols, then padding pieces)
    with no merges: enough for weight tests, whose ids are given directly."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = [*alphabet, *(f"<pad{i}>" for i in range(size - len(alphabet)))][:size]
    types = [1] * len(alphabet) + [3] * (size - len(alphabet))
    return Vocab("gpt2", tokens, types[:size], merges=[], eos=size - 1)


def text_of(tokens: Sequence[str]) -> str:
    return " ".join(tokens)
