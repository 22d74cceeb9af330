"""Builders shared by the layout tests (contracts of the WIRE examples, small arenas)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tspd_core.layout.recipe import ArenaSpec, AttentionKind, PageLayout

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
