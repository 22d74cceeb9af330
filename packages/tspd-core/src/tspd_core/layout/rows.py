"""Per-link row tables: the request-independent half of the copy plan.

For one (P rank, D rank) link and one group, a *row* is one run a page contributes: one
fragment row of one field. Row ``k`` of page pair ``(s, d)`` copies ``length[k]`` bytes from
``src0[k] + s·src_stride[k]`` to ``dst0[k] + d·dst_stride[k]``. Rows are sorted by ``src0``;
``cls`` numbers the distinct (src_stride, dst_stride) pairs — the stride classes within which
descriptors may be coalesced. Tables are built once per link and cached on the route.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.layout.errors import LayoutError
from tspd_core.layout.routes import FieldRoute, RoutePlan

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class GroupRows:
    """The rows of one group on one link (all arrays share one length, sorted by ``src0``)."""

    group_id: str
    src0: I64
    dst0: I64
    src_stride: I64
    dst_stride: I64
    length: I64
    layer: I64
    field: I64  # index into ``names``
    cls: I64
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        """Number of rows."""
        return int(self.src0.size)

    def take(self, keep: npt.NDArray[np.bool_] | slice) -> GroupRows:
        """The rows ``keep`` selects (a boolean mask or a slice; order kept)."""
        return GroupRows(
            self.group_id,
            self.src0[keep],
            self.dst0[keep],
            self.src_stride[keep],
            self.dst_stride[keep],
            self.length[keep],
            self.layer[keep],
            self.field[keep],
            self.cls[keep],
            self.names,
        )


def link_rows(route: RoutePlan, p_rank: int, d_rank: int) -> tuple[GroupRows, ...]:
    """Row tables of the link, one per group in group order (cached on ``route``)."""
    key = ("rows", p_rank, d_rank)
    cached = route.cache.get(key)
    if cached is None:
        link = route.link(p_rank, d_rank)
        fields = link.fields if link is not None else ()
        cached = tuple(
            _group_rows(route, gid, [f for f in fields if f.group_id == gid])
            for gid in route.p_contract.group_ids()
        )
        route.cache[key] = cached
    assert isinstance(cached, tuple)
    return cached


def _group_rows(route: RoutePlan, gid: str, fields: list[FieldRoute]) -> GroupRows:
    cols: list[list[I64]] = [[] for _ in range(7)]
    names = tuple(f.field_id for f in fields)
    for index, froute in enumerate(fields):
        pf = route.p_contract.field(froute.field_id)
        df = route.d_contract.field(froute.field_id)
        p0 = route.p_contract.page0_offset(froute.field_id)
        d0 = route.d_contract.page0_offset(froute.field_id)
        for frag in froute.fragments:
            r = np.arange(frag.rows, dtype=np.int64)
            values = (
                p0 + frag.src_offset + r * frag.src_stride,
                d0 + frag.dst_offset + r * frag.dst_stride,
                np.full(frag.rows, pf.page_stride_bytes, dtype=np.int64),
                np.full(frag.rows, df.page_stride_bytes, dtype=np.int64),
                np.full(frag.rows, frag.nbytes, dtype=np.int64),
                np.full(frag.rows, pf.layer, dtype=np.int64),
                np.full(frag.rows, index, dtype=np.int64),
            )
            for col, value in zip(cols, values, strict=True):
                col.append(value)
    arrays = [np.concatenate(c) if c else np.zeros(0, dtype=np.int64) for c in cols]
    order = np.argsort(arrays[0], kind="stable")
    src0, dst0, sp, sd, length, layer, field = (a[order] for a in arrays)
    _, cls = np.unique(np.stack([sp, sd], axis=1), axis=0, return_inverse=True)
    return GroupRows(
        gid, src0, dst0, sp, sd, length, layer, field, cls.reshape(-1).astype(np.int64), names
    )


def select_rows(
    rows: GroupRows, layers: tuple[int, int] | None, field_ids: Collection[str] | None
) -> GroupRows:
    """The rows of the selected layers (half-open interval) and fields (``None`` = all)."""
    if layers is None and field_ids is None:
        return rows
    keep = np.ones(rows.count, dtype=bool)
    if layers is not None:
        lo, hi = layers
        if lo > hi:
            raise LayoutError(f"layers ({lo}, {hi}) is not a half-open interval lo ≤ hi")
        keep &= (rows.layer >= lo) & (rows.layer < hi)
    if field_ids is not None:
        wanted = set(field_ids)
        keep &= np.isin(rows.field, [i for i, n in enumerate(rows.names) if n in wanted])
    return rows.take(keep)
