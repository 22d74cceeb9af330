"""Models and GPUs from files: a Hugging Face ``config.json`` or a short spec file.

``--model`` takes a built-in name, a ``config.json`` (or the folder holding one), or a model
spec file; ``--gpu-spec`` takes a GPU spec file. Spec files are TOML (``.toml``) or JSON
(``.json``) with one table, ``[model]`` or ``[gpu]``; the keys are below (:data:`MODEL_FORMAT`,
:data:`GPU_FORMAT`, also printed by ``tspd-sim list``). Unknown keys are errors: a typo must not
fall back to a default silently.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tspd_sim.errors import SpecError
from tspd_sim.hf_config import is_hf_config, model_from_hf_config
from tspd_sim.specs import GB, MODELS, GpuSpec, MlaSpec, ModelSpec, MoeSpec

MODEL_FORMAT = """\
[model]                      # a model spec file (TOML; JSON with the same keys works too)
name = "my-llama"
layers = 32
hidden = 4096
heads = 32                   # attention (query) heads
kv_heads = 8                 # default: heads (MHA)
head_dim = 128               # default: hidden / heads
intermediate = 14336         # MLP width (dense layers)
vocab = 128256
max_context = 131072
weight_dtype = "bfloat16"    # float32 | bfloat16 | float16 | fp8
kv_dtype = "bfloat16"        # float32 | bfloat16 | float16 | fp8
mlp = "gated"                # gated (gate, up, down) | plain (fc1, fc2)
tied_embeddings = false
other_params = 0             # norms, biases, position tables: stored, not priced
[model.moe]                  # optional: mixture of experts
experts = 8
top_k = 2
shared = 0                   # shared experts of the expert width
expert_intermediate = 14336
dense_layers = 0             # layers with a dense MLP of dense_intermediate
dense_intermediate = 0
[model.mla]                  # optional: multi-head latent attention (DeepSeek)
q_lora_rank = 1536           # 0: no query compression
kv_lora_rank = 512
qk_nope_head_dim = 128
qk_rope_head_dim = 64
v_head_dim = 128"""

GPU_FORMAT = """\
[gpu]                        # a GPU spec file (TOML; JSON with the same keys works too)
name = "my-h100"             # what @NAME in a group spec refers to ([a-z0-9_-])
bf16_tflops = 989            # peak dense tensor rate, bf16/fp16
fp8_tflops = 1979            # peak dense fp8 rate (default: bf16_tflops, no fp8 units)
memory_gb = 80               # HBM capacity (1 GB = 1e9 bytes)
hbm_tb_s = 3.35              # HBM bandwidth, TB/s
nvlink_gb_s = 450            # intra-node link per GPU, one direction, GB/s (TP all-reduce)
gpus_per_node = 8            # GPUs on that link: the largest TP (default 8)
nic_gbit_s = 400             # scale-out NIC per GPU, Gbit/s (KV transfer)
nic_latency_us = 30          # NIC start-up latency per transfer (default 30)
host_gb_s = 64               # host link (PCIe) per GPU, one way, GB/s: KV swap (default 64)"""

_MODEL_KEYS = {
    "name", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
    "max_context", "weight_dtype", "kv_dtype", "mlp", "tied_embeddings", "other_params", "moe",
    "mla",
}  # fmt: skip
_MOE_KEYS = {"experts", "top_k", "shared", "expert_intermediate", "dense_layers"}
_MOE_KEYS |= {"dense_intermediate"}
_MLA_KEYS = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}
_GPU_KEYS = {
    "name", "bf16_tflops", "fp8_tflops", "memory_gb", "hbm_tb_s", "nvlink_gb_s", "gpus_per_node",
    "nic_gbit_s", "nic_latency_us", "host_gb_s",
}  # fmt: skip
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_GPU_NAME = re.compile(r"^[a-z0-9_-]+$")


def read_document(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON (``.json``) file as a dict; a clear error otherwise."""
    if path.suffix not in (".toml", ".json"):
        raise SpecError(f"{path}: a spec file must be .toml or .json")
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not valid {path.suffix[1:].upper()} ({exc})") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{path}: expected a table/object at the top")
    return doc


def resolve_model(text: str) -> str | ModelSpec:
    """A built-in model's name, or the model a file describes (``config.json``, a folder
    holding one, or a model spec file)."""
    if text.lower() in MODELS:
        return text.lower()
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(
            f"unknown model {text!r}: neither a built-in model {sorted(MODELS)} nor a file "
            "(a Hugging Face config.json, or a model spec .toml/.json; see 'tspd-sim list')"
        )
    return load_model_file(path)


def load_model_file(path: Path) -> ModelSpec:
    """The model of a Hugging Face ``config.json`` or of a ``[model]`` spec file."""
    doc = read_document(path)
    if is_hf_config(doc):
        return model_from_hf_config(doc, _hf_name(doc, path), str(path))
    table = _table(doc, "model", path)
    return _model(table, f"{path} [model]")


def load_gpu_file(path: Path) -> GpuSpec:
    """The GPU of a ``[gpu]`` spec file."""
    table = _table(read_document(path), "gpu", path)
    where = f"{path} [gpu]"
    _no_unknown(table, _GPU_KEYS, where)
    name = str(table.get("name", "")).lower()
    if not _GPU_NAME.match(name):
        raise SpecError(f"{where}: name {table.get('name')!r} must be letters, digits, _ or -")
    bf16 = _num(table, "bf16_tflops", where)
    return GpuSpec(
        name,
        bf16_flops=bf16 * 1e12,
        fp8_flops=_num(table, "fp8_tflops", where, bf16) * 1e12,
        hbm_bw=_num(table, "hbm_tb_s", where) * 1e12,
        memory=_num(table, "memory_gb", where) * GB,
        nvlink_bw=_num(table, "nvlink_gb_s", where) * GB,
        nic_bw=_num(table, "nic_gbit_s", where) * 1e9 / 8,
        nic_latency_s=_num(table, "nic_latency_us", where, 30.0, minimum=0.0) * 1e-6,
        host_bw=_num(table, "host_gb_s", where, 64.0) * GB,
        gpus_per_node=_int(table, "gpus_per_node", where, 8),
    )


# ---- the model spec table ------------------------------------------------------------------


def _model(t: Mapping[str, Any], where: str) -> ModelSpec:
    _no_unknown(t, _MODEL_KEYS, where)
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise SpecError(f"{where}: needs a name")
    heads, hidden = _int(t, "heads", where), _int(t, "hidden", where)
    mlp = t.get("mlp", "gated")
    if mlp not in ("gated", "plain"):
        raise SpecError(f"{where}: mlp {mlp!r}: use 'gated' or 'plain'")
    tied = t.get("tied_embeddings", False)
    if not isinstance(tied, bool):
        raise SpecError(f"{where}: tied_embeddings must be true or false")
    return ModelSpec(
        name.lower(), _int(t, "layers", where), hidden, heads,
        _int(t, "kv_heads", where, heads), _int(t, "head_dim", where, max(1, hidden // heads)),
        _int(t, "intermediate", where, minimum=0), _int(t, "vocab", where),
        _int(t, "max_context", where), weight_bytes=_dtype(t, "weight_dtype", where),
        kv_bytes=_dtype(t, "kv_dtype", where), mla=_mla(t.get("mla"), where),
        moe=_moe(t.get("moe"), where), gated_mlp=mlp == "gated", tied_embeddings=tied,
        other_params=_int(t, "other_params", where, 0, minimum=0),
    )  # fmt: skip


def _moe(t: object, where: str) -> MoeSpec | None:
    if t is None:
        return None
    where = f"{where}.moe"
    if not isinstance(t, Mapping):
        raise SpecError(f"{where}: expected a table")
    _no_unknown(t, _MOE_KEYS, where)
    return MoeSpec(
        _int(t, "experts", where), _int(t, "top_k", where), _int(t, "shared", where, 0, minimum=0),
        _int(t, "expert_intermediate", where), _int(t, "dense_layers", where, 0, minimum=0),
        _int(t, "dense_intermediate", where, 0, minimum=0),
    )  # fmt: skip


def _mla(t: object, where: str) -> MlaSpec | None:
    if t is None:
        return None
    where = f"{where}.mla"
    if not isinstance(t, Mapping):
        raise SpecError(f"{where}: expected a table")
    _no_unknown(t, _MLA_KEYS, where)
    return MlaSpec(
        _int(t, "q_lora_rank", where, 0, minimum=0), _int(t, "kv_lora_rank", where),
        _int(t, "qk_nope_head_dim", where, minimum=0), _int(t, "qk_rope_head_dim", where),
        _int(t, "v_head_dim", where),
    )  # fmt: skip


# ---- small readers ---------------------------------------------------------------------------


def _hf_name(doc: Mapping[str, Any], path: Path) -> str:
    """``_name_or_path``'s last part, else the folder's name, lower-cased."""
    given = doc.get("_name_or_path")
    if isinstance(given, str) and given.strip("/"):
        return given.rstrip("/").rsplit("/", 1)[-1].lower()
    folder = path.resolve().parent.name
    return (folder or path.stem).lower()


def _table(doc: Mapping[str, Any], key: str, path: Path) -> Mapping[str, Any]:
    table = doc.get(key)
    if not isinstance(table, Mapping):
        raise SpecError(f"{path}: expected a [{key}] table (see 'tspd-sim list' for the format)")
    extra = sorted(set(doc) - {key})
    if extra:
        raise SpecError(f"{path}: unknown top-level keys {extra}; only [{key}]")
    return table


def _no_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise SpecError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")


def _int(
    t: Mapping[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1
) -> int:
    value = t.get(key, default)
    if value is None:
        raise SpecError(f"{where}: missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where}: {key} must be an integer ≥ {minimum}, got {value!r}")
    return value


def _num(
    t: Mapping[str, Any],
    key: str,
    where: str,
    default: float | None = None,
    minimum: float | None = None,
) -> float:
    value = t.get(key, default)
    if value is None:
        raise SpecError(f"{where}: missing {key!r}")
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not (value >= minimum if minimum is not None else value > 0):
        bound = f"≥ {minimum}" if minimum is not None else "> 0"
        raise SpecError(f"{where}: {key} must be a number {bound}, got {value!r}")
    if value == float("inf"):
        raise SpecError(f"{where}: {key} must be finite")
    return float(value)


def _dtype(t: Mapping[str, Any], key: str, where: str) -> int:
    value = t.get(key, "bfloat16")
    if value not in _DTYPE_BYTES:
        raise SpecError(f"{where}: {key} {value!r}; use one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[value]
