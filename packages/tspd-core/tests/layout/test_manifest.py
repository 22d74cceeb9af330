"""Block manifests: wire.md §5 slot rules and example, JSON round trips, every rejection."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_testkit import WIRE_EXAMPLE, wire_spec

from tspd_core.layout.codec import (
    MAX_MANIFEST_BYTES,
    encode_manifest,
    parse_contract,
    parse_manifest,
)
from tspd_core.layout.contract import CacheContract, Family, GroupSpec, Retention, TransferPolicy
from tspd_core.layout.errors import ManifestError
from tspd_core.layout.manifest import (
    BlockManifest,
    GroupBlocks,
    build_manifest,
    chunk_positions,
    slot_range,
    validate_manifest,
)
from tspd_core.layout.recipe import StateSpec, build_contract

FULL = GroupSpec("g", Retention.FULL_HISTORY, 4, 1, transfer_policy=TransferPolicy.FULL_SUFFIX)


def test_wire_slot_examples() -> None:
    assert list(slot_range(FULL, 4, 14)) == [1, 2, 3]
    sliding = dataclasses.replace(FULL, retention=Retention.SLIDING_WINDOW, sliding_window_tokens=8)
    assert list(slot_range(sliding, 0, 20)) == [3, 4]
    state = GroupSpec(
        "s",
        Retention.FULL_HISTORY,
        family=Family.STATE,
        transfer_policy=TransferPolicy.LATEST_SNAPSHOT,
        checkpoint_granularity=4,
    )
    assert list(slot_range(state, 0, 14)) == [3]
    with pytest.raises(ManifestError, match="no transfer_policy"):
        slot_range(dataclasses.replace(FULL, transfer_policy=None), 0, 4)


def test_wire_manifest_example_round_trips() -> None:
    raw = (
        b'{"groups":[{"group_id":"full_attention","block_ids":[2,3]}],'
        b'"prefix_len":4,"prompt_len":10}'
    )
    contract = parse_contract(WIRE_EXAMPLE)
    manifest = parse_manifest(raw)
    validate_manifest(manifest, contract)
    assert manifest.block_ids("full_attention").tolist() == [2, 3]
    assert encode_manifest(manifest) == raw
    built = build_manifest(contract, {"full_attention": [0, 2, 3, 0]}, 4, 10)
    assert built == manifest


def test_block_ids_are_frozen_copies() -> None:
    ids = np.array([1, 2])
    group = GroupBlocks("g", ids)
    ids[0] = 9
    assert group.block_ids.tolist() == [1, 2]
    with pytest.raises(ValueError, match="read-only"):
        group.block_ids[0] = 3
    with pytest.raises(ManifestError, match="1-D integer array"):
        GroupBlocks("g", np.array([1.5]))


C = parse_contract(WIRE_EXAMPLE)


@pytest.mark.parametrize(
    ("groups", "prefix", "prompt", "message"),
    [
        ([("full_attention", [1, 2])], 8, 8, "prefix_len 8 must be < prompt_len 8"),
        ([("full_attention", [1, 2])], 2, 8, "not a multiple of the prefix granularity 4"),
        ([("full_attention", [1, 2])], -4, 8, "prefix_len: expected an integer ≥ 0"),
        ([], 0, 8, r"manifest groups \[\] must be \['full_attention'\]"),
        ([("x", [1, 2])], 0, 8, r"must be \['full_attention'\]"),
        ([("full_attention", [1])], 0, 8, r"has 1 block ids but its policy moves 2 slots \(0..1\)"),
        ([("full_attention", [1, 0])], 0, 8, "block id 0 at position 1 is the null page"),
        ([("full_attention", [4, 1])], 0, 8, "block id 4 at position 0 is outside 1..3"),
        ([("full_attention", [2, 2])], 0, 8, "block id 2 appears at positions 0 and 1"),
    ],
)
def test_invalid_manifests(
    groups: list[tuple[str, list[int]]], prefix: int, prompt: int, message: str
) -> None:
    manifest = BlockManifest(tuple(GroupBlocks(g, ids) for g, ids in groups), prefix, prompt)
    with pytest.raises(ManifestError, match=message):
        validate_manifest(manifest, C)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "must be 1..2097152 bytes, got 0"),
        (b"x" * (MAX_MANIFEST_BYTES + 1), "got 2097153"),
        (b"[]", "must be a JSON object"),
        (b"{", "not valid JSON"),
        (b'{"groups":[],"prefix_len":0}', "missing key 'prompt_len'"),
        (b'{"groups":{},"prefix_len":0,"prompt_len":4}', "groups: expected a JSON array"),
        (b'{"groups":[1],"prefix_len":0,"prompt_len":4}', "with group_id and block_ids"),
        (
            b'{"groups":[{"group_id":1,"block_ids":[]}],"prefix_len":0,"prompt_len":4}',
            "group_id: expected a string",
        ),
        (
            b'{"groups":[{"group_id":"g","block_ids":[1,true]}],"prefix_len":0,"prompt_len":4}',
            "array of integers",
        ),
        (
            b'{"groups":[{"group_id":"g","block_ids":[1.0]}],"prefix_len":0,"prompt_len":4}',
            "array of integers",
        ),
        (
            b'{"groups":[{"group_id":"g","block_ids":[-1]}],"prefix_len":0,"prompt_len":4}',
            "ids must lie in",
        ),
        (b'{"groups":[],"prefix_len":true,"prompt_len":4}', "prefix_len: expected an integer"),
        (b'{"groups":[],"prefix_len":0,"prompt_len":"4"}', "prompt_len: expected an integer"),
    ],
)
def test_malformed_manifest_json(raw: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_manifest(raw)


def test_build_manifest_rejections() -> None:
    disagree = r"block-table group IDs disagree with the contract: missing "
    with pytest.raises(ManifestError, match=disagree + r"\['full_attention'\], extra \[\]"):
        build_manifest(C, {}, 0, 8)
    # A table for a group the contract lacks is a scheduler/arena mismatch, never ignored.
    extra = {"full_attention": [1, 2], "linear_attention_0": [3, 4]}
    with pytest.raises(ManifestError, match=disagree + r"\[\], extra \['linear_attention_0'\]"):
        build_manifest(C, extra, 0, 8)
    with pytest.raises(ManifestError, match="has shape \\(1,\\) but slot 1 is needed"):
        build_manifest(C, {"full_attention": [1]}, 0, 8)
    with pytest.raises(ManifestError, match="block id 0 at position 0 is the null page"):
        build_manifest(C, {"full_attention": [0, 1]}, 0, 8)


def test_encode_refuses_oversized_manifest() -> None:
    ids = np.arange(1, 300_000, dtype=np.int64) + 10**9
    with pytest.raises(ManifestError, match="exceeds the wire limit of 2097152"):
        encode_manifest(BlockManifest((GroupBlocks("g", ids),), 0, 1))


def _hybrid() -> CacheContract:
    spec = dataclasses.replace(
        wire_spec(tp_size=1, num_pages=40),
        layers=3,
        sliding_layers=(1,),
        sliding_window_tokens=6,
        state=StateSpec(
            layers=(2,), key_heads=1, value_heads=1, key_head_dim=4, value_head_dim=4, conv_width=1
        ),
        page_alignment=1,
    )
    return build_contract(spec)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_build_then_json_round_trip(data: st.DataObject) -> None:
    contract = _hybrid()
    prompt = data.draw(st.integers(1, 60))
    prefix = data.draw(st.integers(0, (prompt - 1) // 4)) * 4
    tables = {gid: data.draw(st.permutations(range(1, 41))) for gid in contract.group_ids()}
    manifest = build_manifest(contract, tables, prefix, prompt)
    back = parse_manifest(encode_manifest(manifest))
    assert back == manifest
    validate_manifest(back, contract)
    full = manifest.block_ids("full_attention").tolist()
    assert full == tables["full_attention"][prefix // 4 : -(-prompt // 4)]
    sliding_start = max(prefix // 4, max(0, prompt - 6 + 1) // 4)
    assert (
        manifest.block_ids("sliding_attention").tolist()
        == (tables["sliding_attention"][sliding_start : -(-prompt // 4)])
    )
    assert manifest.block_ids("linear_attention_0").tolist() == [
        tables["linear_attention_0"][(prompt - 1) // 4]
    ]


def test_chunk_positions_follow_wire_section_7() -> None:
    contract = _hybrid()
    manifest = build_manifest(
        contract,
        {
            g: list(range(1, 41))
            for g in (
                "full_attention",
                "sliding_attention",
                "linear_attention_0",
            )
        },
        4,
        22,
    )
    # full: slots 1..5 (5 pages); sliding (window 6): slots 4..5 (2 pages); state: slot 5.
    assert manifest.block_ids("full_attention").size == 5
    assert manifest.block_ids("sliding_attention").size == 2
    chunks = [
        chunk_positions(contract, manifest, 4, 10, first=True),
        chunk_positions(contract, manifest, 10, 17, first=False),
        chunk_positions(contract, manifest, 17, 22, first=False),
    ]
    assert chunks == [
        {"full_attention": (0, 1), "sliding_attention": (0, 0), "linear_attention_0": (0, 0)},
        {"full_attention": (1, 3), "sliding_attention": (0, 0), "linear_attention_0": (0, 0)},
        {"full_attention": (3, 5), "sliding_attention": (0, 2), "linear_attention_0": (0, 1)},
    ]
    # A first chunk starting past the prefix is lowered to it (P's cached blocks go too).
    assert chunk_positions(contract, manifest, 8, 22, first=True)["full_attention"] == (0, 5)
    with pytest.raises(ManifestError, match="must satisfy 0 ≤ start < end ≤ prompt_len 22"):
        chunk_positions(contract, manifest, 5, 23, first=False)
