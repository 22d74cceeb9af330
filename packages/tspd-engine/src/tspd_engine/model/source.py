"""A model's config and tensors from where it comes from (a checkpoint directory or a GGUF
file: :func:`tspd_serving.models.resolve` turns ``--model`` into one)."""

from __future__ import annotations

from pathlib import Path

from tspd_engine.model.checkpoint import checkpoint_source, load_config
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.gguf_model import GgufModel
from tspd_engine.model.weights import TensorSource
from tspd_serving.gguf_file import open_gguf
from tspd_serving.models import is_gguf


def model_config(path: Path, dtype: str) -> ModelConfig:
    """The config of the model at ``path`` (a directory or a GGUF file), computed in ``dtype``."""
    if is_gguf(path):
        return GgufModel(open_gguf(path)).config(dtype)
    return load_config(path, dtype)


def tensor_source(path: Path, cfg: ModelConfig) -> TensorSource:
    """The global tensors of the model at ``path`` in Hugging Face names (checked first)."""
    if is_gguf(path):
        return GgufModel(open_gguf(path)).source(cfg)
    return checkpoint_source(path, cfg)
