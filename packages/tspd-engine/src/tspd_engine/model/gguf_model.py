"""A GGUF file as a model (architecture ``llama``): its config and its tensors in Hugging
Face names, so the shard builder treats a GGUF like a safetensors checkpoint.

The file is parsed by :func:`tspd_serving.gguf_file.open_gguf` (once per process: the
tokenizer reads the same parse). Here:

* tensors are dequantized to float32 at load by ``gguf.quants`` (F32, F16, BF16, Q4_0, Q4_1,
  Q5_*, Q8_0, the K-quants, the IQ types: whatever it dequantizes);
* llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` inside each head (it
  interleaves the two rotary halves); the reader puts them back in Hugging Face order::

      GGUF row  h*d + 2j + t   <-   HF row  h*d + t*(d/2) + j     (j < d/2, t in {0, 1})

* no ``output.weight`` means the LM head is the embedding (tied);
* ``rope_freqs.weight`` (Llama 3.1's scaling as per-pair divisors) becomes
  ``RopeScaling("factors")``.

A rank reads only the rows it needs of a row-split tensor (block quants are row-aligned);
column splits (o, down) dequantize the whole rows. Everything is checked before the first
tensor is read: the architecture, every tensor's presence, shape and quant type (by
dequantizing its first row), and no tensor the engine would silently ignore.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from tspd_engine.model.config import ModelConfig, RopeScaling
from tspd_engine.model.weights import TensorSource, global_shapes
from tspd_serving.errors import CheckpointError
from tspd_serving.gguf_file import GgufFile

ARCHITECTURES = ("llama",)
#: GGUF tensor names (``{}`` = layer) and their Hugging Face names.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class GgufModel:
    """The model in one parsed GGUF file: its config and tensors (read-only, shareable by the
    threads of one process, as the file is)."""

    file: GgufFile

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def arch(self) -> str:
        return self.file.arch

    @property
    def tensors(self) -> dict[str, ReaderTensor]:
        return self.file.tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.file.get(key, default)

    def need(self, key: str) -> Any:
        return self.file.need(key)

    def config(self, dtype: str) -> ModelConfig:
        """The :class:`ModelConfig` the metadata describes (computed in ``dtype``)."""
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        a = self.arch
        heads, kv = int(self.need(f"{a}.attention.head_count")), self._kv_heads()
        hidden = int(self.need(f"{a}.embedding_length"))
        head_dim = int(self.get(f"{a}.attention.key_length", hidden // heads))
        rotary = int(self.get(f"{a}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise CheckpointError(f"{self.path}: partial rotary ({rotary} of {head_dim} dims)")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = self.get(f"{a}.vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = int(self.tensors["token_embd.weight"].shape[-1])
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_hidden_layers=int(self.need(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            intermediate_size=int(self.need(f"{a}.feed_forward_length")),
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.get(f"{a}.context_length", 2048)),
            dtype=dtype,
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=int(self.get("tokenizer.ggml.bos_token_id", 0)),
            eos_token_id=int(self.need("tokenizer.ggml.eos_token_id")),
            rope_scaling=self._rope_scaling(),
        )

    def _kv_heads(self) -> int:
        kv = self.get(f"{self.arch}.attention.head_count_kv")
        if isinstance(kv, list):
            raise CheckpointError(f"{self.path}: per-layer KV head counts are not supported")
        return int(kv or self.need(f"{self.arch}.attention.head_count"))

    def _rope_scaling(self) -> RopeScaling:
        a = self.arch
        kind = str(self.get(f"{a}.rope.scaling.type", "none"))
        factor = float(self.get(f"{a}.rope.scaling.factor", self.get(f"{a}.rope.scale_linear", 1)))
        if ROPE_FREQS in self.tensors:
            factors = self.tensor(ROPE_FREQS, None, None).flatten().tolist()
            return RopeScaling("factors", freq_factors=tuple(factors))
        if kind == "linear" or (kind == "none" and factor != 1.0):
            return RopeScaling("linear", factor=factor)
        if kind != "none":
            raise CheckpointError(f"{self.path}: rope scaling {kind!r} is not supported")
        return RopeScaling()

    def hf_names(self, cfg: ModelConfig) -> dict[str, str]:
        """Hugging Face name -> GGUF name of every tensor ``cfg`` needs; refuses a file whose
        tensors do not match (missing, misshapen, unknown, or of a type gguf cannot read)."""
        names: dict[str, str] = {}
        for name in self.tensors:
            if name == ROPE_FREQS:
                continue
            hf = _hf_name(name)
            if hf is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not understood here")
            names[hf] = name
        for hf, shape in global_shapes(cfg).items():
            if hf not in names:
                raise CheckpointError(f"{self.path} lacks the tensor for {hf!r}")
            self._check(self.tensors[names[hf]], shape)
        return names

    def _check(self, t: ReaderTensor, shape: tuple[int, ...]) -> None:
        got = tuple(int(n) for n in reversed(t.shape.tolist()))
        if got != shape:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} has shape {got}, needs {shape}")
        try:
            dequantize(t.data[:1], t.tensor_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} has quant type {t.tensor_type.name}, which "
                "the gguf package cannot dequantize"
            ) from exc

    def tensor(self, name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        """Rows ``rows`` (then columns ``cols``) of the GGUF tensor ``name``, float32."""
        t = self.tensors[name]
        data = t.data if rows is None else t.data[rows]
        if cols is not None:
            data, cols = _column_blocks(data, t, cols)
        out = np.asarray(dequantize_fast(data, t.tensor_type), dtype=np.float32)
        if cols is not None:
            out = out[:, cols]
        # An F32 tensor dequantizes to a view of the read-only mapping: copy it out (and a
        # column cut into its own rows). A dequantized tensor is fresh memory: keep it.
        fresh = out.flags.writeable and out.flags.c_contiguous
        if not fresh or np.may_share_memory(out, self.file.reader.data):
            out = np.array(out, dtype=np.float32, order="C", copy=True)
        return torch.from_numpy(out)

    def source(self, cfg: ModelConfig) -> TensorSource:
        """A :data:`TensorSource` over this file in Hugging Face names, q/k rows unpermuted."""
        names = self.hf_names(cfg)
        d = cfg.head_dim

        def get(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
            t = self.tensor(names[name], rows, cols)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                t = t.reshape(-1, d // 2, 2, t.shape[-1]).transpose(1, 2).reshape(t.shape)
            return t

        return get


#: The quant types dequantized here (bytes per block, values per block); the rest by gguf.
_BLOCKS = {
    GGMLQuantizationType.Q8_0: (34, 32),
    GGMLQuantizationType.Q4_0: (18, 32),
    GGMLQuantizationType.Q4_1: (20, 32),
}
#: Blocks dequantized at a time (8 MiB of float32 out, a few MiB of temporaries).
CHUNK_BLOCKS = 1 << 16


def dequantize_fast(
    data: npt.NDArray[Any], qtype: GGMLQuantizationType, chunk: int = CHUNK_BLOCKS
) -> npt.NDArray[np.float32]:
    """``gguf.quants.dequantize(data, qtype)``, value for value, faster for the common types.

    gguf dequantizes 16 rows per numpy call: for SmolLM2's 576-wide rows that is ~300 blocks
    a call, and the calls' overhead is ~1.5 s of a rank's start-up. Q8_0, Q4_0 and Q4_1 are
    decoded here ``chunk`` blocks a call with the same float32 operations in the same order
    (so the same bits: pinned by tests against gguf); other types go to gguf.
    """
    sizes = _BLOCKS.get(qtype)
    if sizes is None or data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % sizes[0]:
        return dequantize(data, qtype)
    type_size, per_block = sizes
    blocks = data.reshape(-1, type_size)
    out = np.empty((len(blocks), per_block), np.float32)
    for i in range(0, len(blocks), chunk):
        _decode(qtype, blocks[i : i + chunk], out[i : i + chunk])
    return out.reshape(*data.shape[:-1], data.shape[-1] // type_size * per_block)


def _decode(qtype: GGMLQuantizationType, b: npt.NDArray[np.uint8], out: npt.NDArray[Any]) -> None:
    scale = b[:, :2].view(np.float16).astype(np.float32)  # (n, 1), the block's d
    if qtype == GGMLQuantizationType.Q8_0:
        np.multiply(b[:, 2:].view(np.int8), scale, out=out)  # d * q, q an int8
        return
    qs = b[:, 4:] if qtype == GGMLQuantizationType.Q4_1 else b[:, 2:]
    half = qs.shape[1]
    out[:, :half] = qs & 0x0F  # a byte's low nibble is value j, its high one value j + 16
    out[:, half:] = qs >> 4
    if qtype == GGMLQuantizationType.Q4_0:
        out -= 8  # d * (q - 8): small integers, exact in float32
        out *= scale
    else:  # Q4_1: d * q + m
        out *= scale
        out += b[:, 2:4].view(np.float16).astype(np.float32)


def _column_blocks(
    data: npt.NDArray[Any], t: ReaderTensor, cols: slice
) -> tuple[npt.NDArray[Any], slice | None]:
    """The bytes of only the quant blocks that hold columns ``cols`` (a column-split rank
    dequantizes its share, not whole rows), and the columns left to cut after dequantizing."""
    block, size = GGML_QUANT_SIZES[t.tensor_type]
    start, stop, step = cols.indices(int(t.shape[0]))
    if step != 1 or start % block or stop % block or data.dtype != np.uint8:
        return data, cols  # not block-aligned, or not byte-coded (F32/F16): cut afterwards
    return data[:, start // block * size : stop // block * size], None


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None
