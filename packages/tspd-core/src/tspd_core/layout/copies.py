"""Copy descriptors for one request between one P rank and one D rank (WIRE §6.5).

:func:`plan_copies` returns three int64 arrays — source offset (from P's arena base),
destination offset (from D's arena base) and length — built with numpy, no per-page Python
loop. Descriptors whose source and destination both continue exactly are **coalesced** into
one: across pages (consecutive block ids on both sides) and, in page-major arenas, across the
fields of a page::

    P arena   ... [pg 7: L0.k L0.v L1.k L1.v][pg 8: L0.k L0.v L1.k L1.v] ...
    D arena   ... [pg 3: L0.k L0.v L1.k L1.v][pg 4: L0.k L0.v L1.k L1.v] ...
              8 raw descriptors (4 fields × 2 pages) → 1 descriptor of 2 pages

Coalescing is maximal within a group and a stride class (rows with the same P and D page
strides): descriptors are ordered by source offset (usually already so by construction, else
sorted) and neighbours that continue on both sides with the same class are merged. The same
rule drives :mod:`tspd_core.layout.stats`, which counts the result without building it.

The per-link row tables are derived once per route and cached on it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tspd_core.layout.errors import LayoutError, ManifestError
from tspd_core.layout.manifest import BlockManifest, validate_manifest
from tspd_core.layout.routes import RoutePlan
from tspd_core.layout.rows import GroupRows, link_rows, select_rows

I64 = npt.NDArray[np.int64]
DEFAULT_BATCH = 512


@dataclass(frozen=True, slots=True, eq=False)
class Copies:
    """Coalesced copy descriptors: ``src``/``dst`` byte offsets from the two arena bases and
    ``length`` in bytes (all int64, equal length, ordered by ``src`` within each group)."""

    src: I64
    dst: I64
    length: I64
    raw_count: int  # descriptors before coalescing (one per page, fragment row and field)

    def __len__(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        """Total bytes the descriptors move."""
        return int(self.length.sum())

    def absolute(self, src_base: int, dst_base: int) -> tuple[I64, I64, I64]:
        """Absolute (src, dst, length) arrays for a transfer engine, given the arena bases."""
        return self.src + np.int64(src_base), self.dst + np.int64(dst_base), self.length


def iter_batches(copies: Copies, max_descriptors: int = DEFAULT_BATCH) -> Iterator[Copies]:
    """Consecutive slices of at most ``max_descriptors`` descriptors (views, no copy).

    Mooncake's TCP lanes refuse very large batches; 512 per call is safe.
    """
    if max_descriptors < 1:
        raise LayoutError(f"max_descriptors must be ≥ 1, got {max_descriptors}")
    for lo in range(0, len(copies), max_descriptors):
        hi = lo + max_descriptors
        yield Copies(copies.src[lo:hi], copies.dst[lo:hi], copies.length[lo:hi], hi - lo)


def _check_pair(route: RoutePlan, src: BlockManifest, dst: BlockManifest) -> None:
    validate_manifest(src, route.p_contract)
    validate_manifest(dst, route.d_contract)
    if (src.prefix_len, src.prompt_len) != (dst.prefix_len, dst.prompt_len):
        raise ManifestError(
            f"source manifest lengths (prefix {src.prefix_len}, prompt {src.prompt_len}) differ "
            f"from the destination's (prefix {dst.prefix_len}, prompt {dst.prompt_len}); P must "
            "build its source manifest with D's two lengths"
        )


def page_pairs(
    route: RoutePlan,
    src: BlockManifest,
    dst: BlockManifest,
    positions: Mapping[str, tuple[int, int]] | None,
) -> list[tuple[I64, I64]]:
    """Validated (P ids, D ids) per group, cut to ``positions`` (see :func:`plan_copies`)."""
    _check_pair(route, src, dst)
    gids = route.p_contract.group_ids()
    if positions is not None and set(positions) != set(gids):
        raise LayoutError(
            f"positions must name every group exactly: missing "
            f"{sorted(set(gids) - set(positions))}, unknown {sorted(set(positions) - set(gids))}"
        )
    out = []
    for gid in gids:
        s, d = src.block_ids(gid), dst.block_ids(gid)
        if positions is not None:
            lo, hi = positions[gid]
            if not 0 <= lo <= hi <= s.size:
                raise LayoutError(f"positions[{gid!r}] = ({lo}, {hi}) is outside 0..{s.size}")
            s, d = s[lo:hi], d[lo:hi]
        out.append((s, d))
    return out


def plan_copies(
    route: RoutePlan,
    p_rank: int,
    d_rank: int,
    src_manifest: BlockManifest,
    dst_manifest: BlockManifest,
    *,
    layers: tuple[int, int] | None = None,
    field_ids: Collection[str] | None = None,
    positions: Mapping[str, tuple[int, int]] | None = None,
) -> Copies:
    """The coalesced descriptors P rank ``p_rank`` writes to D rank ``d_rank`` for a request.

    ``src_manifest`` holds P's page ids, ``dst_manifest`` D's, each validated against its
    side's contract (:class:`ManifestError`). Optional selections, for layerwise streaming and
    chunked prefill: ``layers`` — a half-open merged-layer interval; ``field_ids`` — only these
    fields; ``positions`` — per group (every group must be named) a half-open interval of
    manifest positions, e.g. from :func:`~tspd_core.layout.manifest.chunk_positions`.
    A pair with no route (a dummy P rank, a D rank it does not serve) gets no descriptors.
    Pure function of its inputs; safe to call from many threads.
    """
    pairs = page_pairs(route, src_manifest, dst_manifest, positions)
    check_selection(route, field_ids)
    if route.link(p_rank, d_rank) is None:
        return _empty()
    parts: list[tuple[I64, I64, I64]] = []
    raw = 0
    for table, (s, d) in zip(link_rows(route, p_rank, d_rank), pairs, strict=True):
        rows = select_rows(table, layers, field_ids)
        if rows.count and s.size:
            raw += rows.count * int(s.size)
            parts.append(_group_copies(rows, s, d))
    if not parts:
        return _empty()
    src, dst, length = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return Copies(src, dst, length, raw)


def check_selection(route: RoutePlan, field_ids: Collection[str] | None) -> None:
    """Unknown field ids in a selection are a caller bug: say so rather than send nothing."""
    if field_ids is None:
        return
    if isinstance(field_ids, str):
        raise LayoutError("field_ids must be a collection of field ids, not one string")
    unknown = sorted(set(field_ids) - {f.field_id for f in route.p_contract.plan.fields})
    if unknown:
        raise LayoutError(f"field_ids names fields the contract does not have: {unknown[:4]}")


def _empty() -> Copies:
    z = np.zeros(0, dtype=np.int64)
    return Copies(z, z, z, 0)


def _group_copies(rows: GroupRows, s: I64, d: I64) -> tuple[I64, I64, I64]:
    """Raw descriptors of one group in source order, then merged."""
    order = np.argsort(s, kind="stable")
    s, d = s[order], d[order]
    n, r = int(s.size), rows.count
    if _row_major_sorted(rows, s):
        src = (rows.src0[:, None] + rows.src_stride[:, None] * s[None, :]).ravel()
        dst = (rows.dst0[:, None] + rows.dst_stride[:, None] * d[None, :]).ravel()
        length = np.repeat(rows.length, n)
        same = np.ones(r * n, dtype=bool)
        same[::n] = np.concatenate(([False], rows.cls[1:] == rows.cls[:-1]))
    elif _page_major_sorted(rows):
        src = (s[:, None] * rows.src_stride[0] + rows.src0[None, :]).ravel()
        dst = (d[:, None] * rows.dst_stride[0] + rows.dst0[None, :]).ravel()
        length = np.tile(rows.length, n)
        same = np.ones(r * n, dtype=bool)
    else:
        src = (rows.src0[:, None] + rows.src_stride[:, None] * s[None, :]).ravel()
        dst = (rows.dst0[:, None] + rows.dst_stride[:, None] * d[None, :]).ravel()
        length = np.repeat(rows.length, n)
        cls = np.repeat(rows.cls, n)
        by_src = np.argsort(src, kind="stable")
        src, dst, length, cls = src[by_src], dst[by_src], length[by_src], cls[by_src]
        same = np.concatenate(([False], cls[1:] == cls[:-1]))
    return merge_runs(src, dst, length, same)


def _row_major_sorted(rows: GroupRows, s: I64) -> bool:
    """Row after row is source-sorted iff each row's last page ends before the next row's
    first page (rows are sorted by page-0 offset; ``s`` ascending)."""
    if rows.count == 1:
        return True
    first = rows.src0 + rows.src_stride * s[0]
    end = rows.src0 + rows.src_stride * s[-1] + rows.length
    return bool(np.all(end[:-1] <= first[1:]))


def _page_major_sorted(rows: GroupRows) -> bool:
    """Page after page is source-sorted iff all rows share one class and fit in one stride."""
    stride = int(rows.src_stride[0])
    return bool(
        np.all(rows.cls == rows.cls[0])
        and int(rows.src0[-1] + rows.length[-1] - rows.src0[0]) <= stride
    )


def merge_runs(
    src: I64, dst: I64, length: I64, same: npt.NDArray[np.bool_]
) -> tuple[I64, I64, I64]:
    """Merge source-ordered descriptors that continue on both sides (``same`` marks
    descriptors in the same class as their predecessor)."""
    if src.size == 0:
        return src, dst, length
    cont = same.copy()
    cont[0] = False
    cont[1:] &= src[1:] == src[:-1] + length[:-1]
    cont[1:] &= dst[1:] == dst[:-1] + length[:-1]
    starts = np.flatnonzero(~cont)
    if starts.size == src.size:
        return src, dst, length
    return src[starts], dst[starts], np.add.reduceat(length, starts)
