"""Llama-format safetensors checkpoints: round trip, sharded reads, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.checkpoint import checkpoint_source, load_config, save_checkpoint
from tspd_engine.model.config import ModelConfig, RopeScaling
from tspd_engine.model.dense import dense_greedy
from tspd_engine.model.hf_config import config_from_hf
from tspd_engine.model.tp import ShardPlan
from tspd_engine.model.weights import full_random_state, random_source, shard_weights
from tspd_serving.errors import CheckpointError, ConfigError

from .conftest import PROMPTS, small_config


def _same(a, b) -> None:
    assert len(a.layers) == len(b.layers)
    for x, y in [(a.embed, b.embed), (a.norm, b.norm), (a.lm_head, b.lm_head)]:
        assert torch.equal(x, y)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 2), (3, 4)])
def test_round_trip_gives_the_seeded_model_shard(tmp_path: Path, rank: int, size: int) -> None:
    cfg = ModelConfig()
    save_checkpoint(tmp_path, cfg, full_random_state(cfg, 3))
    loaded = load_config(tmp_path)
    assert loaded == cfg
    plan = ShardPlan.build(cfg, rank, size)
    got = shard_weights(cfg, plan, checkpoint_source(tmp_path, cfg))
    _same(got, shard_weights(cfg, plan, random_source(cfg, 3)))
    assert got.layers[0].qkv.shape == ((4 // size + 2 * max(1, 2 // size)) * 32, 128)


def test_bf16_checkpoint_loads_as_float32_with_bf16_values(tmp_path: Path) -> None:
    cfg = ModelConfig(tie_word_embeddings=True)
    state = full_random_state(cfg, 1)
    assert "lm_head.weight" not in state
    save_checkpoint(tmp_path, cfg, state, dtype="bfloat16")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"
    assert raw["tie_word_embeddings"] is True
    cfg32 = load_config(tmp_path, dtype="float32")
    w = shard_weights(cfg32, ShardPlan.build(cfg32, 0, 1), checkpoint_source(tmp_path, cfg32))
    want = state["model.embed_tokens.weight"].to(torch.bfloat16).float()
    assert w.embed.dtype == torch.float32
    assert torch.equal(w.embed, want)
    assert w.lm_head is w.embed


def test_index_json_shards_are_followed(tmp_path: Path) -> None:
    cfg = ModelConfig(num_hidden_layers=1)
    state = full_random_state(cfg, 2)
    names = sorted(state)
    parts = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in parts.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    plan = ShardPlan.build(cfg, 0, 1)
    _same(
        shard_weights(cfg, plan, checkpoint_source(tmp_path, load_config(tmp_path))),
        shard_weights(cfg, plan, random_source(cfg, 2)),
    )


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    cfg = ModelConfig(num_hidden_layers=1)
    state = full_random_state(cfg, 0)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        checkpoint_source(tmp_path, cfg)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"shape \(3, 3\), config needs \(256, 128\)"):
        checkpoint_source(tmp_path, cfg)
    with pytest.raises(CheckpointError, match=r"nowhere does not exist or is not a directory$"):
        load_config(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty has no config\.json; is it a Llama"):
        load_config(tmp_path / "empty")


def test_hf_config_keys_and_llama3_rope_scaling() -> None:
    raw = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "eos_token_id": [1, 2],
        "bos_token_id": 0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    cfg = config_from_hf(raw, dtype="float32")
    assert (cfg.head_dim, cfg.eos_token_id, cfg.dtype) == (16, 1, "float32")
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert config_from_hf(cfg.to_hf_dict()) == cfg
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' not supported"):
        config_from_hf(raw | {"rope_scaling": {"type": "yarn", "factor": 2.0}})
    with pytest.raises(ConfigError, match="hidden_act 'gelu' not supported"):
        config_from_hf(raw | {"hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="not a Llama-family config"):
        config_from_hf({"hidden_size": 8})


def test_engine_serves_a_bf16_checkpoint_directory_in_float32(tmp_path: Path) -> None:
    cfg = ModelConfig(num_hidden_layers=3, num_key_value_heads=1)
    state = full_random_state(cfg, 5)
    save_checkpoint(tmp_path, cfg, state, dtype="bfloat16")
    engine = Engine(small_config(checkpoint=tmp_path, seed=123))  # the seed is not used
    assert engine.core.model_cfg == cfg
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=8))
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    want = [tuple(dense_greedy(cfg, rounded, p, 8)) for p in PROMPTS[:2]]
    assert [o.tokens for o in outs] == want
    embed = engine.core.runner.model.weights.embed
    assert torch.equal(embed, rounded["model.embed_tokens.weight"])  # the file was read
    assert not torch.equal(embed, state["model.embed_tokens.weight"])
