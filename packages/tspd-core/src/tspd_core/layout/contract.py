"""The cache transfer contract: typed mirror of wire.md §4.

A contract describes one rank's KV arena: the page-id spaces (groups), the physical regions
(planes), the per-page tensors (fields) and how each field is split across TP ranks (the
transfer schema). It is built once at startup (see :mod:`tspd_core.layout.recipe`), sent to
peers as canonical JSON (:mod:`tspd_core.layout.codec`) and is immutable afterwards, so it may
be shared freely between threads.

Page address of field ``f`` (in plane ``π``), page ``p``, relative to the arena base::

    π.arena_offset_bytes + π.bytes_per_lcm_block − f.page_stride_bytes
        + p · f.page_stride_bytes + f.field_offset_bytes

Page 1 starts parent block 1; page 0 (the null page) is the last slot of parent 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field

from tspd_core.layout.checks import index_contract
from tspd_core.layout.errors import ContractError
from tspd_core.layout.parts import (
    DTYPE_WIDTHS,
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

# The pieces are re-exported: a contract and its parts are one vocabulary for importers.
__all__ = [
    "DTYPE_WIDTHS",
    "CacheContract",
    "Family",
    "FieldLayout",
    "FieldPartition",
    "GroupLayout",
    "GroupSpec",
    "MemoryPlan",
    "Partition",
    "PlaneLayout",
    "Retention",
    "TransferPolicy",
    "TransferSchema",
]


@dataclass(frozen=True, slots=True)
class CacheContract:
    """One rank's arena, as P and D exchange it. Validated on construction.

    Raises :class:`ContractError` naming the first invalid property. Immutable; lookups are
    indexed once here, so the accessors below are O(1).
    """

    plan: MemoryPlan
    group_specs: tuple[GroupSpec, ...]
    transfer_schema: TransferSchema = dc_field(default_factory=TransferSchema)
    _fields: dict[str, FieldLayout] = dc_field(init=False, repr=False, compare=False)
    _planes: dict[str, PlaneLayout] = dc_field(init=False, repr=False, compare=False)
    _groups: dict[str, GroupLayout] = dc_field(init=False, repr=False, compare=False)
    _specs: dict[str, GroupSpec] = dc_field(init=False, repr=False, compare=False)
    _partitions: dict[str, Partition] = dc_field(init=False, repr=False, compare=False)
    _by_group: dict[str, tuple[FieldLayout, ...]] = dc_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        indexes = index_contract(self.plan, self.group_specs, self.transfer_schema)
        for name, value in indexes.items():
            object.__setattr__(self, name, value)

    # ---- lookups -------------------------------------------------------------------------

    def field(self, field_id: str) -> FieldLayout:
        """The field named ``field_id``; :class:`ContractError` if there is none."""
        try:
            return self._fields[field_id]
        except KeyError:
            raise ContractError(f"contract has no field {field_id!r}") from None

    def plane(self, plane_id: str) -> PlaneLayout:
        """The plane named ``plane_id``."""
        try:
            return self._planes[plane_id]
        except KeyError:
            raise ContractError(f"contract has no plane {plane_id!r}") from None

    def group(self, group_id: str) -> GroupLayout:
        """The group layout named ``group_id``."""
        try:
            return self._groups[group_id]
        except KeyError:
            raise ContractError(f"contract has no group {group_id!r}") from None

    def spec(self, group_id: str) -> GroupSpec:
        """The group spec named ``group_id``."""
        try:
            return self._specs[group_id]
        except KeyError:
            raise ContractError(f"contract has no group {group_id!r}") from None

    def partition(self, field_id: str) -> Partition | None:
        """The field's partition, or ``None`` when it is replicated on every rank."""
        return self._partitions.get(field_id)

    def group_ids(self) -> tuple[str, ...]:
        """Group ids in ``group_specs`` order (the order manifests and routes use)."""
        return tuple(spec.group_id for spec in self.group_specs)

    def fields_for_group(self, group_id: str) -> tuple[FieldLayout, ...]:
        """The group's fields sorted by field id (the pairing order of wire.md §6)."""
        return self._by_group.get(group_id, ())

    # ---- geometry ------------------------------------------------------------------------

    def page0_offset(self, field_id: str) -> int:
        """Byte offset of page 0 of ``field_id`` from the arena base."""
        f = self.field(field_id)
        plane = self._planes[f.plane_id]
        return (
            plane.arena_offset_bytes
            + plane.bytes_per_lcm_block
            - f.page_stride_bytes
            + f.field_offset_bytes
        )

    def page_offset(self, field_id: str, page: int) -> int:
        """Byte offset of ``page`` of ``field_id`` from the arena base (wire.md §4)."""
        f = self.field(field_id)
        if not 0 <= page < self._groups[f.group_id].page_count:
            raise ContractError(
                f"page {page} is outside group {f.group_id!r} "
                f"(0..{self._groups[f.group_id].page_count - 1})"
            )
        return self.page0_offset(field_id) + page * f.page_stride_bytes

    def global_shape(self, field_id: str) -> tuple[int, ...]:
        """The field's page shape across all ranks (the partition axis at full extent)."""
        f = self.field(field_id)
        part = self._partitions.get(field_id)
        if part is None:
            return f.shape
        shape = list(f.shape)
        shape[part.axis] = part.global_extent
        return tuple(shape)
