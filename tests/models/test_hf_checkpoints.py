"""Hugging Face safetensors checkpoints written by transformers itself (Llama with Llama 3.1
rope scaling and tied embeddings, Mistral, Qwen2 with q/k/v biases; bf16, f16 and f32 on
disk), read by the engine and checked against transformers' forward on the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tspd_engine.model.checkpoint import checkpoint_source, load_config
from tspd_engine.model.config import RopeScaling
from tspd_serving.errors import CheckpointError, ConfigError

from .helpers import hf_greedy, paged_greedy, paged_model

PROMPTS = [[1, 5, 9, 200, 17, 33, 2, 8, 150], [1, 77, 3]]
STEPS = 8
COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any], torch.dtype]] = {
    "llama-llama3rope-tied-bf16": (
        "llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}, torch.bfloat16,
    ),
    "mistral-f16": ("mistral", {"sliding_window": None, "head_dim": 16}, torch.float16),
    "qwen2-biases-f32": ("qwen2", {"tie_word_embeddings": True}, torch.float32),
}  # fmt: skip


def _save(directory: Path, arch: str, extra: dict[str, Any], dtype: torch.dtype) -> Any:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra))
    with torch.no_grad():  # transformers initializes biases to 0: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(directory)
    return model_cls.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", CASES)
def test_engine_logits_match_transformers_on_its_checkpoint(tmp_path: Path, case: str) -> None:
    arch, extra, dtype = CASES[case]
    reference = _save(tmp_path, arch, extra, dtype)
    cfg = load_config(tmp_path, "float32")
    assert cfg.qkv_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == extra.get("tie_word_embeddings", False)
    if arch == "llama":
        assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
        assert cfg.rope_theta == 500000.0
    ours, our_tokens = paged_greedy(paged_model(cfg, checkpoint_source(tmp_path, cfg)), PROMPTS,
                                    STEPS)  # fmt: skip
    ref, ref_tokens = hf_greedy(reference, PROMPTS, STEPS)
    assert our_tokens == ref_tokens
    worst = float((ours - ref).abs().max())
    assert worst <= 1e-4, f"max |logit difference| {worst:.2e}"


def _config(tmp_path: Path, **raw: Any) -> Path:
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(COMMON | raw))
    return d


def test_config_refusals_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"architecture 'GPTNeoXForCausalLM' is not supported; "
        r"supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM$",
    ):
        load_config(_config(tmp_path, architectures=["GPTNeoXForCausalLM"]))
    with pytest.raises(ConfigError, match=r"^attention_bias: true is not supported"):
        load_config(_config(tmp_path, architectures=["LlamaForCausalLM"], attention_bias=True))
    with pytest.raises(ConfigError, match=r"rope_scaling type 'yarn' not supported"):
        load_config(_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_a_sliding_window_caps_the_context(tmp_path: Path) -> None:
    mistral = _config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=128)
    assert load_config(mistral).max_position_embeddings == 128
    qwen = _config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=128,
                   use_sliding_window=False)  # fmt: skip
    assert load_config(qwen).max_position_embeddings == 256


def test_eos_falls_back_to_generation_config(tmp_path: Path) -> None:
    raw = {k: v for k, v in COMMON.items() if k != "eos_token_id"}
    d = tmp_path / "gen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"^no eos_token_id in config\.json or generation_"):
        load_config(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert load_config(d).eos_token_id == 7


def test_truncated_and_integer_tensors_are_refused_at_start(tmp_path: Path) -> None:
    _save(tmp_path, "llama", {}, torch.float32)
    cfg = load_config(tmp_path)
    file = tmp_path / "model.safetensors"
    state = {k: v.clone() for k, v in load_file(str(file)).items()}  # not the mapping we cut
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors: .*incomplete "
                       r"metadata, file not fully covered"):  # fmt: skip
        checkpoint_source(tmp_path, cfg)
    state["model.embed_tokens.weight"] = torch.zeros(256, 64, dtype=torch.int8)
    save_file(state, str(file))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.embed_tokens\.weight' in model\."
                       r"safetensors is I8; the engine reads F32, F16, BF16"):  # fmt: skip
        checkpoint_source(tmp_path, cfg)
