"""Every rejection path of contract parsing, validation, recipes and peer compatibility."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from layout_testkit import WIRE_EXAMPLE, dump, example_obj, wire_spec

from tspd_core.errors import TspdError
from tspd_core.layout.codec import MAX_CONTRACT_BYTES, encode_contract, parse_contract
from tspd_core.layout.compat import check_compatible
from tspd_core.layout.errors import ContractError, ContractMismatch, LayoutError
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    StateSpec,
    build_contract,
)

Edit = Callable[[dict[str, Any]], object]


def _set(path: str, value: object) -> Edit:
    def edit(obj: dict[str, Any]) -> None:
        *head, last = path.split("/")
        target: Any = obj
        for key in head:
            target = target[int(key)] if key.isdigit() else target[key]
        if value is _DELETE:
            del target[last]
        elif last.isdigit():
            target[int(last)] = value
        else:
            target[last] = value

    return edit


_DELETE = object()

BAD_EDITS: list[tuple[str, Edit, str]] = [
    ("top plan missing", _set("plan", _DELETE), "contract: missing key 'plan'"),
    ("no schema", _set("transfer_schema", _DELETE), "missing key 'transfer_schema'"),
    ("plan not object", _set("plan", []), "plan: expected a JSON object"),
    ("groups not list", _set("plan/groups", {}), "plan.groups: expected a JSON array"),
    ("bool int", _set("plan/prefix_granularity", True), "plan.prefix_granularity: expected an"),
    ("float int", _set("plan/num_lcm_blocks", 3.0), "plan.num_lcm_blocks: expected an integer"),
    ("zero blocks", _set("plan/num_lcm_blocks", 0), "plan.num_lcm_blocks: must be ≥ 1"),
    ("no groups", _set("plan/groups", []), "at least one group"),
    ("unknown group key", _set("plan/groups/0/x", 1), "plan.groups[0]: unknown keys ['x']"),
    ("missing plane key", _set("plan/planes/1/arena_offset_bytes", _DELETE), "missing keys"),
    ("unknown field key", _set("plan/fields/2/element_size", 2), "unknown keys ['element_size']"),
    ("unknown spec key", _set("group_specs/0/block_size", 4), "unknown keys ['block_size']"),
    ("spec no retention", _set("group_specs/0/retention", _DELETE), "missing keys ['retention']"),
    ("bad retention", _set("group_specs/0/retention", "forever"), "retention: expected one of"),
    ("page count", _set("plan/groups/0/page_count", 5), "page_count: must be 1 + num_lcm_blocks"),
    (
        "dup group",
        lambda o: o["plan"]["groups"].append(dict(o["plan"]["groups"][0])),
        "duplicate id 'full_attention'",
    ),
    ("dup plane id", _set("plan/planes/1/plane_id", "unit.0.k"), "duplicate id 'unit.0.k'"),
    ("plane past arena", _set("plan/planes/3/arena_offset_bytes", 1537), "past the arena"),
    ("unknown plane", _set("plan/fields/0/plane_id", "nope"), "unknown plane 'nope'"),
    ("unknown group", _set("plan/fields/0/group_id", "nope"), "unknown group 'nope'"),
    ("bad field id", _set("plan/fields/0/field_id", "k0"), "layer.<L>.<suffix>"),
    ("bad dtype", _set("plan/fields/0/dtype", "bf16"), "unknown dtype 'bf16'"),
    ("empty shape", _set("plan/fields/0/shape", []), "shape: must be a non-empty"),
    ("zero extent", _set("plan/fields/0/shape", [4, 0, 8]), "shape[1]: must be ≥ 1"),
    ("shape not list", _set("plan/fields/0/shape", 4), "shape: expected a JSON array"),
    ("small stride", _set("plan/fields/0/page_stride_bytes", 64), "pages would overlap"),
    ("field out of plane", _set("plan/fields/0/field_offset_bytes", 8), "pages span plane"),
    ("dup field", _set("plan/fields/1/field_id", "layer.0.k"), "duplicate id 'layer.0.k'"),
    ("spec names", _set("group_specs/0/group_id", "other"), "missing ['full_attention']"),
    ("geometry", _set("group_specs/0/rows_per_page", None), "declare rows_per_page"),
    (
        "checkpoint on history",
        _set("group_specs/0/checkpoint_granularity", 4),
        "checkpoint_granularity excludes",
    ),
    (
        "sliding without window",
        _set("group_specs/0/retention", "sliding_window"),
        "needs sliding_window_tokens",
    ),
    ("policy", _set("group_specs/0/transfer_policy", "latest_snapshot"), "use full_suffix"),
    (
        "schema unknown field",
        _set("transfer_schema/fields/0/field_id", "layer.7.k"),
        "'layer.7.k' is not a field",
    ),
    ("schema dup", _set("transfer_schema/fields/1/field_id", "layer.0.k"), "duplicate id"),
    ("axis", _set("transfer_schema/fields/0/partition/axis", 3), "is not an axis of shape"),
    ("extent", _set("transfer_schema/fields/0/partition/global_extent", 5), "multiple of the"),
    ("one part", _set("transfer_schema/fields/0/partition/global_parts", [4]), "0 or 2..16"),
    ("parts sum", _set("transfer_schema/fields/0/partition/global_parts", [2, 4]), "sum 6"),
    (
        "parts shards",
        _set("transfer_schema/fields/0/partition/global_parts", [1, 3]),
        "not divisible by the 2 distinct shards",
    ),
    ("parts type", _set("transfer_schema/fields/0/partition/global_parts", 2), "JSON array"),
    ("no partition", _set("transfer_schema/fields/0/partition", _DELETE), "missing key"),
]


@pytest.mark.parametrize(
    ("edit", "message"), [(e, m) for _, e, m in BAD_EDITS], ids=[n for n, _, _ in BAD_EDITS]
)
def test_bad_contract_is_rejected_with_its_path(edit: Edit, message: str) -> None:
    obj = example_obj()
    edit(obj)
    with pytest.raises(ContractError) as info:
        parse_contract(dump(obj))
    assert message in str(info.value)
    assert isinstance(info.value, TspdError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "must be 1..262144 bytes, got 0"),
        (b" " * (MAX_CONTRACT_BYTES + 1), "got 262145"),
        (b"{nope", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1]", "must be a JSON object, got list"),
    ],
)
def test_malformed_contract_bytes(raw: bytes, message: str) -> None:
    with pytest.raises(ContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_contract(raw)


def test_parse_contract_rejects_non_bytes() -> None:
    with pytest.raises(ContractError, match="expected bytes, got str"):
        parse_contract(WIRE_EXAMPLE.decode())  # type: ignore[arg-type]


def test_encode_refuses_oversized_contract() -> None:
    big = build_contract(ArenaSpec(layers=700, kv_heads=1, head_dim=1, page_size=1, num_pages=1))
    with pytest.raises(ContractError, match="exceeds the wire limit of 262144"):
        encode_contract(big)


BAD_SPECS: list[tuple[dict[str, Any], str]] = [
    ({"layers": 0}, "layers: expected an integer ≥ 1"),
    ({"tp_size": 0}, "tp_size: must be 1..1024"),
    ({"tp_rank": 2}, "tp_rank: must be 0..1"),
    ({"dtype": "fp4"}, "dtype: unknown 'fp4'"),
    ({"num_pages": None}, "exactly one of num_pages and memory_bytes"),
    ({"memory_bytes": 10}, "exactly one of num_pages and memory_bytes"),
    ({"num_pages": None, "memory_bytes": 1000}, "hold no page"),
    ({"kv_heads": 3}, "3 KV heads cannot be split evenly over TP 2"),
    ({"sliding_layers": (1,)}, "sliding_layers need sliding_window_tokens"),
    ({"sliding_layers": (5,), "sliding_window_tokens": 4}, "must be target layers 0..1"),
    ({"attention": AttentionKind.MLA, "latent_dim": 0}, "latent_dim: expected an integer ≥ 1"),
    (
        {
            "state": StateSpec(
                layers=(0,), key_heads=1, value_heads=2, key_head_dim=2, value_head_dim=2
            )
        },
        "must divide by TP 2",
    ),
    (
        {
            "sliding_layers": (0,),
            "sliding_window_tokens": 4,
            "state": StateSpec(
                layers=(0,), key_heads=2, value_heads=2, key_head_dim=2, value_head_dim=2
            ),
        },
        "both sliding-window and state",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_SPECS)
def test_bad_arena_spec(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_contract(dataclasses.replace(wire_spec(), **change))


def _variant(edit: Edit) -> Any:
    obj = example_obj()
    edit(obj)
    return parse_contract(dump(obj))


def _wider_head_dim(obj: dict[str, Any]) -> None:
    """layer.0.k with head dim 16 (its plane grown to fit, the others moved along)."""
    plan = obj["plan"]
    plan["fields"][0].update(shape=[4, 2, 16], page_stride_bytes=256)
    plan["planes"][0]["bytes_per_lcm_block"] = 256
    plan["lcm_block_bytes"] = 640
    for plane, offset in zip(plan["planes"], [0, 1024, 1536, 2048], strict=True):
        plane["arena_offset_bytes"] = offset


def _rename_field(obj: dict[str, Any]) -> None:
    obj["plan"]["fields"][3]["field_id"] = "layer.1.w"
    obj["transfer_schema"]["fields"][3]["field_id"] = "layer.1.w"


MISMATCHES: list[tuple[Edit, str]] = [
    (_set("plan/prefix_granularity", 8), "prefix_granularity: 4 vs 8"),
    (_set("group_specs/0/rows_per_page", 8), "group full_attention rows_per_page: 4 vs 8"),
    (
        _set("group_specs/0/entry_stride_tokens", 2),
        "group full_attention entry_stride_tokens: 1 vs 2",
    ),
    (
        _set("plan/fields/2/dtype", "float16"),
        "group full_attention field layer.1.k dtype: bfloat16 vs float16",
    ),
    (
        _set("transfer_schema/fields/3/partition/global_parts", [2, 2]),
        "group full_attention field layer.1.v partition: axis 1 extent 4 parts [] vs "
        "axis 1 extent 4 parts [2, 2]",
    ),
    (
        _wider_head_dim,
        "group full_attention field layer.0.k global shape: [4, 4, 8] vs [4, 4, 16]",
    ),
    (
        _rename_field,
        "group full_attention field ids: 4 fields (only here: ['layer.1.v'])",
    ),
]


@pytest.mark.parametrize(("edit", "message"), MISMATCHES)
def test_mismatch_names_the_property(edit: Edit, message: str) -> None:
    obj = example_obj()
    edit(obj)
    peer = parse_contract(dump(obj))
    with pytest.raises(ContractMismatch) as info:
        check_compatible(parse_contract(WIRE_EXAMPLE), peer)
    assert message in str(info.value)
    assert isinstance(info.value, LayoutError)


def test_replicated_vs_partitioned_and_group_order() -> None:
    peer = _variant(lambda o: o["transfer_schema"]["fields"].pop(0))
    with pytest.raises(
        ContractMismatch,
        match="layer.0.k partition: axis 1 extent 4 parts "
        r"\[\] vs replicated",
    ):
        check_compatible(parse_contract(WIRE_EXAMPLE), peer)
    renamed = _variant(_rename_group)
    with pytest.raises(ContractMismatch, match=r"group order: \['full_attention'\] vs \['g'\]"):
        check_compatible(parse_contract(WIRE_EXAMPLE), renamed)


def _rename_group(obj: dict[str, Any]) -> None:
    obj["plan"]["groups"][0]["group_id"] = "g"
    obj["group_specs"][0]["group_id"] = "g"
    for f in obj["plan"]["fields"]:
        f["group_id"] = "g"


def test_equal_tp_requires_equal_local_shape_and_layouts_must_agree() -> None:
    ours = build_contract(wire_spec(tp_size=2))
    hnd = build_contract(dataclasses.replace(wire_spec(tp_size=2), page_layout=PageLayout.HND))
    # One line says what differs and which flag to start with (TokenSpeed is NHD only).
    order = (
        r"cache contracts differ: group full_attention field layer\.0\.k partition: axis 1 "
        r"extent 4 parts \[\] vs axis 0 extent 4 parts \[\] \(P vs D\); the K/V page orders "
        r"differ \(token-major \(NHD\) vs head-major \(HND\)\): start the tspd node with "
        r"--page-layout nhd \(token-major, the only order TokenSpeed has, and tspd's default\) "
        r"or both with --page-layout hnd$"
    )
    with pytest.raises(ContractMismatch, match=order) as info:
        check_compatible(ours, hnd, our_tp=2, their_tp=2, labels=("P", "D"))
    assert "\n" not in str(info.value)
    # Same global semantics, but a TP-2 shape announced by a peer claiming TP 2 too.
    tp1 = build_contract(wire_spec(tp_size=1))
    check_compatible(ours, tp1, our_tp=2, their_tp=1)
    with pytest.raises(ContractMismatch, match=r"local shape at equal TP: \[4, 2, 8\] vs \[4, 4"):
        check_compatible(ours, tp1, our_tp=2, their_tp=2)
