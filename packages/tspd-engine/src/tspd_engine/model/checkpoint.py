"""Hugging Face safetensors checkpoints (Llama, Mistral, Qwen2) in a local directory.

A directory holds ``config.json`` (read by :mod:`.hf_config`) and either ``model.safetensors``
or shards listed by ``model.safetensors.index.json``. Each rank reads only its own slices
(``safe_open(...).get_slice``), so a TP 8 rank does not load the whole model. Tensors stored as
bf16, f16 or f32 are cast to float32 here and to the compute dtype by the shard builder.

Everything is checked before the first slice is read: every file opens (a truncated or
corrupt file is named with safetensors' reason), every tensor the config needs is present
with its global shape and a floating dtype.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tspd_engine.model.config import ModelConfig
from tspd_engine.model.hf_config import config_from_json_file
from tspd_engine.model.weights import TensorSource, global_shapes, torch_dtype
from tspd_serving.errors import CheckpointError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: safetensors dtype names the loader casts (anything else, e.g. int8 or fp8, is refused).
FLOAT_DTYPES = ("F32", "F16", "BF16")


def save_checkpoint(
    directory: Path, cfg: ModelConfig, state: Mapping[str, torch.Tensor], dtype: str | None = None
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tensors cast to ``dtype`` if given)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = cfg.replace(dtype=dtype) if dtype else cfg
    expected = global_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"state lacks {len(missing)} tensors, e.g. {missing[:3]}")
    tensors = {k: v.to(torch_dtype(target)).contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / SINGLE), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(target.to_hf_dict(), indent=2) + "\n")


def load_config(directory: Path, dtype: str | None = "float32") -> ModelConfig:
    """The model config of a checkpoint directory; ``dtype`` is the compute dtype to use."""
    if not directory.is_dir():
        raise CheckpointError(f"model directory {directory} does not exist or is not a directory")
    if not (directory / CONFIG).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG}; is it a Llama checkpoint directory?")
    return config_from_json_file(directory / CONFIG, dtype)


def checkpoint_source(directory: Path, cfg: ModelConfig) -> TensorSource:
    """A :data:`~tspd_engine.model.weights.TensorSource` reading slices from the checkpoint files.

    Checks up front that every tensor the config needs is present with its global shape.
    """
    where = _tensor_files(directory)
    shapes = global_shapes(cfg)
    for name, shape in shapes.items():
        if name not in where:
            raise CheckpointError(f"checkpoint {directory} lacks tensor {name!r}")
        with _open(where[name]) as f:
            part = f.get_slice(name)
            got, dtype = tuple(part.get_shape()), part.get_dtype()
        if got != shape:
            raise CheckpointError(f"tensor {name!r} has shape {got}, config needs {shape}")
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} in {where[name].name} is {dtype}; the engine reads "
                f"{', '.join(FLOAT_DTYPES)} (quantized checkpoints: use a GGUF file)"
            )

    def get(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        with _open(where[name]) as f:
            part: Any = f.get_slice(name)
            full = slice(None)
            index = (rows or full,) if len(shapes[name]) == 1 else (rows or full, cols or full)
            t = part[index]
        return torch.as_tensor(t).to(torch.float32)

    return get


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _tensor_files(directory: Path) -> dict[str, Path]:
    if (directory / INDEX).is_file():
        try:
            index = json.loads((directory / INDEX).read_text())
            where = {k: directory / v for k, v in index["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise CheckpointError(f"{directory / INDEX} is malformed: {exc!r}") from exc
        for path in sorted(set(where.values())):
            if not path.is_file():
                raise CheckpointError(f"{directory / INDEX} names {path.name}, which is missing")
            with _open(path):  # a truncated shard fails here, at start
                pass
        return where
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no *.safetensors files")
    where = {}
    for path in files:
        with _open(path) as f:
            where |= dict.fromkeys(f.keys(), path)
    return where
