"""Models from Hugging Face config.json files and spec files; GPUs from spec files.

The configs below are the published ``config.json`` values of each model (the keys the
simulator reads, plus a few it ignores, as the files have them). KV bytes per token are
compared exactly with the formula written out by hand; parameter counts with the published
figure, within the tolerance stated at each check (published sizes are rounded).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tspd_sim.cli import main
from tspd_sim.cluster import ClusterSpec, GroupSpec, parse_group
from tspd_sim.errors import SpecError
from tspd_sim.hf_config import model_from_hf_config
from tspd_sim.sim import SimConfig, Simulation
from tspd_sim.sim.kv import KvPlanner
from tspd_sim.spec_files import load_gpu_file, load_model_file, resolve_model
from tspd_sim.specs import GPUS, MODELS, ModelSpec
from tspd_sim.testing import mooncake_trace, small_config

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}  # fmt: skip
QWEN2_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
    "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rope_theta": 1000000.0, "sliding_window": 131072,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 152064,
}  # fmt: skip
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
    "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000,
}  # fmt: skip
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3,
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "v_head_dim": 128,
    "vocab_size": 129280,
}  # fmt: skip
OPT_6_7B: dict[str, Any] = {
    "_name_or_path": "facebook/opt-6.7b", "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "do_layer_norm_before": True, "ffn_dim": 16384,
    "hidden_size": 4096, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 32, "num_hidden_layers": 32, "torch_dtype": "float16",
    "vocab_size": 50272, "word_embed_proj_dim": 4096,
}  # fmt: skip


def _hf(doc: dict[str, Any], name: str = "m") -> ModelSpec:
    return model_from_hf_config(doc, name)


# ---- KV bytes per token: exact --------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "tp", "expected"),
    [
        # layers x (K and V) x KV heads on the rank x head dim x 2 bytes
        (LLAMA3_8B, 1, 32 * 2 * 8 * 128 * 2),
        (LLAMA3_8B, 4, 32 * 2 * 2 * 128 * 2),
        (LLAMA3_8B, 8, 32 * 2 * 1 * 128 * 2),
        (QWEN2_7B, 1, 28 * 2 * 4 * 128 * 2),
        (QWEN2_7B, 4, 28 * 2 * 1 * 128 * 2),
        (QWEN3_8B, 2, 36 * 2 * 4 * 128 * 2),
        (MIXTRAL_8X7B, 1, 32 * 2 * 8 * 128 * 2),
        (MIXTRAL_8X7B, 2, 32 * 2 * 4 * 128 * 2),
        # MLA: one latent (kv_lora 512 + rope 64) per layer, the same on every rank
        (DEEPSEEK_V3, 1, 61 * (512 + 64) * 2),
        (DEEPSEEK_V3, 8, 61 * (512 + 64) * 2),
        # OPT: MHA, 32 heads of 128
        (OPT_6_7B, 1, 32 * 2 * 32 * 128 * 2),
        (OPT_6_7B, 8, 32 * 2 * 4 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_are_exact(doc: dict[str, Any], tp: int, expected: int) -> None:
    assert _hf(doc).kv_bytes_per_token(tp) == expected


def test_the_layout_contract_carries_the_same_bytes_per_token() -> None:
    # The planner's contract for an engine of these models holds exactly the KV bytes per
    # token the cost model and memory sizing use (page bytes / page size, per rank).
    page = 64
    for doc in (LLAMA3_8B, QWEN2_7B, QWEN3_8B, MIXTRAL_8X7B, DEEPSEEK_V3, OPT_6_7B):
        model = _hf(doc)
        planner = KvPlanner(model, small_config().cluster.tuning)
        for tp in (1, 2, 4):
            contract = planner.layout(tp, 16).contract
            per_page = sum(f.payload_bytes for f in contract.plan.fields)
            assert per_page == model.kv_bytes_per_token(tp) * page, (model.name, tp)


# ---- parameter counts: published figures -------------------------------------------------------


def test_parameter_counts_match_the_published_sizes() -> None:
    # Meta: 8.03 B; the Llama module count (norms included) is 8,030,261,248.
    assert _hf(LLAMA3_8B).total_params == 8_030_261_248
    # Qwen2-7B: 7.62 B (Qwen2 report); within 0.1 %.
    assert _hf(QWEN2_7B).total_params == pytest.approx(7.62e9, rel=1e-3)
    # Qwen3-8B: 8.2 B, 6.95 B without embeddings (model card); within 0.5 %.
    qwen3 = _hf(QWEN3_8B)
    assert qwen3.total_params == pytest.approx(8.2e9, rel=5e-3)
    assert qwen3.total_params - 2 * qwen3.lm_head_params == pytest.approx(6.95e9, rel=5e-3)
    # Mixtral: 46.7 B total, 12.9 B active with the embeddings (Mistral AI); within 0.5 %.
    mixtral = _hf(MIXTRAL_8X7B)
    assert mixtral.total_params == pytest.approx(46.7e9, rel=5e-3)
    assert mixtral.active_params + mixtral.lm_head_params == pytest.approx(12.9e9, rel=5e-3)
    # DeepSeek-V3: 671 B total, 37 B active (report, MTP layer excluded, to the nearest
    # billion): within 0.1 % and 2 %.
    dsv3 = _hf(DEEPSEEK_V3)
    assert dsv3.total_params == pytest.approx(671e9, rel=1e-3)
    assert dsv3.active_params == pytest.approx(37e9, rel=2e-2)
    assert dsv3.weight_bytes == 1  # fp8 checkpoint
    # OPT-6.7B: 6.66 B (Hugging Face's count of the checkpoint); within 0.1 %.
    opt = _hf(OPT_6_7B)
    assert opt.total_params == pytest.approx(6.66e9, rel=1e-3)
    assert not opt.gated_mlp
    assert opt.tied_embeddings


def test_a_config_equals_the_built_in_model_it_describes() -> None:
    built = MODELS["deepseek-v3"]
    parsed = _hf(DEEPSEEK_V3)
    # Same shapes: only the norms and router biases (other_params) and the context differ.
    assert parsed.kv_bytes_per_token(1) == built.kv_bytes_per_token(1)
    assert parsed.active_params == built.active_params
    assert parsed.total_params - parsed.other_params == built.total_params
    llama = {**LLAMA3_8B, "max_position_embeddings": 131072}
    assert _hf(llama).total_params - _hf(llama).other_params == MODELS["llama-3-8b"].total_params


def test_unsupported_architectures_and_bad_keys_are_refused_by_name() -> None:
    with pytest.raises(SpecError, match="unsupported architecture 'GPT2LMHeadModel'; supported: "):
        _hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(SpecError, match="missing 'num_hidden_layers'"):
        _hf({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"})
    with pytest.raises(SpecError, match="quantization 'awq' is not supported"):
        _hf({**LLAMA3_8B, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(SpecError, match="torch_dtype 'int8'"):
        _hf({**LLAMA3_8B, "torch_dtype": "int8"})
    # model_type alone is enough when architectures is absent
    no_arch = {k: v for k, v in QWEN2_7B.items() if k != "architectures"}
    assert _hf(no_arch).total_params == _hf(QWEN2_7B).total_params


# ---- files and the cluster ------------------------------------------------------------------


def test_model_files_load_by_path_folder_and_spec(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen2-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_7B))
    by_folder = resolve_model(str(folder))
    by_file = resolve_model(str(folder / "config.json"))
    assert isinstance(by_folder, ModelSpec)
    assert by_folder == by_file
    assert by_folder.name == "qwen2-7b"
    assert resolve_model("LLAMA-3-8B") == "llama-3-8b"
    spec = tmp_path / "tiny.toml"
    spec.write_text(
        '[model]\nname = "tiny"\nlayers = 4\nhidden = 512\nheads = 8\nkv_heads = 2\n'
        'intermediate = 1024\nvocab = 1000\nmax_context = 4096\nmlp = "plain"\n'
        "[model.moe]\nexperts = 4\ntop_k = 1\nexpert_intermediate = 256\n"
    )
    tiny = load_model_file(spec)
    assert (tiny.head_dim, tiny.kv_bytes_per_token(1)) == (64, 4 * 2 * 2 * 64 * 2)
    # 4 layers x (attention 2*512*512 + 2*512*128, router 512*4, 4 experts of 2*512*256)
    # + embedding and LM head 2 * 1000 * 512
    attn = 2 * 512 * 512 + 2 * 512 * 128
    assert tiny.total_params == 4 * (attn + 512 * 4 + 4 * 2 * 512 * 256) + 2 * 1000 * 512
    as_json = tmp_path / "tiny.json"
    as_json.write_text(json.dumps({"model": {"name": "tiny", "layers": 4, "hidden": 512,
                                             "heads": 8, "kv_heads": 2, "intermediate": 1024,
                                             "vocab": 1000, "max_context": 4096,
                                             "mlp": "plain", "moe": {"experts": 4, "top_k": 1,
                                             "expert_intermediate": 256}}}))  # fmt: skip
    assert load_model_file(as_json) == tiny


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[model]\nname = "x"\nlayers = 4\n', "missing 'heads'"),
        ('[model]\nname = "x"\nlayrs = 4\n', "unknown keys ['layrs']"),
        ('[modle]\nname = "x"\n', "expected a [model] table"),
        ("[model\n", "not valid TOML"),
    ],
)
def test_bad_model_spec_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=re.escape(message)):
        load_model_file(path)


GPU_TOML = """\
[gpu]
name = "mi300x"
bf16_tflops = 1307
fp8_tflops = 2615
memory_gb = 192
hbm_tb_s = 5.3
nvlink_gb_s = 448
nic_gbit_s = 400
nic_latency_us = 20
host_gb_s = 64
"""


def test_gpu_spec_files(tmp_path: Path) -> None:
    path = tmp_path / "mi300x.toml"
    path.write_text(GPU_TOML)
    gpu = load_gpu_file(path)
    assert (gpu.name, gpu.bf16_flops, gpu.memory, gpu.nic_bw) == ("mi300x", 1307e12, 192e9, 50e9)
    assert (gpu.nic_latency_s, gpu.host_bw, gpu.gpus_per_node) == (pytest.approx(20e-6), 64e9, 8)
    group = parse_group("2xtp4@mi300x", {"mi300x": gpu})
    assert group.gpu == gpu
    assert group.label() == "2xtp4@mi300x"
    # The NIC latency of the spec reaches the network.
    trace = mooncake_trace([(0.0, 1000, 2, [])])
    cfg = small_config(GroupSpec(1, 1, 1, gpu), GroupSpec(1, 1, 1, gpu))
    sim = Simulation(trace, cfg)
    assert sim.net.latency(0, 0) == pytest.approx(20e-6)
    bad = tmp_path / "bad.toml"
    bad.write_text(GPU_TOML.replace("hbm_tb_s = 5.3", "hbm_tb_s = -1"))
    with pytest.raises(SpecError, match="hbm_tb_s must be a number > 0, got -1"):
        load_gpu_file(bad)
    bad.write_text(GPU_TOML.replace("nvlink_gb_s", "nvlink"))
    with pytest.raises(SpecError, match="unknown keys \\['nvlink'\\]"):
        load_gpu_file(bad)


def test_tp_must_fit_the_heads_and_the_node() -> None:
    qwen2 = _hf(QWEN2_7B, "qwen2-7b")
    with pytest.raises(SpecError, match="TP 8 does not divide its 28 attention heads"):
        ClusterSpec(qwen2, (GroupSpec(1, 8),), (GroupSpec(1),))
    with pytest.raises(SpecError, match="its 4 KV heads cannot be split over TP 7"):
        ClusterSpec(qwen2, (GroupSpec(1),), (GroupSpec(1, 7),))
    with pytest.raises(SpecError, match="TP 3 does not divide its 32 attention heads"):
        ClusterSpec("llama-3-8b", (GroupSpec(1, 3),), (GroupSpec(1),))
    small_node = GPUS["h100"].__class__(**{**_fields(GPUS["h100"]), "gpus_per_node": 4})
    with pytest.raises(SpecError, match="TP 8 spans more than one node of 4"):
        GroupSpec(1, 8, 1, small_node)


def _fields(obj: object) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}  # type: ignore[attr-defined]


def test_a_config_json_model_runs_end_to_end(tmp_path: Path) -> None:
    # Mixtral on H200s: its layout contract comes from the planner, bytes per link too.
    model = _hf(MIXTRAL_8X7B, "mixtral-8x7b")
    cfg = SimConfig(cluster=ClusterSpec(model, (GroupSpec(1, 2, 1, "h200"),),
                                        (GroupSpec(1, 2, 1, "h200"),)))  # fmt: skip
    trace = mooncake_trace([(0.0, 3000, 5, []), (0.5, 1200, 3, [])])
    df = Simulation(trace, cfg).run().requests
    assert df["finish_s"].notna().all()
    # 3000 tokens in 64-token pages: 47 pages of 32 layers x K,V x 4 heads/rank x 64 x 128 x 2
    # bytes, on each of the two (P rank, D rank) links.
    assert df.loc[0, "transfer_bytes"] == 2 * 47 * 32 * 2 * 4 * 64 * 128 * 2


def test_cli_takes_model_files_and_gpu_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**QWEN2_7B, "_name_or_path": "Qwen/Qwen2-7B"}))
    gpu = tmp_path / "gpu.toml"
    gpu.write_text(GPU_TOML)
    args = ["run", "--trace", "synthetic", "--requests", "20", "--input-len", "fixed:500",
            "--output-len", "fixed:4", "--quiet", "--no-plots", "--out", str(tmp_path / "o"),
            "--model", str(cfg), "--gpu-spec", str(gpu), "--prefill", "1xtp2",
            "--decode", "1xtp1@h100"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["cluster"] == "qwen2-7b P[1xtp2@mi300x] D[1xtp1@h100]"
    capsys.readouterr()
    bad = [*args[:-6], "--model", "gpt2"]
    assert main(bad) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "unknown model 'gpt2': neither a built-in model" in err
    cfg.write_text(json.dumps({"architectures": ["GemmaForCausalLM"]}))
    assert main(args) == 2
    assert "unsupported architecture 'GemmaForCausalLM'" in capsys.readouterr().err
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert 'name = "my-h100"' in out
    assert "MixtralForCausalLM" in out
