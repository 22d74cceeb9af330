"""Build a rank's cache transfer contract from an arena description.

:class:`ArenaSpec` says what the model caches (attention kind, heads, dtype, page size, extra
draft / sliding-window / state layers) and how this rank lays it out (TP size and rank, page
layout, plane arrangement, capacity). :func:`build_contract` turns it into a validated
:class:`CacheContract`. The fields, groups and plane names come from
:mod:`tspd_core.layout.declare` (TokenSpeed's vocabulary); where they go in the arena depends
on the arrangement:

    per_field   TokenSpeed's recipe shape: one plane per field occurrence, packed by
                TokenSpeed's rules (tspd_core.layout.packing) — for the models both serve,
                the very contract TokenSpeed builds, byte for byte
      | unit.0.k: pg0 pg1 pg2 ... | unit.0.v: pg0 pg1 ... | unit.1.k: ... |

    page_major  tspd's own: one plane per group, a page of every layer side by side
      | page.full_attention: [L0.k L0.v L1.k L1.v ...]pg0 [L0.k L0.v ...]pg1 ... |

At equal TP a page-major page is one contiguous run whatever the block-table fragmentation;
per-field planes keep each layer's bytes together for layerwise streaming.
"""

from __future__ import annotations

from tspd_core.layout.arena_spec import (
    ArenaSpec,
    AttentionKind,
    PageLayout,
    PlaneArrangement,
    StateSpec,
)
from tspd_core.layout.contract import (
    DTYPE_WIDTHS,
    CacheContract,
    Family,
    FieldLayout,
    FieldPartition,
    GroupLayout,
    GroupSpec,
    MemoryPlan,
    PlaneLayout,
    Retention,
    TransferPolicy,
    TransferSchema,
)
from tspd_core.layout.declare import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    Field,
    declare,
    group_ids,
    local_heads,
)
from tspd_core.layout.errors import ContractError
from tspd_core.layout.packing import Packed, pack

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "MAX_TP",
    "SLIDING_ATTENTION",
    "ArenaSpec",
    "AttentionKind",
    "PageLayout",
    "PlaneArrangement",
    "StateSpec",
    "build_contract",
    "local_extent",
]

MAX_TP = 1024
#: TokenSpeed's plane alignment for hybrid (state) arenas; ordinary ones align to 1.
HYBRID_ALIGNMENT = 256


def _positive(value: int, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(f"arena spec {what}: expected an integer ≥ {minimum}, got {value!r}")


def _check_spec(spec: ArenaSpec) -> None:
    _positive(spec.layers, "layers")
    _positive(spec.draft_layers, "draft_layers", 0)
    _positive(spec.page_size, "page_size")
    if spec.page_alignment is not None:
        _positive(spec.page_alignment, "page_alignment")
    if not 1 <= spec.tp_size <= MAX_TP:
        raise ContractError(f"arena spec tp_size: must be 1..{MAX_TP}, got {spec.tp_size}")
    if not 0 <= spec.tp_rank < spec.tp_size:
        raise ContractError(
            f"arena spec tp_rank: must be 0..{spec.tp_size - 1}, got {spec.tp_rank}"
        )
    if spec.dtype not in DTYPE_WIDTHS:
        raise ContractError(f"arena spec dtype: unknown {spec.dtype!r}")
    if (spec.num_pages is None) == (spec.memory_bytes is None):
        raise ContractError("arena spec: give exactly one of num_pages and memory_bytes")
    if spec.attention == AttentionKind.MLA:
        _positive(spec.latent_dim, "latent_dim")
        _positive(spec.rope_dim, "rope_dim", 0)
    else:
        _positive(spec.kv_heads, "kv_heads")
        _positive(spec.head_dim, "head_dim")
    special = set(spec.sliding_layers) | set(spec.state.layers if spec.state else ())
    if any(not 0 <= layer < spec.layers for layer in special):
        raise ContractError(
            f"arena spec: sliding/state layers must be target layers 0..{spec.layers - 1}"
        )
    if spec.state:
        _check_state(spec.state, spec)
    if spec.sliding_layers and spec.sliding_window_tokens is None:
        raise ContractError("arena spec: sliding_layers need sliding_window_tokens")


def _check_state(state: StateSpec, spec: ArenaSpec) -> None:
    if set(state.layers) & set(spec.sliding_layers):
        raise ContractError("arena spec: a layer cannot be both sliding-window and state")
    for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_width"):
        _positive(getattr(state, name), f"state.{name}")
    for name in ("conv_dtype", "ssm_dtype"):
        if getattr(state, name) not in DTYPE_WIDTHS:
            raise ContractError(f"arena spec state.{name}: unknown {getattr(state, name)!r}")
    if state.checkpoint_granularity is not None:
        _positive(state.checkpoint_granularity, "state.checkpoint_granularity")


def local_extent(extent: int, tp: int, what: str) -> int:
    """Per-rank extent of ``extent`` heads over ``tp`` ranks (1 with replicas if tp > extent)."""
    return local_heads(extent, tp, what)


def _group_spec(spec: ArenaSpec, gid: str) -> GroupSpec:
    if gid.startswith(LINEAR_ATTENTION):
        assert spec.state is not None, "state groups exist only with a state spec"
        return GroupSpec(
            gid,
            Retention.FULL_HISTORY,
            family=Family.STATE,
            transfer_policy=TransferPolicy.LATEST_SNAPSHOT,
            checkpoint_granularity=spec.state.checkpoint_granularity or spec.page_size,
        )
    sliding = gid == SLIDING_ATTENTION
    return GroupSpec(
        gid,
        Retention.SLIDING_WINDOW if sliding else Retention.FULL_HISTORY,
        rows_per_page=spec.page_size,
        entry_stride_tokens=1,
        sliding_window_tokens=spec.sliding_window_tokens if sliding else None,
        transfer_policy=TransferPolicy.FULL_SUFFIX,
    )


def _per_field(spec: ArenaSpec, fields: list[Field]) -> Packed:
    """TokenSpeed's recipe shape. Ordinary models pin one page of every group per parent and
    align to 1; hybrids with state derive the packing, align to 256 and may pad a page up to
    ``1 + 2 · draft layers / full-attention layers`` of itself (TokenSpeed's bounds)."""
    decls = [f.decl for f in fields]
    if spec.state is None:
        return pack(
            decls,
            alignment=spec.page_alignment or 1,
            max_padding=1.0,
            pinned={f.group_id: 1 for f in fields},
        )
    full = group_ids(spec)[: spec.layers].count(FULL_ATTENTION)
    if full == 0:
        raise ContractError("arena spec: a hybrid with state needs a full-attention layer")
    return pack(
        decls,
        alignment=spec.page_alignment or HYBRID_ALIGNMENT,
        max_padding=1.0 + 2.0 * spec.draft_layers / full,
    )


def _page_major(spec: ArenaSpec, fields: list[Field]) -> Packed:
    """tspd's own: a page of every field of a group side by side in plane ``page.<group>``
    (layer order), one page per parent. Offsets and strides are multiples of the widest
    element, so every field stays addressable through a typed view (``FieldGeometry``)."""
    a = max(spec.page_alignment or 1, *(f.decl.itemsize for f in fields))
    offsets: dict[str, int] = {}
    ends: dict[str, int] = {}
    for f in fields:
        offsets[f.field_id] = ends.get(f.group_id, 0)
        ends[f.group_id] = -(-(offsets[f.field_id] + f.decl.payload) // a) * a
    planes = {f"page.{gid}": size for gid, size in ends.items()}
    strides = {f.field_id: ends[f.group_id] for f in fields}
    packing = dict.fromkeys(ends, 1)
    return Packed(sum(planes.values()), packing, planes, offsets, strides)


def _num_lcm_blocks(spec: ArenaSpec, lcm: int) -> int:
    """Usable parents: ``num_pages`` as given, or what the byte budget holds past parent 0."""
    if spec.num_pages is not None:
        _positive(spec.num_pages, "num_pages")
        return spec.num_pages
    assert spec.memory_bytes is not None, "checked: one of num_pages/memory_bytes is set"
    num = spec.memory_bytes // lcm - 1
    if num < 1:
        raise ContractError(
            f"arena spec memory_bytes: {spec.memory_bytes} bytes hold no page; one parent "
            f"(a page of every group) takes {lcm} bytes and the null parent another {lcm}"
        )
    return num


def _planes(plane_bytes: dict[str, int], num: int) -> tuple[PlaneLayout, ...]:
    """Planes sorted by id, back to back, each ``(num + 1) · bytes_per_lcm_block`` long."""
    planes, cursor = [], 0
    for pid in sorted(plane_bytes):
        planes.append(PlaneLayout(pid, plane_bytes[pid], cursor))
        cursor += (num + 1) * plane_bytes[pid]
    return tuple(planes)


def build_contract(spec: ArenaSpec) -> CacheContract:
    """The validated contract of the arena ``spec`` describes (raises :class:`ContractError`)."""
    _check_spec(spec)
    fields = declare(spec)
    gids = list(dict.fromkeys(f.group_id for f in fields))
    page_major = spec.arrangement == PlaneArrangement.PAGE_MAJOR
    packed = _page_major(spec, fields) if page_major else _per_field(spec, fields)
    num = _num_lcm_blocks(spec, packed.lcm_block_bytes)
    plane_of = {f.field_id: f"page.{f.group_id}" if page_major else f.decl.plane_id for f in fields}
    # wire.md §4: plan.fields ordered by (plane, group, field id); plan.groups by group id.
    fields.sort(key=lambda f: (plane_of[f.field_id], f.group_id, f.field_id))
    layouts = tuple(
        FieldLayout(
            f.group_id,
            f.field_id,
            plane_of[f.field_id],
            f.decl.shape,
            f.decl.dtype,
            packed.offsets[f.field_id],
            packed.strides[f.field_id],
        )
        for f in fields
    )
    plan = MemoryPlan(
        prefix_granularity=spec.page_size,
        lcm_block_bytes=packed.lcm_block_bytes,
        num_lcm_blocks=num,
        groups=tuple(
            GroupLayout(gid, packed.packing[gid], 1 + num * packed.packing[gid])
            for gid in sorted(gids)
        ),
        planes=_planes(packed.plane_bytes, num),
        fields=layouts,
    )
    schema = TransferSchema(
        tuple(FieldPartition(f.field_id, f.partition) for f in fields if f.partition is not None)
    )
    return CacheContract(plan, tuple(_group_spec(spec, gid) for gid in gids), schema)
