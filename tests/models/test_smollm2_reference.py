"""SmolLM2-135M-Instruct through the engine's paged model against transformers' Llama on the
same (dequantized) weights: the logits of the first 32 greedy steps of 8 prompts, float32.

One batched run on each side (the engine: one ragged prefill and 31 decode rounds over
16-token pages; transformers: its KV cache over the left-padded batch), so the whole test
costs ~11 s on this 2-core machine (measured: 0.8 s to parse the GGUF, 2 s to dequantize and
shard, 4.4 s for the engine's steps, 3.2 s for transformers'); the worst difference measured is
7.8e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tspd_engine.model.gguf_model import GgufModel
from tspd_serving.gguf_file import open_gguf
from tspd_serving.hf_tokenizer import load_tokenizer

from .helpers import full_state, hf_greedy, hf_llama, paged_greedy, paged_model, state_source

STEPS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "Water boils at",
    "The quick brown fox",
]
CHATS = ["What is the capital of France?", "Give me three tips for writing clear code."]


def test_logits_of_32_greedy_steps_match_transformers(smollm2: Path) -> None:
    tok = load_tokenizer(smollm2)
    prompts = [tok.encode(t) for t in TEXTS]
    prompts += [tok.chat_prompt([{"role": "user", "content": c}]) for c in CHATS]
    f = GgufModel(open_gguf(smollm2))
    cfg = f.config("float32")
    state = full_state(cfg, f.source(cfg))  # dequantized once, for both implementations
    ours, our_tokens = paged_greedy(paged_model(cfg, state_source(state)), prompts, STEPS)
    ref, ref_tokens = hf_greedy(hf_llama(cfg, state), prompts, STEPS)
    assert our_tokens == ref_tokens
    assert ours.shape == ref.shape == (8, STEPS, 49152)
    worst = float((ours - ref).abs().max())
    assert worst <= 1e-3, f"max |logit difference| {worst:.2e} over 8 prompts x {STEPS} steps"
    # The model answers, rather than matching noise with noise.
    assert tok.decode(our_tokens[0]).startswith(" Paris")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.29.self_attn.k_proj.weight"])  # fmt: skip
def test_gguf_rows_are_unpermuted_like_transformers_reads_them(smollm2: Path, name: str) -> None:
    # transformers' GGUF reader undoes llama.cpp's rotary permutation its own way: the rows we
    # hand the shard builder must be exactly its rows.
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    f = GgufModel(open_gguf(smollm2))
    cfg = f.config("float32")
    gguf_name = f.hf_names(cfg)[name]
    raw = f.tensor(gguf_name, None, None).numpy()
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    want = LlamaTensorProcessor(config=config).process(raw, gguf_name).weights
    assert torch.equal(f.source(cfg)(name, None, None), torch.from_numpy(want))
