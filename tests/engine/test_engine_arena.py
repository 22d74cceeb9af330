"""The KV arena: one shared uint8 tensor whose torch views agree with the layout contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tspd_core.layout.views import field_view
from tspd_engine.config import EngineConfig
from tspd_engine.model.config import ModelConfig
from tspd_engine.model.kv_arena import KvArena


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("arrangement", ["per_field", "page_major"])
def test_views_write_where_the_contract_says(layout: str, arrangement: str) -> None:
    cfg = EngineConfig(num_pages=6, page_size=4, page_layout=layout, arrangement=arrangement)
    arena = KvArena.build(cfg.model, cfg, rank=0)
    assert arena.tensor.is_shared()
    assert arena.nbytes == arena.contract.plan.arena_bytes
    k, v = arena.pages(1)
    assert tuple(k.shape) == (7, 2, 4, 32)  # null page + 6, kv heads, P, head dim
    k[3, 1, 2] = torch.arange(32, dtype=torch.float32)
    v[5, 0, 3, 7] = -1.0
    raw = arena.tensor.numpy()
    kf = field_view(raw, arena.contract, "layer.1.k").view(np.float32)
    vf = field_view(raw, arena.contract, "layer.1.v").view(np.float32)
    if layout == "nhd":  # contract shape is (P, heads, D)
        kf, vf = kf.transpose(0, 2, 1, 3), vf.transpose(0, 2, 1, 3)
    assert kf[3, 1, 2].tolist() == list(range(32))
    assert vf[5, 0, 3, 7] == -1.0
    # Exactly the 31 non-zero values of arange and the -1 landed: nothing else moved.
    assert int(np.count_nonzero(raw.view(np.float32))) == 32


def test_copy_and_zero_pages_touch_every_layer() -> None:
    cfg = EngineConfig(model=ModelConfig(num_hidden_layers=3), num_pages=4, page_size=2)
    arena = KvArena.build(cfg.model, cfg, rank=0)
    for layer in range(3):
        k, v = arena.pages(layer)
        k[1], v[1] = layer + 1.0, -(layer + 1.0)
    arena.copy_pages(np.array([1]), np.array([3]))
    for layer in range(3):
        k, v = arena.pages(layer)
        assert torch.equal(k[3], k[1])
        assert torch.equal(v[3], v[1])
    arena.zero_pages(np.array([1, 3]))
    assert int(torch.count_nonzero(arena.tensor)) == 0
    with pytest.raises(ValueError, match="2 sources but 1 destinations"):
        arena.copy_pages(np.array([1, 2]), np.array([3]))


def test_tp_rank_arena_holds_its_kv_heads_only() -> None:
    cfg = EngineConfig(model=ModelConfig(num_key_value_heads=2), tp=2, num_pages=3, page_size=4)
    arena = KvArena.build(cfg.model, cfg, rank=1)
    assert tuple(arena.pages(0)[0].shape) == (4, 1, 4, 32)
    part = arena.contract.partition("layer.0.k")
    assert part is not None
    assert (part.axis, part.global_extent) == (1, 2)  # token-major (NHD) pages by default
