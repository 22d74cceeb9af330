"""Contracts and manifests: tspd's builders against TokenSpeed's, byte for byte.

For MHA, GQA (1, 2 and 8 KV heads), MLA, fp8 and a Qwen3.5 GDN hybrid at TP 1/2/4/8 both
recipes give the same canonical JSON; each side parses and re-serialises the other's to the
same bytes and accepts it as a peer; manifests are the same bytes up to 131,072 tokens; the
packer agrees with TokenSpeed's on generated field sets; and both refuse the same things.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tspd_testing.interop import env as tokenspeed_env

if tokenspeed_env.MISSING:
    pytest.skip(tokenspeed_env.MISSING, allow_module_level=True)
tokenspeed_env.load()

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenspeed.runtime.layers.attention.kv_cache.recipes import plan as ts_plan  # noqa: E402
from tokenspeed.runtime.layers.attention.kv_cache.recipes import spec as ts_spec  # noqa: E402
from tokenspeed.runtime.pd import cache_protocol as ts  # noqa: E402
from tokenspeed.runtime.pd.transfer_plan import CacheTransferPlanner  # noqa: E402

from tspd_core.layout import (  # noqa: E402
    ContractError,
    ManifestError,
    RouteError,
    build_contract,
    build_manifest,
    check_compatible,
    encode_contract,
    encode_manifest,
    parse_contract,
    parse_manifest,
    plan_routes,
    validate_manifest,
)
from tspd_core.layout.packing import Declared, pack  # noqa: E402
from tspd_testing.interop.contracts import MODELS, Model, tokenspeed_contract, tspd_spec  # noqa: E402

TPS = (1, 2, 4, 8)
BUDGET = 1 << 31


def _both(m: Model, tp: int) -> tuple[bytes, bytes]:
    theirs = tokenspeed_contract(m, tp, BUDGET).to_wire_bytes()
    ours = encode_contract(build_contract(tspd_spec(m, tp, BUDGET)))
    return theirs, ours


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_both_builders_give_the_same_canonical_json(model: Model, tp: int) -> None:
    theirs, ours = _both(model, tp)
    assert ours == theirs
    # Each side parses the other's and writes it back unchanged.
    assert encode_contract(parse_contract(theirs)) == theirs
    assert ts.CacheTransferContract.from_wire_bytes(ours).to_wire_bytes() == ours


def test_the_three_shapes_the_issue_named() -> None:
    """MLA as one latent row per token, fp8 published as uint8, GDN state groups per position."""
    mla = parse_contract(_both(MODELS[4], 2)[1])
    assert [(f.field_id, f.shape, f.plane_id) for f in mla.plan.fields][:1] == [
        ("layer.0.latent_kv", (64, 1, 576), "slot.0")
    ]
    fp8 = parse_contract(_both(MODELS[5], 1)[1])
    assert {f.dtype for f in fp8.plan.fields} == {"uint8"}
    gdn = parse_contract(_both(MODELS[7], 2)[1])
    assert gdn.group_ids() == (
        "linear_attention_0",
        "linear_attention_1",
        "linear_attention_2",
        "full_attention",
    )


@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_each_side_accepts_the_others_contract_as_a_peer(model: Model) -> None:
    for p_tp, d_tp in itertools.product(TPS, TPS):
        theirs = tokenspeed_contract(model, p_tp, BUDGET)
        ours = build_contract(tspd_spec(model, d_tp, BUDGET))
        ts.validate_cache_peer_layout(theirs, ts.CacheTransferContract.from_wire_bytes(
            encode_contract(ours)
        ))  # fmt: skip
        check_compatible(parse_contract(theirs.to_wire_bytes()), ours, our_tp=p_tp, their_tp=d_tp)


class _Forward:
    """A one-request forward batch as TokenSpeed's manifest builder reads it."""

    def __init__(self, tables: dict[str, np.ndarray]) -> None:
        self.tables = tables

    def block_tables_arrays(self) -> dict[str, np.ndarray]:
        return {g: row[None, :] for g, row in self.tables.items()}


WINDOWS = [(0, 1), (0, 17), (16, 4097), (4096, 4096 + 128), (0, 131_071), (65_536, 131_072)]


@pytest.mark.parametrize("model", [MODELS[0], MODELS[4], MODELS[7]], ids=["gqa", "mla", "gdn"])
def test_manifests_are_the_same_bytes_up_to_131072_tokens(model: Model) -> None:
    contract = build_contract(tspd_spec(model, 2, BUDGET))
    theirs = ts.CacheTransferContract.from_wire_bytes(encode_contract(contract))
    rng = np.random.default_rng(7)
    for prefix, prompt in WINDOWS:
        prefix -= prefix % contract.plan.prefix_granularity
        slots = -(-prompt // model.page)
        tables = {
            g: rng.integers(1, contract.group(g).page_count, slots) for g in contract.group_ids()
        }
        # The ids need not be distinct for TokenSpeed's builder; they must be for ours.
        tables = {g: _distinct(t, contract.group(g).page_count) for g, t in tables.items()}
        ours = build_manifest(contract, tables, prefix, prompt)
        wire = ts.build_cache_block_manifest(
            _Forward(tables), layout=theirs, request_row=0, prefix_len=prefix, prompt_len=prompt
        ).to_wire_bytes()
        assert encode_manifest(ours) == wire
        ts.validate_cache_manifest(
            ts.CachePDBlockManifest.from_wire_bytes(encode_manifest(ours)), layout=theirs, peer="d"
        )
        validate_manifest(parse_manifest(wire), contract)


def _distinct(ids: np.ndarray, page_count: int) -> np.ndarray:
    return (np.arange(ids.size) % (page_count - 1)) + 1 if ids.size < page_count else ids


def test_a_table_for_a_group_the_contract_lacks_is_refused_by_both() -> None:
    contract = build_contract(tspd_spec(MODELS[0], 1, BUDGET))
    theirs = ts.CacheTransferContract.from_wire_bytes(encode_contract(contract))
    tables = {"full_attention": np.arange(1, 3), "linear_attention_0": np.arange(1, 3)}
    with pytest.raises(ts.CacheContractError, match="group IDs disagree"):
        ts.build_cache_block_manifest(
            _Forward(tables), layout=theirs, request_row=0, prefix_len=0, prompt_len=20
        )
    with pytest.raises(ManifestError, match="group IDs disagree with the contract"):
        build_manifest(contract, tables, 0, 20)


def test_8_kv_heads_at_tp_3_is_refused_by_both_for_the_same_reason() -> None:
    model = MODELS[0]  # 8 KV heads: a TP-3 rank would hold 2, which no TP-3 split can be
    theirs = tokenspeed_contract(model, 3, BUDGET)
    reason = "cannot map global extent 8 and local extent 2 to TP=3"
    with pytest.raises(ValueError, match=reason):
        CacheTransferPlanner(
            prefill_tp_size=3, decode_tp_size=3, prefill_layout=theirs, decode_layout=theirs
        )
    ours = parse_contract(theirs.to_wire_bytes())
    with pytest.raises(RouteError, match=reason):
        plan_routes(ours, 3, ours, 3)
    with pytest.raises(ContractError, match=reason):
        build_contract(tspd_spec(model, 3, BUDGET))


# ---- the packer against TokenSpeed's, on generated field sets --------------------------------

_DTYPES = ["uint8", "bfloat16", "float32"]


@st.composite
def _field_sets(draw: st.DrawFn) -> tuple[list[Declared], int, float, bool]:
    groups = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True))
    fields = []
    for n in range(draw(st.integers(len(groups), 7))):
        gid = groups[n % len(groups)]
        fields.append(
            Declared(
                gid,
                f"layer.{n}.f",
                f"unit.{draw(st.integers(0, 2))}",
                (draw(st.sampled_from([1, 2, 3, 8, 24, 64])), draw(st.sampled_from([1, 4, 16]))),
                draw(st.sampled_from(_DTYPES)),
                exact=draw(st.booleans()),
            )
        )
    alignment = draw(st.sampled_from([1, 2, 256]))
    return fields, alignment, draw(st.sampled_from([0.25, 1.0, 4.0])), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(_field_sets())
def test_the_packer_matches_tokenspeeds(case: tuple[list[Declared], int, float, bool]) -> None:
    fields, alignment, padding, pinned = case
    groups = sorted({f.group_id for f in fields})
    pins = dict.fromkeys(groups, 1) if pinned else None
    declared = tuple(
        (
            ts_spec.CacheGroupSpec(g, "full_history", rows_per_page=4, entry_stride_tokens=1),
            tuple(
                ts_plan.CacheFieldSpec(f.field_id, f.plane_id, f.shape, f.dtype, f.exact)
                for f in fields
                if f.group_id == g
            ),
        )
        for g in groups
    )
    try:
        layout = ts_plan.pack(
            declared,
            prefix_granularity=4,
            cache_blocks_per_lcm_block=pins,
            alignment=alignment,
            max_padding_fraction=padding,
        )
    except ValueError:
        with pytest.raises(ContractError):
            pack(fields, alignment=alignment, max_padding=padding, pinned=pins)
        return
    ours = pack(fields, alignment=alignment, max_padding=padding, pinned=pins)
    assert ours.lcm_block_bytes == layout.lcm_block_bytes
    assert ours.packing == dict(layout.group_packing)
    assert ours.plane_bytes == dict(layout.plane_bytes)
    assert {f.field_id: (f.field_offset_bytes, f.page_stride_bytes) for f in layout.fields} == {
        f.field_id: (ours.offsets[f.field_id], ours.strides[f.field_id]) for f in fields
    }
