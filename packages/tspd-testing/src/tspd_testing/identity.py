"""Identity-tagged arenas: test oracles for moving KV between unequal rank sets.

Every element of a field page gets a value derived only from *global* coordinates — the
request's salt, the field, the prompt slot the page holds, and the element's index inside the
page's **global** shape (the partition axis at full extent, so a head keeps its tag whichever
rank holds it). The value is a multiplicative hash of those coordinates, truncated to the
element width, so any misplaced, shifted, re-sliced-wrong or cross-request byte shows up as a
mismatch with near certainty, and the check needs no knowledge of the route that moved it.

The mapping from a rank's local index on the partition axis to the global one is computed here
independently of the layout planner (wire.md §6.2), so the planner is checked, not trusted.
Used by the unit tests, the multi-process tests and the transfer benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tspd_core.layout import CacheContract, FieldLayout, field_view

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank's arena and where it sits in its TP group."""

    arena: npt.NDArray[np.uint8]  #: the whole arena as bytes (a view, writes land in it)
    contract: CacheContract
    tp_size: int
    tp_rank: int


def local_to_global(contract: CacheContract, field_id: str, tp_size: int, tp_rank: int) -> Any:
    """Local index -> global index along the field's partition axis (identity if replicated)."""
    f = contract.field(field_id)
    part = contract.partition(field_id)
    if part is None:
        return None
    local = f.shape[part.axis]
    shards = part.global_extent // local
    shard = tp_rank // (tp_size // shards)
    out: list[int] = []
    global_off = local_off = 0
    for extent in part.parts:
        x = extent // shards
        out.extend(range(global_off + shard * x, global_off + (shard + 1) * x))
        global_off += extent
        local_off += x
    assert len(out) == local, f"{field_id}: parts do not tile the local extent"
    return np.asarray(out, dtype=np.int64)


def _flat_global_index(contract: CacheContract, field_id: str, tp_size: int, tp_rank: int) -> Any:
    f = contract.field(field_id)
    idx = list(np.indices(f.shape, dtype=np.int64))
    mapping = local_to_global(contract, field_id, tp_size, tp_rank)
    if mapping is not None:
        part = contract.partition(field_id)
        assert part is not None
        idx[part.axis] = mapping[idx[part.axis]]
    return np.ravel_multi_index(tuple(idx), contract.global_shape(field_id))


def identity_pages(
    view: RankView, field_id: str, slots: npt.ArrayLike, salt: int
) -> npt.NDArray[np.generic]:
    """The expected content of ``field_id`` for prompt ``slots`` on this rank, page by page."""
    f = view.contract.field(field_id)
    flat = _flat_global_index(view.contract, field_id, view.tp_size, view.tp_rank).astype(np.uint64)
    field_no = np.uint64(view.contract.plan.fields.index(f) + 1)
    slot_arr = np.asarray(slots, dtype=np.uint64).reshape(-1, *([1] * len(f.shape)))
    page_elems = np.uint64(int(np.prod(view.contract.global_shape(field_id))))
    with np.errstate(over="ignore"):  # wrapping mod 2**64 is the hash
        base = (np.uint64(salt) * np.uint64(4099) + field_no) * np.uint64(1 << 24)
        key = (base + slot_arr) * page_elems + flat
        hashed = (key + np.uint64(1)) * _GOLDEN
    width = f.itemsize
    out: npt.NDArray[np.generic] = (hashed >> np.uint64(64 - 8 * width)).astype(_UINT[width])
    return out


def _pages_view(view: RankView, field_id: str) -> npt.NDArray[np.generic]:
    raw = field_view(view.arena, view.contract, field_id)
    return raw.view(_UINT[view.contract.field(field_id).itemsize])  # type: ignore[no-any-return]


def fill_identity(
    view: RankView,
    pages: Mapping[str, npt.ArrayLike],
    salt: int,
    layers: tuple[int, int] | None = None,
) -> None:
    """Write the identity of slot ``i`` into page ``pages[group][i]`` for every field (of the
    merged ``layers`` interval only, if given: a forward writing layer by layer).

    ``pages[group]`` is a block-table row (slot -> page id); pages with id 0 are skipped.
    """
    for gid, row in pages.items():
        ids = np.asarray(row, dtype=np.int64)
        slots = np.flatnonzero(ids)
        for f in _fields(view.contract, gid, layers):
            _pages_view(view, f.field_id)[ids[slots]] = identity_pages(
                view, f.field_id, slots, salt
            )


def check_identity(
    view: RankView,
    group_id: str,
    slots: npt.ArrayLike,
    page_ids: npt.ArrayLike,
    salt: int,
    layers: tuple[int, int] | None = None,
) -> list[str]:
    """Mismatches (as readable lines) between pages ``page_ids`` and the identity of ``slots``
    (fields of the merged ``layers`` interval only, if given)."""
    slots_arr = np.asarray(slots, dtype=np.int64)
    ids = np.asarray(page_ids, dtype=np.int64)
    problems: list[str] = []
    for f in _fields(view.contract, group_id, layers):
        got = _pages_view(view, f.field_id)[ids]
        want = identity_pages(view, f.field_id, slots_arr, salt)
        bad = np.flatnonzero((got != want).reshape(len(ids), -1).any(axis=1))
        problems.extend(
            f"{f.field_id} slot {slots_arr[i]} page {ids[i]}: "
            f"{int((got[i] != want[i]).sum())} of {got[i].size} elements differ"
            f"{' (all zero: cleared, never written)' if not got[i].any() else ''}"
            for i in bad[:8]
        )
    return problems


def page_mask(
    contract: CacheContract,
    pages: Mapping[str, npt.ArrayLike],
    layers: tuple[int, int] | None = None,
) -> npt.NDArray[np.bool_]:
    """Bytes of the arena covered by the payload of ``pages`` (every field of each group, or
    the fields of the merged ``layers`` interval)."""
    mask = np.zeros(contract.plan.arena_bytes, dtype=np.bool_)
    for gid, row in pages.items():
        ids = np.asarray(row, dtype=np.int64)
        for f in _fields(contract, gid, layers):
            starts = contract.page0_offset(f.field_id) + ids * f.page_stride_bytes
            for s in starts.tolist():
                mask[s : s + f.payload_bytes] = True
    return mask


def _fields(
    contract: CacheContract, group_id: str, layers: tuple[int, int] | None
) -> list[FieldLayout]:
    fields = contract.fields_for_group(group_id)
    return [f for f in fields if layers is None or layers[0] <= f.layer < layers[1]]
