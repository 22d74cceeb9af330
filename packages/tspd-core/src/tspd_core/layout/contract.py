"""The cache transfer contract: typed mirror of WIRE §4.

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

import math
from dataclasses import dataclass
from dataclasses import field as dc_field
from enum import StrEnum

from tspd_core.layout.errors import ContractError

#: Byte width of every dtype a contract may name (WIRE §4).
DTYPE_WIDTHS: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}


class Retention(StrEnum):
    """How much of a group's history a decode step still reads."""

    FULL_HISTORY = "full_history"
    SLIDING_WINDOW = "sliding_window"


class Family(StrEnum):
    """History groups hold per-token KV rows; state groups hold recurrent-state snapshots."""

    HISTORY = "history"
    STATE = "state"


class TransferPolicy(StrEnum):
    """Which of a group's pages PD moves (WIRE §5); ``None`` in a spec means PD is off."""

    FULL_SUFFIX = "full_suffix"
    LATEST_SNAPSHOT = "latest_snapshot"


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """One page-id space: ``page_count = 1 + num_lcm_blocks · cache_blocks_per_lcm_block``."""

    group_id: str
    cache_blocks_per_lcm_block: int
    page_count: int


@dataclass(frozen=True, slots=True)
class PlaneLayout:
    """One physical region of the arena, ``(num_lcm_blocks + 1) · bytes_per_lcm_block`` long."""

    plane_id: str
    bytes_per_lcm_block: int
    arena_offset_bytes: int


@dataclass(frozen=True, slots=True)
class FieldLayout:
    """One per-page tensor: its rank-local shape, dtype and byte placement."""

    group_id: str
    field_id: str
    plane_id: str
    shape: tuple[int, ...]
    dtype: str
    field_offset_bytes: int
    page_stride_bytes: int

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_WIDTHS[self.dtype]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one page of this field (``prod(shape) · itemsize``)."""
        return math.prod(self.shape) * self.itemsize

    @property
    def layer(self) -> int:
        """The merged layer index ``L`` of ``layer.<L>.<suffix>``."""
        return int(self.field_id.split(".", 2)[1])

    @property
    def suffix(self) -> str:
        """The ``<suffix>`` of ``layer.<L>.<suffix>`` (``k``, ``v``, ``latent_kv``, ...)."""
        return self.field_id.split(".", 2)[2]


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Byte geometry of one arena; ``num_lcm_blocks`` excludes the null parent 0."""

    prefix_granularity: int
    lcm_block_bytes: int
    num_lcm_blocks: int
    groups: tuple[GroupLayout, ...]
    planes: tuple[PlaneLayout, ...]
    fields: tuple[FieldLayout, ...]

    @property
    def arena_bytes(self) -> int:
        """Size of the whole arena, null parent included."""
        return (self.num_lcm_blocks + 1) * self.lcm_block_bytes


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Semantics of one group (WIRE §4 ``group_specs``); its order is the group order.

    Row groups set ``rows_per_page`` and ``entry_stride_tokens``; snapshot-state groups set
    only ``checkpoint_granularity``. Either way ``block_granularity`` is the number of prompt
    tokens one block-table slot spans.
    """

    group_id: str
    retention: Retention
    rows_per_page: int | None = None
    entry_stride_tokens: int | None = None
    sliding_window_tokens: int | None = None
    family: Family = Family.HISTORY
    transfer_policy: TransferPolicy | None = None
    checkpoint_granularity: int | None = None

    @property
    def block_granularity(self) -> int:
        """Tokens per block-table slot (G)."""
        if self.checkpoint_granularity is not None:
            return self.checkpoint_granularity
        assert self.rows_per_page is not None, f"group {self.group_id}: no geometry"
        assert self.entry_stride_tokens is not None, f"group {self.group_id}: no geometry"
        return self.rows_per_page * self.entry_stride_tokens


@dataclass(frozen=True, slots=True)
class Partition:
    """How one field's axis is split across TP ranks (WIRE §4, §6.2).

    ``global_parts`` is empty (one part of ``global_extent``) or 2..16 parts that are sharded
    independently (e.g. GDN conv: ``[Kw, Kw, Vw]``).
    """

    axis: int
    global_extent: int
    global_parts: tuple[int, ...] = ()

    @property
    def parts(self) -> tuple[int, ...]:
        """The parts, with the implicit single part spelled out."""
        return self.global_parts or (self.global_extent,)


@dataclass(frozen=True, slots=True)
class FieldPartition:
    """A ``transfer_schema.fields`` entry; fields without one are replicated."""

    field_id: str
    partition: Partition


@dataclass(frozen=True, slots=True)
class TransferSchema:
    """The partitioned fields, in plan-field order."""

    fields: tuple[FieldPartition, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheContract:
    """One rank's arena, as P and D exchange it. Validated on construction.

    Raises :class:`ContractError` naming the first invalid property. Immutable; lookups are
    indexed once here, so the accessors below are O(1).
    """

    plan: MemoryPlan
    group_specs: tuple[GroupSpec, ...]
    transfer_schema: TransferSchema = TransferSchema()
    _fields: dict[str, FieldLayout] = dc_field(init=False, repr=False, compare=False)
    _planes: dict[str, PlaneLayout] = dc_field(init=False, repr=False, compare=False)
    _groups: dict[str, GroupLayout] = dc_field(init=False, repr=False, compare=False)
    _specs: dict[str, GroupSpec] = dc_field(init=False, repr=False, compare=False)
    _partitions: dict[str, Partition] = dc_field(init=False, repr=False, compare=False)
    _by_group: dict[str, tuple[FieldLayout, ...]] = dc_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from tspd_core.layout.checks import index_contract

        for name, value in index_contract(self).items():
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
        """The group's fields sorted by field id (the pairing order of WIRE §6)."""
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
        """Byte offset of ``page`` of ``field_id`` from the arena base (WIRE §4)."""
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
