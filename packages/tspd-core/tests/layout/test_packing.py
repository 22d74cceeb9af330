"""Packing fields into one parent: ties between groups sharing a plane, flexible groups,
alignment, and the refusals (TokenSpeed's rules; tests/interop compares with its planner)."""

from __future__ import annotations

import pytest

from tspd_core.layout.errors import ContractError
from tspd_core.layout.packing import Declared, pack

KIB = 1024


def test_hybrid_plane_ties_the_attention_packing_to_the_state_page() -> None:
    """Qwen3.5 at TP 1: a 2 MiB ssm page shares plane a with 128 KiB K pages, so one parent
    holds 16 attention pages per state page; conv (any stride) rides in plane b."""
    fields = [
        Declared("full_attention", "layer.3.k", "unit.0.a", (128, 2, 256), "bfloat16"),
        Declared("full_attention", "layer.3.v", "unit.0.b", (128, 2, 256), "bfloat16"),
        Declared("linear_attention_0", "layer.0.ssm", "unit.0.a", (32, 128, 128), "float32"),
        Declared(
            "linear_attention_0", "layer.0.conv", "unit.0.b", (8192, 3), "bfloat16", exact=False
        ),
    ]
    packed = pack(fields, alignment=256, max_padding=1.0)
    assert packed.packing == {"full_attention": 16, "linear_attention_0": 1}
    assert packed.plane_bytes == {"unit.0.a": 2048 * KIB, "unit.0.b": 2048 * KIB}
    assert packed.lcm_block_bytes == 4096 * KIB
    assert packed.strides == {
        "layer.3.k": 128 * KIB,
        "layer.3.v": 128 * KIB,
        "layer.0.ssm": 2048 * KIB,
        "layer.0.conv": 2048 * KIB,
    }
    assert set(packed.offsets.values()) == {0}


def test_contradicting_ties_fall_back_and_the_stride_check_refuses() -> None:
    # Plane p asks K_A·100 = K_B·200, plane q asks K_A·100 = K_B·100: no solution.
    fields = [
        Declared("A", "layer.0.x", "p", (100,), "uint8"),
        Declared("A", "layer.0.y", "q", (100,), "uint8"),
        Declared("B", "layer.1.x", "p", (200,), "uint8"),
        Declared("B", "layer.1.y", "q", (100,), "uint8"),
    ]
    with pytest.raises(
        ContractError,
        match=r"field layer\.0\.x needs page stride 100 .* plane p gives its group 200",
    ):
        pack(fields, alignment=1, max_padding=1.0)


def test_a_group_without_exact_fields_fills_what_the_others_fixed() -> None:
    """B's 100-byte pages fit 10 times in A's 1024-byte plane, but 1024 divides by 8 only."""
    fields = [
        Declared("A", "layer.0.k", "p", (1024,), "uint8"),
        Declared("B", "layer.1.conv", "p", (100,), "uint8", exact=False),
    ]
    packed = pack(fields, alignment=1, max_padding=1.0)
    assert packed.packing == {"A": 1, "B": 8}
    assert packed.plane_bytes == {"p": 1024}
    assert packed.strides == {"layer.0.k": 1024, "layer.1.conv": 128}


def test_padding_over_the_limit_is_refused() -> None:
    # A: 100 bytes, B: 30 bytes in separate planes; K_B = 100 // 30 = 3, parent 100 + 90 -> 192.
    fields = [
        Declared("A", "layer.0.k", "p", (100,), "uint8"),
        Declared("B", "layer.1.k", "q", (30,), "uint8"),
    ]
    assert pack(fields, alignment=1, max_padding=1.2).lcm_block_bytes == 192
    with pytest.raises(
        ContractError,
        match=r"group A: a page of 100 bytes takes a 192-byte slot .* padding 0\.920000 of it, "
        r"over the limit 0\.500000",
    ):
        pack(fields, alignment=1, max_padding=0.5)


def test_fields_of_a_group_sit_side_by_side_at_element_boundaries() -> None:
    fields = [
        Declared("A", "layer.0.b", "p", (2,), "float32", exact=False),
        Declared("A", "layer.0.a", "p", (3,), "uint8", exact=False),
    ]
    packed = pack(fields, alignment=1, max_padding=1.0, pinned={"A": 1})
    # Sorted by field id: a (3 bytes) at 0, b (float32) at the next multiple of 4.
    assert packed.offsets == {"layer.0.a": 0, "layer.0.b": 4}
    assert packed.plane_bytes == {"p": 12}
    assert packed.strides == {"layer.0.a": 12, "layer.0.b": 12}


def test_pinned_packing_and_alignment() -> None:
    fields = [
        Declared("A", "layer.0.k", "p", (64,), "uint8"),
        Declared("B", "layer.1.k", "p", (64,), "uint8"),
    ]
    assert pack(fields, alignment=64, max_padding=1.0, pinned={"A": 1, "B": 1}).plane_bytes == {
        "p": 64
    }
    with pytest.raises(ContractError, match=r"layer\.0\.k needs page stride 64 .* gives its "):
        pack(fields, alignment=128, max_padding=1.0, pinned={"A": 1, "B": 1})
