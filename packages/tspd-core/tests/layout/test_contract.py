"""Contracts: wire.md §4.1 byte for byte, geometry, canonical JSON round trips."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_testkit import WIRE_EXAMPLE, dump, example_obj, wire_spec

from tspd_core.layout.codec import canonical_contract, encode_contract, parse_contract
from tspd_core.layout.compat import check_compatible
from tspd_core.layout.contract import Family, Retention, TransferPolicy
from tspd_core.layout.errors import ContractError
from tspd_core.layout.models import deepseek_v3, llama3_8b, llama3_70b
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
    build_contract,
)
from tspd_core.layout.views import field_geometry, field_view


def test_recipe_reproduces_wire_example_byte_for_byte() -> None:
    raw = encode_contract(build_contract(wire_spec()))
    assert len(raw) == 1703
    assert raw == WIRE_EXAMPLE


def test_wire_example_geometry() -> None:
    c = parse_contract(WIRE_EXAMPLE)
    assert c.plan.arena_bytes == 2048
    assert [c.page_offset("layer.0.k", p) for p in range(4)] == [0, 128, 256, 384]
    assert [c.page_offset("layer.1.v", p) for p in range(4)] == [1536, 1664, 1792, 1920]
    assert c.global_shape("layer.0.k") == (4, 4, 8)
    assert [f.field_id for f in c.fields_for_group("full_attention")] == [
        "layer.0.k",
        "layer.0.v",
        "layer.1.k",
        "layer.1.v",
    ]


def test_wire_example_tp1_peer_with_five_parents() -> None:
    d = build_contract(wire_spec(tp_size=1, num_pages=5))
    k0 = d.field("layer.0.k")
    assert k0.shape == (4, 4, 8)
    assert k0.page_stride_bytes == 256
    assert [p.bytes_per_lcm_block for p in d.plan.planes] == [256] * 4
    assert [p.arena_offset_bytes for p in d.plan.planes] == [0, 1536, 3072, 4608]
    assert d.plan.lcm_block_bytes == 1024
    assert d.group("full_attention").page_count == 6
    p = parse_contract(WIRE_EXAMPLE)
    check_compatible(p, d, our_tp=2, their_tp=1)
    check_compatible(d, p, our_tp=1, their_tp=2)


def test_parse_is_canonical_and_idempotent() -> None:
    pretty = json.dumps(json.loads(WIRE_EXAMPLE), indent=2, sort_keys=True).encode()
    assert canonical_contract(pretty) == WIRE_EXAMPLE
    assert canonical_contract(WIRE_EXAMPLE) == WIRE_EXAMPLE


def test_group_spec_defaults_fill_in_and_unknown_outer_keys_are_ignored() -> None:
    obj = example_obj()
    obj["group_specs"][0] = {
        "group_id": "full_attention",
        "retention": "full_history",
        "rows_per_page": 4,
        "entry_stride_tokens": 1,
        "transfer_policy": "full_suffix",
    }
    obj["cache_fields_by_stage"] = [["layer.0.k"]]  # newer peers may add keys up here
    obj["plan"]["extra"] = 1
    obj["transfer_schema"]["fields"][0]["note"] = "x"
    c = parse_contract(dump(obj))
    spec = c.spec("full_attention")
    assert (spec.family, spec.sliding_window_tokens, spec.checkpoint_granularity) == (
        Family.HISTORY,
        None,
        None,
    )
    assert encode_contract(c) == WIRE_EXAMPLE


def test_field_view_writes_land_at_page_addresses() -> None:
    c = parse_contract(WIRE_EXAMPLE)
    arena = np.zeros(c.plan.arena_bytes, dtype=np.uint8)
    view = field_view(arena, c, "layer.1.v")
    assert view.shape == (4, 4, 2, 8)
    assert view.dtype == np.uint16  # bfloat16 bit patterns
    view[2, 1, 0, 3] = 0xABCD
    # page 2 of layer.1.v is at 1792; token 1, head 0, dim 3 → element 1·16 + 3 = 19.
    where = 1792 + 19 * 2
    assert arena[where : where + 2].tolist() == [0xCD, 0xAB]
    assert int(arena.astype(np.int64).sum()) == 0xCD + 0xAB
    geo = field_geometry(c, "layer.1.v")
    assert (geo.page0_offset, geo.page_stride, geo.strides_bytes) == (1536, 128, (128, 32, 16, 2))
    assert geo.extent_bytes == 3 * 128 + 128


def test_field_view_rejects_a_wrong_arena() -> None:
    c = parse_contract(WIRE_EXAMPLE)
    with pytest.raises(ValueError, match="2047 bytes but the contract describes 2048"):
        field_view(np.zeros(2047, np.uint8), c, "layer.0.k")
    with pytest.raises(ValueError, match="1-D C-contiguous uint8"):
        field_view(np.zeros(1024, np.uint16), c, "layer.0.k")
    with pytest.raises(ValueError, match=r"no field 'layer\.9\.k'"):
        field_view(np.zeros(2048, np.uint8), c, "layer.9.k")


specs = st.builds(
    ArenaSpec,
    layers=st.integers(1, 4),
    attention=st.sampled_from(list(AttentionKind)),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([2, 8]),
    dtype=st.sampled_from(["bfloat16", "float32", "float8_e4m3fn", "int64"]),
    page_size=st.sampled_from([1, 4, 16]),
    tp_size=st.sampled_from([1, 2, 4, 8]),
    page_layout=st.sampled_from(list(PageLayout)),
    arrangement=st.sampled_from(list(PlaneArrangement)),
    latent_dim=st.sampled_from([4, 16]),
    rope_dim=st.sampled_from([0, 2]),
    draft_layers=st.integers(0, 2),
    num_pages=st.integers(1, 40),
    page_alignment=st.sampled_from([1, 64]),
)


@settings(max_examples=60, deadline=None)
@given(specs)
def test_recipes_round_trip_through_canonical_json(spec: ArenaSpec) -> None:
    if spec.arrangement == PlaneArrangement.PER_FIELD and spec.page_alignment == 64:
        # Per-field planes keep a field's pages exactly one payload apart (TokenSpeed's
        # rule): a plane alignment the payloads do not fill is refused, never padded.
        loose = build_contract(dataclasses.replace(spec, page_alignment=1)).plan.fields
        if any(f.payload_bytes % math.lcm(64, f.itemsize) for f in loose):
            with pytest.raises(ContractError, match="needs page stride"):
                build_contract(spec)
            return
    c = build_contract(spec)
    raw = encode_contract(c)
    back = parse_contract(raw)
    assert back == c
    assert encode_contract(back) == raw
    assert raw.isascii()
    # Every page of every field lies inside the arena, and fields never share bytes.
    owner = np.full(c.plan.arena_bytes, -1, dtype=np.int64)
    for i, f in enumerate(c.plan.fields):
        geo = field_geometry(c, f.field_id)
        assert geo.aligned
        for page in range(geo.page_count):
            lo = geo.page0_offset + page * geo.page_stride
            span = owner[lo : lo + f.payload_bytes]
            assert span.size == f.payload_bytes
            assert (span == -1).all()
            span[:] = i


def test_hybrid_state_groups_follow_tokenspeed() -> None:
    """Qwen3.5-style: state-0, state-1, state-2, full, twice, plus one MTP draft layer."""
    spec = ArenaSpec(
        layers=8,
        kv_heads=2,
        head_dim=32,
        page_size=16,
        tp_size=2,
        draft_layers=1,
        state=StateSpec(
            layers=(0, 1, 2, 4, 5, 6),
            key_heads=2,
            value_heads=4,
            key_head_dim=16,
            value_head_dim=16,
        ),
        num_pages=6,
    )
    c = build_contract(spec)
    states = ("linear_attention_0", "linear_attention_1", "linear_attention_2")
    assert c.group_ids() == (*states, "full_attention")
    for gid in states:
        assert (c.spec(gid).family, c.spec(gid).transfer_policy) == (
            Family.STATE,
            TransferPolicy.LATEST_SNAPSHOT,
        )
        assert c.spec(gid).checkpoint_granularity == 16
    assert [f.field_id for f in c.fields_for_group("linear_attention_1")] == [
        "layer.1.conv",
        "layer.1.ssm",
        "layer.5.conv",
        "layer.5.ssm",
    ]
    assert [f.field_id for f in c.fields_for_group("full_attention")] == [
        "layer.3.k",
        "layer.3.v",
        "layer.7.k",
        "layer.7.v",
        "layer.8.k",  # the draft layer, merged after the 8 target layers
        "layer.8.v",
    ]
    # ssm is K-last (value heads / TP, value dim, key dim) in fp32; conv is bf16 rows of
    # 2·Kw + Vw = 2·32 + 64 split [32, 32, 64] over TP 2.
    ssm, conv, k = c.field("layer.4.ssm"), c.field("layer.4.conv"), c.field("layer.7.k")
    assert (ssm.shape, ssm.dtype, ssm.plane_id) == ((2, 16, 16), "float32", "unit.1.a")
    assert (conv.shape, conv.dtype, conv.plane_id) == ((64, 3), "bfloat16", "unit.1.b")
    part = c.partition("layer.4.conv")
    assert part is not None
    assert (part.axis, part.global_extent, part.global_parts) == (0, 128, (32, 32, 64))
    # A 2 KiB ssm page shares its plane with two 1 KiB K pages: K packs 2 pages per parent.
    assert (k.shape, k.plane_id, k.page_stride_bytes) == ((16, 1, 32), "unit.1.a", 1024)
    assert {g.group_id: g.cache_blocks_per_lcm_block for g in c.plan.groups} == {
        "full_attention": 2,
        **dict.fromkeys(states, 1),
    }
    assert [g.group_id for g in c.plan.groups] == ["full_attention", *states]
    assert c.group("full_attention").page_count == 1 + 2 * 6
    assert (ssm.page_stride_bytes, conv.page_stride_bytes) == (2048, 2048)
    assert c.plan.lcm_block_bytes == 6 * 2048  # planes unit.{0,1,2}.{a,b}
    assert parse_contract(encode_contract(c)) == c


def test_sliding_layers_share_planes_with_full_ones() -> None:
    """GPT-OSS-style: the n-th sliding and the n-th full layer take turns in plane unit.n."""
    spec = ArenaSpec(
        layers=4,
        kv_heads=2,
        head_dim=4,
        page_size=4,
        tp_size=2,
        sliding_layers=(0, 2),
        sliding_window_tokens=8,
        num_pages=6,
    )
    c = build_contract(spec)
    assert c.group_ids() == ("sliding_attention", "full_attention")
    sliding = c.spec("sliding_attention")
    assert (sliding.retention, sliding.sliding_window_tokens) == (Retention.SLIDING_WINDOW, 8)
    planes = {f.field_id: f.plane_id for f in c.plan.fields}
    assert planes == {
        "layer.0.k": "unit.0.k",
        "layer.0.v": "unit.0.v",
        "layer.1.k": "unit.0.k",
        "layer.1.v": "unit.0.v",
        "layer.2.k": "unit.1.k",
        "layer.2.v": "unit.1.v",
        "layer.3.k": "unit.1.k",
        "layer.3.v": "unit.1.v",
    }
    assert c.plan.lcm_block_bytes == 4 * 4 * 1 * 4 * 2
    assert parse_contract(encode_contract(c)) == c


def test_page_major_places_a_page_of_every_layer_side_by_side() -> None:
    spec = ArenaSpec(
        layers=2,
        kv_heads=2,
        head_dim=4,
        page_size=4,
        dtype="float32",
        arrangement=PlaneArrangement.PAGE_MAJOR,
        num_pages=3,
    )
    c = build_contract(spec)
    assert [p.plane_id for p in c.plan.planes] == ["page.full_attention"]
    payload = 2 * 4 * 4 * 4
    offsets = {f.field_id: f.field_offset_bytes for f in c.plan.fields}
    assert offsets == {
        "layer.0.k": 0,
        "layer.0.v": payload,
        "layer.1.k": 2 * payload,
        "layer.1.v": 3 * payload,
    }
    assert {f.page_stride_bytes for f in c.plan.fields} == {4 * payload}
    assert c.page_offset("layer.1.v", 2) == 2 * 4 * payload + 3 * payload


def test_memory_budget_sets_the_page_count() -> None:
    one = build_contract(wire_spec(num_pages=1)).plan.lcm_block_bytes
    c = build_contract(
        ArenaSpec(**{**_fields(wire_spec()), "num_pages": None, "memory_bytes": 10 * one + 5})
    )
    assert c.plan.num_lcm_blocks == 9
    assert c.plan.arena_bytes == 10 * one


def _fields(spec: ArenaSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in ArenaSpec.__dataclass_fields__}


@pytest.mark.parametrize("tp", range(1, 9))
def test_model_recipes_at_every_tp(tp: int) -> None:
    """Llama-3-8B/70B split 8 KV heads (TP 3, 5, 6, 7 do not divide them); DeepSeek-V3's
    latent is replicated, so every rank holds the same 61 · 64 · 576 · 2 bytes per page."""
    ds = build_contract(deepseek_v3(tp, tp - 1, num_pages=10))
    assert ds.plan.lcm_block_bytes == 61 * 64 * (512 + 64) * 2
    # One latent row per token: kv_lora_rank 512 and rope 64 side by side (TokenSpeed's shape).
    latent = ds.field("layer.60.latent_kv")
    assert (latent.shape, latent.plane_id) == ((64, 1, 576), "slot.60")
    assert [f.suffix for f in ds.plan.fields] == ["latent_kv"] * 61
    assert ds.partition("layer.0.latent_kv") is None
    mtp = build_contract(deepseek_v3(tp, num_pages=10, draft_layers=1))
    assert mtp.field("layer.61.latent_kv").shape == (64, 1, 576)
    for recipe, layers in ((llama3_8b, 32), (llama3_70b, 80)):
        if 8 % tp:
            with pytest.raises(
                ContractError, match=f"8 KV heads cannot be split evenly over TP {tp}"
            ):
                build_contract(recipe(tp, num_pages=10))
            continue
        c = build_contract(recipe(tp, tp - 1, memory_bytes=1 << 30))
        per_page = layers * 2 * 16 * (8 // tp) * 128 * 2
        assert c.plan.lcm_block_bytes == per_page
        assert c.plan.num_lcm_blocks == (1 << 30) // per_page - 1
        assert c.field("layer.0.k").shape == (16, 8 // tp, 128)  # token-major by default


def test_geometry_in_elements_matches_the_byte_view() -> None:
    c = parse_contract(WIRE_EXAMPLE)
    arena = np.arange(c.plan.arena_bytes, dtype=np.int64).astype(np.uint8)
    g = field_geometry(c, "layer.0.v")
    assert g.aligned
    assert (g.element_offset, g.element_strides) == (256, (64, 16, 8, 1))
    typed = arena.view(np.uint16)
    by_elements = np.lib.stride_tricks.as_strided(
        typed[g.element_offset :],
        (g.page_count, *g.shape),
        tuple(s * 2 for s in g.element_strides),
    )
    assert np.array_equal(by_elements, field_view(arena, c, "layer.0.v"))
