"""vLLM's own KV tensors described as one tspd arena: a cache contract and its uint8 tensor.

vLLM (0.32) places every attention layer's KV cache in one backing allocation and hands the
connector one view per layer, ``[blocks, heads, tokens, content]`` in the dtype of the cache,
where ``content`` is a token's K and V of one head (CPU: a head's K rows of a block, then
its V rows; CUDA backends: K then V of a cell). Which axis is outermost inside a page — heads
(HND, vLLM's ``LBHNC``) or tokens (NHD, ``LBNHC``) — and whether a block holds one layer
(layer-compact) or every layer (block-outermost, ``BLHNC``/``BLNHC``) is the backend's choice;
this module reads it from the views' strides, never from vLLM's configuration, so whatever
order the backend picked is described as it is:

* one field per layer, ``layer.<L>.kv``, the page's bytes as the view shows them: shape
  ``(heads, tokens, content)`` split over KV heads on axis 0 (HND) or ``(tokens, heads,
  content)`` on axis 1 (NHD); an MLA latent (one head) is replicated, not split;
* layer-compact: one plane per layer (``unit.<L>``, its pages back to back);
  block-outermost: one plane ``page.full_attention`` whose page holds every layer's page;
* one group ``full_attention``, one page per parent, page ``p`` = vLLM's block ``p`` (block 0
  is vLLM's null block, as page 0 is tspd's).

The planner (:mod:`tspd_core.layout`) then routes any pair of such contracts, equal TP or not,
and refuses a pair whose page orders differ with the reason. Pure: no vLLM import, any thread.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch

from tspd_core.layout import (
    CacheContract,
    ContractError,
    FieldLayout,
    FieldPartition,
    GroupLayout,
    GroupSpec,
    MemoryPlan,
    Partition,
    PlaneLayout,
    Retention,
    TransferPolicy,
    TransferSchema,
)
from tspd_vllm.errors import LayoutError

GROUP = "full_attention"
#: torch dtypes a KV view may have, by the name a contract gives them.
DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
_LAYER_INDEX = re.compile(r"(\d+)")


class PageOrder(StrEnum):
    """Which axis is outermost inside one layer's page."""

    HND = "hnd"  #: heads, then tokens (vLLM's LBHNC: the CPU backend's only order)
    NHD = "nhd"  #: tokens, then heads (vLLM's LBNHC)


@dataclass(frozen=True, slots=True)
class Geometry:
    """One layer view's page, in bytes."""

    offset: int  #: byte offset of block 0 in the backing allocation
    block_stride: int
    page_bytes: int
    order: PageOrder
    shape: tuple[int, int, int]  #: the page as the contract's field shape
    heads: int
    blocks: int
    tokens: int
    dtype: str


@dataclass(frozen=True, slots=True)
class KvArena:
    """One rank's arena over vLLM's KV allocation (owned by vLLM's worker; this only views it).

    ``tensor`` is a 1-D uint8 view of exactly ``contract.plan.arena_bytes`` bytes starting at
    the allocation's first byte, so sharing it with tspd's transfer worker shares the very
    memory vLLM's attention reads and writes.
    """

    tensor: torch.Tensor
    contract: CacheContract
    order: PageOrder
    layers: tuple[str, ...]  #: vLLM layer names, in the contract's layer order
    num_blocks: int
    block_size: int


def layer_order(names: list[str]) -> list[str]:
    """vLLM's layer names sorted by their layer index (the first integer in the name, e.g.
    ``model.layers.12.self_attn.attn``); a name without one is refused."""
    keyed = []
    for name in names:
        found = _LAYER_INDEX.search(name)
        if found is None:
            raise LayoutError(f"KV layer {name!r} has no layer index in its name")
        keyed.append((int(found.group(1)), name))
    if len({k for k, _ in keyed}) != len(keyed):
        raise LayoutError(f"two KV layers share a layer index: {sorted(names)}")
    return [name for _, name in sorted(keyed)]


def geometry(name: str, view: torch.Tensor) -> Geometry:
    """The page geometry of one layer's ``[blocks, heads, tokens, content]`` view."""
    if view.dim() != 4:
        raise LayoutError(f"KV layer {name!r}: expected a 4-D view, got shape {tuple(view.shape)}")
    if view.dtype not in DTYPES:
        raise LayoutError(f"KV layer {name!r}: dtype {view.dtype} has no contract name")
    blocks, heads, tokens, content = view.shape
    s_block, s_head, s_token, s_elem = view.stride()
    item = view.element_size()
    if s_elem != 1:
        raise LayoutError(f"KV layer {name!r}: a cell's content is not contiguous")
    if (heads == 1 or s_head == tokens * content) and (tokens == 1 or s_token == content):
        order, shape = PageOrder.HND, (heads, tokens, content)
    elif s_token == heads * content and s_head == content:
        order, shape = PageOrder.NHD, (tokens, heads, content)
    else:
        raise LayoutError(
            f"KV layer {name!r}: strides {view.stride()} of shape {tuple(view.shape)} are "
            "neither heads-then-tokens nor tokens-then-heads inside a page"
        )
    page = heads * tokens * content * item
    if s_block * item < page:
        raise LayoutError(f"KV layer {name!r}: block stride {s_block * item} < page {page}")
    return Geometry(
        offset=int(view.storage_offset()) * item,
        block_stride=s_block * item,
        page_bytes=page,
        order=order,
        shape=shape,
        heads=heads,
        blocks=blocks,
        tokens=tokens,
        dtype=DTYPES[view.dtype],
    )


def _same_shape(names: list[str], geos: list[Geometry]) -> Geometry:
    first = geos[0]
    for name, g in zip(names, geos, strict=True):
        if (g.block_stride, g.shape, g.dtype, g.blocks, g.order) != (
            first.block_stride,
            first.shape,
            first.dtype,
            first.blocks,
            first.order,
        ):
            raise LayoutError(
                f"KV layer {name!r} is shaped unlike {names[0]!r} ({g} vs {first}): one "
                "attention group of same-shaped layers is what this connector moves"
            )
    return first


Placement = list[tuple[str, int]]  #: each layer's (plane id, field offset in a page)


def _planes(geos: list[Geometry], first: Geometry) -> tuple[list[PlaneLayout], Placement]:
    """The planes, and each layer's (plane id, field offset)."""
    if first.block_stride == first.page_bytes:  # layer-compact: a plane per layer
        planes = [PlaneLayout(f"unit.{i}", g.page_bytes, g.offset) for i, g in enumerate(geos)]
        return planes, [(p.plane_id, 0) for p in planes]
    base = min(g.offset for g in geos)  # block-outermost: every layer's page in one block
    rel = [g.offset - base for g in geos]
    if any(r + first.page_bytes > first.block_stride for r in rel):
        raise LayoutError(
            f"KV layers' pages do not fit one block of {first.block_stride} bytes (offsets {rel})"
        )
    return [PlaneLayout(f"page.{GROUP}", first.block_stride, base)], [
        (f"page.{GROUP}", r) for r in rel
    ]


def build_arena(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    total_kv_heads: int,
    replicated: bool = False,
) -> KvArena:
    """Describe the views vLLM registers (``register_kv_caches``) as one arena.

    ``total_kv_heads`` is the model's KV head count (the global extent each rank's heads are
    a share of); ``replicated`` marks a latent every rank holds whole (MLA). Layers that share
    another layer's cache (vLLM's KV sharing: the same view under two names) are described
    once. Raises :class:`LayoutError` naming the tensor and the rule.
    """
    if not kv_caches:
        raise LayoutError("no KV layers to describe (is the model attention-free?)")
    unique: dict[tuple[int, tuple[int, ...]], str] = {}
    for name in layer_order(list(kv_caches)):
        view = kv_caches[name]
        unique.setdefault((view.data_ptr(), tuple(view.stride())), name)
    names = list(unique.values())
    views = [kv_caches[n] for n in names]
    storage = views[0].untyped_storage()
    if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
        raise LayoutError("vLLM's KV layers are not one allocation (vLLM < 0.32?)")
    geos = [geometry(n, v) for n, v in zip(names, views, strict=True)]
    first = _same_shape(names, geos)
    planes, placement = _planes(geos, first)
    blocks = first.blocks
    ends = max(p.arena_offset_bytes + blocks * p.bytes_per_lcm_block for p in planes)
    lcm = -(-ends // blocks)
    if blocks * lcm > storage.nbytes():
        raise LayoutError(
            f"{blocks} blocks of {lcm} bytes exceed vLLM's allocation ({storage.nbytes()} bytes)"
        )
    stride = first.block_stride
    fields = [
        FieldLayout(GROUP, f"layer.{i}.kv", plane, first.shape, first.dtype, off, stride)
        for i, (plane, off) in enumerate(placement)
    ]
    fields.sort(key=lambda f: (f.plane_id, f.group_id, f.field_id))
    plan = MemoryPlan(
        prefix_granularity=first.tokens,
        lcm_block_bytes=lcm,
        num_lcm_blocks=blocks - 1,
        groups=(GroupLayout(GROUP, 1, blocks),),
        planes=tuple(sorted(planes, key=lambda p: p.plane_id)),
        fields=tuple(fields),
    )
    spec = GroupSpec(
        GROUP,
        Retention.FULL_HISTORY,
        rows_per_page=first.tokens,
        entry_stride_tokens=1,
        transfer_policy=TransferPolicy.FULL_SUFFIX,
    )
    axis = 0 if first.order == PageOrder.HND else 1
    schema = TransferSchema(
        ()
        if replicated
        else tuple(FieldPartition(f.field_id, Partition(axis, total_kv_heads)) for f in fields)
    )
    try:
        contract = CacheContract(plan, (spec,), schema)
    except ContractError as exc:
        raise LayoutError(f"vLLM's KV tensors make no valid contract: {exc}") from exc
    whole = torch.empty(0, dtype=torch.uint8, device=views[0].device).set_(storage)
    return KvArena(
        tensor=whole[: blocks * lcm],
        contract=contract,
        order=first.order,
        layers=tuple(names),
        num_blocks=blocks,
        block_size=first.tokens,
    )
