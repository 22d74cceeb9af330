"""GGUF checkpoints: llama.cpp's names, q/k permutation and quant types read back exactly,
shards cut from them, the engine generating from them, and files refused with a reason."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

from tspd_engine.config import EngineConfig
from tspd_engine.frames import SamplingParams
from tspd_engine.loop.engine import Engine
from tspd_engine.model.checkpoint import save_checkpoint
from tspd_engine.model.config import ModelConfig, RopeScaling
from tspd_engine.model.dense import dense_greedy
from tspd_engine.model.gguf_model import GgufModel, dequantize_fast
from tspd_engine.model.rope import inverse_frequencies
from tspd_engine.model.source import model_config, tensor_source
from tspd_engine.model.tp import ShardPlan
from tspd_engine.model.weights import full_random_state, global_shapes, shard_weights
from tspd_serving.errors import CheckpointError
from tspd_serving.gguf_file import GgufFile
from tspd_serving.hf_tokenizer import load_tokenizer

from .gguf_files import Q, byte_vocab, write_gguf

#: float32-exact values: GGUF stores eps and theta as float32.
CFG = ModelConfig(
    vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=50000.0,
    rms_norm_eps=2.0**-20, max_position_embeddings=512, bos_token_id=0, eos_token_id=299,
)  # fmt: skip
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _write(tmp_path: Path, cfg: ModelConfig = CFG, qtype: Q = Q.F32, **kw: object) -> tuple:
    state = full_random_state(cfg, 4)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    readback = write_gguf(path, cfg, state, byte_vocab(cfg.vocab_size), qtype, **kw)  # type: ignore[arg-type]
    return path, readback


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_every_tensor_reads_back_as_written(tmp_path: Path, qtype: Q) -> None:
    path, readback = _write(tmp_path, qtype=qtype)
    cfg = model_config(path, "float32")
    assert cfg == CFG
    source = tensor_source(path, cfg)
    for name, want in readback.items():
        assert torch.equal(source(name, None, None), torch.from_numpy(want)), name


def test_tp_shards_are_slices_of_the_whole(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, qtype=Q.Q8_0)
    source = tensor_source(path, CFG)
    whole = shard_weights(CFG, ShardPlan.build(CFG, 0, 1), source)
    for rank in range(2):
        part = shard_weights(CFG, ShardPlan.build(CFG, rank, 2), source)
        # o: this rank's 2 query heads' input columns (32 of 64: a whole Q8_0 block each).
        cols = slice(rank * 32, rank * 32 + 32)
        assert torch.equal(part.layers[1].o, whole.layers[1].o[:, cols])
        assert torch.equal(part.layers[1].down, whole.layers[1].down[:, rank * 64 : rank * 64 + 64])


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "safetensors"])
def test_each_rank_asks_its_source_for_its_slices_only(tmp_path: Path, fmt: str) -> None:
    # Every tensor a rank reads comes back as that rank's slice (safetensors' get_slice, a
    # GGUF's rows or quant blocks): over a TP 2 pair, each split tensor's elements are read
    # exactly once in all; only the replicated ones (norms, embedding, LM head: docs/engine.md,
    # Tensor parallelism) are read whole by each.
    if fmt == "safetensors":
        path = tmp_path / "ckpt"
        save_checkpoint(path, CFG, full_random_state(CFG, 4))
    else:
        path, _ = _write(tmp_path, qtype=Q.Q8_0)
    source = tensor_source(path, CFG)
    shapes = global_shapes(CFG)
    read: dict[str, int] = dict.fromkeys(shapes, 0)

    def recording(name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        t = source(name, rows, cols)
        read[name] += t.numel()
        return t

    for rank in range(2):
        shard_weights(CFG, ShardPlan.build(CFG, rank, 2), recording)
    whole = {name: math.prod(shape) for name, shape in shapes.items()}
    replicated = {n for n in shapes if "_proj." not in n}
    assert replicated == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}_layernorm.weight"
        for i in range(CFG.num_hidden_layers)
        for n in ("input", "post_attention")
    }
    assert {n: read[n] for n in replicated} == {n: 2 * whole[n] for n in replicated}
    assert {n: read[n] for n in shapes if n not in replicated} == {
        n: whole[n] for n in shapes if n not in replicated
    }


def test_engine_generates_what_the_dense_reference_does_on_the_read_weights(tmp_path: Path) -> None:
    path, readback = _write(tmp_path, qtype=Q.Q4_1)
    engine = Engine(EngineConfig(checkpoint=path, num_pages=32, page_size=4))
    try:
        (out,) = engine.generate([[0, 5, 17, 42, 99, 7]], SamplingParams(max_tokens=10))
    finally:
        engine.close()
    state = {k: torch.from_numpy(v) for k, v in readback.items()}
    assert list(out.tokens) == dense_greedy(CFG, state, [0, 5, 17, 42, 99, 7], 10)


def test_no_output_tensor_means_a_tied_head(tmp_path: Path) -> None:
    tied = CFG.replace(tie_word_embeddings=True)
    path, _ = _write(tmp_path, cfg=tied)
    cfg = model_config(path, "float32")
    assert cfg.tie_word_embeddings
    w = shard_weights(cfg, ShardPlan.build(cfg, 0, 1), tensor_source(path, cfg))
    assert w.lm_head is w.embed


def test_rope_freqs_become_frequency_factors(tmp_path: Path) -> None:
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    base = inverse_frequencies(CFG)
    factors = (base / inverse_frequencies(CFG.replace(rope_scaling=llama3))).numpy()
    path, _ = _write(tmp_path, extra_tensors={"rope_freqs.weight": factors})
    cfg = model_config(path, "float32")
    assert cfg.rope_scaling == RopeScaling("factors", freq_factors=tuple(factors.tolist()))
    torch.testing.assert_close(
        inverse_frequencies(cfg), inverse_frequencies(CFG.replace(rope_scaling=llama3)),
        rtol=1e-6, atol=0,
    )  # fmt: skip


def test_config_keys_are_read(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    f = GgufFile(path)
    assert (f.arch, f.get("llama.block_count"), f.get("nope", "x")) == ("llama", 2, "x")
    model = GgufModel(f)
    assert math.isclose(model.config("bfloat16").rope_theta, 50000.0)
    assert model.config("bfloat16").dtype == "bfloat16"


# -- refusals -----------------------------------------------------------------------------


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, arch="gptneox")
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gptneox' is not supported "
                       r"\(supported: llama\)$"):  # fmt: skip
        model_config(path, "float32")


def test_unknown_and_missing_tensors_are_refused(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, extra_tensors={"blk.0.attn_q.bias": np.zeros(64)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_q\.bias' is not understood"):
        tensor_source(path, CFG)
    bigger = CFG.replace(num_hidden_layers=3)
    path, _ = _write(tmp_path)
    with pytest.raises(CheckpointError, match=r"lacks the tensor for 'model\.layers\.2\."):
        tensor_source(path, bigger)


def test_truncated_file_is_refused_at_open(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file: "):
        GgufFile(path)
    path.write_bytes(b"GGUF" + b"\xff" * 20)
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file: "):
        GgufFile(path)


def _retype(path: Path, tensor: str, qtype: int) -> None:
    """Rewrite the type id in ``tensor``'s info record (name, dims, type, offset)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * dims, qtype)
    path.write_bytes(bytes(data))


def test_quant_types_gguf_cannot_read_are_refused(tmp_path: Path) -> None:
    path, _ = _write(tmp_path, qtype=Q.Q8_0)
    _retype(path, "blk.0.ffn_up.weight", 250)  # no such type at all
    with pytest.raises(CheckpointError, match=r"not a readable GGUF file: unknown quant type 250 "):
        GgufFile(path)
    path, _ = _write(tmp_path, qtype=Q.Q8_0)
    _retype(path, "blk.0.ffn_up.weight", int(Q.Q8_1))  # same block bytes, no dequantizer
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight' has quant type "
                       r"Q8_1, which the gguf package cannot dequantize"):  # fmt: skip
        tensor_source(path, CFG)


def test_a_file_without_a_vocabulary_has_no_tokenizer(tmp_path: Path) -> None:
    state = full_random_state(CFG, 1)
    path = tmp_path / "novocab.gguf"
    vocab = byte_vocab(CFG.vocab_size)
    vocab.tokens, vocab.types = [], []
    write_gguf(path, CFG, state, vocab)
    with pytest.raises(CheckpointError, match=r"has no tokenizer\.ggml\.tokens: it carries no "
                       r"tokenizer$"):  # fmt: skip
        load_tokenizer(path)


FAST = [Q.Q8_0, Q.Q4_0, Q.Q4_1]


@pytest.mark.parametrize("qtype", FAST, ids=[q.name for q in FAST])
def test_fast_dequantize_gives_the_gguf_package_bits(qtype: Q) -> None:
    # Same float32 operations in the same order: the same bits, -0.0 included, across chunk
    # boundaries (3 blocks a chunk), for whole tensors, row cuts and block-aligned column cuts.
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((13, 160)) * 4).astype(np.float32)
    x[2] = 0.0
    x[5] = -np.abs(x[5])  # blocks of negative values only: negative Q4 scales
    data = quantize(x, qtype)
    block_bytes = data.shape[1] // 5
    for part in (data, data[4:9], data[:, block_bytes : 3 * block_bytes]):
        want = dequantize(part, qtype)
        got = dequantize_fast(part, qtype, chunk=3)
        assert (got.dtype, got.shape) == (np.float32, want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _stock_fields(path: Path) -> dict[str, object]:
    reader = GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items()}


def test_metadata_reads_as_the_stock_reader_reads_it(tmp_path: Path) -> None:
    # The reader parses an array as one view (numbers) or one byte range (strings); every
    # value still reads as gguf's own reader reads it, vocabulary arrays included.
    path, _ = _write(tmp_path, qtype=Q.Q4_1)
    ours = GgufFile(path)
    stock = _stock_fields(path)
    assert len(stock["tokenizer.ggml.tokens"]) == CFG.vocab_size  # type: ignore[arg-type]
    assert {name: ours.get(name) for name in stock} == stock


def test_a_vocabulary_cut_short_is_refused_at_open(tmp_path: Path) -> None:
    path, _ = _write(tmp_path)
    data = path.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens")
    path.write_bytes(data[: at + 400])  # inside the token strings
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file: .*past the end"):
        GgufFile(path)
