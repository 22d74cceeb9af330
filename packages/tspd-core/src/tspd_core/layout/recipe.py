"""Build a rank's cache transfer contract from an arena description.

:class:`ArenaSpec` says what the model caches (attention kind, heads, dtype, page size, extra
draft / sliding-window / state layers) and how this rank lays it out (TP size and rank, page
layout, plane arrangement, capacity). :func:`build_contract` turns it into a validated
:class:`CacheContract` following the WIRE §4 recipe conventions:

* fields ``layer.<L>.k``/``layer.<L>.v`` (MHA/GQA, partitioned over KV heads),
  ``layer.<L>.latent_kv`` (+ ``rope_k``) for MLA (replicated), ``layer.<L>.conv``/``ssm`` for
  GDN state layers; draft layers get merged indices after the target layers;
* one group per retention kind, in order of first appearance over the layers;
* planes sorted by id and placed back to back, one parent holding one page of every group.

Two plane arrangements::

    per_field  (one plane per field: layerwise streaming sends whole planes)
      | unit.0.k: pg0 pg1 pg2 ... | unit.0.v: pg0 pg1 ... | unit.1.k: ... |

    page_major (one plane per group: a page of every layer side by side)
      | page.full_attention: [L0.k L0.v L1.k L1.v ...]pg0 [L0.k L0.v ...]pg1 ... |

At equal TP a page-major page is one contiguous run whatever the block-table fragmentation;
per-field planes keep each layer's bytes together for layerwise streaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from tspd_core.layout.contract import (
    DTYPE_WIDTHS,
    CacheContract,
    Family,
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
from tspd_core.layout.errors import ContractError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
MAX_TP = 1024


class AttentionKind(StrEnum):
    """MHA and GQA cache per-KV-head K and V; MLA caches one replicated latent per token."""

    MHA = "mha"
    GQA = "gqa"
    MLA = "mla"


class PageLayout(StrEnum):
    """Order of a K/V page: NHD = (tokens, heads, dim), HND = (heads, tokens, dim).

    HND makes one rank's head slice of a page a single contiguous run; NHD is the layout
    TokenSpeed's recipes use (partition axis 1).
    """

    NHD = "nhd"
    HND = "hnd"


class PlaneArrangement(StrEnum):
    """One plane per field, or one page-major plane per group (see module docstring)."""

    PER_FIELD = "per_field"
    PAGE_MAJOR = "page_major"


@dataclass(frozen=True, slots=True)
class StateSpec:
    """GDN-style recurrent-state layers, moved as the latest snapshot only.

    ``conv`` is ``(2·Kw + Vw, conv_width)`` split in parts ``[Kw, Kw, Vw]`` (Kw = key heads ·
    key dim, Vw = value heads · value dim); ``ssm`` is ``(value_heads, key_dim, value_dim)``;
    both are split over TP on axis 0.
    """

    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int = 3
    dtype: str = "float32"
    checkpoint_granularity: int | None = None


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    """What one rank caches and how it lays it out. Give ``num_pages`` or ``memory_bytes``.

    ``num_pages`` is the usable page count per group (page 0, the null page, comes extra);
    ``memory_bytes`` sizes the arena from a byte budget instead.
    """

    layers: int
    attention: AttentionKind = AttentionKind.GQA
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    page_size: int = 16
    tp_size: int = 1
    tp_rank: int = 0
    page_layout: PageLayout = PageLayout.HND
    arrangement: PlaneArrangement = PlaneArrangement.PER_FIELD
    latent_dim: int = 512
    rope_dim: int = 64
    draft_layers: int = 0
    sliding_layers: tuple[int, ...] = ()
    sliding_window_tokens: int | None = None
    state: StateSpec | None = None
    num_pages: int | None = None
    memory_bytes: int | None = None
    page_alignment: int = 1

    @property
    def total_layers(self) -> int:
        """Target plus draft layers (merged layer indices are ``0 .. total_layers−1``)."""
        return self.layers + self.draft_layers


@dataclass(frozen=True, slots=True)
class _Field:
    group_id: str
    field_id: str
    shape: tuple[int, ...]
    dtype: str
    partition: Partition | None


def _positive(value: int, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ContractError(f"arena spec {what}: expected an integer ≥ {minimum}, got {value!r}")


def _check_spec(spec: ArenaSpec) -> None:
    _positive(spec.layers, "layers")
    _positive(spec.draft_layers, "draft_layers", 0)
    _positive(spec.page_size, "page_size")
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
    special = set(spec.sliding_layers) | set(spec.state.layers if spec.state else ())
    if any(not 0 <= layer < spec.layers for layer in special):
        raise ContractError(
            f"arena spec: sliding/state layers must be target layers 0..{spec.layers - 1}"
        )
    if spec.state and set(spec.state.layers) & set(spec.sliding_layers):
        raise ContractError("arena spec: a layer cannot be both sliding-window and state")
    if spec.sliding_layers and spec.sliding_window_tokens is None:
        raise ContractError("arena spec: sliding_layers need sliding_window_tokens")


def local_extent(extent: int, tp: int, what: str) -> int:
    """Per-rank extent of ``extent`` heads over ``tp`` ranks (1 with replicas if tp > extent)."""
    if extent >= tp and extent % tp == 0:
        return extent // tp
    if extent < tp and tp % extent == 0:
        return 1
    raise ContractError(
        f"{extent} {what} cannot be split evenly over TP {tp}: need TP to divide "
        f"{extent} or be a multiple of it"
    )


def _attention_fields(spec: ArenaSpec, layer: int, gid: str) -> list[_Field]:
    if spec.attention == AttentionKind.MLA:
        _positive(spec.latent_dim, "latent_dim")
        _positive(spec.rope_dim, "rope_dim", 0)
        out = [
            _Field(
                gid, f"layer.{layer}.latent_kv", (spec.page_size, spec.latent_dim), spec.dtype, None
            )
        ]
        if spec.rope_dim:
            out.append(
                _Field(
                    gid, f"layer.{layer}.rope_k", (spec.page_size, spec.rope_dim), spec.dtype, None
                )
            )
        return out
    _positive(spec.kv_heads, "kv_heads")
    _positive(spec.head_dim, "head_dim")
    heads = local_extent(spec.kv_heads, spec.tp_size, "KV heads")
    if spec.page_layout == PageLayout.HND:
        shape, axis = (heads, spec.page_size, spec.head_dim), 0
    else:
        shape, axis = (spec.page_size, heads, spec.head_dim), 1
    part = Partition(axis, spec.kv_heads)
    return [
        _Field(gid, f"layer.{layer}.{suffix}", shape, spec.dtype, part) for suffix in ("k", "v")
    ]


def _state_fields(spec: ArenaSpec, state: StateSpec, layer: int) -> list[_Field]:
    tp = spec.tp_size
    for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_width"):
        _positive(getattr(state, name), f"state.{name}")
    if state.key_heads % tp or state.value_heads % tp:
        raise ContractError(
            f"state heads ({state.key_heads} key, {state.value_heads} value) must divide by TP {tp}"
        )
    kw, vw = state.key_heads * state.key_head_dim, state.value_heads * state.value_head_dim
    conv = Partition(0, 2 * kw + vw, (kw, kw, vw))
    ssm = Partition(0, state.value_heads)
    return [
        _Field(
            LINEAR_ATTENTION,
            f"layer.{layer}.conv",
            ((2 * kw + vw) // tp, state.conv_width),
            state.dtype,
            conv,
        ),
        _Field(
            LINEAR_ATTENTION,
            f"layer.{layer}.ssm",
            (state.value_heads // tp, state.key_head_dim, state.value_head_dim),
            state.dtype,
            ssm,
        ),
    ]


def _fields(spec: ArenaSpec) -> list[_Field]:
    out: list[_Field] = []
    state_layers = set(spec.state.layers) if spec.state else set()
    for layer in range(spec.total_layers):
        if spec.state is not None and layer in state_layers:
            out += _state_fields(spec, spec.state, layer)
        elif layer in spec.sliding_layers:
            out += _attention_fields(spec, layer, SLIDING_ATTENTION)
        else:
            out += _attention_fields(spec, layer, FULL_ATTENTION)
    return out


def _group_spec(spec: ArenaSpec, gid: str) -> GroupSpec:
    if gid == LINEAR_ATTENTION:
        assert spec.state is not None, "state group exists only with a state spec"
        granularity = spec.state.checkpoint_granularity or spec.page_size
        _positive(granularity, "state.checkpoint_granularity")
        return GroupSpec(
            gid,
            Retention.FULL_HISTORY,
            family=Family.STATE,
            transfer_policy=TransferPolicy.LATEST_SNAPSHOT,
            checkpoint_granularity=granularity,
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


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _payload(f: _Field) -> int:
    return math.prod(f.shape) * DTYPE_WIDTHS[f.dtype]


def _placements(spec: ArenaSpec, fields: list[_Field]) -> dict[str, tuple[str, int, int]]:
    """field id → (plane id, field offset, page stride); plane bytes = the stride.

    Offsets and strides are multiples of the widest element too, so every field stays
    addressable through a typed view of the arena (``FieldGeometry.aligned``).
    """
    a = max(spec.page_alignment, *(DTYPE_WIDTHS[f.dtype] for f in fields))
    if spec.arrangement == PlaneArrangement.PER_FIELD:
        return {
            f.field_id: (f"unit.{f.field_id.removeprefix('layer.')}", 0, _align(_payload(f), a))
            for f in fields
        }
    offsets: dict[str, int] = {}
    out: dict[str, tuple[str, int, int]] = {}
    for f in fields:
        offsets[f.field_id] = offsets.get(f.group_id, 0)
        offsets[f.group_id] = _align(offsets[f.field_id] + _payload(f), a)
    for f in fields:
        out[f.field_id] = (f"page.{f.group_id}", offsets[f.field_id], offsets[f.group_id])
    return out


def _num_lcm_blocks(spec: ArenaSpec, lcm: int) -> int:
    """Usable parents: ``num_pages`` as given, or what the byte budget holds past parent 0."""
    if spec.num_pages is not None:
        _positive(spec.num_pages, "num_pages")
        return spec.num_pages
    assert spec.memory_bytes is not None, "checked: one of num_pages/memory_bytes is set"
    num = spec.memory_bytes // lcm - 1
    if num < 1:
        raise ContractError(
            f"arena spec memory_bytes: {spec.memory_bytes} bytes hold no page; one page of "
            f"every field takes {lcm} bytes and the null page another {lcm}"
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
    fields = _fields(spec)
    gids = list(dict.fromkeys(f.group_id for f in fields))
    place = _placements(spec, fields)
    plane_bytes = {pid: stride for pid, _, stride in place.values()}
    num = _num_lcm_blocks(spec, sum(plane_bytes.values()))
    order = {pid: i for i, pid in enumerate(sorted(plane_bytes))}
    # WIRE §4: plan.fields ordered by (plane, group, field id).
    fields.sort(key=lambda f: (order[place[f.field_id][0]], gids.index(f.group_id), f.field_id))
    layouts = tuple(
        FieldLayout(
            f.group_id,
            f.field_id,
            place[f.field_id][0],
            f.shape,
            f.dtype,
            place[f.field_id][1],
            place[f.field_id][2],
        )
        for f in fields
    )
    plan = MemoryPlan(
        prefix_granularity=spec.page_size,
        lcm_block_bytes=sum(plane_bytes.values()),
        num_lcm_blocks=num,
        groups=tuple(GroupLayout(gid, 1, 1 + num) for gid in gids),
        planes=_planes(plane_bytes, num),
        fields=layouts,
    )
    schema = TransferSchema(
        tuple(FieldPartition(f.field_id, f.partition) for f in fields if f.partition is not None)
    )
    return CacheContract(plan, tuple(_group_spec(spec, gid) for gid in gids), schema)
