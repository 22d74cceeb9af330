"""Builders shared by the layout tests (contracts of the WIRE examples, small arenas)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.copies import Copies
from tspd_core.layout.recipe import ArenaSpec, AttentionKind, PageLayout
from tspd_core.layout.views import field_view

WIRE = Path("/work/shared/WIRE.md")

#: WIRE §4.1's canonical contract, verbatim (1703 bytes).
WIRE_EXAMPLE = (
    b'{"plan":{"prefix_granularity":4,"lcm_block_bytes":512,"num_lcm_blocks":3,"groups":'
    b'[{"group_id":"full_attention","cache_blocks_per_lcm_block":1,"page_count":4}],"planes":'
    b'[{"plane_id":"unit.0.k","bytes_per_lcm_block":128,"arena_offset_bytes":0},'
    b'{"plane_id":"unit.0.v","bytes_per_lcm_block":128,"arena_offset_bytes":512},'
    b'{"plane_id":"unit.1.k","bytes_per_lcm_block":128,"arena_offset_bytes":1024},'
    b'{"plane_id":"unit.1.v","bytes_per_lcm_block":128,"arena_offset_bytes":1536}],"fields":'
    b'[{"group_id":"full_attention","field_id":"layer.0.k","plane_id":"unit.0.k","shape":'
    b'[4,2,8],"dtype":"bfloat16","field_offset_bytes":0,"page_stride_bytes":128},'
    b'{"group_id":"full_attention","field_id":"layer.0.v","plane_id":"unit.0.v","shape":'
    b'[4,2,8],"dtype":"bfloat16","field_offset_bytes":0,"page_stride_bytes":128},'
    b'{"group_id":"full_attention","field_id":"layer.1.k","plane_id":"unit.1.k","shape":'
    b'[4,2,8],"dtype":"bfloat16","field_offset_bytes":0,"page_stride_bytes":128},'
    b'{"group_id":"full_attention","field_id":"layer.1.v","plane_id":"unit.1.v","shape":'
    b'[4,2,8],"dtype":"bfloat16","field_offset_bytes":0,"page_stride_bytes":128}]},'
    b'"group_specs":[{"group_id":"full_attention","retention":"full_history","rows_per_page":4,'
    b'"entry_stride_tokens":1,"sliding_window_tokens":null,"family":"history",'
    b'"transfer_policy":"full_suffix","checkpoint_granularity":null}],"transfer_schema":'
    b'{"fields":[{"field_id":"layer.0.k","partition":{"axis":1,"global_extent":4,'
    b'"global_parts":[]}},{"field_id":"layer.0.v","partition":{"axis":1,"global_extent":4,'
    b'"global_parts":[]}},{"field_id":"layer.1.k","partition":{"axis":1,"global_extent":4,'
    b'"global_parts":[]}},{"field_id":"layer.1.v","partition":{"axis":1,"global_extent":4,'
    b'"global_parts":[]}}]}}'
)


def wire_spec(tp_size: int = 2, tp_rank: int = 0, num_pages: int = 3) -> ArenaSpec:
    """The arena of WIRE §4.1: 2 layers, 4 KV heads, head dim 8, 4-token pages, bf16, NHD."""
    return ArenaSpec(
        layers=2,
        attention=AttentionKind.MHA,
        kv_heads=4,
        head_dim=8,
        dtype="bfloat16",
        page_size=4,
        tp_size=tp_size,
        tp_rank=tp_rank,
        page_layout=PageLayout.NHD,
        num_pages=num_pages,
    )


def example_obj() -> dict[str, Any]:
    """A fresh, mutable parse of the WIRE example (for building bad variants)."""
    value: dict[str, Any] = json.loads(WIRE_EXAMPLE)
    return value


def dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ---- identity-tagged arenas ------------------------------------------------------------------


def global_index_map(contract: CacheContract, field_id: str, tp: int, rank: int) -> np.ndarray:
    """Local index → global index along the field's partition axis, for ``rank`` of ``tp``.

    Written from WIRE §6.2 independently of the planner: S = X / x shards, R = T / S ranks per
    shard, shard = rank // R; part i's local slice maps to O_i + shard · x_i onward.
    """
    f = contract.field(field_id)
    part = contract.partition(field_id)
    assert part is not None
    local = f.shape[part.axis]
    shards = part.global_extent // local
    shard = rank // (tp // shards)
    out = []
    origin = 0
    for extent in part.parts:
        width = extent // shards
        out.extend(range(origin + shard * width, origin + (shard + 1) * width))
        origin += extent
    assert len(out) == local
    return np.array(out, dtype=np.int64)


def identity_codes(
    contract: CacheContract, field_id: str, tp: int, rank: int, tag: int
) -> np.ndarray:
    """Codes of one page of ``field_id`` as seen by ``rank``: ``tag · |global page| + flat
    global index + 1``, where the global index spans (token or head, head or token, dim)."""
    size, flat = _flat_global_index(contract, field_id, tp, rank)
    return tag * size + flat + 1


@functools.lru_cache(maxsize=4096)
def _flat_global_index(
    contract: CacheContract, field_id: str, tp: int, rank: int
) -> tuple[int, np.ndarray]:
    f = contract.field(field_id)
    gshape = contract.global_shape(field_id)
    idx = list(np.indices(f.shape))
    part = contract.partition(field_id)
    if part is not None:
        idx[part.axis] = global_index_map(contract, field_id, tp, rank)[idx[part.axis]]
    return int(np.prod(gshape)), np.ravel_multi_index(tuple(idx), gshape)


def tag_pages(
    arena: np.ndarray,
    contract: CacheContract,
    tp: int,
    rank: int,
    tables: dict[str, np.ndarray],
    slots: dict[str, range],
) -> None:
    """Write identity codes into ``slots`` of every group (page = tables[group][slot]).

    The tag of (field, slot) is ``field index · 1000 + slot``: every element then encodes
    layer, field, token position (slot · G + row), global head and dim.
    """
    for fi, f in enumerate(sorted(contract.plan.fields, key=lambda f: f.field_id)):
        view = field_view(arena, contract, f.field_id)
        for slot in slots[f.group_id]:
            page = tables[f.group_id][slot]
            view[page] = identity_codes(contract, f.field_id, tp, rank, fi * 1000 + slot)


def apply_copies(copies: Copies, src_arena: np.ndarray, dst_arena: np.ndarray) -> None:
    """A plain memcpy executor that refuses out-of-bounds descriptors."""
    assert (copies.length > 0).all()
    for s, d, n in zip(
        copies.src.tolist(), copies.dst.tolist(), copies.length.tolist(), strict=True
    ):
        assert s >= 0, f"source offset {s} is negative"
        assert s + n <= src_arena.size, f"source [{s}, {s + n}) out of bounds"
        assert d >= 0, f"destination offset {d} is negative"
        assert d + n <= dst_arena.size, f"destination [{d}, {d + n}) out of bounds"
        dst_arena[d : d + n] = src_arena[s : s + n]
