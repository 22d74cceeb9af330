"""Layouts the bootstrap tests register: wire.md §4.1's example and valid variants of it."""

from __future__ import annotations

from tspd_core.layout import ArenaSpec, AttentionKind, PageLayout, build_contract, encode_contract

# wire.md §4.1: the canonical contract of a 2-layer MHA model at TP 2 (1703 bytes).
WIRE_LAYOUT = (
    '{"plan":{"prefix_granularity":4,"lcm_block_bytes":512,"num_lcm_blocks":3,"groups":[{'
    '"group_id":"full_attention","cache_blocks_per_lcm_block":1,"page_count":4}],"planes"'
    ':[{"plane_id":"unit.0.k","bytes_per_lcm_block":128,"arena_offset_bytes":0},{"plane_i'
    'd":"unit.0.v","bytes_per_lcm_block":128,"arena_offset_bytes":512},{"plane_id":"unit.'
    '1.k","bytes_per_lcm_block":128,"arena_offset_bytes":1024},{"plane_id":"unit.1.v","by'
    'tes_per_lcm_block":128,"arena_offset_bytes":1536}],"fields":[{"group_id":"full_atten'
    'tion","field_id":"layer.0.k","plane_id":"unit.0.k","shape":[4,2,8],"dtype":"bfloat16'
    '","field_offset_bytes":0,"page_stride_bytes":128},{"group_id":"full_attention","fiel'
    'd_id":"layer.0.v","plane_id":"unit.0.v","shape":[4,2,8],"dtype":"bfloat16","field_of'
    'fset_bytes":0,"page_stride_bytes":128},{"group_id":"full_attention","field_id":"laye'
    'r.1.k","plane_id":"unit.1.k","shape":[4,2,8],"dtype":"bfloat16","field_offset_bytes"'
    ':0,"page_stride_bytes":128},{"group_id":"full_attention","field_id":"layer.1.v","pla'
    'ne_id":"unit.1.v","shape":[4,2,8],"dtype":"bfloat16","field_offset_bytes":0,"page_st'
    'ride_bytes":128}]},"group_specs":[{"group_id":"full_attention","retention":"full_his'
    'tory","rows_per_page":4,"entry_stride_tokens":1,"sliding_window_tokens":null,"family'
    '":"history","transfer_policy":"full_suffix","checkpoint_granularity":null}],"transfe'
    'r_schema":{"fields":[{"field_id":"layer.0.k","partition":{"axis":1,"global_extent":4'
    ',"global_parts":[]}},{"field_id":"layer.0.v","partition":{"axis":1,"global_extent":4'
    ',"global_parts":[]}},{"field_id":"layer.1.k","partition":{"axis":1,"global_extent":4'
    ',"global_parts":[]}},{"field_id":"layer.1.v","partition":{"axis":1,"global_extent":4'
    ',"global_parts":[]}}]}}'
)


def wire_layout(num_pages: int) -> str:
    """The wire.md §4.1 contract with ``num_pages`` parents (3: :data:`WIRE_LAYOUT` itself): a
    valid layout of the same model that differs only in capacity (a conflicting one)."""
    spec = ArenaSpec(
        layers=2,
        attention=AttentionKind.MHA,
        kv_heads=4,
        head_dim=8,
        page_size=4,
        tp_size=2,
        page_layout=PageLayout.NHD,
        num_pages=num_pages,
    )
    return encode_contract(build_contract(spec)).decode()
