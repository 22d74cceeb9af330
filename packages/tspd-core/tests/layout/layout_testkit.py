"""Builders shared by the layout tests (contracts of the wire.md §4.1 examples, small arenas)."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tspd_core.layout.contract import CacheContract
from tspd_core.layout.copies import Copies
from tspd_core.layout.manifest import BlockManifest, build_manifest
from tspd_core.layout.recipe import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
    build_contract,
)
from tspd_core.layout.routes import FieldRoute, RoutePlan, plan_routes
from tspd_core.layout.views import field_view

#: wire.md §4.1's canonical contract, verbatim (1703 bytes).
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
    """The arena of wire.md §4.1: 2 layers, 4 KV heads, head dim 8, 4-token pages, bf16, NHD."""
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
    """A fresh, mutable parse of the wire.md §4.1 example (for building bad variants)."""
    value: dict[str, Any] = json.loads(WIRE_EXAMPLE)
    return value


def dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# ---- identity-tagged arenas ------------------------------------------------------------------


def global_index_map(contract: CacheContract, field_id: str, tp: int, rank: int) -> np.ndarray:
    """Local index → global index along the field's partition axis, for ``rank`` of ``tp``.

    Written from wire.md §6.2 independently of the planner: S = X / x shards, R = T / S ranks per
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


Desc = tuple[int, int, int, tuple[int, int]]  # src, dst, length, (P stride, D stride)


def naive_copies(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    src: BlockManifest,
    dst: BlockManifest,
    layers: tuple[int, int] | None = None,
    positions: dict[str, tuple[int, int]] | None = None,
) -> tuple[list[tuple[int, int, int]], int]:
    """The straightforward per-page loop (wire.md §6.5) plus a Python merge: the test oracle.

    Returns the coalesced (src, dst, length) list and the raw descriptor count.
    """
    link = route.link(p_rank, d_rank)
    if link is None:
        return [], 0
    out: list[tuple[int, int, int]] = []
    raw = 0
    for gid in route.p_contract.group_ids():
        s_ids, d_ids = src.block_ids(gid).tolist(), dst.block_ids(gid).tolist()
        lo, hi = positions[gid] if positions else (0, len(s_ids))
        descs: list[Desc] = []
        for froute in (f for f in link.fields if f.group_id == gid):
            layer = int(froute.field_id.split(".")[1])
            if layers is None or layers[0] <= layer < layers[1]:
                descs += _field_descs(route, froute, s_ids[lo:hi], d_ids[lo:hi])
        raw += len(descs)
        out += _merge(sorted(descs))
    return out, raw


def _field_descs(
    route: RoutePlan, froute: FieldRoute, s_ids: list[int], d_ids: list[int]
) -> list[Desc]:
    pc, dc, fid = route.p_contract, route.d_contract, froute.field_id
    cls = (pc.field(fid).page_stride_bytes, dc.field(fid).page_stride_bytes)
    descs = []
    for s_page, d_page in zip(s_ids, d_ids, strict=True):
        for frag in froute.fragments:
            for row in range(frag.rows):
                s = pc.page_offset(fid, s_page) + frag.src_offset + row * frag.src_stride
                d = dc.page_offset(fid, d_page) + frag.dst_offset + row * frag.dst_stride
                descs.append((s, d, frag.nbytes, cls))
    return descs


def _merge(descs: list[Desc]) -> list[tuple[int, int, int]]:
    merged: list[Desc] = []
    for s, d, n, cls in descs:
        if merged:
            ms, md, mn, mc = merged[-1]
            if mc == cls and ms + mn == s and md + mn == d:
                merged[-1] = (ms, md, mn + n, mc)
                continue
        merged.append((s, d, n, cls))
    return [(s, d, n) for s, d, n, _ in merged]


# ---- random cases for property tests ---------------------------------------------------------


def _ids(data: st.DataObject, n: int, first: int, last: int) -> np.ndarray:
    """n distinct ids in first..last: contiguous, shuffled, or contiguous runs in random order."""
    mode = data.draw(st.sampled_from(["contiguous", "shuffled", "runs"]))
    if mode == "contiguous":
        start = data.draw(st.integers(first, last - n + 1))
        return np.arange(start, start + n)
    perm = np.array(data.draw(st.permutations(range(first, last + 1))))[:n]
    if mode == "runs":
        cut = data.draw(st.integers(0, n))
        perm[:cut] = np.sort(perm[:cut])
    return perm


def parent_spans(contract: CacheContract, n: int, order: list[str]) -> dict[str, range]:
    """Page ids per group whose parents no other group uses, at least ``n`` per group.

    Groups sharing a plane take turns in its bytes: page p of a group packing K pages per
    parent lies in parent ⌈p / K⌉, and two groups must never hold one parent at once (a
    scheduler hands out parents). Groups get consecutive parents in ``order``.
    """
    out, parent = {}, 1
    for gid in order:
        k = contract.group(gid).cache_blocks_per_lcm_block
        count = -(-n // k)
        out[gid] = range((parent - 1) * k + 1, (parent - 1 + count) * k + 1)
        parent += count
    assert parent - 1 <= contract.plan.num_lcm_blocks, "too few parents for these tables"
    return out


def _tables(data: st.DataObject, contract: CacheContract, n: int) -> dict[str, np.ndarray]:
    order = data.draw(st.permutations(list(contract.group_ids())))
    spans = parent_spans(contract, n, order)
    return {gid: _ids(data, n, span.start, span.stop - 1) for gid, span in spans.items()}


def _draw_spec(data: st.DataObject, kind: str, heads: int) -> ArenaSpec:
    spec = ArenaSpec(
        layers=data.draw(st.integers(1, 3)),
        attention=AttentionKind.MLA if kind == "mla" else AttentionKind.GQA,
        kv_heads=heads,
        head_dim=data.draw(st.sampled_from([2, 1, 3])),
        latent_dim=3,
        rope_dim=data.draw(st.sampled_from([0, 1])),
        dtype=data.draw(st.sampled_from(["bfloat16", "int8", "float32"])),
        page_size=data.draw(st.sampled_from([4, 2, 1])),
        page_layout=data.draw(st.sampled_from(list(PageLayout))),
        arrangement=data.draw(st.sampled_from(list(PlaneArrangement))),
        num_pages=24,
    )
    if kind != "hybrid":
        return spec
    # Each group holds two layers, and the state pages outweigh the conv windows, as in
    # Qwen3.5: TokenSpeed's packing (which the recipe follows) ties the groups sharing a plane.
    state = StateSpec(
        layers=(0, 3),
        key_heads=heads,
        value_heads=heads,
        key_head_dim=4,
        value_head_dim=4,
        conv_width=1,
        conv_dtype="int8",
        ssm_dtype="int8",
    )
    return dataclasses.replace(
        spec,
        layers=6,
        sliding_layers=(1, 4),
        sliding_window_tokens=5,
        state=state,
        page_alignment=1,
        num_pages=48,  # three groups' parents side by side (see parent_spans)
    )


def draw_case(data: st.DataObject) -> tuple[RoutePlan, BlockManifest, BlockManifest]:
    """A random compatible (P, D) pair, route and manifests (P ids, D ids)."""
    kind = data.draw(st.sampled_from(["gqa", "mla", "hybrid"]))
    heads = data.draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    spec = _draw_spec(data, kind, heads)
    fits = [t for t in range(1, 9) if heads % t == 0 or (kind != "hybrid" and t % heads == 0)]
    p, d = data.draw(st.sampled_from(fits)), data.draw(st.sampled_from(fits))
    pc = build_contract(dataclasses.replace(spec, tp_size=p))
    dc = build_contract(dataclasses.replace(spec, tp_size=d, num_pages=spec.num_pages + 6))
    g = spec.page_size
    prompt = data.draw(st.integers(1, 16 * g))
    prefix = data.draw(st.integers(0, (prompt - 1) // g)) * g
    n = -(-prompt // g)
    src = build_manifest(pc, _tables(data, pc, n), prefix, prompt)
    dst = build_manifest(dc, _tables(data, dc, n), prefix, prompt)
    return plan_routes(pc, p, dc, d), src, dst
