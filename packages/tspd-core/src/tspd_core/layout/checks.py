"""Validation of one cache transfer contract (its own consistency, not a peer's).

Called by :class:`~tspd_core.layout.contract.CacheContract` on construction; returns the lookup
indexes it builds along the way. Every failure is a :class:`ContractError` whose message names
the property (``plan.fields[layer.0.k].page_stride_bytes``) and the rule it broke.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from tspd_core.layout.errors import ContractError
from tspd_core.layout.parts import (
    DTYPE_WIDTHS,
    Family,
    FieldLayout,
    GroupLayout,
    GroupSpec,
    MemoryPlan,
    Partition,
    PlaneLayout,
    Retention,
    TransferPolicy,
    TransferSchema,
)

_FIELD_ID = re.compile(r"layer\.(0|[1-9][0-9]*)\.[A-Za-z0-9_]+")
MAX_PARTS = 16


def check_int(value: object, path: str, minimum: int = 0) -> int:
    """``value`` as an int ≥ ``minimum`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"{path}: expected an integer, got {value!r}")
    if value < minimum:
        raise ContractError(f"{path}: must be ≥ {minimum}, got {value}")
    return value


def _unique(ids: Iterable[str], what: str) -> None:
    seen: set[str] = set()
    for ident in ids:
        if not isinstance(ident, str) or not ident:
            raise ContractError(f"{what}: ids must be non-empty strings, got {ident!r}")
        if ident in seen:
            raise ContractError(f"{what}: duplicate id {ident!r}")
        seen.add(ident)


def index_contract(
    plan: MemoryPlan, group_specs: tuple[GroupSpec, ...], schema: TransferSchema
) -> dict[str, object]:
    """Validate a contract's plan, group specs and transfer schema together and return the
    contract's lookup indexes (attribute name → dict)."""
    check_int(plan.prefix_granularity, "plan.prefix_granularity", 1)
    check_int(plan.lcm_block_bytes, "plan.lcm_block_bytes", 1)
    check_int(plan.num_lcm_blocks, "plan.num_lcm_blocks", 1)
    if not plan.groups:
        raise ContractError("plan.groups: a contract needs at least one group")
    groups = _check_groups(plan.groups, plan.num_lcm_blocks)
    planes = _check_planes(plan.planes, plan.num_lcm_blocks, plan.arena_bytes)
    fields = _check_fields(plan.fields, groups, planes, plan.num_lcm_blocks)
    specs = _check_specs(group_specs, groups)
    partitions = _check_schema(schema, fields)
    by_group = {
        gid: tuple(sorted((f for f in plan.fields if f.group_id == gid), key=lambda f: f.field_id))
        for gid in groups
    }
    return {
        "_fields": fields,
        "_planes": planes,
        "_groups": groups,
        "_specs": specs,
        "_partitions": partitions,
        "_by_group": by_group,
    }


def _check_groups(groups: tuple[GroupLayout, ...], num: int) -> dict[str, GroupLayout]:
    _unique((g.group_id for g in groups), "plan.groups")
    for g in groups:
        path = f"plan.groups[{g.group_id}]"
        k = check_int(g.cache_blocks_per_lcm_block, f"{path}.cache_blocks_per_lcm_block", 1)
        count = check_int(g.page_count, f"{path}.page_count", 2)
        if count != 1 + num * k:
            raise ContractError(
                f"{path}.page_count: must be 1 + num_lcm_blocks · cache_blocks_per_lcm_block"
                f" = {1 + num * k}, got {count}"
            )
    return {g.group_id: g for g in groups}


def _check_planes(
    planes: tuple[PlaneLayout, ...], num: int, arena_bytes: int
) -> dict[str, PlaneLayout]:
    _unique((p.plane_id for p in planes), "plan.planes")
    spans = []
    for p in planes:
        path = f"plan.planes[{p.plane_id}]"
        bpl = check_int(p.bytes_per_lcm_block, f"{path}.bytes_per_lcm_block", 1)
        off = check_int(p.arena_offset_bytes, f"{path}.arena_offset_bytes", 0)
        if off + (num + 1) * bpl > arena_bytes:
            raise ContractError(
                f"{path}: ends at byte {off + (num + 1) * bpl}, past the arena "
                f"({arena_bytes} bytes = (num_lcm_blocks + 1) · lcm_block_bytes)"
            )
        spans.append((off, off + (num + 1) * bpl, p.plane_id))
    # Distinct planes are distinct bytes (groups share bytes by sharing a plane id).
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise ContractError(f"plan.planes: planes {a!r} and {b!r} overlap in the arena")
    return {p.plane_id: p for p in planes}


def _check_fields(
    fields: tuple[FieldLayout, ...],
    groups: dict[str, GroupLayout],
    planes: dict[str, PlaneLayout],
    num: int,
) -> dict[str, FieldLayout]:
    _unique((f.field_id for f in fields), "plan.fields")
    for f in fields:
        _check_field(f, groups, planes, num)
    _check_no_overlap(fields)
    return {f.field_id: f for f in fields}


def _check_field(
    f: FieldLayout, groups: dict[str, GroupLayout], planes: dict[str, PlaneLayout], num: int
) -> None:
    path = f"plan.fields[{f.field_id}]"
    if not _FIELD_ID.fullmatch(f.field_id):
        raise ContractError(f"{path}: field ids must look like layer.<L>.<suffix>")
    if f.group_id not in groups:
        raise ContractError(f"{path}.group_id: unknown group {f.group_id!r}")
    if f.plane_id not in planes:
        raise ContractError(f"{path}.plane_id: unknown plane {f.plane_id!r}")
    if not isinstance(f.shape, tuple) or not f.shape:
        raise ContractError(f"{path}.shape: must be a non-empty list, got {f.shape!r}")
    for i, extent in enumerate(f.shape):
        check_int(extent, f"{path}.shape[{i}]", 1)
    if f.dtype not in DTYPE_WIDTHS:
        raise ContractError(
            f"{path}.dtype: unknown dtype {f.dtype!r}; expected one of {sorted(DTYPE_WIDTHS)}"
        )
    offset = check_int(f.field_offset_bytes, f"{path}.field_offset_bytes", 0)
    stride = check_int(f.page_stride_bytes, f"{path}.page_stride_bytes", 1)
    if stride < f.payload_bytes:
        raise ContractError(
            f"{path}.page_stride_bytes: {stride} is smaller than one page of the field "
            f"({f.payload_bytes} bytes), so its pages would overlap"
        )
    plane = planes[f.plane_id]
    first = plane.bytes_per_lcm_block - stride + offset
    end = first + (groups[f.group_id].page_count - 1) * stride + f.payload_bytes
    if first < 0 or end > (num + 1) * plane.bytes_per_lcm_block:
        raise ContractError(
            f"{path}: pages span plane bytes [{first}, {end}) but plane {plane.plane_id!r} "
            f"holds [0, {(num + 1) * plane.bytes_per_lcm_block})"
        )


def _check_no_overlap(fields: tuple[FieldLayout, ...]) -> None:
    """Fields of one group in one plane share its page stride and sit side by side in a page."""
    buckets: dict[tuple[str, str], list[FieldLayout]] = {}
    for f in fields:
        buckets.setdefault((f.group_id, f.plane_id), []).append(f)
    for (gid, pid), members in buckets.items():
        stride = members[0].page_stride_bytes
        odd = [f for f in members if f.page_stride_bytes != stride]
        if odd:
            raise ContractError(
                f"plan.fields: {odd[0].field_id} has page stride {odd[0].page_stride_bytes} "
                f"in plane {pid} but "
                f"{members[0].field_id} of the same group has {stride}; one group pages "
                "a plane with one stride"
            )
        members.sort(key=lambda f: f.field_offset_bytes)
        for a, b in itertools.pairwise(members):
            if b.field_offset_bytes < a.field_offset_bytes + a.payload_bytes:
                raise ContractError(
                    f"plan.fields: {a.field_id} and {b.field_id} (group {gid}, plane {pid}) "
                    "overlap inside a page"
                )
        span = members[-1].field_offset_bytes + members[-1].payload_bytes
        if span - members[0].field_offset_bytes > stride:
            raise ContractError(
                f"plan.fields: fields of group {gid} in plane {pid} span "
                f"{span - members[0].field_offset_bytes} bytes, more than their page stride "
                f"{stride}, so neighbouring pages would overlap"
            )


def _check_specs(
    specs: tuple[GroupSpec, ...], groups: dict[str, GroupLayout]
) -> dict[str, GroupSpec]:
    _unique((s.group_id for s in specs), "group_specs")
    named = {s.group_id for s in specs}
    if named != set(groups):
        raise ContractError(
            f"group_specs: must name exactly the plan's groups; missing "
            f"{sorted(set(groups) - named)}, extra {sorted(named - set(groups))}"
        )
    for spec in specs:
        check_spec(spec)
    return {s.group_id: s for s in specs}


def check_spec(spec: GroupSpec) -> None:
    """Validate one group spec's geometry and policy."""
    path = f"group_specs[{spec.group_id}]"
    _enum(spec.retention, Retention, f"{path}.retention")
    _enum(spec.family, Family, f"{path}.family")
    if spec.transfer_policy is not None:
        _enum(spec.transfer_policy, TransferPolicy, f"{path}.transfer_policy")
    if spec.checkpoint_granularity is not None:
        if spec.rows_per_page is not None or spec.entry_stride_tokens is not None:
            raise ContractError(
                f"{path}: checkpoint_granularity excludes rows_per_page/entry_stride_tokens"
            )
        if spec.family != Family.STATE:
            raise ContractError(f"{path}: only state groups may set checkpoint_granularity")
        check_int(spec.checkpoint_granularity, f"{path}.checkpoint_granularity", 1)
    else:
        if spec.rows_per_page is None or spec.entry_stride_tokens is None:
            raise ContractError(
                f"{path}: declare rows_per_page and entry_stride_tokens, or checkpoint_granularity"
            )
        check_int(spec.rows_per_page, f"{path}.rows_per_page", 1)
        check_int(spec.entry_stride_tokens, f"{path}.entry_stride_tokens", 1)
    if spec.sliding_window_tokens is not None:
        check_int(spec.sliding_window_tokens, f"{path}.sliding_window_tokens", 1)
    if spec.retention == Retention.SLIDING_WINDOW and spec.sliding_window_tokens is None:
        raise ContractError(f"{path}: a sliding_window group needs sliding_window_tokens")
    if spec.transfer_policy is not None:
        snapshot = spec.family == Family.STATE and spec.retention == Retention.FULL_HISTORY
        want = TransferPolicy.LATEST_SNAPSHOT if snapshot else TransferPolicy.FULL_SUFFIX
        if spec.transfer_policy != want:
            raise ContractError(
                f"{path}.transfer_policy: {spec.family}/{spec.retention} groups use "
                f"{want.value}, got {spec.transfer_policy}"
            )


def _enum(value: object, kind: type[Retention | Family | TransferPolicy], path: str) -> None:
    if not isinstance(value, kind):
        raise ContractError(f"{path}: expected one of {[m.value for m in kind]}, got {value!r}")


def _check_schema(schema: TransferSchema, fields: dict[str, FieldLayout]) -> dict[str, Partition]:
    entries = schema.fields
    _unique((e.field_id for e in entries), "transfer_schema.fields")
    out: dict[str, Partition] = {}
    for entry in entries:
        if entry.field_id not in fields:
            raise ContractError(
                f"transfer_schema.fields: {entry.field_id!r} is not a field of the plan"
            )
        check_partition(entry.partition, fields[entry.field_id])
        out[entry.field_id] = entry.partition
    return out


def check_partition(part: Partition, f: FieldLayout) -> None:
    """Validate one field's partition against its local shape (wire.md §4)."""
    path = f"transfer_schema.fields[{f.field_id}].partition"
    axis = check_int(part.axis, f"{path}.axis", 0)
    if axis >= len(f.shape):
        raise ContractError(f"{path}.axis: {axis} is not an axis of shape {list(f.shape)}")
    local = f.shape[axis]
    extent = check_int(part.global_extent, f"{path}.global_extent", 1)
    if extent < local or extent % local:
        raise ContractError(
            f"{path}.global_extent: {extent} must be a multiple of the local extent {local}"
        )
    shards = extent // local
    if not part.global_parts:
        return
    if not 2 <= len(part.global_parts) <= MAX_PARTS:
        raise ContractError(f"{path}.global_parts: need 0 or 2..{MAX_PARTS} parts")
    for i, size in enumerate(part.global_parts):
        if check_int(size, f"{path}.global_parts[{i}]", 1) % shards:
            raise ContractError(
                f"{path}.global_parts[{i}]: {size} is not divisible by the {shards} distinct shards"
            )
    if sum(part.global_parts) != extent:
        raise ContractError(
            f"{path}.global_parts: sum {sum(part.global_parts)} ≠ global_extent {extent}"
        )
