"""The pieces a cache transfer contract is made of: its memory plan (groups, planes, fields),
group semantics and the transfer schema's partitions (wire.md §4).

Plain frozen values with no validation of their own; :mod:`tspd_core.layout.checks` validates
them together when a :class:`~tspd_core.layout.contract.CacheContract` is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

#: Byte width of every dtype a contract may name (wire.md §4).
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
    """Which of a group's pages PD moves (wire.md §5); ``None`` in a spec means PD is off."""

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
    """Semantics of one group (wire.md §4 ``group_specs``); its order is the group order.

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
    """How one field's axis is split across TP ranks (wire.md §4, §6.2).

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
