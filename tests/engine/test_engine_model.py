"""The paged, TP-sharded model against the dense reference (single process, TP 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_engine.model.attention import build_meta, pack_tables
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.dense import dense_greedy, dense_logits
from tspd_engine.model.llama import LlamaModel
from tspd_engine.model.tp import ShardPlan, TpGroup
from tspd_engine.model.weights import full_random_state, random_source, shard_weights
from tspd_serving.errors import ConfigError

CPU = torch.device("cpu")
PAGE = 4


class Pages:
    """Plain per-layer page tensors [pages, kv_heads, P, D] (the arena has its own tests)."""

    def __init__(self, cfg: ModelConfig, kv_heads: int, count: int = 64) -> None:
        shape = (cfg.num_hidden_layers, count, kv_heads, PAGE, cfg.head_dim)
        self.k = torch.full(shape, float("nan"))  # unwritten slots must never be read
        self.v = torch.full(shape, float("nan"))
        self.k[:, 0] = 0.0  # the null page pads short rows; it is masked, but must be finite
        self.v[:, 0] = 0.0

    def __call__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


def _model(cfg: ModelConfig, seed: int = 0) -> LlamaModel:
    plan = ShardPlan.build(cfg, 0, 1)
    return LlamaModel(cfg, plan, shard_weights(cfg, plan, random_source(cfg, seed)), TpGroup(), CPU)


def _step(model, pages, rows):  # rows: (context, ids, table)
    context = np.array([r[0] for r in rows], dtype=np.int64)
    new = np.array([len(r[1]) for r in rows], dtype=np.int64)
    tables = [np.asarray(r[2], dtype=np.int64) for r in rows]
    meta = build_meta(context, new, *pack_tables(tables), PAGE, CPU)
    ids = torch.tensor([t for r in rows for t in r[1]])
    return model.forward(model.embed(ids), meta, pages)


def test_ragged_prefill_then_decode_matches_dense_reference() -> None:
    cfg = ModelConfig()
    model, pages = _model(cfg), Pages(cfg, cfg.num_key_value_heads)
    state = full_random_state(cfg, 0)
    a = [256, *b"paged attention over a ragged batch"]
    b = [256, *b"second row"]
    ta, tb = [5, 9, 2, 7, 11, 13, 17, 19, 21, 23], [3, 30, 31, 32]
    # Chunked prefill of a (two chunks) alongside a whole prefill of b, then a decode round.
    first = _step(model, pages, [(0, a[:10], ta), (0, b, tb)])
    second = _step(model, pages, [(10, a[10:], ta)])
    third = _step(model, pages, [(len(a), [65], ta), (len(b), [66], tb)])
    ref_a, ref_b = dense_logits(cfg, state, [*a, 65]), dense_logits(cfg, state, [*b, 66])
    torch.testing.assert_close(first[0], ref_a[9], rtol=0, atol=2e-5)
    torch.testing.assert_close(first[1], ref_b[len(b) - 1], rtol=0, atol=2e-5)
    torch.testing.assert_close(second[0], ref_a[len(a) - 1], rtol=0, atol=2e-5)
    torch.testing.assert_close(third[0], ref_a[len(a)], rtol=0, atol=2e-5)
    torch.testing.assert_close(third[1], ref_b[len(b)], rtol=0, atol=2e-5)


def test_greedy_tokens_equal_dense_greedy() -> None:
    cfg = ModelConfig(num_hidden_layers=3)
    model, pages = _model(cfg, seed=7), Pages(cfg, cfg.num_key_value_heads)
    prompt = [256, *b"hello"]
    table = list(range(1, 17))
    logits = _step(model, pages, [(0, prompt, table)])
    got = [int(logits[0].argmax())]
    while len(got) < 24:
        logits = _step(model, pages, [(len(prompt) + len(got) - 1, [got[-1]], table)])
        got.append(int(logits[0].argmax()))
    assert got == dense_greedy(cfg, full_random_state(cfg, 7), prompt, 24)


def test_block_table_too_short_is_rejected() -> None:
    with pytest.raises(ValueError, match="block table has 1 pages, 2 needed"):
        build_meta(np.array([0]), np.array([5]), *pack_tables([np.array([3])]), PAGE, CPU)


@pytest.mark.parametrize(
    ("size", "rank", "q", "kv", "kv_start", "replicas"),
    [(1, 0, 8, 2, 0, 1), (2, 1, 4, 1, 1, 1), (4, 1, 2, 1, 0, 2), (4, 2, 2, 1, 1, 2)],
)
def test_shard_plan_splits_and_replicates_kv_heads(size, rank, q, kv, kv_start, replicas) -> None:
    cfg = ModelConfig(num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    plan = ShardPlan.build(cfg, rank, size)
    assert (plan.q_heads, plan.q_head_start) == (q, rank * q)
    assert (plan.kv_heads, plan.kv_head_start, plan.kv_replicas) == (kv, kv_start, replicas)
    assert plan.intermediate == cfg.intermediate_size // size


def test_shard_plan_rejects_indivisible_heads() -> None:
    cfg = ModelConfig(num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="num_attention_heads 6 is not divisible by TP size 4"):
        ShardPlan.build(cfg, 0, 4)
    with pytest.raises(ConfigError, match="TP size 6 is not a multiple"):
        ShardPlan.build(
            ModelConfig(num_attention_heads=12, num_key_value_heads=4, intermediate_size=96), 0, 6
        )
